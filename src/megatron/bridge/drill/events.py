"""What the job's events say happened: steps over time, restarts phase by phase, resumes, and each fault's outcome.

The failure it avoids: reconstructing a run from its log text breaks when a message is reworded, misattributes
lines when processes interleave, and cannot time what no line states. The drill reads the job's event stream
instead (``training/events/stream.py``, ``docs/training/events.md``): typed events every rank and the launcher
appended, each with its wall-clock time (unix seconds; every process of the drill runs on one machine, so the times
of different processes compare). Lines the reader had to skip (truncated, not JSON, an unknown version) are kept in
:attr:`Timeline.problems` and reported, never fatal.

:func:`read_run` builds a :class:`Timeline` from an event directory; :func:`outcomes` matches each scheduled fault
with the ``fault_injected`` event of its strike, the first ``fault_detected`` event of a mechanism meant for it, the
restarts it caused (any layer) and the first step completed after the resume; :func:`cycles` splits each recovery
(detection to first step) into its phases (:class:`~megatron.bridge.training.events.stream.CyclePhase`).
"""

import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron.bridge.drill.schedule import MUTATIONS, RELOADING
from megatron.bridge.training.events.reader import Problem, read_events, signal_name
from megatron.bridge.training.events.stream import CyclePhase, Event, EventKind, Mechanism, RestartLayer
from megatron.bridge.training.faults.spec import Fault

DETECTED_BY: dict[Mechanism, str] = {
    Mechanism.LAUNCHER_WORKER_EXIT: "ft_launcher: worker exited",
    Mechanism.RANK_MONITOR_SECTION_TIMEOUT: "rank monitor: section timeout",
    Mechanism.RANK_MONITOR_HEARTBEAT_TIMEOUT: "rank monitor: heartbeat timeout",
    Mechanism.INPROCESS_EXCEPTION: "in-process restart: exception in the training function",
    Mechanism.INPROCESS_SOFT_TIMEOUT: "in-process restart: no progress for soft_timeout",
    Mechanism.INPROCESS_HARD_TIMEOUT: "in-process restart: no progress for hard_timeout",
    Mechanism.INPROCESS_DEAD_PEER: "in-process restart: a peer stopped its heartbeats",
    Mechanism.RERUN_NAN: "re-run state machine: NaN loss",
    Mechanism.RERUN_SPIKE: "re-run state machine: loss spike",
    Mechanism.NAN_GUARD: "loss guard: NaN loss",
    Mechanism.PREEMPTION_SIGNAL: "signal handler: all ranks agree to stop",
    Mechanism.STRAGGLER_SCORE: "straggler detector: score below threshold",
    Mechanism.LOCAL_CHECKPOINT_HASH: "local tier: content hash mismatch at load",
    Mechanism.CHECKPOINT_VERIFICATION: "global checkpoint: manifest mismatch at load",
    Mechanism.LIVENESS_PING: "liveness ping: rank lost",
}
"""How the report names each detection mechanism."""
_IN_PLACE = {"nan": "step re-run in place (transient)", "corrupt-local": "discarded, fell back to the global tier"}
_BY_LAYER = {RestartLayer.IN_PROCESS: "in-process restart in the same processes", RestartLayer.IN_JOB: "in-job restart",
             RestartLayer.REQUEUE: "requeue"}  # fmt: skip
_SAVED_FIRST = {"preempt": "save, exit 18, ", "slow": "save, exit 21, "}
_HANG_SEEN_BY = (Mechanism.RANK_MONITOR_SECTION_TIMEOUT, Mechanism.RANK_MONITOR_HEARTBEAT_TIMEOUT,
                 Mechanism.INPROCESS_SOFT_TIMEOUT)  # fmt: skip
"""A hung rank's peers block in a collective with it: the first of them to time out (often a peer) detects it."""


def recovered_by(outcome: "Outcome") -> str:
    """How ``outcome``'s fault was recovered, for people: in place, or the restarts it caused, layer by layer."""
    if not outcome.restarts:
        return _IN_PLACE.get(outcome.fault.kind, "in place")
    steps = [
        _BY_LAYER[r.layer] + (" (did not finish)" if r.ended is None and r is not outcome.restarts[-1] else "")
        for r in outcome.restarts
    ]
    return f"{_SAVED_FIRST.get(outcome.fault.kind, '')}{', then '.join(steps)}, resume from newest verified checkpoint"


