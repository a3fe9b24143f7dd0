"""Goodput's parts checked against what the ledger never reads: the event stream and the processes' own starts.

The goodput summary's ``other`` is what its named causes leave of the wall time, so ``productive + sum(lost) ==
wall`` holds whatever the ledger books where: it proves nothing. Here each part is bounded by independent evidence
instead, rank 0's events (the ledger is rank 0's):

- productive: the step time of the applied steps the final model contains (the last ``step_completed`` of each
  iteration; an earlier one was recomputed after a rollback), less what re-runs took of them (``rerun``);
- rollback: at least the step time of the recomputed applied steps, less re-run time (each ran after the checkpoint
  resumed and before the failed attempt's last progress record: rank 0 rewrites it after every step at
  ``logger.log_interval=1``);
- restart + rollback: at most, per resume, from the step event of the resumed iteration (before its save took the
  ledger's snapshot) to the new attempt's process start; restart alone at least, per in-job restart, from the
  launcher's ``workers_stopped`` (rank 0 of the old attempt, the writer of its progress record, is gone) to it;
- start-up: per attempt, from its start to at least its checkpoint load and at most its first step's start (its
  first ``step_completed`` less that step's time), plus the job's start to the first attempt's;
- checkpoint_save: at least the commit time of every synchronous save (the commit happens inside the blocking call
  the ledger times);
- start-up + other: at most the time from the job's start to the first attempt's, plus, per attempt, the time from
  its start to its last save (the final attempt: to its exit) that is neither a step nor a synchronous save's
  commit (past that save a failed attempt's time is rollback, restart or a kept cause); other at least zero;
- the ratio: kept step time over the wall time, the wall time ending between rank 0's last step event and its final
  ``exit`` event.

Only the ordering of events in time is relied on, never their spacing on a loaded machine. Tolerances come from
the clocks: a process start read from ``/proc`` is good to two 10 ms ticks (uptime and start time), and the ledger's
clock is the wall clock at its process's start advanced by the monotonic clock, which NTP may slew against the
event timestamps' wall clock by at most 500 ppm.
"""

from dataclasses import dataclass
from typing import Any, Optional

from megatron.bridge.training.events.stream import Event, EventKind, Process

TICK_S = 0.02
"""A process start from ``/proc``: ``/proc/uptime`` and the start time are each read in 10 ms ticks."""
SLEW = 5e-4
"""The most the kernel slews the wall clock against the monotonic one (500 ppm), per second of span."""
FLOAT_S = 1e-6
"""Float sums of the same step times in another order (and through JSON and ``torch.save``)."""


@dataclass(frozen=True)
class Attempt:
    """Rank 0's view of one training attempt (in-job restart count, in-process iteration)."""

    key: tuple[Optional[int], Optional[int]]
    start: float
    """``attempt_start`` of its ``attempt_started``: the process start (or an in-process iteration's start)."""
    steps: list[Event]
    saves: list[Event]
    load: Optional[Event]
    exit: Optional[Event]


@dataclass(frozen=True)
class Evidence:
    """Bounds on each goodput part from the events (seconds; see the module docstring)."""

    kept_steps_s: float
    recomputed_steps_s: float
    startup_s: tuple[float, Optional[float]]
    """(at least, at most); ``None``: an attempt that resumed without training leaves no upper bound."""
    resume_gaps_s: float
    """restart + rollback at most."""
    respawn_s: float
    """restart at least."""
    sync_commits_s: float
    startup_and_other_s: Optional[float]
    """start-up + other at most (``None``: an earlier attempt that never trained leaves it unknown)."""
    end_s: tuple[float, float]
    """Unix times the summary's end (``job_start + wall_s``) lies between."""
    attempts: list[Attempt]


def _key(e: Event) -> tuple[Optional[int], Optional[int]]:
    return e.restart_count, e.inprocess_iteration


def attempts_of(events: list[Event]) -> list[Attempt]:
    """Rank 0's attempts in time order, with their steps, load and last event."""
    mine = [e for e in events if e.rank == 0 and e.process in (None, Process.WORKER)]
    found = []
    for started in (e for e in mine if e.kind == EventKind.ATTEMPT_STARTED):
        own = [e for e in mine if _key(e) == _key(started) and e.time >= started.time]
        steps = [e for e in own if e.kind == EventKind.STEP_COMPLETED]
        saves = [e for e in own if e.kind == EventKind.CHECKPOINT_SAVED]
        load, end = (
            next((e for e in own if e.kind == kind), None) for kind in (EventKind.CHECKPOINT_LOADED, EventKind.EXIT)
        )
        found.append(Attempt(_key(started), float(started.attempt_start), steps, saves, load, end))
    return found


