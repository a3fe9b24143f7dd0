"""Real faults on demand, for drills and tests: a rank hangs, dies, raises, slows down or computes a bad loss.

``MBRIDGE_FAULTS="<kind>@<iteration>:<rank>[:x<factor>][:always],..."`` with kind ``hang`` (the process stops itself
with SIGSTOP, as a hung GPU or a deadlock would look from outside), ``kill`` (SIGKILL), ``exception`` (an uncaught
``RuntimeError``), ``sigterm`` (the rank receives SIGTERM, as from a scheduler that preempts the job),
``sigterm-tree`` (the rank and every process it started receive SIGTERM, as Slurm signals a job step), ``stall``
(the rank stops making progress but stays alive, waiting with the GIL released, as a rank blocked on a lock, a
store or a peer would: its threads and its heartbeats go on), ``slow``
(from that iteration on, every forward step of the rank takes ``factor`` times as long, default 2: the rank sleeps
for the extra time inside the step; CPU-side timing sees it, CUDA kernel timing does not), ``nan`` (the rank's
forward output, hence its loss and gradients, becomes NaN) or ``spike`` (its forward output is multiplied by
``factor``, default 100).

A fault strikes when the given rank *starts* that iteration, in the first attempt of a job only
(``TORCHELASTIC_RESTART_COUNT`` unset or 0, and the first in-process restart iteration) unless ``always`` is given,
so that a restarted job can recover. With ``MBRIDGE_FAULTS_LEDGER=<file>`` a fault strikes instead the first time
any attempt reaches it: the rank appends a JSON line (kind, iteration, rank, wall-clock time, pid, restart count) to
that file just before striking, and later attempts skip what the file lists. A schedule can then span restarts (a
drill kills a rank, and after the restart hangs another), and the file says when each fault struck.
``nan`` and ``spike`` corrupt only the first forward pass of the iteration (a re-run of the step computes the true
value: a transient fault); with ``always`` every pass of that iteration in every attempt is corrupted (a
reproducible fault).
"""

import functools
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

ENV = "MBRIDGE_FAULTS"
LEDGER_ENV = "MBRIDGE_FAULTS_LEDGER"
KINDS = ("hang", "kill", "exception", "sigterm", "sigterm-tree", "stall", "slow", "nan", "spike")
_SCALED = ("slow", "spike")
"""Kinds that take ``x<factor>``."""
_VALUE_KINDS = ("nan", "spike")
"""Kinds that corrupt the forward output instead of acting on the process."""


@dataclass(frozen=True)
class Fault:
    """One scheduled fault."""

    kind: str
    iteration: int
    rank: int
    always: bool = False
    factor: Optional[float] = None
    """``slow``: how many times longer the forward steps take (default 2); ``spike``: the output multiplier
    (default 100)."""


def parse(spec: str) -> list[Fault]:
    """Parse a ``MBRIDGE_FAULTS`` value.

    Raises:
        ValueError: an item is malformed or names an unknown kind.
    """
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            kind, rest = item.split("@")
            parts = rest.split(":")
            iteration, rank = int(parts[0]), int(parts[1])
            options = parts[2:]
            always = "always" in options
            factors = [float(o[1:]) for o in options if o.startswith("x") and kind in _SCALED]
            if (
                kind not in KINDS
                or len(options) != always + len(factors)
                or len(factors) > 1
                or not all(1 < f < 1e3 for f in factors)
            ):
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(
                f"{ENV}: bad item {item!r}; expected <kind>@<iteration>:<rank>[:x<factor>][:always] with kind in "
                f"{KINDS} (x<factor> in (1, 1000) only for {_SCALED})"
            ) from None
        faults.append(Fault(kind, iteration, rank, always, factors[0] if factors else None))
    return faults


def struck_faults(ledger: str) -> list[dict[str, Any]]:
    """The records of a ``MBRIDGE_FAULTS_LEDGER`` file, oldest first (none if it does not exist yet)."""
    try:
        with open(ledger) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill mid-write: that strike is still in the log
            continue
    return records