@dataclass
class Restart:
    """One restart of any layer, phase by phase (``docs/training/events.md``, "Restart phases").

    An in-process restart is reported by every rank: its events are merged (the earliest of each).
    """

    layer: RestartLayer
    begun: float
    """``restart_begun``: the failure was seen and the restart decided."""
    restart_count: Optional[int] = None
    inprocess_iteration: Optional[int] = None
    """The attempt the restart leads to: (in-job restarts, in-process iteration)."""
    stopped: Optional[float] = None
    """The end of the teardown: ``workers_stopped`` (in-job) or ``restart_ended`` (in-process)."""
    ended: Optional[float] = None
    """``restart_ended``: the new workers (or the new in-process iteration) run."""
    spawned: Optional[float] = None
    """The earliest ``attempt_start`` of the new attempt on any rank."""
    load_began: Optional[float] = None
    loaded: Optional[float] = None
    """Rank 0's checkpoint load in the new attempt: when it began and ended."""
    first_step: Optional[float] = None
    """Rank 0's first completed step in the new attempt."""
    setup: dict[CyclePhase, tuple[float, float]] = field(default_factory=dict)
    """Rank 0's set-up phases in the new attempt (its ``phase`` events): (start, end) of each."""
    resumed_from: Optional[int] = None
    tier: Optional[str] = None
    """The checkpoint the new attempt resumed from (its iteration and tier)."""
    cause: Optional[Event] = None
    """The last ``fault_detected`` event before the restart began."""

    def phases(self) -> dict[str, Optional[float]]:
        """Seconds of teardown, spawn, setup, load and first step, and the total (``None``: not measured)."""

        def span(a: Optional[float], b: Optional[float]) -> Optional[float]:
            return None if a is None or b is None else b - a

        setup_end = self.load_began if self.load_began is not None else self.first_step
        return {
            "teardown": span(self.begun, self.stopped),
            "spawn": span(self.stopped, self.spawned),
            "setup": span(self.spawned, setup_end),
            "load": span(self.load_began, self.loaded),
            "first_step": span(self.loaded, self.first_step),
            "total": span(self.begun, self.first_step),
        }


@dataclass
class Timeline:
    """The run as its event stream tells it."""

    start: Optional[float] = None
    """The run's time zero: the launcher's process start, else the earliest process start or event."""
    end: Optional[float] = None
    steps: list[tuple[float, int, float]] = field(default_factory=list)
    """(time, iteration, step seconds) of every step rank 0 completed, in time order (repeated iterations after a
    rollback appear again)."""
    restarts: list[Restart] = field(default_factory=list)
    """Every restart of any layer, by the time it began."""
    resumes: list[tuple[float, int]] = field(default_factory=list)
    """(time, iteration) of every attempt's start of training: rank 0's checkpoint load, or (the attempt's start, 0)
    for an attempt that trained from scratch."""
    attempts: list[Event] = field(default_factory=list)
    """Every rank's ``attempt_started`` events."""
    straggler_reports: list[tuple[float, int, dict[int, float]]] = field(default_factory=list)
    """(time, iteration, rank -> relative score) of every straggler report."""
    events: list[Event] = field(default_factory=list)
    """Every event read, in time order."""
    problems: list[Problem] = field(default_factory=list)
    """Lines of the event files that were skipped, and why."""

    def restarts_of(self, layer: RestartLayer) -> list[Restart]:
        """The restarts of one layer."""
        return [r for r in self.restarts if r.layer == layer]


def _is(event: Event, kind: EventKind, rank: Optional[int] = None) -> bool:
    """``event`` is of ``kind`` (and, with ``rank``, a training process's event about that rank)."""
    return event.kind == kind and (rank is None or (event.rank == rank and event.process in (None, "worker")))