def _accountable_end(attempt: Attempt, final: bool) -> Optional[float]:
    """Until when the final ledger can hold this attempt's start-up and ``other`` (``None``: not known).

    The final attempt's: its exit (after its summary). An earlier one's: its last save (the ledger a later attempt
    resumes was snapshotted during a save; past it, a progress record makes the time rollback or a kept cause), but
    not before its first step's start (its start-up runs to there).
    """
    if final:
        return attempt.exit.time if attempt.exit is not None else None
    ends = [e.time for e in attempt.saves] + [attempt.steps[0].time - attempt.steps[0].seconds] * bool(attempt.steps)
    return max(ends) if attempt.steps else None


def evidence(events: list[Event], job_start: float) -> Evidence:
    """What rank 0's events and the launcher's say each goodput part is at least and at most."""
    attempts = attempts_of(events)
    steps = [s for a in attempts for s in a.steps]
    kept: dict[int, Event] = {}
    for s in steps:  # in time order: a later step of an iteration recomputed the earlier one
        kept[s.iteration] = s
    kept_ids = {id(s) for s in kept.values()}
    applied = [s for s in steps if s.applied is not False]
    lo = hi = attempts[0].start - job_start
    for a in attempts:
        lo += a.load.time - a.start if a.load is not None else 0.0
        if a.steps:
            hi = None if hi is None else hi + a.steps[0].time - a.steps[0].seconds - a.start
        elif a.load is not None:
            hi = None  # it resumed a ledger and never trained: its start-up is counted up to its end, unseen here
    gaps = respawn = 0.0
    stopped = {e.restart_count: e.time for e in events if e.kind == EventKind.WORKERS_STOPPED}
    for a in attempts:
        if a.load is None or not a.load.iteration:
            continue
        saved = [s for s in steps if s.iteration == a.load.iteration and s.time < a.load.time]
        gaps += a.start - saved[-1].time
        restart_count, inprocess = a.key
        if not inprocess and restart_count in stopped:
            respawn += a.start - stopped[restart_count]
    saves = [e for e in events if e.kind == EventKind.CHECKPOINT_SAVED and e.rank == 0]
    sync = [e for e in saves if None not in (e.seconds, e.commit_seconds) and e.commit_seconds <= e.seconds]
    sync_commits = sum(e.commit_seconds for e in sync)
    # Start-up and ``other`` lie in each attempt's span up to its accountable end, outside its steps and commits.
    outside: Optional[float] = attempts[0].start - job_start
    for n, a in enumerate(attempts):
        end = _accountable_end(a, n == len(attempts) - 1)
        if end is None or outside is None:
            outside = None
            continue
        busy = [s.seconds for s in a.steps if s.time <= end] + [
            e.commit_seconds for e in sync if e in a.saves and e.time <= end
        ]
        outside += end - a.start - sum(busy)
    finals = [e for e in events if e.kind == EventKind.EXIT and e.rank == 0 and e.process in (None, Process.WORKER)]
    return Evidence(
        kept_steps_s=sum(s.seconds for s in applied if id(s) in kept_ids),
        recomputed_steps_s=sum(s.seconds for s in applied if id(s) not in kept_ids),
        startup_s=(lo, hi),
        resume_gaps_s=gaps,
        respawn_s=respawn,
        sync_commits_s=sync_commits,
        startup_and_other_s=outside,
        end_s=(steps[-1].time, finals[-1].time),
        attempts=attempts,
    )


def assert_goodput_agrees_with_events(summary: dict[str, Any], events: list[Event]) -> Evidence:
    """Assert each part of a goodput ``summary`` against the bounds :func:`evidence` finds; return them."""
    ev = evidence(events, summary["job_start"])
    lost, wall, productive = summary["lost_s"], summary["wall_s"], summary["productive_s"]
    tol = TICK_S * (len(ev.attempts) + 1) + SLEW * wall
    facts = f"{summary}\n{ev}"
    assert ev.kept_steps_s - lost["rerun"] - FLOAT_S <= productive <= ev.kept_steps_s + FLOAT_S, facts
    assert lost["rollback"] >= ev.recomputed_steps_s - lost["rerun"] - FLOAT_S, facts
    assert lost["restart"] >= ev.respawn_s - tol, facts
    assert lost["restart"] + lost["rollback"] <= ev.resume_gaps_s + tol, facts
    low, high = ev.startup_s
    assert lost["startup"] >= low - tol and (high is None or lost["startup"] <= high + tol), facts
    assert lost["checkpoint_save"] >= ev.sync_commits_s - FLOAT_S, facts
    assert lost["other"] >= -tol, facts
    within = ev.startup_and_other_s
    assert within is None or lost["startup"] + lost["other"] <= within + tol, facts
    first, last = ev.end_s
    assert first - tol <= summary["job_start"] + wall <= last + tol, facts
    assert (ev.kept_steps_s - lost["rerun"]) / (last - summary["job_start"]) - FLOAT_S <= summary["goodput"], facts
    assert summary["goodput"] <= ev.kept_steps_s / (first - summary["job_start"]) + FLOAT_S, facts
    return ev
