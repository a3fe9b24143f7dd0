"""Collective liveness ping: find a dead or stuck rank in seconds, by rank, instead of waiting out a collective.

Every ``health.liveness_ping_interval`` steps, at the start of the step, each rank records the iteration in the
rendezvous store (``mbridge_liveness/<attempt>/rank<N>``) and joins a one-element all-reduce on a gloo side group
created with ``timeout=health.liveness_ping_timeout`` (gloo on NCCL runs too: a CPU tensor, no device sync). A peer
that died closes its connections and the all-reduce fails at once; a peer that never arrives makes it time out. The
first rank to notice waits, at most until the timeout, for the others to record this ping, then names every rank
whose record is older, with its last stack when hang attribution wrote one, and writes a ``fault_detected`` event
(mechanism ``liveness_ping``) for each. When the ping timed out, the missing ranks are alive and stuck and their dumps
may still be coming: the searching rank waits up to :data:`STACK_GRACE_S` more for them (not when a connection
closed: a dead rank dumps nothing). The other survivors wait for that verdict and every survivor exits
:attr:`ExitCode.PEER_UNRESPONSIVE` (24) with it.

Cost per ping: one store write and one 4-byte gloo all-reduce per rank. A rank that hangs inside a step's own
collectives holds its peers in that collective before they reach the ping: ft section timeouts and hang attribution
cover that case.
"""

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.bridge.training.components import Component, Run
from megatron.bridge.training.config import HealthConfig
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind, Mechanism
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.utils import upstream

logger = logging.getLogger(__name__)

_POLL_S = 0.2
STACK_GRACE_S = 2.0
"""How long past a timed-out ping the searching rank waits for a stuck rank's stack dump (a stuck rank dumps half the
ping timeout past its last step's length into its step, which a slow step can put past the timeout)."""
VERDICT_GRACE_S = 5.0 + STACK_GRACE_S
"""How much longer than the searching rank's deadline the other survivors wait for its verdict: 5 s past its stack
wait, for survivors whose pings started apart."""


