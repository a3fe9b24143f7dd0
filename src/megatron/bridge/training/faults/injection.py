"""Failures on demand, so that every recovery path can be tested with the real thing: one registry of faults.

A drill or a test names the faults it wants, and the rank they are aimed at fails for real at that moment: it
stops (SIGSTOP), dies (SIGKILL), raises, is signalled, stalls, slows down, computes a NaN or a spike, is killed in
the middle of a checkpoint commit, saves a local checkpoint with NaN weights, or finds the bytes of its written local
checkpoint flipped. Nothing else in the package injects faults: the checkpoint commit protocol and the local tier
ask this registry whether a fault is due, and ``ft.simulate_fault*`` (the public FaultToleranceConfig fields) become
one of its faults.

Spec: a comma-separated list of ``<kind>@<when>:<rank>[:<phase>][:x<factor>][:always]``, e.g.
``kill@8:1,nan@12:0,slow@1:1:x3,kill@6:1:save.during_write,nan@8:0:local_save,hang@4s:1``. Set it in
``fault_injection.faults`` (config) and/or in ``$MBRIDGE_FAULTS`` (for launcher-driven runs); when both are set,
both apply (the environment's faults are added to the config's).

- ``when``: the iteration (1-based, the one the rank is about to run or save), or ``<seconds>s``: that many
  seconds after the rank starts training, wherever it is then (phase ``timer``).
- ``rank``: the global rank that fails.
- ``phase``: where the fault strikes (for each kind below, the first phase listed is its default):

  - ``hang`` (SIGSTOP: a hung GPU, a deadlock), ``kill`` (SIGKILL: a crashed process), ``sigterm`` (SIGTERM: a
    scheduler preempting the job), ``sigterm-tree`` (SIGTERM to the rank and every process it started, as Slurm
    signals a job step): ``step``, ``save.<point>``, ``timer``;
  - ``exception`` (an uncaught ``RuntimeError``), ``stall`` (the rank stays alive but makes no progress, waiting
    with the GIL released, as a rank blocked on a lock, a store, a peer or storage that stops answering; its
    threads and heartbeats go on): ``step``, ``save.<point>``;
  - ``slow`` (the rank's forward steps take ``x<factor>`` times as long, default 2, from that iteration on: it
    sleeps for the extra time inside the step, which CPU-side timing sees and CUDA kernel timing does not; the
    extra time is a multiple of the median of the rank's recent forward times, so a single forward step that
    other processes delay is not stretched ``factor`` times more),
    ``spike`` (its forward output is multiplied by ``x<factor>``, default 100): ``forward``;
  - ``nan``: ``forward`` (its forward output becomes NaN, hence its loss and gradients), ``local_save`` (its
    local checkpoint of that iteration is saved with NaN weights: a poisoned local checkpoint);
  - ``corrupt``: ``local_save`` (once the rank's local checkpoint of that iteration is written, 64 bytes in the
    middle of its file are flipped: storage that damages data at rest, which the content hashes catch at load);
  - ``fill``: ``global_save``, ``local_save`` (the file system of ``checkpoint.save``, or of the local tier's
    directory, is filled up to :data:`FILL_LEAVES` free bytes with the file :data:`FILL_FILE` in that directory, just
    before the rank's files of that iteration's save are written and after the free-space check: a disk that
    fills up during a save; delete the file to free the space);
  - ``oom`` (the rank allocates and touches host memory, 64 MiB at a time, until the kernel's out-of-memory killer
    kills it with SIGKILL: the kill comes from the kernel, never from the rank. It needs a memory limit, as Slurm's
    ``--mem`` sets: it stops at the limit of its memory cgroup plus 256 MiB, or at 2 GiB where it finds none, and
    then raises a ``RuntimeError`` saying that nothing killed it), ``clock_jump`` (this process's wall clock,
    ``time.time()`` and ``time.time_ns()``, jumps by ``x<factor>`` hours, default 1, negative for backwards, from
    then on; the monotonic clocks do not move: an NTP step or a mis-set clock, seen by this rank only): ``step``.
  - ``skip_restore`` (a broken resume on purpose, to prove that a comparison with an uninterrupted run catches
    it: the drill's mutations): ``restore.<part>``, no default: as the rank loads the checkpoint of that iteration
    (either tier) it leaves ``<part>`` (:data:`RESTORE_PARTS`) as its fresh start made it: ``rng`` (every generator
    keeps this start's seeds), ``optimizer`` (moments, step counts and master weights stay as built), ``data`` (the
    training data stream starts at the first sample; the consumed-sample count itself is restored).

  ``step``: when the rank starts the iteration. ``forward``: in the rank's forward passes of the iteration.
  ``save.<point>``: at that point of the global checkpoint's commit protocol in the save of that iteration (points
  in :data:`SAVE_POINTS`: a crash, hang or stall during a save; only rank 0 commits, so every point after
  ``during_write`` needs rank 0). ``local_save``: before the local checkpoint's content hashes are computed, so it
  verifies (a state that is bad although intact, as a replica assembled from the wrong pieces would be).
  ``timer``: goes with ``<seconds>s``, from a timer thread (``ft.simulate_fault`` is such a fault). ``restore.<part>``:
  at the load of the checkpoint of that iteration.
- ``always``: strike in every attempt. Without it a fault strikes in the first attempt of a job only
  (``TORCHELASTIC_RESTART_COUNT`` unset or 0, and the first in-process restart iteration), so that a restarted job
  can recover; with a ledger (``fault_injection.ledger``) it strikes instead the first time any attempt reaches it.
  ``nan`` and ``spike`` in ``forward`` corrupt only the first pass of the iteration (a re-run of the step computes
  the true value: a transient fault); with ``always`` every pass of that iteration in every attempt is corrupted (a
  reproducible fault).

The ledger is a file of JSON lines shared by every attempt: a rank appends the fault (its spec, kind, iteration,
rank, phase, wall-clock time, pid, restart count) just before striking, and later attempts skip what it lists, so a
schedule can span restarts. It decides what is still due; reports read when each fault struck from the
``fault_injected`` events every strike writes to the event stream (``events/stream.py``, ledger or not).

A malformed item or an unknown kind is a ``ValueError`` naming the item, the bad part and the expected form (an item
given twice in one spec, too); the config's ``validate()`` checks both sources before anything starts.
"""

