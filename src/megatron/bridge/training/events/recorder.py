"""The training loop's part of the event stream: attempts, steps, checkpoint saves and loads, and the exit.

The problem: what a training attempt did (when it started, which steps it completed, what each save and load cost,
how it ended) was known only from log lines. :class:`EventRecorder` is the loop's feature that writes it as typed
events (``events/stream.py``): a callback for the loop's events (``on_train_step_end``, ``on_checkpoint_save_start``/
``_end``, ``on_checkpoint_save``, ``on_checkpoint_load``) plus three calls ``pretrain`` makes where the loop has no
event: :meth:`attempt_started` and :meth:`exited` (the load is timed from :attr:`Run.load_started`).

A save is written once it is both committed and no longer blocking the loop, whichever comes last: a synchronous
save commits inside the blocking call, an asynchronous one commits a few steps later. Its ``seconds`` are the loop's
time in the save call, ``finalize_seconds`` (async) the loop's time in the finalize that committed it,
``commit_seconds`` the time from the save's start to its commit. Rank 0 adds the checkpoint's size.
"""

import os
import time
from typing import Any, Optional

from megatron.bridge.training.components import Component, Run
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind
from megatron.bridge.training.exit_codes import exit_code_of


def directory_bytes(path: str, prefix: str = "") -> Optional[int]:
    """Bytes of the files under ``path`` whose names start with ``prefix``; ``None`` if it cannot be read."""
    total = 0
    try:
        for root, _, files in os.walk(path):
            for name in files:
                if name.startswith(prefix):
                    try:
                        total += os.path.getsize(os.path.join(root, name))
                    except OSError:  # removed meanwhile (retention of an older checkpoint)
                        continue
    except OSError:
        return None
    return total


def _tier(checkpoint_type: Any) -> str:
    return str(getattr(checkpoint_type, "value", checkpoint_type))


class EventRecorder(Component):
    """Writes this rank's attempt, step, checkpoint and exit events (nothing when no event directory is set).

    As a run's component it records the attempt's start when built, the checkpoint it resumed from (its load time
    from :attr:`Run.load_started`), and the exit: the code training ended with, or the exception it unwound with.

    Args:
        rank: this process's global rank (rank 0 measures checkpoint sizes).
        flush_interval: the steps between writes of the buffered step events (the loop's log interval).
        writer: where events go (default: this process's, :func:`event_stream.writer`; tests pass their own).
        run: the attempt it records (its checkpoint load's start), when it is a run's component.
    """

    def __init__(
        self,
        rank: int,
        flush_interval: int = 1,
        writer: Optional[event_stream.EventWriter] = None,
        run: Optional[Run] = None,
    ) -> None:
        self.rank = rank
        self.flush_interval = max(1, flush_interval)
        self._emit = writer.emit if writer is not None else event_stream.emit
        self._flush = writer.flush if writer is not None else event_stream.flush
        self._saves: dict[int, dict[str, Any]] = {}
        """Iteration -> what is known of its save so far (start, blocking seconds, commit)."""
        self._current: Optional[int] = None
        self._run = run

    @classmethod
    def build(cls, run: Run) -> "EventRecorder":
        """The recorder of this rank, flushing step events every log interval; the attempt's start is recorded now."""
        recorder = cls(run.rank, flush_interval=run.cfg.logger.log_interval, run=run)
        recorder.attempt_started(
            process_start=run.process_start, attempt_start=run.attempt_start, attempt=run.attempt, job_id=run.job_id
        )
        return recorder

    def finish(self, run: Run, code: Any, reason: str) -> None:
        """The ``exit`` event of a run that ended with ``code``."""
        self.exited(int(code), reason)

    def fail(self, run: Run, err: BaseException) -> None:
        """The ``exit`` event of an attempt unwinding with ``err``."""
        self.exited(exit_code_of(err), f"{type(err).__name__}: {err}"[:500])

    # -------------------------------------------------------------- calls from pretrain

    def attempt_started(self, **fields: Any) -> None:
        """The attempt began: ``process_start``, ``attempt_start``, ``attempt``, ``job_id`` (Event fields)."""
        self._emit(EventKind.ATTEMPT_STARTED, **fields)

    def exited(self, code: Optional[int], reason: str) -> None:
        """The attempt ends with exit ``code`` (``None``: an exception without one)."""
        self._emit(EventKind.EXIT, exit_code=code, detail=reason)

    # -------------------------------------------------------------- the loop's events

    def on_train_step_end(self, context: Any) -> None:
        """A step ran: its iteration (counted after this event), time and whether its update was kept.

        Step events are buffered by the writer; they reach the file every ``flush_interval`` steps (or sooner, with
        any other event).
        """
        iteration = context.state.train_state.step + 1
        self._emit(
            EventKind.STEP_COMPLETED, iteration=iteration, seconds=context.step_time, applied=not context.skipped_iter
        )
        if iteration % self.flush_interval == 0:
            self._flush()

    def on_checkpoint_save_start(self, context: Any) -> None:
        """A save of the current iteration starts blocking the loop."""
        iteration = context.state.train_state.step
        self._current = iteration
        self._saves[iteration] = {"start": time.perf_counter()}

    def on_checkpoint_save_end(self, context: Any) -> None:
        """The loop goes on; a save already committed (synchronous) is written now."""
        iteration = self._current
        save = self._saves.get(iteration) if iteration is not None else None
        if save is None:
            return
        save["blocking"] = time.perf_counter() - save["start"]
        if "committed" in save:
            self._write_save(iteration)

    def on_checkpoint_save(self, context: Any) -> None:
        """A checkpoint was committed; written now unless the loop is still blocked on it."""
        iteration = getattr(context, "iteration", None)
        if iteration is None:
            return
        save = self._saves.setdefault(iteration, {})
        save.update(committed=time.perf_counter(), tier=_tier(context.checkpoint_type), path=context.checkpoint_name)
        save["finalize"] = getattr(context, "finalize_seconds", None)
        if "blocking" in save or "start" not in save:  # an async commit, or a save this recorder did not see start
            self._write_save(iteration)

    def on_checkpoint_load(self, context: Any) -> None:
        """The attempt resumed from a checkpoint: its tier, iteration, size and load time."""
        tier = _tier(context.checkpoint_type)
        iteration = getattr(context, "iteration", None)
        started = None if self._run is None else self._run.load_started
        self._emit(
            EventKind.CHECKPOINT_LOADED,
            tier=tier,
            iteration=iteration,
            seconds=None if started is None else time.perf_counter() - started,
            bytes=self._size(context.checkpoint_name, tier, iteration),
        )

    def _write_save(self, iteration: int) -> None:
        save = self._saves.pop(iteration)
        start = save.get("start")
        self._emit(
            EventKind.CHECKPOINT_SAVED,
            tier=save["tier"],
            iteration=iteration,
            seconds=save.get("blocking"),
            commit_seconds=None if start is None else save["committed"] - start,
            finalize_seconds=save.get("finalize"),
            bytes=self._size(save["path"], save["tier"], iteration),
        )

    def _size(self, path: Optional[str], tier: str, iteration: Optional[int]) -> Optional[int]:
        """Rank 0: the committed directory of a global checkpoint; its node's files of a local one's iteration."""
        if self.rank != 0 or not path:
            return None
        if tier == "local":
            return None if iteration is None else directory_bytes(path, f"iter_{iteration:07d}_")
        return directory_bytes(path)