def _attempt(event: Event) -> tuple[Optional[int], Optional[int]]:
    """The attempt a rank's event belongs to: (in-job restarts, in-process iteration)."""
    return event.restart_count, event.inprocess_iteration


def build_timeline(events: list[Event], problems: Optional[list[Problem]] = None) -> Timeline:
    """The :class:`Timeline` of ``events`` (in time order, as :func:`read_events` returns them)."""
    attempts = [e for e in events if _is(e, EventKind.ATTEMPT_STARTED)]
    launched = [e.process_start for e in events if _is(e, EventKind.LAUNCHER_STARTED) and e.process_start is not None]
    earliest = [e.time for e in events[:1]] + [e.process_start for e in attempts if e.process_start is not None]
    timeline = Timeline(
        start=min(launched or earliest, default=None),
        end=max((e.time for e in events), default=None),
        steps=[(e.time, e.iteration, e.seconds or 0.0) for e in events if _is(e, EventKind.STEP_COMPLETED, 0)],
        restarts=_restarts(events, attempts),
        attempts=attempts,
        straggler_reports=[
            (e.time, e.iteration, e.relative_scores or {}) for e in events if _is(e, EventKind.STRAGGLER_REPORT)
        ],
        events=events,
        problems=list(problems or []),
    )
    for started in (e for e in attempts if e.rank == 0):
        load = _of_attempt(events, EventKind.CHECKPOINT_LOADED, _attempt(started), started.time)
        if load is not None and load.iteration is not None:
            timeline.resumes.append((load.time, load.iteration))
        elif _of_attempt(events, EventKind.STEP_COMPLETED, _attempt(started), started.time) is not None:
            timeline.resumes.append((started.time, 0))  # trained from scratch
    return timeline


def _first(events: list[Event], after: float, match: Callable[[Event], bool]) -> Optional[Event]:
    """The first event at or after ``after`` that ``match`` accepts."""
    return next((e for e in events if e.time >= after and match(e)), None)


def _of_attempt(events: list[Event], kind: EventKind, attempt: tuple, after: float) -> Optional[Event]:
    """Rank 0's first event of ``kind`` in ``attempt`` (see :func:`_attempt`) at or after ``after``."""
    return _first(events, after, lambda e: _is(e, kind, 0) and _attempt(e) == attempt)


def _restarts(events: list[Event], attempts: list[Event]) -> list[Restart]:
    """One :class:`Restart` per restart of any layer, its phases from its own events and its new attempt's."""

    def key(e: Event) -> tuple:
        in_process = e.layer == RestartLayer.IN_PROCESS
        return e.layer, e.restart_count, e.inprocess_iteration if in_process else None

    found: dict[tuple, Restart] = {}
    for e in events:
        if _is(e, EventKind.RESTART_BEGUN) and e.layer is not None and key(e) not in found:
            found[key(e)] = Restart(e.layer, e.time, e.restart_count, e.inprocess_iteration)
    for e in events:
        r = found.get(key(e)) if e.kind in (EventKind.WORKERS_STOPPED, EventKind.RESTART_ENDED) else None
        if r is None:
            continue
        if e.kind == EventKind.RESTART_ENDED and r.ended is None:
            r.ended = e.time
        if r.stopped is None and (e.kind == EventKind.WORKERS_STOPPED) == (r.layer != RestartLayer.IN_PROCESS):
            r.stopped = e.time
    for r in found.values():
        new = (r.restart_count, r.inprocess_iteration if r.layer == RestartLayer.IN_PROCESS else 0)
        starts = [a.attempt_start if a.attempt_start is not None else a.time for a in attempts if _attempt(a) == new]
        r.spawned = min(starts, default=None)
        load = _of_attempt(events, EventKind.CHECKPOINT_LOADED, new, r.begun)
        if load is not None:
            r.loaded, r.resumed_from, r.tier = load.time, load.iteration, load.tier
            r.load_began = load.time - (load.seconds or 0.0)
        step = _of_attempt(events, EventKind.STEP_COMPLETED, new, r.begun)
        r.first_step = None if step is None else step.time
        r.setup = _setup_phases(events, new, r.begun)
        detections = [e for e in events if _is(e, EventKind.FAULT_DETECTED) and e.time <= r.begun]
        r.cause = detections[-1] if detections else None
    return sorted(found.values(), key=lambda r: r.begun)