import functools
import json
import logging
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from megatron.bridge.training.callbacks import Callback
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind
from megatron.bridge.training.faults import effects as fault_effects
from megatron.bridge.training.faults.effects import FILL_FILE, FILL_LEAVES  # noqa: F401 - part of this API

if TYPE_CHECKING:  # no import at run time: config.py's validate() parses fault specs with this module
    from megatron.bridge.training.config import FaultInjectionConfig

logger = logging.getLogger(__name__)

ENV = "MBRIDGE_FAULTS"
"""The environment variable of launcher-driven runs; its faults are added to ``fault_injection.faults``."""
GRAMMAR = "<kind>@<when>:<rank>[:<phase>][:x<factor>][:always] (when: an iteration >= 1 or <seconds>s)"

STEP, FORWARD, LOCAL_SAVE, TIMER = "step", "forward", "local_save", "timer"
GLOBAL_SAVE = "global_save"
"""The phase before a rank writes its files of a global checkpoint (after the free-space check)."""
SAVE = "save."
"""Prefix of the phases at a point of the checkpoint commit protocol: ``save.<point>``."""
SAVE_POINTS = (
    "during_write",  # this rank wrote its files, nothing else happened (every rank passes here)
    "after_manifest",  # all files and the manifest are in .tmp_iter_N (rank 0 from here on)
    "after_replace_old",  # an existing iter_N was moved to .replaced_iter_N (a re-save of the same iteration)
    "after_rename",  # iter_N is in place, the tracker still names the previous checkpoint
    "after_tracker_tmp",  # the new tracker is written to its temporary file but not renamed
    "after_tracker",  # committed; .replaced_iter_N (if any) not yet deleted
)
"""The points of ``checkpoint/layout.py``'s commit protocol a ``save.<point>`` fault can strike at."""
RESTORE = "restore."
"""Prefix of the phases at the load of a checkpoint: ``restore.<part>`` (``skip_restore``)."""
RESTORE_PARTS = ("rng", "optimizer", "data")
"""What a ``skip_restore`` can leave unrestored (see the module docstring)."""

