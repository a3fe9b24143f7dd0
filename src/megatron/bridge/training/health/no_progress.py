"""The no-progress guard: a job that fails the same way after every restart stops, and says so, instead of looping.

The failure it handles: a crash that every restart meets again (a bad batch at one iteration, a rank that dies on the
same step, a save that hangs at the same point). Each restart reloads the same checkpoint, runs to the same place and
fails there, until the launcher's restart budget (or the scheduler's requeues) is used up: a Megatron-LM user saw 44
identical restarts of about 90 s each, and nothing said that none of them made progress.

How: at the set-up of every restart, rank 0 reads what the job's earlier attempts did from the event stream
(``events/stream.py``: the attempts' starts, the checkpoints they loaded and committed, the steps they completed,
the ranks' exits and the launcher's worker exits) and every rank gets its verdict by broadcast, so all ranks decide
the same. An attempt made *progress* when it committed a checkpoint newer than any committed before it (or the one
it resumed from), or completed a step beyond the furthest step reached before it. When the last
``ft.max_no_progress_restarts`` attempts in a row ended in a failure without progress, this attempt stops before
training with :attr:`ExitCode.NO_PROGRESS` (29, a *stop* code: ft_launcher is asked not to restart, the job is not
requeued), a log line and a ``fault_detected`` event (mechanism ``no_progress``) naming the repeated failure: the
rank, the exception or signal, and the iteration it failed at.

What counts:

* An attempt is one start of the training function: a worker process started by the launcher (an in-job restart,
  ``TORCHELASTIC_RESTART_COUNT``), a Slurm requeue (same job id, ``SLURM_RESTART_COUNT``), or an in-process restart
  iteration: each reloads the checkpoint and can loop the same way. Attempts are told apart by rank 0's
  ``attempt_started`` events: the events between two of them belong to the earlier one.
* The history is the job's: only attempts with this attempt's job id (``utils.launch_env``) count, so a new job in
  the same directory (a new Slurm job, another ``--rdzv-id``, ``torchrun --standalone``) starts fresh. A relaunch
  under the same job id continues the job's history.
* The first attempt of a launch (no in-job restart, no requeue, no in-process iteration) is not a restart: the guard
  does not act on it.
* An attempt that ended on purpose breaks the chain: training finished (0), a planned requeue (16, 18, 19) or a stop
  (``STOP_CODES``, this guard's own 29 among them): whatever started after it was started by a decision.
* The iteration a failure happened at is the one after the attempt's last completed step (step events of a killed
  rank may be lost since its last flush, so the survivors' count). The failure's rank and cause come first from a
  rank monitor's hang detection, then from a worker killed by a signal, then from a rank's own exit with an
  exception or code, then from the launcher's view of an exit code: a peer that failed in the collective the first
  rank broke is a consequence, not the cause.
"""

import dataclasses
import glob
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Optional

from megatron.bridge.training.components import Component, Run
from megatron.bridge.training.events import reader as event_reader
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import Event, EventKind, Mechanism, Process
from megatron.bridge.training.exit_codes import STOP_CODES, ExitCode, TrainingExit
from megatron.bridge.utils import dist as dist_utils
from megatron.bridge.utils import launch_env
from megatron.bridge.utils.fields import is_enabled

logger = logging.getLogger(__name__)

FIELD = "ft.max_no_progress_restarts"
"""The config field (how reports name it)."""

ON_PURPOSE = frozenset(
    {int(ExitCode.FINISHED), int(ExitCode.RERUN_RESUME), int(ExitCode.PREEMPTED), int(ExitCode.DURATION_LIMIT)}
    | {int(code) for code in STOP_CODES}
)
"""Exit codes of an attempt that ended on purpose: the chain of failed attempts breaks there."""

_HANGS = (Mechanism.RANK_MONITOR_SECTION_TIMEOUT, Mechanism.RANK_MONITOR_HEARTBEAT_TIMEOUT)