def _setup_phases(events: list[Event], attempt: tuple, after: float) -> dict[CyclePhase, tuple[float, float]]:
    """Rank 0's set-up phases in ``attempt`` (see :func:`_attempt`) from ``after`` on: the first ``phase`` of each."""
    found: dict[CyclePhase, tuple[float, float]] = {}
    for e in events:
        if e.time >= after and _is(e, EventKind.PHASE, 0) and _attempt(e) == attempt and e.cycle_phase is not None:
            if e.start is not None and e.end is not None:
                found.setdefault(e.cycle_phase, (e.start, e.end))
    return found


SETUP_PHASES = (CyclePhase.PROCESS_START, CyclePhase.PROCESS_GROUP, CyclePhase.HEALTH_CHECKS, CyclePhase.MODEL_BUILD,
                CyclePhase.CHECKPOINT_LOAD, CyclePhase.DATA_BUILD)  # fmt: skip
"""The phases a training attempt writes itself (``phase`` events), in their order."""


@dataclass
class Cycle:
    """One restart cycle: from a fault's detection to the first step completed after the restart that recovered it.

    Its phases (:class:`CyclePhase`, ``docs/training/events.md``, "Restart cycles") are spans of wall-clock time:
    the detection (the strike to it) comes before the cycle; the teardown runs from the detection to the end of the
    failed attempt (``workers_stopped``; in-process: the new iteration's start), the rendezvous (in-job) to rank 0's
    fork, the set-up phases are rank 0's own ``phase`` events in the new attempt, and the first step runs from the
    end of set-up to rank 0's first ``step_completed``. Back to back, they add up to the cycle; what they leave is
    :attr:`unaccounted_s`.
    """

    restart: Restart
    """The restart that recovered the fault: the cycle's layer, its new attempt."""
    detected: float
    """When the fault was detected: the cycle's start."""
    cause: str
    """The fault (its label), or ``unexplained: <mechanism>`` for a restart no scheduled fault explains."""
    struck: Optional[float] = None
    """When the fault struck (``fault_injected``), if known."""
    kind: Optional[str] = None
    """The fault's kind (``kill``, ``stall``...; ``None``: unexplained)."""

    @property
    def layer(self) -> RestartLayer:
        """The layer of the restart that recovered the fault."""
        return self.restart.layer

    @property
    def seconds(self) -> Optional[float]:
        """The cycle: seconds from the detection to the first completed step."""
        return None if self.restart.first_step is None else self.restart.first_step - self.detected

    def spans(self) -> dict[CyclePhase, Optional[tuple[float, float]]]:
        """(start, end) of every phase, in order (``None``: not measured, or not of this layer)."""
        r, setup = self.restart, self.restart.setup
        measured = [setup[p] for p in SETUP_PHASES if p in setup]
        in_job = r.layer != RestartLayer.IN_PROCESS
        stopped = r.stopped if in_job else (measured[0][0] if measured else r.ended)
        forked = setup[CyclePhase.PROCESS_START][0] if CyclePhase.PROCESS_START in setup else None
        set_up = measured[-1][1] if measured else None
        return {
            CyclePhase.DETECTION: None if self.struck is None else (self.struck, self.detected),
            CyclePhase.TEARDOWN: None if stopped is None else (self.detected, stopped),
            CyclePhase.RENDEZVOUS: (r.stopped, forked) if in_job and None not in (r.stopped, forked) else None,
            **{p: setup.get(p) for p in SETUP_PHASES},
            CyclePhase.FIRST_STEP: None if None in (set_up, r.first_step) else (set_up, r.first_step),
        }  # fmt: skip

    def phases(self) -> dict[str, Optional[float]]:
        """Seconds of every phase, by :class:`CyclePhase` value, in order (``None``: not measured)."""
        return {p.value: None if span is None else span[1] - span[0] for p, span in self.spans().items()}

    @property
    def accounted_s(self) -> float:
        """Seconds of the cycle's measured phases (the detection, before the cycle, left out)."""
        phases = self.phases()
        return sum(s for name, s in phases.items() if s is not None and name != CyclePhase.DETECTION)

    @property
    def unaccounted_s(self) -> Optional[float]:
        """Seconds of the cycle no phase covers (a gap between them, or a phase not measured)."""
        return None if self.seconds is None else self.seconds - self.accounted_s