def _record_strike(fault: Fault) -> None:
    """Append ``fault`` to the ledger (when one is set), durably, before it strikes."""
    ledger = os.environ.get(LEDGER_ENV)
    if not ledger:
        return
    record = {
        "kind": fault.kind,
        "iteration": fault.iteration,
        "rank": fault.rank,
        "time": time.time(),
        "pid": os.getpid(),
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }
    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def descendants(pid: int) -> list[int]:
    """PIDs of every process below ``pid`` (Linux ``/proc``), children before grandchildren."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop(0)
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:  # exited meanwhile
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            queue += children
    return found


def strike(kind: str, where: str) -> None:
    """Make this process fail the way ``kind`` says."""
    logger.error("fault injection: %s at %s (pid %d)", kind, where, os.getpid())
    for handler in logging.getLogger().handlers:
        handler.flush()
    if kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif kind == "sigterm-tree":
        for pid in [*descendants(os.getpid()), os.getpid()]:
            os.kill(pid, signal.SIGTERM)
    elif kind == "stall":
        stall_forever()
    else:
        raise RuntimeError(f"fault injection: exception at {where}")


def stall_forever() -> None:
    """Never return, waiting with the GIL released (the ``stall`` fault; hang attribution names this function)."""
    while True:  # short sleeps: the GIL is free, and an exception raised asynchronously into the thread lands
        time.sleep(0.05)


class StepFaults:
    """The faults scheduled for this rank, checked at the start of every iteration."""

    def __init__(self, rank: int, inprocess_iteration: int = 0) -> None:
        ledger = os.environ.get(LEDGER_ENV)
        if ledger:
            done = {(r["kind"], r["iteration"], r["rank"]) for r in struck_faults(ledger)}
            due = lambda f: (f.kind, f.iteration, f.rank) not in done  # noqa: E731
        else:
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and inprocess_iteration == 0
            due = lambda f: first_attempt  # noqa: E731
        mine = [f for f in parse(os.environ.get(ENV, "")) if f.rank == rank and (f.always or due(f))]
        self._at = {f.iteration: f for f in mine if f.kind not in ("slow", *_VALUE_KINDS)}
        self._values = {f.iteration: f for f in mine if f.kind in _VALUE_KINDS}
        self._slow: Optional[Fault] = next((f for f in mine if f.kind == "slow"), None)
        self._slow_now = False
        self._iteration = 0
        self._value_struck: set[int] = set()

    def before_step(self, iteration: int) -> None:
        """Strike if a fault is scheduled for ``iteration`` (the iteration about to run, 1-based)."""
        self._iteration = iteration
        if self._slow is not None and iteration >= self._slow.iteration and not self._slow_now:
            factor = self._slow.factor or 2.0
            _record_strike(self._slow)
            logger.error("fault injection: forward steps %.1fx slower from iteration %d", factor, iteration)
            self._slow_now = True
        fault = self._at.get(iteration)
        if fault is not None:
            _record_strike(fault)
            strike(fault.kind, f"iteration {iteration}")

    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        """``forward_step`` with the scheduled ``slow``, ``nan`` and ``spike`` faults (unchanged without any)."""
        if self._slow is None and not self._values:
            return forward_step
        extra = (self._slow.factor or 2.0) - 1.0 if self._slow is not None else 0.0

        @functools.wraps(forward_step)
        def faulty_forward_step(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            output, loss_func = forward_step(*args, **kwargs)
            if self._slow_now:
                time.sleep(extra * (time.perf_counter() - start))
            return self._corrupt(output), loss_func

        return faulty_forward_step

    def _corrupt(self, output: Any) -> Any:
        """The forward output, made NaN or scaled when a value fault is due in this iteration."""
        fault = self._values.get(self._iteration)
        if fault is None or (not fault.always and self._iteration in self._value_struck):
            return output
        if self._iteration not in self._value_struck:
            _record_strike(fault)
        self._value_struck.add(self._iteration)
        value = float("nan") if fault.kind == "nan" else (fault.factor or 100.0)
        logger.error(
            "fault injection: %s forward output (x%s) at iteration %d%s",
            fault.kind,
            value,
            self._iteration,
            " (every pass)" if fault.always else " (first pass only)",
        )
        return output * value