@dataclasses.dataclass(frozen=True)
class Failure:
    """How one attempt failed: the rank it started on, its cause and the iteration it struck."""

    rank: Optional[int]
    """The rank that failed first (``None``: no event names one)."""
    cause: str
    """The exception, signal, exit code or hang, as words."""
    iteration: int
    """The iteration it failed at: the one after the attempt's last completed step."""
    signal: Optional[int] = None
    """The signal that killed the rank, if one did."""

    def __str__(self) -> str:
        who = "an unknown rank" if self.rank is None else f"rank {self.rank}"
        return f"{who} at iteration {self.iteration}: {self.cause}"


@dataclasses.dataclass(frozen=True)
class Attempt:
    """What one earlier attempt did, read from its events."""

    start: Event
    """Rank 0's ``attempt_started``."""
    resumed: int
    """The iteration of the checkpoint it loaded (0: a fresh start)."""
    last_step: Optional[int]
    """The furthest step it completed (any rank; ``None``: none)."""
    last_commit: Optional[int]
    """The newest checkpoint it committed (any tier; ``None``: none)."""
    exit_codes: frozenset
    """The exit codes its ranks reported (``None`` for an exception without one)."""
    failure: Failure

    @property
    def on_purpose(self) -> bool:
        """It ended finished, for a planned requeue or with a stop code."""
        return any(code in ON_PURPOSE for code in self.exit_codes)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The guard's decision to stop: the attempts without progress (oldest first) and the report."""

    attempts: tuple[Attempt, ...]
    report: str
    repeated: Optional[Failure]
    """The failure every counted attempt had, when they all had the same one."""


def split_attempts(events: Iterable[Event]) -> list[list[Event]]:
    """The events grouped by attempt, in time order: each group starts with rank 0's ``attempt_started``.

    Events before the first such start (a launcher's start) belong to no attempt and are dropped.
    """
    groups: list[list[Event]] = []
    for event in sorted(events, key=lambda e: e.time):
        if event.kind == EventKind.ATTEMPT_STARTED and event.rank == 0 and event.process != Process.LAUNCHER:
            groups.append([event])
        elif groups:
            groups[-1].append(event)
    return groups


def _failure(events: Sequence[Event], iteration: int) -> Failure:
    """The first cause of an attempt's end (see the module doc for the order of the evidence)."""
    hangs = [e for e in events if e.kind == EventKind.FAULT_DETECTED and e.mechanism in _HANGS]
    if hangs:
        e = hangs[0]
        what = f"section {e.section!r}" if e.section else "heartbeat"
        limit = f" ({e.timeout:g} s)" if e.timeout is not None else ""
        return Failure(e.rank, f"hung: the rank monitor's {what} timeout{limit} expired", iteration)
    exits = [e for e in events if e.kind == EventKind.WORKER_EXITED and e.exit_code]
    signaled = [e for e in exits if e.signal]
    if signaled:
        e = signaled[0]
        oom = any(
            d.kind == EventKind.FAULT_DETECTED and d.mechanism == Mechanism.OUT_OF_MEMORY and d.rank == e.rank
            for d in events
        )
        cause = f"killed by signal {e.signal} ({event_reader.signal_name(e.signal)})"
        return Failure(e.rank, cause + (" by the out-of-memory killer" if oom else ""), iteration, e.signal)
    raised = [
        e
        for e in events
        if e.kind == EventKind.EXIT and e.process == Process.WORKER and e.exit_code != 0 and e.rank is not None
    ]
    if raised:
        e = raised[0]
        return Failure(e.rank, e.detail or f"exit code {e.exit_code}", iteration)
    if exits:
        return Failure(exits[0].rank, f"exit code {exits[0].exit_code}", iteration)
    return Failure(None, "no exit was recorded (every rank killed, or its events lost)", iteration)