def cycles(timeline: Timeline, found: "list[Outcome] | tuple" = ()) -> list[Cycle]:
    """Every restart cycle of the run, in the order of their detections.

    One per fault of ``found`` recovered by a restart, then one per restart no fault of ``found`` claimed (its
    cause: the last ``fault_detected`` before it began). A fault that caused several restarts (an in-process
    restart cut short by the launcher's) makes one cycle, up to the first step after the last of them that trained.
    """
    result: list[Cycle] = []
    claimed: set[int] = set()
    for o in found:
        claimed.update(id(r) for r in o.restarts)
        trained = [r for r in o.restarts if r.first_step is not None]
        if o.detected is not None and trained:
            result.append(Cycle(trained[-1], o.detected, o.fault.label, o.struck, o.fault.kind))
    for r in timeline.restarts:
        if id(r) in claimed or r.first_step is None or r.cause is None:
            continue
        struck = [e.time for e in timeline.events if _is(e, EventKind.FAULT_INJECTED) and e.time <= r.cause.time]
        label = f"unexplained: {r.cause.mechanism.value if r.cause.mechanism else r.cause.kind.value}"
        result.append(Cycle(r, r.cause.time, label, struck[-1] if struck else None))
    return sorted(result, key=lambda c: c.detected)


@dataclass
class Outcome:
    """What happened to one scheduled fault (``None``: not seen)."""

    fault: Fault
    struck: Optional[float] = None
    """Its ``fault_injected`` event's time."""
    detected: Optional[float] = None
    """The first detection by a mechanism meant for it."""
    recovered: Optional[float] = None
    """The first step completed after the resume (a NaN: its iteration completed)."""
    resumed_from: Optional[int] = None
    steps_lost: Optional[int] = None
    restarts: list[Restart] = field(default_factory=list)
    """The restarts it caused, any layer, in order; the last one recovered it."""
    detection: Optional[Event] = None
    """The ``fault_detected`` event taken as its detection."""

    @property
    def restart(self) -> Optional[Restart]:
        """The restart that recovered it (``None``: recovered in place, or no restart was claimed)."""
        return self.restarts[-1] if self.restarts else None

    @property
    def relaunched(self) -> bool:
        """The launcher restarted the workers for it (an in-job restart)."""
        return any(r.layer == RestartLayer.IN_JOB for r in self.restarts)

    @property
    def detection_line(self) -> Optional[str]:
        """The detection, for people (:func:`describe`)."""
        return None if self.detection is None else describe(self.detection)

    @property
    def detection_s(self) -> Optional[float]:
        """Seconds from the strike to the detection."""
        return None if self.struck is None or self.detected is None else self.detected - self.struck

    @property
    def recovery_s(self) -> Optional[float]:
        """Seconds from the detection to the first completed step after it."""
        return None if self.detected is None or self.recovered is None else self.recovered - self.detected

    @property
    def ok(self) -> bool:
        """Struck, detected and recovered."""
        return None not in (self.struck, self.detected, self.recovered)


def describe(event: Event) -> str:
    """One line for people about a detection event: its mechanism, rank, exit code or signal, timeout, detail."""
    who = "" if event.rank is None else f"rank {event.rank}"  # a local rank alone is the writer's, not the blamed one
    who += "" if event.rank is None or event.local_rank is None else f", local_rank: {event.local_rank}"
    who += "" if event.exit_code is None else f" (exitcode: {event.exit_code})"
    parts = [who.strip()] if who else []
    if event.signal is not None:
        parts.append(f"{'killed by ' if event.exit_code is not None else ''}{signal_name(event.signal)}")
    if event.section is not None or (event.seconds is not None and event.timeout is not None):
        timed = event.seconds is not None and event.timeout is not None
        over = f" {event.seconds:.2f} s > {event.timeout:.2f} s" if timed else ""
        parts.append(f"section '{event.section}' open{over}" if event.section is not None else f"no heartbeat{over}")
    if event.iteration is not None:
        parts.append(f"at iteration {event.iteration}")
    if event.score is not None:
        parts.append(f"score {event.score:.3f}" + ("" if event.threshold is None else f" < {event.threshold:.3f}"))
    text = event.mechanism.value if event.mechanism is not None else event.kind.value
    text += f": {', '.join(parts)}" if parts else ""
    return text + (f": {event.detail}" if event.detail else "")


