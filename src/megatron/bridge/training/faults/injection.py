"""Failures on demand, so that every recovery path can be tested with the real thing: one registry of faults.

A drill or a test names the faults it wants (in the one grammar of ``faults/spec.py``), and the rank they are aimed
at fails for real at that moment: it stops (SIGSTOP), dies (SIGKILL), raises, is preempted (SIGTERM), stalls, slows
down, computes a NaN or a spike, is killed in the middle of a checkpoint commit, saves a local checkpoint with NaN
weights, finds the bytes of its written local checkpoint flipped, fills its disk, runs out of memory, sees its wall
clock jump, resumes without restoring a part of its state, or has one bit of its weights flipped. Nothing else in
the package injects faults: the checkpoint commit protocol, the local tier and the load ask this registry whether a
fault is due, and ``ft.simulate_fault*`` (the public FaultToleranceConfig fields) become one of its faults.

The faults of a process are those of ``fault_injection.faults`` (config) and of ``$MBRIDGE_FAULTS`` (for
launcher-driven runs): when both are set, both apply (the environment's are added to the config's).

Which attempt a fault strikes in: without ``:always``, the first attempt of a job only (``TORCHELASTIC_RESTART_COUNT``
unset or 0, and the first in-process restart iteration), so that a restarted job can recover; with a ledger
(``fault_injection.ledger``) it strikes instead the first time any attempt reaches it. ``nan`` and ``spike`` in
``forward`` corrupt only the first pass of the iteration (a re-run of the step computes the true value: a transient
fault); with ``always`` every pass of that iteration in every attempt is corrupted (a reproducible fault).

The ledger is a file of JSON lines shared by every attempt: a rank appends the fault (its spec, kind, iteration,
rank, phase, wall-clock time, pid, restart count) just before striking, and later attempts skip what it lists, so a
schedule can span restarts. It decides what is still due; reports read when each fault struck from the
``fault_injected`` events every strike writes to the event stream (``events/stream.py``, ledger or not).

This module imports nothing of the config: :func:`install` takes any object with ``faults`` and ``ledger``
(:class:`FaultSettings`); the config's ``validate()`` checks both sources with :func:`parse` before anything starts.
"""

import errno
import functools
import json
import logging
import os
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Optional, Protocol

from megatron.bridge.training.callbacks import Callback
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind
from megatron.bridge.training.faults import effects as fault_effects
from megatron.bridge.training.faults.effects import FILL_FILE, FILL_LEAVES  # noqa: F401 - part of this API
from megatron.bridge.training.faults.spec import (  # noqa: F401 - the grammar is part of this API
    CONFIG_FIELD,
    ENV,
    FACTORS,
    FORWARD,
    GLOBAL_SAVE,
    GRAMMAR,
    IO_ERROR,
    IO_PHASES,
    KINDS,
    LOCAL_SAVE,
    PHASES,
    RESTORE,
    RESTORE_PARTS,
    SAVE,
    SAVE_POINTS,
    SKIPPED_PART,
    STEP,
    TIMER,
    UPDATE,
    Fault,
    number,
    parse,
)
from megatron.bridge.utils import launch_env

logger = logging.getLogger(__name__)

_SIGNAL_OF = {"hang": int(signal.SIGSTOP), "kill": int(signal.SIGKILL), "preempt": int(signal.SIGTERM),
              "preempt-tree": int(signal.SIGTERM)}  # fmt: skip
"""The signal each signalling kind sends (in its ``fault_injected`` event)."""
_SLOW_WINDOW = 16
"""Forward steps whose median ``slow`` multiplies."""


class FaultSettings(Protocol):
    """What :func:`install` reads of the job's settings (the config's ``fault_injection`` section, or any such)."""

    faults: Optional[str]
    """The job's fault spec (``faults/spec.py``); empty or ``None``: none."""
    ledger: Optional[str]
    """The ledger file shared by every attempt, or ``None``."""


def struck_faults(ledger: str) -> list[dict[str, Any]]:
    """The records of a ledger file, oldest first (none if it does not exist yet)."""
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


