"""Goodput: the share of a job's wall time spent on training steps whose results survive, and where the rest went.

Productive time is the sum of the step times up to the iteration the model is at; it travels with the checkpoints
(the ``goodput`` entry of their common part), so steps a failed attempt computed after its last checkpoint drop out
of it on resume. Wall time runs from the job's start (kept in the checkpoints of the same job, else
``$MBRIDGE_JOB_START_TIME``, else this process's start). The rest is lost, by cause: ``startup`` (attempt start to
first step), ``checkpoint_save`` (the loop blocked on a save or an async commit), ``save_retry`` (failed attempts
of a global save and the waits before their retries, ``checkpoint.save_retries``), ``rollback`` (a failed attempt's
time past the checkpoint resumed), ``restart`` (its last sign of life to the next attempt's start), ``rerun``
(re-run passes and steps not applied) and ``other`` (the remainder: logging, collectives between steps...). Each
attempt's start-up is also split by set-up phase (``startups``: process start, process group, health checks, model
build, checkpoint load, data build, then ``to_first_step``; ``events/phases.py``), for the last attempts.

Rank 0 rewrites ``<checkpoint.save>/goodput/progress.json`` every log interval, after each save, and when an attempt
starts or stops cleanly: the next attempt splits its gap into rollback and restart with it. At the end of an attempt
rank 0 writes ``summary.json`` and logs one ``goodput:`` line. Every rank keeps a ledger (a local-tier checkpoint
carries each rank's own); only rank 0 writes files.
"""

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

from megatron.bridge.training.components import Component, Run
from megatron.bridge.utils.fs import atomic_write_json
from megatron.bridge.utils.process_start import process_start_time

logger = logging.getLogger(__name__)

ENTRY = "goodput"
"""Key of the tracker's entry in the common part of a checkpoint."""
CAUSES = ("startup", "checkpoint_save", "rollback", "restart", "rerun", "save_retry")
"""Named causes of lost time; ``other`` is what they leave of the wall time."""
JOB_START_ENV = "MBRIDGE_JOB_START_TIME"
DIRECTORY, PROGRESS, SUMMARY = "goodput", "progress.json", "summary.json"
_VERSION = 1
_EARLIER_JOBS_KEPT = 32  # a chain of jobs on one save directory keeps the totals of this many before it
_STARTUPS_KEPT = 32  # the start-ups split by phase of this many attempts, the last ones
_KEPT_FROM_PROGRESS = ("startup", "restart", "checkpoint_save", "rerun", "save_retry")
"""Causes a failed attempt's progress record keeps past the checkpoint; the rest of its time there is rollback."""
_warned_missing = False


def steady_wall_clock() -> Callable[[], float]:
    """Unix time that a step of the system clock does not move: the wall clock now, then ``time.monotonic()``.

    The tracker's intervals (start-up, a save) and its ``at`` stamps are measured in one process with it, so an NTP
    step or a mis-set clock while training runs neither adds hours to a cause nor makes one negative.
    """
    wall, mono = time.time(), time.monotonic()
    return lambda: wall + (time.monotonic() - mono)


def _ledger(record: Any) -> Optional[dict[str, Any]]:
    """A checkpoint entry or progress record with the fields accounting needs, or ``None`` if it is not one."""
    try:
        return {
            "job_id": str(record["job_id"]),
            "job_start": float(record["job_start"]),
            "at": float(record["at"]),
            "iteration": int(record["iteration"]),
            "productive_s": float(record["productive_s"]),
            "lost_s": {c: float(record["lost_s"].get(c, 0.0)) for c in CAUSES},
            "attempts": int(record["attempts"]),
            "earlier_jobs": dict(record.get("earlier_jobs") or {}),
            "startups": [dict(s) for s in record.get("startups") or []][-_STARTUPS_KEPT:],
        }
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def totals(ledger: dict[str, Any], now: float) -> dict[str, Any]:
    """Wall, productive and lost seconds (``other`` included: the causes add up to the wall time) and the ratio."""
    wall = now - ledger["job_start"]
    lost = dict(ledger["lost_s"])
    lost["other"] = wall - ledger["productive_s"] - sum(lost.values())
    ratio = ledger["productive_s"] / wall if wall > 0 else 0.0
    return {"wall_s": wall, "productive_s": ledger["productive_s"], "goodput": ratio, "lost_s": lost}


def format_line(summary: dict[str, Any]) -> str:
    """The one-line report: ``goodput: 0.873 (productive 52.3 s of 59.9 s wall) | lost: startup 4.1 s, ...``."""
    lost = ", ".join(f"{cause} {seconds:.1f} s" for cause, seconds in summary["lost_s"].items())
    return (
        f"goodput: {summary['goodput']:.3f} (productive {summary['productive_s']:.1f} s of {summary['wall_s']:.1f} s "
        f"wall) | lost: {lost}"
    )