def _detects(fault: Fault, e: Event) -> bool:
    """``e`` is a detection of ``fault`` by a mechanism meant for its kind."""
    if e.kind != EventKind.FAULT_DETECTED:
        return False
    m = e.mechanism
    died_by = set() if m != Mechanism.LAUNCHER_WORKER_EXIT or e.rank != fault.rank else {e.signal, -(e.exit_code or 0)}
    if fault.kind == "kill":
        return signal.SIGKILL in died_by
    if fault.kind == "hang":  # under in-process restart: its soft timeout, then its hard timeout terminates the rank
        return m in _HANG_SEEN_BY or bool(died_by & {signal.SIGKILL, signal.SIGTERM})
    if fault.kind == "stall":
        return m == Mechanism.INPROCESS_SOFT_TIMEOUT
    if fault.kind == "preempt":
        return m == Mechanism.PREEMPTION_SIGNAL
    if fault.kind == "nan":
        return m == Mechanism.RERUN_NAN and e.rank == fault.rank and e.iteration == fault.iteration
    if fault.kind == "slow":
        return m == Mechanism.STRAGGLER_SCORE and e.rank == fault.rank
    if fault.kind == "corrupt-local":
        return m == Mechanism.LOCAL_CHECKPOINT_HASH and e.iteration == fault.iteration
    return False


def _strike(events: list[Event], fault: Fault) -> Optional[Event]:
    """The ``fault_injected`` event of ``fault`` (the training processes name its kind as the ledger does)."""
    wanted = (fault.kind, fault.iteration, fault.rank)
    injected = (e for e in events if _is(e, EventKind.FAULT_INJECTED))
    return next((e for e in injected if (e.fault_kind, e.iteration, e.rank) == wanted), None)


def outcomes(timeline: Timeline, faults: list[Fault]) -> list[Outcome]:
    """Match each scheduled fault with its strike, detection, restarts and recovery.

    A fault that reloads a checkpoint (``RELOADING``) claims the restarts of any layer that began after it struck
    and before the next such fault struck, up to the one that recovers it (in-process for a stall, in-job for the
    others); a restart is claimed once. A NaN is recovered in place only if no restart came between it and the
    completed step; a corrupted local checkpoint, when the global one after it is resumed.

    Args:
        timeline: what the event stream of the run with faults says.
        faults: the schedule, sorted by iteration (its mutations are left out: :func:`mutation_outcomes`).

    Returns:
        One :class:`Outcome` per fault, in schedule order; what could not be matched stays ``None``.
    """
    result = [Outcome(fault) for fault in faults if fault.kind not in MUTATIONS]
    for outcome in result:
        strike = _strike(timeline.events, outcome.fault)
        outcome.struck = None if strike is None else strike.time
    claimed: set[int] = set()
    for i, outcome in enumerate(result):
        fault = outcome.fault
        if outcome.struck is None:
            continue
        outcome.detection = _first(timeline.events, outcome.struck, lambda e, f=fault: _detects(f, e))
        if outcome.detection is None:
            continue
        outcome.detected = outcome.detection.time
        if fault.kind == "nan":
            _recovered_in_place(outcome, timeline)
        elif fault.kind == "corrupt-local":
            _after_load(outcome, timeline, outcome.detected)
            if outcome.resumed_from is not None:
                outcome.steps_lost = fault.iteration - outcome.resumed_from
        elif fault.kind in RELOADING:
            later = [o.struck for o in result[i + 1 :] if o.fault.kind in RELOADING and o.struck is not None]
            _restarted(outcome, timeline, min(later, default=float("inf")), claimed)
    return result