class FaultRegistry:
    """Every fault of the job, and which of them are still due in this process.

    Args:
        faults: the job's faults (all ranks).
        ledger: the ledger file (once per job), or ``None`` (first attempt only).
        inprocess_iteration: the in-process restart iteration of this attempt (0: the first).
    """

    def __init__(self, faults: Iterable[Fault], ledger: Optional[str] = None, inprocess_iteration: int = 0) -> None:
        self.faults: list[Fault] = []
        self.ledger = ledger
        self._done = {r.get("fault") for r in struck_faults(ledger)} if ledger else set()
        self._first = launch_env.current().restart_count == 0 and inprocess_iteration == 0
        self._due: list[Fault] = []
        for fault in faults:
            self.add(fault)
        self.replaced = False
        """Set when another registry is installed (an in-process restart): its armed timers no longer strike."""
        self.strikes: Counter[Fault] = Counter()
        """How many times each fault struck in this registry (an ``io-error`` fails several attempts)."""

    def add(self, fault: Fault) -> None:
        """One more fault of the job.

        It is due in this attempt if it never struck (with a ledger), else if this is the job's first attempt, or
        always with ``:always``.
        """
        self.faults.append(fault)
        if fault.always or (str(fault) not in self._done if self.ledger else self._first):
            self._due.append(fault)

    def pending(self, rank: int, phases: Iterable[str]) -> list[Fault]:
        """The faults of ``rank`` in ``phases`` still due in this attempt."""
        phases = tuple(phases)
        return [f for f in self._due if f.rank == rank and f.phase in phases]

    def find(self, phase: str, rank: int, iteration: int, kind: Optional[str] = None) -> Optional[Fault]:
        """The fault (of ``kind``, if given) due at ``phase`` of ``iteration`` on ``rank``; not recorded."""
        due = (f for f in self.pending(rank, [phase]) if f.iteration == iteration and kind in (None, f.kind))
        return next(due, None)

    def take(self, phase: str, rank: int, iteration: int, kind: Optional[str] = None) -> Optional[Fault]:
        """:meth:`find`, recorded as struck."""
        fault = self.find(phase, rank, iteration, kind)
        if fault is not None:
            self.record(fault)
        return fault

    def record(self, fault: Fault, keep_due: bool = False) -> None:
        """``fault`` is about to strike: no longer due in this attempt (unless ``always``); in the ledger, durably.

        Also a ``fault_injected`` event (``events/stream.py``), with or without a ledger: when it struck, for reports.
        ``keep_due``: it strikes again (an ``io-error`` with attempts left to fail).
        """
        self.strikes[fault] += 1
        if not fault.always and not keep_due and fault in self._due:
            self._due.remove(fault)
        event_stream.emit(
            EventKind.FAULT_INJECTED,
            rank=fault.rank,
            fault=str(fault),
            fault_kind=fault.kind,
            iteration=fault.iteration,
            phase=fault.phase,
            seconds=fault.seconds,
            signal=_SIGNAL_OF.get(fault.kind),
        )
        if not self.ledger:
            return
        record = {
            "fault": str(fault),
            "kind": fault.kind,
            "iteration": fault.iteration,
            "rank": fault.rank,
            "phase": fault.phase,
            "time": time.time(),
            "pid": os.getpid(),
            "restart_count": launch_env.current().restart_count,
        }
        fd = os.open(self.ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)


_active: Optional[FaultRegistry] = None


def install(cfg: FaultSettings, inprocess_iteration: int = 0) -> FaultRegistry:
    """Make the faults of ``cfg`` (the config's ``fault_injection``) and ``$MBRIDGE_FAULTS`` this process's.

    Called at each start. More may be added with :meth:`FaultRegistry.add` (``ft.simulate_fault`` is).
    """
    global _active
    faults = [*parse(cfg.faults or "", CONFIG_FIELD), *parse(os.environ.get(ENV, ""), ENV)]
    if _active is not None:
        _active.replaced = True
    _active = FaultRegistry(faults, cfg.ledger, inprocess_iteration)
    return _active