class LivenessPing:
    """The ping of one run; a no-op when ``health.liveness_ping_interval`` is 0.

    Args:
        cfg: the health section.
        attempt: a name unique to this start (records of an earlier attempt in the same store must not count).
        where_is: ``rank -> one line`` saying where a rank was stuck, if known (hang attribution's summary); ``None``
            when hang attribution is off (no stack is waited for).
    """

    def __init__(self, cfg: HealthConfig, attempt: str, where_is: Optional[Callable[[int], Optional[str]]]) -> None:
        self.interval = cfg.liveness_ping_interval
        self.timeout = cfg.liveness_ping_timeout
        self._prefix = f"mbridge_liveness/{attempt}"
        self._where_is = where_is
        self._group: Any = None
        self._store: Any = None

    def setup(self) -> None:
        """Create the side group (a collective: every rank, after the default group exists)."""
        if not self.interval:
            return
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
        self._store = upstream.default_store()
        logger.info("liveness ping every %d steps, timeout %.1f s", self.interval, self.timeout)

    def maybe_ping(self, iteration: int) -> None:
        """Ping when ``iteration`` (the step about to run) is a multiple of the interval.

        Raises:
            TrainingExit: ``PEER_UNRESPONSIVE`` when a rank died or did not join within the timeout.
        """
        if not self.interval or iteration % self.interval:
            return
        rank = dist.get_rank()
        start = time.monotonic()
        self._store.set(f"{self._prefix}/rank{rank}", str(iteration))
        flag = torch.ones(1)
        try:
            dist.all_reduce(flag, group=self._group)
        except RuntimeError as err:  # DistBackendError and gloo's timeout are RuntimeErrors
            waited = time.monotonic() - start
            raise TrainingExit(ExitCode.PEER_UNRESPONSIVE, self._diagnose(iteration, start, waited, err)) from None

    def shutdown(self) -> None:
        """Forget the side group (destroying the default group destroys it)."""
        self._group = None
        self._store = None

    def _diagnose(self, iteration: int, start: float, waited: float, err: BaseException) -> str:
        """Name the ranks that did not record this ping by the deadline; the same message on every survivor.

        The first rank to fail searches; the others wait for its verdict, so that no survivor exits first (the store's
        host may be one of them, and a launcher stops every worker at the first exit).
        """
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        first_line = text.split("] ", 1)[-1]  # gloo prefixes its source location: "[.../pair.cc:553] Connection..."
        verdict = f"{self._prefix}/verdict{iteration}"
        try:
            if self._store.add(f"{self._prefix}/failed{iteration}", 1) != 1:
                remaining = start + self.timeout - time.monotonic() + VERDICT_GRACE_S
                self._store.wait([verdict], datetime.timedelta(seconds=max(remaining, VERDICT_GRACE_S)))
                return self._store.get(verdict).decode()
            missing = self._missing(iteration, start + self.timeout)
            stacks = self._stacks(missing, STACK_GRACE_S if waited >= self.timeout * 0.9 else 0.0)
            message = self._describe(iteration, waited, first_line, missing, stacks)
            for lost in missing or [None]:  # the searching rank speaks for every survivor: one event per lost rank
                event_stream.emit(
                    EventKind.FAULT_DETECTED, mechanism=Mechanism.LIVENESS_PING, rank=lost, iteration=iteration,
                    detail=message,
                )  # fmt: skip
            self._store.set(verdict, message)
            return message
        except Exception as store_err:  # noqa: BLE001 - the store's host may be the rank that died
            return (
                f"liveness ping at iteration {iteration} failed after {waited:.1f} s ({first_line}); no rank could "
                f"name the lost ranks ({type(store_err).__name__}: {store_err}): the store's host, or the rank that "
                "searched, may be among them"
            )

    def _describe(
        self,
        iteration: int,
        waited: float,
        first_line: str,
        missing: dict[int, Optional[int]],
        stacks: dict[int, Optional[str]],
    ) -> str:
        if not missing:
            return (
                f"liveness ping at iteration {iteration} failed after {waited:.1f} s ({first_line}), although every "
                "rank recorded it: a connection failed"
            )
        described = []
        for rank, last in missing.items():
            seen = f"last ping at iteration {last}" if last is not None else "no ping recorded"
            where = stacks.get(rank)
            described.append(f"rank {rank} ({seen}{'; stack: ' + where if where else ''})")
        return (
            f"liveness ping at iteration {iteration}: {', '.join(described)} did not answer within "
            f"health.liveness_ping_timeout={self.timeout} s (dead or stuck; noticed after {waited:.1f} s: "
            f"{first_line})"
        )

    def _stacks(self, missing: dict[int, Optional[int]], grace: float) -> dict[int, Optional[str]]:
        """Where each missing rank was stuck; waits up to ``grace`` seconds for the dumps of ranks that pinged before.

        A rank with no record never reached this attempt's loop: no dump of it is coming.
        """
        if self._where_is is None:
            return {}
        deadline = time.monotonic() + grace
        while True:
            stacks = {rank: self._where_is(rank) for rank in missing}
            pending = [rank for rank, last in missing.items() if last is not None and stacks[rank] is None]
            if not pending or time.monotonic() >= deadline:
                return stacks
            time.sleep(_POLL_S)

    def _missing(self, iteration: int, deadline: float) -> dict[int, Optional[int]]:
        """Ranks whose record is older than ``iteration`` at ``deadline`` (polling; late ranks may still arrive)."""
        world = dist.get_world_size()
        while True:
            missing: dict[int, Optional[int]] = {}
            for rank in range(world):
                key = f"{self._prefix}/rank{rank}"
                last = int(self._store.get(key)) if self._store.check([key]) else None
                if last is None or last < iteration:
                    missing[rank] = last
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(_POLL_S)


class LivenessCallback(Component):
    """The liveness ping as a run's component: pings, when due, at the start of a step.

    Before any collective of the step, a save's commit included. A dead peer's report names where this rank is
    when hang attribution offers it (:attr:`Run.where_is`).
    """

    def __init__(self, ping: LivenessPing) -> None:
        self.ping = ping

    @classmethod
    def build(cls, run: Run) -> "LivenessCallback":
        """The ping of ``health`` (it does nothing when ``health.liveness_ping_interval`` is 0)."""
        return cls(LivenessPing(run.cfg.health, run.attempt, run.where_is))

    def setup(self, run: Run) -> None:
        """Make the ping's process group (the run's one exists now)."""
        self.ping.setup()

    def on_train_step_start(self, context: Any) -> None:
        """Ping every rank if the step about to run is due."""
        self.ping.maybe_ping(context.state.train_state.step + 1)

    def close(self) -> None:
        """Destroy the ping's process group."""
        self.ping.shutdown()