def summarize(events: Sequence[Event]) -> Attempt:
    """The :class:`Attempt` of one group of :func:`split_attempts`."""

    def iterations(kind: EventKind) -> list[int]:
        return [e.iteration for e in events if e.kind == kind and e.iteration is not None]

    loads, steps, commits = (iterations(k) for k in (EventKind.CHECKPOINT_LOADED, EventKind.STEP_COMPLETED,
                                                     EventKind.CHECKPOINT_SAVED))  # fmt: skip
    resumed = max(loads, default=0)
    last_step = max(steps, default=None)
    exit_codes = frozenset(e.exit_code for e in events if e.kind == EventKind.EXIT and e.process == Process.WORKER)
    failed_at = (resumed if last_step is None else max(last_step, resumed)) + 1
    return Attempt(
        start=events[0],
        resumed=resumed,
        last_step=last_step,
        last_commit=max(commits, default=None),
        exit_codes=exit_codes,
        failure=_failure(events, failed_at),
    )


def job_history(events: Iterable[Event], job_id: str) -> list[Attempt]:
    """The attempts of job ``job_id``: the latest ones in a row with its id (an older job's attempts end it)."""
    attempts = [summarize(group) for group in split_attempts(events)]
    first = len(attempts)
    while first > 0 and attempts[first - 1].start.job_id == job_id:
        first -= 1
    return attempts[first:]


def stalled(attempts: Sequence[Attempt]) -> list[Attempt]:
    """The latest attempts in a row that failed without progress (oldest first); the guard counts them.

    Progress: a checkpoint committed beyond any committed or resumed from before, or a step completed beyond the
    furthest reached before (the attempt's own resumed checkpoint counts as reached).
    """
    progressed = []
    best_step = best_commit = None
    for attempt in attempts:
        step_before = max(attempt.resumed, best_step or 0)
        commit_before = max(attempt.resumed, best_commit or 0)
        moved = (attempt.last_step or 0) > step_before or (attempt.last_commit or 0) > commit_before
        progressed.append(moved or attempt.on_purpose)
        best_step = max(best_step or 0, attempt.last_step or 0, attempt.resumed)
        best_commit = max(best_commit or 0, attempt.last_commit or 0, attempt.resumed)
    count = 0
    while count < len(attempts) and not progressed[len(attempts) - 1 - count]:
        count += 1
    return list(attempts[len(attempts) - count :])


def decide(events: Iterable[Event], job_id: str, limit: int) -> Optional[Verdict]:
    """Stop (a :class:`Verdict`) when the last ``limit`` attempts of job ``job_id`` all failed without progress.

    ``events`` are the earlier attempts' (this attempt's own are not among them); ``limit`` >= 1.
    """
    counted = stalled(job_history(events, job_id))
    if len(counted) < limit:
        return None
    counted = counted[-limit:]
    failures = {attempt.failure for attempt in counted}
    repeated = next(iter(failures)) if len(failures) == 1 else None
    resumed = sorted({attempt.resumed for attempt in counted})
    furthest = max(max(a.last_step or 0, a.resumed) for a in counted)
    if repeated is not None:
        what = f"the same failure each time: {repeated}"
    else:
        what = "their failures: " + "; ".join(f"{a.start.attempt or 'attempt'}: {a.failure}" for a in counted)
    report = (
        f"no progress in the last {limit} attempts of job {job_id} ({FIELD}={limit}): each resumed from iteration "
        f"{'/'.join(map(str, resumed))} and ended without committing a newer checkpoint or completing a step past "
        f"iteration {furthest}; {what}. Restarting again would repeat it, so the job stops (exit code "
        f"{int(ExitCode.NO_PROGRESS)}, no restart, no requeue). Fix the cause, then relaunch (a new job id starts a "
        f"new history), or set {FIELD}=0 to turn this guard off"
    )
    return Verdict(tuple(counted), report, repeated)