_SIGNALS = (STEP, SAVE, TIMER)
PHASES = {
    "hang": _SIGNALS,
    "kill": _SIGNALS,
    "sigterm": _SIGNALS,
    "sigterm-tree": _SIGNALS,
    "exception": (STEP, SAVE),
    "stall": (STEP, SAVE),
    "slow": (FORWARD,),
    "spike": (FORWARD,),
    "nan": (FORWARD, LOCAL_SAVE),
    "corrupt": (LOCAL_SAVE,),
    "fill": (GLOBAL_SAVE, LOCAL_SAVE),
    "oom": (STEP,),
    "clock_jump": (STEP,),
    "skip_restore": (RESTORE,),
}
"""Every kind and the phases it can strike in; the first is its default."""
KINDS = tuple(PHASES)
_FACTORS = {"slow": 2.0, "spike": 100.0, "clock_jump": 1.0}
"""Kinds that take ``x<factor>``, and their default factor (``clock_jump``: hours)."""
_SIGNAL_OF = {"hang": int(signal.SIGSTOP), "kill": int(signal.SIGKILL), "sigterm": int(signal.SIGTERM),
              "sigterm-tree": int(signal.SIGTERM)}  # fmt: skip
"""The signal each signalling kind sends (in its ``fault_injected`` event)."""
_SLOW_WINDOW = 16
"""Forward steps whose median ``slow`` multiplies."""


def _number(value: float) -> str:
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


@dataclass(frozen=True)
class Fault:
    """One scheduled fault; constructing one checks it (``ValueError`` naming the bad part)."""

    kind: str
    iteration: Optional[int]
    """The iteration it strikes at; ``None`` for a timed fault (``seconds``)."""
    rank: int
    phase: str = ""
    """Where it strikes (see the module docstring); empty means the kind's default."""
    always: bool = False
    """Strike in every attempt, not only the first (or the first to reach it, with a ledger)."""
    factor: Optional[float] = None
    """``slow``: how many times longer the forward steps take (default 2); ``spike``: the output multiplier
    (default 100)."""
    seconds: Optional[float] = None
    """A timed fault: seconds after the rank starts training (instead of an iteration; phase ``timer``)."""

    def __post_init__(self) -> None:
        if self.kind not in PHASES:
            raise ValueError(f"unknown kind {self.kind!r} (kinds: {', '.join(KINDS)})")
        timed = self.seconds is not None
        if timed == (self.iteration is not None):
            raise ValueError("give either an iteration or a time in seconds")
        if not self.phase and PHASES[self.kind][0] == RESTORE:
            raise ValueError(f"{self.kind} needs its phase {RESTORE}<part> (parts: {', '.join(RESTORE_PARTS)})")
        if not self.phase:
            object.__setattr__(self, "phase", TIMER if timed else PHASES[self.kind][0])
        family = next((p for p in (SAVE, RESTORE) if self.phase.startswith(p)), self.phase)
        if family not in PHASES[self.kind]:
            allowed = ", ".join(p + {SAVE: "<point>", RESTORE: "<part>"}.get(p, "") for p in PHASES[self.kind])
            raise ValueError(f"{self.kind} cannot strike in phase {self.phase!r} (its phases: {allowed})")
        if family == RESTORE and self.phase[len(RESTORE) :] not in RESTORE_PARTS:
            raise ValueError(f"unknown part {self.phase!r} (parts: {RESTORE}{f', {RESTORE}'.join(RESTORE_PARTS)})")
        if family == SAVE and self.phase[len(SAVE) :] not in SAVE_POINTS:
            raise ValueError(f"unknown checkpoint point {self.phase!r} (points: save.{', save.'.join(SAVE_POINTS)})")
        if family == SAVE and self.phase != SAVE + SAVE_POINTS[0] and self.rank != 0:
            raise ValueError(f"only rank 0 reaches {self.phase!r} (it commits the checkpoint)")
        if (family == TIMER) != timed:
            raise ValueError("a <seconds>s time goes with phase timer, an iteration with the other phases")
        if timed and not 0 <= self.seconds < float("inf"):
            raise ValueError(f"time {self.seconds}s is not a number of seconds >= 0")
        if not timed and self.iteration < 1:
            raise ValueError(f"iteration {self.iteration} is not >= 1")
        if self.rank < 0:
            raise ValueError(f"rank {self.rank} is not >= 0")
        if self.factor is not None and self.kind not in _FACTORS:
            raise ValueError(f"x<factor> is only for {' and '.join(_FACTORS)}")
        if self.kind == "clock_jump" and self.factor is not None and not 0 < abs(self.factor) < 1e4:
            raise ValueError(f"x{self.factor:g}: a clock jump is a non-zero number of hours, under 10000 either way")
        if self.kind != "clock_jump" and self.factor is not None and not 1 < self.factor < 1e3:
            raise ValueError(f"factor {self.factor:g} is not in (1, 1000)")

    @property
    def scale(self) -> float:
        """``factor``, or the kind's default one."""
        return self.factor if self.factor is not None else _FACTORS.get(self.kind, 1.0)

    def __str__(self) -> str:
        """The spec of this fault (``parse(str(fault)) == [fault]``)."""
        when = f"{_number(self.seconds)}s" if self.seconds is not None else str(self.iteration)
        options = [self.phase] if self.phase != (TIMER if self.seconds is not None else PHASES[self.kind][0]) else []
        options += [f"x{_number(self.factor)}"] if self.factor is not None else []
        options += ["always"] if self.always else []
        return ":".join([f"{self.kind}@{when}", str(self.rank), *options])