def registry() -> FaultRegistry:
    """The installed registry; in a process that installed none, the faults of ``$MBRIDGE_FAULTS`` alone."""
    global _active
    if _active is None:
        _active = FaultRegistry(parse(os.environ.get(ENV, ""), ENV))
    return _active


def at_save_point(point: str, rank: int, iteration: int) -> None:
    """Strike if a fault is due at ``point`` of the commit protocol (see :data:`SAVE_POINTS`) in this save."""
    fault = registry().take(SAVE + point, rank, iteration)
    if fault is not None:
        how = {"kill": "SIGKILL", "hang": "SIGSTOP", "stall": "a stalled write"}.get(fault.kind, fault.kind)
        strike(fault.kind, f"checkpoint point {point!r} on rank {rank}, iteration {iteration}", label=how)


def io_error(phase: str, rank: int, iteration: int, path: str) -> Optional[OSError]:
    """The error this attempt of the global save of ``iteration`` fails with at ``phase`` on ``rank`` (``None``: none).

    ``phase``: one of :data:`IO_PHASES`. Each call is one attempt: an ``io-error`` due there strikes in the first
    ``x<N>`` attempts (every one with ``always``), each recorded as struck. ``path``: what the error names.
    """
    due = registry()
    fault = due.find(phase, rank, iteration, IO_ERROR)
    if fault is None:
        return None
    struck = due.strikes[fault] + 1
    due.record(fault, keep_due=struck < fault.scale)
    logger.error(
        "fault injection: io-error (%s) on rank %d, iteration %d, attempt %d: %s", phase, rank, iteration, struck, path
    )
    return OSError(errno.EIO, f"Input/output error (injected io-error at {phase}, attempt {struck})", path)


def io_errors_in_writer(phase: str, rank: int, iteration: int, path: str) -> Optional[tuple[OSError, Optional[int]]]:
    """The error, and how many attempts it fails (``None``: every one), of an async global save's background writer.

    That writer makes every attempt of the save of ``iteration`` itself (it retries it), so one call covers them all:
    an ``io-error`` due at ``phase`` on ``rank`` fails the writer's first ``x<N>`` attempts (every one with
    ``always``). It is recorded as struck once, here, when the save is handed to the writer.
    """
    due = registry()
    fault = due.take(phase, rank, iteration, IO_ERROR)
    if fault is None:
        return None
    attempts = None if fault.always else int(fault.scale)
    logger.error(
        "fault injection: io-error (%s) on rank %d, iteration %d: %s attempts of the background write fail: %s",
        phase,
        rank,
        iteration,
        "all" if attempts is None else f"the first {attempts}",
        path,
    )
    return OSError(errno.EIO, f"Input/output error (injected io-error at {phase})", path), attempts


def poisons_local_save(rank: int, iteration: int) -> bool:
    """Whether the local checkpoint of ``iteration`` on ``rank`` is to be saved with NaN weights (and is, now)."""
    return registry().take(LOCAL_SAVE, rank, iteration, kind="nan") is not None


def skipped_restores(rank: int, iteration: int) -> frozenset[str]:
    """The parts (:data:`RESTORE_PARTS`) ``rank`` leaves unrestored as it loads the checkpoint of ``iteration``.

    Each ``no-<part>-restore`` due there (:data:`SKIPPED_PART`) is recorded as struck.
    """
    due = registry()
    parts = frozenset(part for kind, part in SKIPPED_PART.items() if due.take(RESTORE, rank, iteration, kind=kind))
    for part in sorted(parts):
        logger.error("fault injection: rank %d resumes iteration %d without restoring its %s", rank, iteration, part)
    return parts


def fill_storage(phase: str, rank: int, iteration: int, directory: str) -> None:
    """Fill the file system of ``directory`` up to :data:`FILL_LEAVES` free bytes if a ``fill`` is due now.

    ``phase``: :data:`GLOBAL_SAVE` or :data:`LOCAL_SAVE`. The space goes to :data:`FILL_FILE` in ``directory``.
    """
    if registry().take(phase, rank, iteration, kind="fill") is not None:
        fault_effects.fill_filesystem(directory)