def read_history(directory: str, before: float) -> list[Event]:
    """The events written before ``before`` (unix time) that the decision needs, from ``directory``.

    Rank 0's file (the attempts, their loads, steps and commits) and the launchers' files, then the files of the ranks
    the launchers saw fail or the rank monitors found hung (their own exit events say what they raised); every rank's
    file when no launcher wrote events. Lines that cannot be read are skipped (the reader reports them).
    """

    def read(paths: Iterable[str]) -> list[Event]:
        found: list[Event] = []
        for path in paths:
            events, problems = event_reader.read_file(path)
            if problems:
                logger.debug("no-progress guard: %d unreadable line(s) in %s skipped", len(problems), path)
            found += [e for e in events if e.time < before]
        return found

    launchers = sorted(glob.glob(os.path.join(directory, "events-launcher-*.jsonl")))
    rank0 = os.path.join(directory, event_stream.worker_file(0))
    events = read([*launchers, rank0])
    if launchers:
        failed = {e.rank for e in events if e.kind in (EventKind.WORKER_EXITED, EventKind.FAULT_DETECTED)}
        failed.discard(None)
        failed.discard(0)
        paths = [os.path.join(directory, event_stream.worker_file(rank)) for rank in sorted(failed)]
    else:
        pattern = os.path.join(directory, event_stream.FILE_GLOB)
        paths = [p for p in sorted(glob.glob(pattern)) if p != rank0]
    return events + read(p for p in paths if os.path.exists(p))


class NoProgressGuard(Component):
    """Stops a restart that would repeat the same failure again (:attr:`ExitCode.NO_PROGRESS`).

    Args:
        directory: the job's event directory.
        limit: ``ft.max_no_progress_restarts`` (>= 1).
        job_id: this attempt's job (``utils.launch_env``).
        before: unix time this attempt started: the events from then on are its own.
    """

    def __init__(self, directory: str, limit: int, job_id: str, before: float) -> None:
        self.directory = directory
        self.limit = limit
        self.job_id = job_id
        self.before = before

    @classmethod
    def build(cls, run: Run) -> Optional["NoProgressGuard"]:
        """The guard of a restart with fault tolerance on; ``None`` when off, without events, or not a restart."""
        cfg = run.cfg
        limit = getattr(cfg.ft, "max_no_progress_restarts", 0) if is_enabled(cfg.ft) else 0
        directory = event_stream.resolve_directory(cfg.health.event_dir, cfg.checkpoint.save)
        env = launch_env.current()
        restart = env.restart_count > 0 or env.requeue_count > 0 or run.inprocess_iteration > 0
        if limit and directory is None and run.rank == 0:
            logger.warning("%s=%d has no effect: the event stream is off (health.event_dir)", FIELD, limit)
        if not limit or directory is None or not restart:
            return None
        return cls(directory, limit, run.job_id, run.attempt_start)

    def setup(self, run: Run) -> None:
        """Rank 0 reads the earlier attempts and decides; every rank stops when it says so.

        Raises:
            TrainingExit: :attr:`ExitCode.NO_PROGRESS` on every rank when the guard trips.
        """
        report = dist_utils.on_rank0(self._decide, "the no-progress guard's reading of the event stream")
        if report is not None:
            raise TrainingExit(ExitCode.NO_PROGRESS, report)

    def _decide(self) -> Optional[str]:
        """Rank 0: the report when the guard trips (logged, and a ``fault_detected`` event), else ``None``."""
        try:
            verdict = decide(read_history(self.directory, self.before), self.job_id, self.limit)
        except Exception as err:  # noqa: BLE001 - a guard that cannot read must not be what stops training
            logger.warning("no-progress guard: could not read %s (%s); not checked", self.directory, err)
            return None
        if verdict is None:
            return None
        logger.error("no-progress guard: %s", verdict.report)
        repeated = verdict.repeated
        event_stream.emit(
            EventKind.FAULT_DETECTED,
            mechanism=Mechanism.NO_PROGRESS,
            rank=None if repeated is None else repeated.rank,
            iteration=None if repeated is None else repeated.iteration,
            signal=None if repeated is None else repeated.signal,
            exit_code=int(ExitCode.NO_PROGRESS),
            detail=verdict.report,
        )
        return verdict.report