def _parse_item(item: str) -> Fault:
    kind, at, rest = item.partition("@")
    if not at:
        raise ValueError("no '@' after the kind")
    if kind not in PHASES:
        raise ValueError(f"unknown kind {kind!r}")
    when, *parts = rest.split(":")
    if not parts:
        raise ValueError("no :<rank> after the iteration")
    iteration = seconds = None
    try:
        if when.endswith("s"):
            seconds = float(when[:-1])
        else:
            iteration = int(when)
    except ValueError:
        raise ValueError(f"{when!r} is neither an iteration nor <seconds>s") from None
    try:
        rank = int(parts[0])
    except ValueError:
        raise ValueError(f"rank {parts[0]!r} is not a whole number") from None
    phase, factor, always = "", None, False
    for option in parts[1:]:
        if option == "always" and not always:
            always = True
        elif option.startswith("x") and factor is None:
            try:
                factor = float(option[1:])
            except ValueError:
                raise ValueError(f"factor {option!r} is not x<number>") from None
        elif (option in (STEP, FORWARD, LOCAL_SAVE, GLOBAL_SAVE, TIMER) or option.startswith((SAVE, RESTORE))) and (
            not phase
        ):
            phase = option
        else:
            raise ValueError(
                f"option {option!r} is unknown or given twice (options: a phase {STEP}, {FORWARD}, {SAVE}<point>, "
                f"{GLOBAL_SAVE}, {LOCAL_SAVE}, {TIMER}, {RESTORE}<part>; x<factor>; always)"
            )
    return Fault(kind, iteration, rank, phase, always, factor, seconds)


def parse(spec: str, source: str = ENV) -> list[Fault]:
    """Parse a fault spec (see the module docstring); ``source`` names where it came from in errors.

    Raises:
        ValueError: ``"<source>: bad item '<item>': <what is wrong>. Fix: ..."``.
    """
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            faults.append(_parse_item(item))
        except ValueError as err:
            raise ValueError(
                f"{source}: bad item {item!r}: {err}. Fix: write each item as {GRAMMAR}, kinds {', '.join(KINDS)}"
            ) from None
        if faults[-1] in faults[:-1]:
            raise ValueError(f"{source}: item {item!r} is there twice (a fault strikes once); remove one")
    return faults


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
        self._first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and inprocess_iteration == 0
        self._due: list[Fault] = []
        for fault in faults:
            self.add(fault)
        self.replaced = False
        """Set when another registry is installed (an in-process restart): its armed timers no longer strike."""

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

    def take(self, phase: str, rank: int, iteration: int, kind: Optional[str] = None) -> Optional[Fault]:
        """The fault (of ``kind``, if given) due at ``phase`` of ``iteration`` on ``rank``, recorded as struck."""
        due = (f for f in self.pending(rank, [phase]) if f.iteration == iteration and kind in (None, f.kind))
        fault = next(due, None)
        if fault is not None:
            self.record(fault)
        return fault

    def record(self, fault: Fault) -> None:
        """``fault`` is about to strike: no longer due in this attempt (unless ``always``); in the ledger, durably.

        Also a ``fault_injected`` event (``events/stream.py``), with or without a ledger: when it struck, for reports.
        """
        if not fault.always and fault in self._due:
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
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        }
        fd = os.open(self.ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)