class GoodputTracker:
    """Counts productive and lost time of one attempt on top of the job's ledger (every method is cheap).

    Args:
        job_id: the job's identity (Slurm job id, else the launcher's run id, else ``"local"``).
        attempt: this attempt's name (as hang attribution names it).
        attempt_start: unix time this attempt started (the process's start, or an in-process iteration's).
        save_dir: ``checkpoint.save`` (``None``: no progress record, no summary file).
        rank: this rank; rank 0 writes the files and logs.
        process_start: this process's start (default :func:`process_start_time`), the job start of last resort.
        clock: unix time (default :func:`steady_wall_clock`, made here; tests pass a fake one).
        env: the environment to read ``MBRIDGE_JOB_START_TIME`` from (default ``os.environ``).
    """

    def __init__(
        self,
        job_id: str,
        attempt: str,
        attempt_start: float,
        save_dir: Optional[str],
        rank: int,
        process_start: Optional[float] = None,
        clock: Optional[Callable[[], float]] = None,
        env: Optional[dict[str, str]] = None,
    ) -> None:
        self.job_id, self.attempt, self.attempt_start = job_id, attempt, attempt_start
        self._rank, self._clock = rank, clock if clock is not None else steady_wall_clock()
        self._dir = os.path.join(save_dir, DIRECTORY) if save_dir is not None else None
        self._process_start = process_start_time() if process_start is None else process_start
        self._env = os.environ if env is None else env
        self.ledger: Optional[dict[str, Any]] = None
        """The job's ledger, from :meth:`resume` on; lost seconds up to the last closed interval."""
        self._first_step_at: Optional[float] = None
        self.phases: dict[str, float] = {}
        """Seconds of this attempt's set-up phases (``Run.phases``): its start-up record splits by them."""
        self._saving_since: Optional[float] = None
        self._step_rerun = 0.0
        # Read before any collective: rank 0 rewrites the file only after the checkpoint load, which every rank joins.
        self._earlier_progress = self._read_progress()

    def _read_progress(self) -> Optional[dict[str, Any]]:
        if self._dir is None:
            return None
        try:
            with open(os.path.join(self._dir, PROGRESS)) as f:
                record = _ledger(json.load(f))
        except (OSError, ValueError):
            return None
        if record is None or record["job_id"] != self.job_id or record["at"] > self.attempt_start:
            return None  # another job's, or not of an earlier attempt
        return record

    def _job_start(self) -> float:
        value = self._env.get(JOB_START_ENV)
        if value:
            try:
                return min(float(value), self.attempt_start)
            except ValueError:
                logger.warning("goodput: ignoring %s=%r (not unix seconds)", JOB_START_ENV, value)
        return min(self._process_start, self.attempt_start)

    def resume(self, entry: Any, iteration: int, loaded: bool) -> None:
        """Continue the job's ledger from the loaded checkpoint's ``entry`` (call after the load, on every rank).

        Args:
            entry: the checkpoint's goodput entry (``None``: none loaded, or a checkpoint written without one).
            iteration: the iteration training resumes at.
            loaded: a checkpoint was loaded.
        """
        global _warned_missing
        ckpt = _ledger(entry) if entry is not None else None
        if loaded and ckpt is None and self._rank == 0 and not _warned_missing:
            _warned_missing = True
            logger.warning("goodput: the checkpoint holds no goodput entry (older version): the ledger starts afresh")
        earlier = dict(ckpt["earlier_jobs"]) if ckpt is not None else {}
        if ckpt is not None and ckpt["job_id"] != self.job_id:  # another job's: its time is not ours
            earlier[ckpt["job_id"]] = {**totals(ckpt, ckpt["at"]), **{k: ckpt[k] for k in ("attempts", "iteration")}}
            earlier = dict(list(earlier.items())[-_EARLIER_JOBS_KEPT:])
            ckpt = None
        progress = self._earlier_progress
        if progress is not None and ckpt is not None and progress["at"] <= ckpt["at"]:
            progress = None  # not newer than the checkpoint: nothing happened past it that we know of
        base = ckpt
        if base is None:  # a new ledger, from the job's start
            start = progress["job_start"] if progress is not None else self._job_start()
            new = {"job_id": self.job_id, "job_start": start, "at": start, "productive_s": 0.0, "lost_s": {}}
            base = _ledger({**new, "iteration": 0, "attempts": 0})
        lost = dict(base["lost_s"])
        if progress is not None:  # an earlier attempt went on past the checkpoint: its gap is rollback and restart
            gap = progress["at"] - base["at"]
            kept = {c: max(0.0, progress["lost_s"][c] - base["lost_s"][c]) for c in _KEPT_FROM_PROGRESS}
            if sum(kept.values()) > gap:  # its ledger does not descend from this checkpoint
                kept = {}
            for cause, seconds in kept.items():
                lost[cause] += seconds
            lost["rollback"] += max(0.0, gap - sum(kept.values()))
            lost["restart"] += max(0.0, self.attempt_start - progress["at"])
        elif ckpt is not None:
            lost["restart"] += max(0.0, self.attempt_start - ckpt["at"])
        else:  # the job's first attempt: from the job's launch to this process is start-up
            lost["startup"] += max(0.0, self.attempt_start - base["job_start"])
        self.ledger = {
            "job_id": self.job_id,
            "job_start": base["job_start"],
            "at": self._clock(),
            "iteration": iteration,
            "productive_s": base["productive_s"],
            "lost_s": lost,
            "attempts": max(base["attempts"], progress["attempts"] if progress is not None else 0) + 1,
            "earlier_jobs": earlier,
            "startups": (progress if progress is not None else base)["startups"],
        }
        self._write(PROGRESS, self.snapshot())

    def step_start(self) -> None:
        """A step begins; the first one ends this attempt's start-up."""
        if self._first_step_at is None and self.ledger is not None:
            self._first_step_at = self._clock()
            startup = self._first_step_at - self.attempt_start
            self.ledger["lost_s"]["startup"] += startup
            phases = {**self.phases, "to_first_step": max(0.0, startup - sum(self.phases.values()))}
            record = {"attempt": self.attempt, "startup_s": startup, "phases_s": phases}
            self.ledger["startups"] = [*self.ledger["startups"], record][-_STARTUPS_KEPT:]

    def add_rerun(self, seconds: float) -> None:
        """Seconds of the current step spent re-running it (passes after the first)."""
        self._step_rerun += seconds
        if self.ledger is not None:
            self.ledger["lost_s"]["rerun"] += seconds

    def add_save_retry(self, seconds: float) -> None:
        """Count seconds a failed save attempt and its backoff took as ``save_retry`` (not ``checkpoint_save``).

        Called while the loop is blocked on the save: the open save interval starts that much later.
        """
        if self.ledger is not None:
            self.ledger["lost_s"]["save_retry"] += seconds
        if self._saving_since is not None:
            self._saving_since += seconds

    def step_end(self, seconds: float, kept: bool) -> None:
        """A step took ``seconds``; ``kept``: its update was applied (else the step counts as ``rerun``)."""
        own, self._step_rerun = max(0.0, seconds - self._step_rerun), 0.0
        if self.ledger is not None and kept:
            self.ledger["productive_s"] += own
        elif self.ledger is not None:
            self.ledger["lost_s"]["rerun"] += own

    @contextmanager
    def saving(self, iteration: Optional[int] = None) -> Iterator[None]:
        """The loop is blocked on a save or a commit; for a save of ``iteration``, the progress record follows."""
        self.save_started(iteration)
        try:
            yield
        finally:
            self.save_ended(iteration)

    def save_started(self, iteration: Optional[int] = None) -> None:
        """The loop blocks on a save (of ``iteration``) or a commit from now on."""
        self._saving_since = self._clock()
        if iteration is not None and self.ledger is not None:
            self.ledger["iteration"] = iteration

    def save_ended(self, iteration: Optional[int] = None) -> None:
        """The save or commit returned: its time counts as ``checkpoint_save``; a save rewrites the progress record."""
        if self._saving_since is None:
            return
        now, since, self._saving_since = self._clock(), self._saving_since, None
        if self.ledger is not None:
            self.ledger["lost_s"]["checkpoint_save"] += now - since
            if iteration is not None:
                self._write(PROGRESS, self.snapshot())

    def snapshot(self) -> dict[str, Any]:
        """The ledger as of now (open start-up and save intervals counted up to now): a checkpoint entry."""
        now = self._clock()
        assert self.ledger is not None, "resume() starts the ledger"
        record = {**self.ledger, "lost_s": dict(self.ledger["lost_s"]), "at": now, "version": _VERSION}
        if self._first_step_at is None:
            record["lost_s"]["startup"] += now - self.attempt_start
        if self._saving_since is not None:
            record["lost_s"]["checkpoint_save"] += now - self._saving_since
        return {**record, "attempt": self.attempt}

    def progress(self, iteration: int) -> dict[str, float]:
        """At a log interval: rank 0 rewrites the progress record; returns the TensorBoard scalars."""
        if self.ledger is None:
            return {}
        self.ledger["iteration"] = iteration
        record = self.snapshot()
        self._write(PROGRESS, record)
        t = totals(record, record["at"])
        scalars = {"goodput/ratio": t["goodput"], **{f"goodput/{key}": t[key] for key in ("productive_s", "wall_s")}}
        return {**scalars, **{f"goodput/lost_{cause}_s": seconds for cause, seconds in t["lost_s"].items()}}

    def finish(self, iteration: Optional[int], ended: str, failed: bool = False) -> Optional[dict[str, Any]]:
        """End of the attempt: rank 0 writes the progress record and ``summary.json`` and logs the goodput line.

        Args:
            iteration: where training stopped (``None``: the last one the tracker saw).
            ended: how the attempt ended, e.g. ``"FINISHED (exit code 0)"``.
            failed: an exception ends it; the progress record keeps the last step or save as its last sign of life
                (the time the failure took to surface, e.g. a hang timeout, is the next attempt's ``restart``).

        Returns:
            The summary, or ``None`` when the attempt ended before its checkpoint was loaded (nothing to account).
        """
        if self.ledger is None:
            return None
        if iteration is not None:
            self.ledger["iteration"] = iteration
        record = self.snapshot()
        keys = ("job_id", "job_start", "iteration", "attempts", "attempt", "at", "earlier_jobs", "startups")
        summary = {**{k: record[k] for k in keys}, **totals(record, record["at"]), "ended": ended}
        if not failed:
            self._write(PROGRESS, record)
        self._write(SUMMARY, summary)
        if self._rank == 0:
            logger.info("%s", format_line(summary))  # drills parse this line: keep its shape
        return summary

    def _write(self, name: str, record: dict[str, Any]) -> None:
        if self._rank != 0 or self._dir is None:
            return
        path = os.path.join(self._dir, name)
        try:  # not durable: a record that a machine crash loses is only accounting
            os.makedirs(self._dir, exist_ok=True)
            atomic_write_json(path, record, durable=False, indent=1, sort_keys=True)
        except OSError as err:  # accounting never stops training
            logger.warning("goodput: could not write %s: %s", path, err)