def corrupt_written_local_checkpoint(rank: int, iteration: int, path: Callable[[], str]) -> None:
    """Flip 64 bytes in the middle of the written local checkpoint ``path()`` if ``corrupt-local`` is due now."""
    if registry().take(LOCAL_SAVE, rank, iteration, kind="corrupt-local") is None:
        return
    target = path()
    with open(target, "r+b") as f:
        middle = f.seek(0, os.SEEK_END) // 2
        f.seek(middle)
        chunk = f.read(64)
        f.seek(middle)
        f.write(bytes(b ^ 0xFF for b in chunk))
        f.flush()
        os.fsync(f.fileno())
    logger.error(
        "fault injection: flipped %d bytes of local checkpoint %s (iteration %d)", len(chunk), target, iteration
    )


def strike(kind: str, where: str, label: Optional[str] = None, factor: Optional[float] = None) -> None:
    """Make this process fail the way ``kind`` says (``label``: how the log line names it; default ``kind``).

    ``factor``: a ``clock-jump``'s hours (default 1).
    """
    logger.error("fault injection: %s at %s (pid %d)", label or kind, where, os.getpid())
    for handler in logging.getLogger().handlers:
        handler.flush()
    if kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "preempt":
        os.kill(os.getpid(), signal.SIGTERM)
    elif kind == "preempt-tree":
        for pid in [*fault_effects.descendants(os.getpid()), os.getpid()]:
            os.kill(pid, signal.SIGTERM)
    elif kind == "stall":
        stall_forever()
    elif kind == "oom":
        fault_effects.allocate_until_killed()
    elif kind == "clock-jump":
        fault_effects.jump_clock(FACTORS["clock-jump"] if factor is None else factor)
    else:
        raise RuntimeError(f"fault injection: exception at {where}")


def flip_one_bit(chunks: Iterable[Any]) -> str:
    """Flip one bit of the rank's weights in place: bit 4 of a byte of the middle element of its largest parameter.

    The byte is the element's second-highest for elements of 4 or more bytes (in a float32: mantissa bits 16-22 and
    the exponent's lowest bit; bit 4 is mantissa bit 20), its lowest otherwise (in a bfloat16: mantissa bits): the
    value changes by up to an eighth and stays finite, a corruption no loss check sees. Returns where it flipped.
    """
    name, param = max(
        ((f"{i}.{n}", p) for i, chunk in enumerate(chunks) for n, p in chunk.named_parameters()),
        key=lambda item: item[1].numel(),
    )
    size = param.element_size()
    element = param.numel() // 2
    offset = element * size + (size - 2 if size >= 4 else 0)
    import torch

    with torch.no_grad():
        param.data.view(-1).view(torch.uint8)[offset] ^= 1 << 4
    return f"parameter {name} (<chunk>.<name>), element {element}, byte {offset} of its data, bit 4"


def stall_forever() -> None:
    """Never return, waiting with the GIL released (the ``stall`` fault; hang attribution names this function)."""
    while True:  # short sleeps: the GIL is free, and an exception raised asynchronously into the thread lands
        time.sleep(0.05)