_active: Optional[FaultRegistry] = None


def install(cfg: "FaultInjectionConfig", inprocess_iteration: int = 0) -> FaultRegistry:
    """Make the faults of ``cfg`` and ``$MBRIDGE_FAULTS`` the ones of this process (at each start).

    More may be added with :meth:`FaultRegistry.add` (``ft.simulate_fault`` is).
    """
    global _active
    faults = [*parse(cfg.faults or "", "fault_injection.faults"), *parse(os.environ.get(ENV, ""))]
    if _active is not None:
        _active.replaced = True
    _active = FaultRegistry(faults, cfg.ledger, inprocess_iteration)
    return _active


def registry() -> FaultRegistry:
    """The installed registry; in a process that installed none, the faults of ``$MBRIDGE_FAULTS`` alone."""
    global _active
    if _active is None:
        _active = FaultRegistry(parse(os.environ.get(ENV, "")))
    return _active


def at_save_point(point: str, rank: int, iteration: int) -> None:
    """Strike if a fault is due at ``point`` of the commit protocol (see :data:`SAVE_POINTS`) in this save."""
    fault = registry().take(SAVE + point, rank, iteration)
    if fault is not None:
        how = {"kill": "SIGKILL", "hang": "SIGSTOP", "stall": "a stalled write"}.get(fault.kind, fault.kind)
        strike(fault.kind, f"checkpoint point {point!r} on rank {rank}, iteration {iteration}", label=how)


def poisons_local_save(rank: int, iteration: int) -> bool:
    """Whether the local checkpoint of ``iteration`` on ``rank`` is to be saved with NaN weights (and is, now)."""
    return registry().take(LOCAL_SAVE, rank, iteration, kind="nan") is not None


def skipped_restores(rank: int, iteration: int) -> frozenset[str]:
    """The parts (:data:`RESTORE_PARTS`) ``rank`` leaves unrestored as it loads the checkpoint of ``iteration``.

    Each ``skip_restore`` due there is recorded as struck.
    """
    due = registry()
    parts = frozenset(p for p in RESTORE_PARTS if due.take(RESTORE + p, rank, iteration, kind="skip_restore"))
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
    """Flip 64 bytes in the middle of the written local checkpoint file ``path()`` if ``corrupt`` is due now."""
    if registry().take(LOCAL_SAVE, rank, iteration, kind="corrupt") is None:
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

    ``factor``: a ``clock_jump``'s hours (default 1).
    """
    logger.error("fault injection: %s at %s (pid %d)", label or kind, where, os.getpid())
    for handler in logging.getLogger().handlers:
        handler.flush()
    if kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif kind == "sigterm-tree":
        for pid in [*fault_effects.descendants(os.getpid()), os.getpid()]:
            os.kill(pid, signal.SIGTERM)
    elif kind == "stall":
        stall_forever()
    elif kind == "oom":
        fault_effects.allocate_until_killed()
    elif kind == "clock_jump":
        fault_effects.jump_clock(_FACTORS["clock_jump"] if factor is None else factor)
    else:
        raise RuntimeError(f"fault injection: exception at {where}")


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
        mine = self._registry.pending(rank, (STEP, FORWARD, TIMER))
        self._at = {f.iteration: f for f in mine if f.phase == STEP}
        self._values = {f.iteration: f for f in mine if f.phase == FORWARD and f.kind != "slow"}
        self._slow: Optional[Fault] = next((f for f in mine if f.kind == "slow"), None)
        self._timed = [f for f in mine if f.phase == TIMER]
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

    def _arm(self, fault: Fault) -> None:
        """Start the timer of a timed fault."""
        logger.warning("fault injection: %s armed on rank %d, %.1f s from now", fault, self.rank, fault.seconds)

        def wait_and_strike() -> None:
            time.sleep(fault.seconds)
            if self._registry.replaced:  # the attempt that armed it is over; the new one decides for itself
                logger.warning("fault injection: %s disarmed: the process restarted in process", fault)
                return
            self._registry.record(fault)
            strike(fault.kind, f"{_number(fault.seconds)} s into training on rank {self.rank}")

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