class GoodputCallback(Component):
    """Goodput as a run's component: the first step ends start-up, steps are productive or re-run, saves are lost.

    It offers its tracker as :attr:`Run.goodput` (the loop adds re-run passes and commit waits to it) and its ledger
    as a checkpoint entry (:attr:`Run.checkpoint_extras`), so a resumed run goes on counting where the checkpoint
    left off.
    """

    def __init__(self, tracker: GoodputTracker) -> None:
        self.tracker = tracker

    @classmethod
    def build(cls, run: Run) -> "GoodputCallback":
        """Count this attempt from its start: an in-process restart iteration's own, else the process start."""
        tracker = GoodputTracker(
            run.job_id,
            run.attempt,
            run.attempt_start,
            run.cfg.checkpoint.save,
            run.rank,
            process_start=run.process_start,
        )
        run.goodput = tracker
        run.checkpoint_extras[ENTRY] = tracker.snapshot
        return cls(tracker)

    def ready(self, run: Run) -> None:
        """Carry on the ledger of the checkpoint the run resumed from (none: a fresh start)."""
        checkpoints = run.checkpoints
        loaded = checkpoints.resumed["tier"] is not None
        checkpoints.on_save_retry = self.tracker.add_save_retry
        self.tracker.phases = dict(run.phases.seconds) if run.phases is not None else {}
        self.tracker.resume(checkpoints.loaded_common_extra.get(ENTRY), run.global_state.train_state.step, loaded)

    def finish(self, run: Run, code: Any, reason: str) -> None:
        """Write the attempt's summary."""
        self.tracker.finish(run.global_state.train_state.step, f"{code.name} (exit code {int(code)})")

    def fail(self, run: Run, err: BaseException) -> None:
        """Best effort: the summary of an attempt that is ending with an exception."""
        code = getattr(err, "exit_code", None)  # a TrainingExit's ExitCode
        ended = f"{code.name} (exit code {int(code)})" if code is not None else type(err).__name__
        self.tracker.finish(None, ended, failed=True)

    def on_train_step_start(self, context: Any) -> None:
        """The first step ends start-up."""
        self.tracker.step_start()

    def on_train_step_end(self, context: Any) -> None:
        """The step is productive if its update was applied, else re-run time."""
        self.tracker.step_end(context.step_time or 0.0, kept=not context.skipped_iter)

    def on_checkpoint_save_start(self, context: Any) -> None:
        """Save time starts."""
        self.tracker.save_started(context.state.train_state.step)

    def on_checkpoint_save_end(self, context: Any) -> None:
        """Save time ends; the progress record is rewritten."""
        self.tracker.save_ended(context.state.train_state.step)