class StepFaults(Callback):
    """The faults of one rank in the training loop: at iteration start, in forward passes, and on a timer.

    Timed faults are armed when the rank starts its first iteration. As a callback, it strikes at
    ``on_train_step_start``.

    Args:
        rank: this process's global rank.
        faults: the registry to take them from (default: :func:`registry`).
    """

    def __init__(self, rank: int, faults: Optional[FaultRegistry] = None) -> None:
        self._registry = faults if faults is not None else registry()
        self.rank = rank
        mine = self._registry.pending(rank, (STEP, FORWARD, TIMER, UPDATE))
        self._at = {f.iteration: f for f in mine if f.phase == STEP}
        self._values = {f.iteration: f for f in mine if f.phase == FORWARD and f.kind != "slow"}
        self._slow: Optional[Fault] = next((f for f in mine if f.kind == "slow"), None)
        self._timed = [f for f in mine if f.phase == TIMER]
        self._updates = {f.iteration: f for f in mine if f.phase == UPDATE}
        self._slow_now = False
        self._recent_forward: list[float] = []
        """The rank's latest forward times (without ``slow``'s sleep): their median is what ``slow`` multiplies."""
        self._iteration = 0
        self._value_struck: set[int] = set()

    def on_train_step_start(self, context: Any) -> None:
        """Strike what is scheduled for the step about to run."""
        self.before_step(context.state.train_state.step + 1)

    def before_step(self, iteration: int) -> None:
        """Strike if a fault is scheduled for ``iteration`` (the iteration about to run, 1-based)."""
        self._iteration = iteration
        while self._timed:
            self._arm(self._timed.pop())
        if self._slow is not None and iteration >= self._slow.iteration and not self._slow_now:
            self._registry.record(self._slow)
            logger.error("fault injection: forward steps %.1fx slower from iteration %d", self._slow.scale, iteration)
            self._slow_now = True
        fault = self._at.get(iteration)
        if fault is not None:
            self._registry.record(fault)
            strike(fault.kind, f"iteration {iteration}", factor=fault.factor)

    def on_train_step_end(self, context: Any) -> None:
        """Strike what is scheduled right after the optimizer step of the step that just ran (``bitflip``)."""
        fault = self._updates.get(context.state.train_state.step + 1)
        if fault is None:
            return
        if not fault.always:
            del self._updates[fault.iteration]
        self._registry.record(fault)
        where = flip_one_bit(context.model)
        logger.error("fault injection: bitflip after the optimizer step of iteration %d: %s", fault.iteration, where)

    def _arm(self, fault: Fault) -> None:
        """Start the timer of a timed fault."""
        logger.warning("fault injection: %s armed on rank %d, %.1f s from now", fault, self.rank, fault.seconds)

        def wait_and_strike() -> None:
            time.sleep(fault.seconds)
            if self._registry.replaced:  # the attempt that armed it is over; the new one decides for itself
                logger.warning("fault injection: %s disarmed: the process restarted in process", fault)
                return
            self._registry.record(fault)
            strike(fault.kind, f"{number(fault.seconds)} s into training on rank {self.rank}")

        threading.Thread(target=wait_and_strike, name="fault-injection-timer", daemon=True).start()

    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        """``forward_step`` with the scheduled ``slow``, ``nan`` and ``spike`` faults (unchanged without any)."""
        if self._slow is None and not self._values:
            return forward_step
        extra = self._slow.scale - 1.0 if self._slow is not None else 0.0

        @functools.wraps(forward_step)
        def faulty_forward_step(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            output, loss_func = forward_step(*args, **kwargs)
            if extra:
                self._stretch(time.perf_counter() - start, extra)
            return self._corrupt(output), loss_func

        return faulty_forward_step

    def _stretch(self, took: float, extra: float) -> None:
        """Once ``slow`` has struck, sleep ``extra`` times the median of the rank's recent forward times.

        The median of the last :data:`_SLOW_WINDOW` forward steps (their own time, without the sleep) tracks how
        fast this rank runs now while ignoring single steps the machine delayed: multiplying each step's own time
        would stretch such a delay ``factor`` times too, far past what the fault means and into hang-detection
        timeouts.
        """
        self._recent_forward = [*self._recent_forward[1 - _SLOW_WINDOW :], took]
        if self._slow_now:
            time.sleep(extra * statistics.median(self._recent_forward))

    def _corrupt(self, output: Any) -> Any:
        """The forward output, made NaN or scaled when a value fault is due in this iteration."""
        fault = self._values.get(self._iteration)
        if fault is None or (not fault.always and self._iteration in self._value_struck):
            return output
        if self._iteration not in self._value_struck:
            self._registry.record(fault)
        self._value_struck.add(self._iteration)
        value = float("nan") if fault.kind == "nan" else fault.scale
        logger.error(
            "fault injection: %s forward output (x%s) at iteration %d%s",
            fault.kind,
            value,
            self._iteration,
            " (every pass)" if fault.always else " (first pass only)",
        )
        return output * value