def mutation_outcomes(timeline: Timeline, faults: list[Fault]) -> list[Outcome]:
    """The schedule's mutations, each with when it struck (nothing is meant to detect or recover one)."""
    result = [Outcome(fault) for fault in faults if fault.kind in MUTATIONS]
    for outcome in result:
        strike = _strike(timeline.events, outcome.fault)
        outcome.struck = None if strike is None else strike.time
    return result


def _restarted(outcome: Outcome, timeline: Timeline, until: float, claimed: set[int]) -> None:
    """Claim the restarts ``outcome``'s fault caused (begun from its strike to ``until``); fill in its recovery.

    Steps lost: the last step completed before the recovering restart minus the checkpoint resumed; a local
    checkpoint rejected on the way counts as the one resumed (what the fallback cost beyond it is the corruption's).
    """
    assert outcome.struck is not None
    final = RestartLayer.IN_PROCESS if outcome.fault.kind == "stall" else RestartLayer.IN_JOB
    mine = [r for r in timeline.restarts if id(r) not in claimed and outcome.struck <= r.begun < until]
    last = next((n for n, r in enumerate(mine) if r.layer == final), None)
    outcome.restarts = mine if last is None else mine[: last + 1] + _cut_short(mine[last], mine[last + 1 :])
    claimed.update(id(r) for r in outcome.restarts)
    if last is None:
        return
    begun = mine[last].begun
    _after_load(outcome, timeline, begun)
    done = [it for t, it, _ in timeline.steps if t <= begun]
    if outcome.resumed_from is None or not done:
        return
    end = float("inf") if outcome.recovered is None else outcome.recovered
    rejected = [e.iteration for e in timeline.events if _is(e, EventKind.FAULT_DETECTED) and e.iteration is not None
                and e.mechanism == Mechanism.LOCAL_CHECKPOINT_HASH and begun <= e.time <= end]  # fmt: skip
    outcome.steps_lost = done[-1] - max([outcome.resumed_from, *rejected])


def _cut_short(in_job: Restart, later: list[Restart]) -> list[Restart]:
    """In-process restarts a survivor began while the launcher was stopping the workers, which never ended.

    The survivor's own layer sees the dead peer too, and may react inside the launcher's stop window: that restart is
    part of the same recovery, not a new one.
    """
    if in_job.layer != RestartLayer.IN_JOB:
        return []
    stopped = in_job.stopped if in_job.stopped is not None else in_job.ended
    return [
        r for r in later
        if r.layer == RestartLayer.IN_PROCESS and r.ended is None and stopped is not None and r.begun <= stopped
    ]  # fmt: skip


def _recovered_in_place(outcome: Outcome, timeline: Timeline) -> None:
    """A NaN: recovered when its iteration completes with no restart in between (else it was not in place)."""
    assert outcome.detected is not None
    it = outcome.fault.iteration
    done = next((t for t, i, _ in timeline.steps if t >= outcome.detected and i == it), None)
    if done is None or any(outcome.detected <= r.begun <= done for r in timeline.restarts):
        return
    outcome.recovered, outcome.steps_lost = done, 0


def _after_load(outcome: Outcome, timeline: Timeline, since: float) -> None:
    """Fill in the first resume after ``since`` and the first step completed after it."""
    load = next(((t, it) for t, it in timeline.resumes if t >= since), None)
    if load is None:
        return
    outcome.resumed_from = load[1]
    outcome.recovered = next((t for t, _, _ in timeline.steps if t >= load[0]), None)


def unexplained_restarts(timeline: Timeline, found: list[Outcome]) -> list[float]:
    """When the restarts no scheduled fault caused began (a spurious timeout, say): reported, never hidden."""
    explained = {id(r) for o in found for r in o.restarts}
    return [r.begun for r in timeline.restarts if id(r) not in explained]


def read_run(event_dir: "str | Path") -> Timeline:
    """The :class:`Timeline` of a run's event directory (every ``events-*.jsonl``; unreadable lines in ``problems``)."""
    events, problems = read_events(str(event_dir))
    return build_timeline(events, problems)
