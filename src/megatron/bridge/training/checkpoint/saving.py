"""The save half of the checkpoint manager: global saves (sync or async) with an atomic, verified commit.

Failures handled: a save interrupted at any point (a crash, a kill, a full disk) must never leave a checkpoint a
loader could mistake for a whole one. Every rank writes into a temporary directory (megatron-core
``dist_checkpointing``, ``torch_dist``); once all of them finished, the ranks hash the files in parallel, rank 0
writes the manifest and commits (rename, then the tracker: ``layout.py``), and only then runs retention, so the last
good checkpoint is never deleted. An async save is committed by :meth:`SavePath.finalize` at a step every rank
reaches; a storage fault (full, unavailable) is turned into an agreed stop or, with
``global_save_failure_policy="continue_local"``, into a local-tier save (``storage_guard.py``). When the local tier
stops the run, the healthy global save in flight is committed first.
"""

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from megatron.core import dist_checkpointing

from megatron.bridge.training.checkpoint import async_writer, contents, layout, manifest, save_retry, storage
from megatron.bridge.training.checkpoint.async_writer import AsyncSavesBusy
from megatron.bridge.training.checkpoint.local_tier import LocalTier
from megatron.bridge.training.checkpoint.storage_guard import GLOBAL, LOCAL, StorageGuard, raised_by_every_rank
from megatron.bridge.training.config import CheckpointConfig
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind
from megatron.bridge.training.exit_codes import TrainingExit
from megatron.bridge.training.faults import injection as fault_injection
from megatron.bridge.training.state import TrainState
from megatron.bridge.training.utils.pg_utils import checkpoint_process_groups
from megatron.bridge.utils import upstream
from megatron.bridge.utils.dist import all_gather_object, barrier, on_rank0, rank, world_size
from megatron.bridge.utils.orphans import die_with_this_process

logger = logging.getLogger("megatron.bridge.training.checkpointing")  # the name the run's save lines always had


def hash_checkpoint(ckpt_dir: str, note: Any = None) -> tuple[dict[str, manifest.FileEntry], list[Any]]:
    """Hash every file of ``ckpt_dir`` not hashed yet by a background writer, split over ranks; table on rank 0.

    ``note``: anything of this rank's to gather in the same collective; every rank's, in rank order, comes second.
    """

    def scan() -> tuple[dict[str, manifest.FileEntry], list[str]]:
        known = manifest.take_partial_manifests(ckpt_dir)
        return known, [rel for rel in manifest.list_files(ckpt_dir) if rel not in known]

    known, todo = on_rank0(scan, "listing the checkpoint's files")
    share = manifest.hash_share(ckpt_dir, todo, rank(), world_size())
    merged = dict(known)
    notes = []
    for part, noted in all_gather_object((share, note)):
        merged.update(part)
        notes.append(noted)
    return merged, notes


class SavePath:
    """The save half of :class:`~megatron.bridge.training.checkpoint.manager.CheckpointManager` (a mixin).

    The manager's ``__init__`` sets the state below; :meth:`finalize` and :meth:`busy_here` are called by every rank
    at the same step of the training loop.
    """

    cfg: CheckpointConfig
    storage: StorageGuard
    local: Optional[LocalTier]
    _queue: Any
    _pending: Optional[int]
    _pending_tmp: Optional[str]
    _strategy: Any
    _run_id: str
    _saves: int
    _run_config: Optional[str]
    _common_extra: dict[str, Callable[[], Any]]
    _on_saved: Callable[..., None]
    _finalizing_since: Optional[float]
    last_blocking_seconds: float
    last_finalize_seconds: float
    last_saved_iteration: Optional[int]
    on_save_retry: Optional[Callable[[float], None]] = None
    """Called with the seconds a failed attempt and its backoff took from the loop (goodput's ``save_retry``)."""
    _blocked_since: Optional[float] = None
    """When the running blocking finalize of the global save began to wait for its background writes."""

    def _save_strategy(self) -> Any:
        """megatron-core's save strategy for this run, built on the first save and reused by the later ones."""
        if self._strategy is not None:
            return self._strategy  # reused: the fully parallel wrapper caches its work distribution
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        strategy = get_default_save_sharded_strategy(self.cfg.ckpt_format)
        if self.cfg.ckpt_assume_constant_structure and hasattr(strategy, "use_cached_ckpt_structure"):
            # megatron-core checks on the second save that the plan did not change, then reuses it: no plan exchange
            strategy.use_cached_ckpt_structure = True
        if self.cfg.fully_parallel_save and parallel_state.get_data_parallel_world_size() > 1:
            strategy = FullyParallelSaveStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True), True
            )
        self._strategy = strategy
        return strategy

    def save(
        self,
        model: list[torch.nn.Module],
        optimizer: Any,
        scheduler: Any,
        state: TrainState,
        rank_extra: Optional[dict] = None,
    ) -> None:
        """Save a checkpoint of the current state into ``cfg.save`` (asynchronously with ``async_save``).

        ``rank_extra``: this rank's plain-valued extra state; :attr:`loaded_rank_extra` returns it after a load.
        A checkpoint of the same iteration is replaced atomically. A save that fails with a transient storage error
        is tried again, up to ``checkpoint.save_retries`` times (``save_retry.py``): here when it is synchronous, in
        its background writer when it is asynchronous.
        """
        root = self.cfg.save
        assert root is not None, "validate() guarantees checkpoint.save when saving"
        iteration = state.step
        if self._pending is not None:
            self.finalize(blocking=True)  # one save in flight at a time
        start = time.perf_counter()
        progress = state.state_dict()  # train_state.pt holds the state of this step, not of the async commit's
        number = 0
        while True:
            number += 1
            since = time.perf_counter()
            self._saves += 1
            attempt = f"{self._run_id}-{self._saves}"
            tmp = layout.tmp_dir(root, iteration, attempt)
            sharded_sd = contents.sharded_state_dict(
                model,
                optimizer,
                scheduler,
                state,
                rank_extra=rank_extra,
                common_extra=self._extras(),
                ckpt_cfg=self.cfg,
                generator_states=self._generator_states(),
            )
            # Every rank creates tmp and checks the free space, then all agree: nothing is written when it is short.
            if not self.storage.before_save(GLOBAL, iteration, storage.tensor_bytes(sharded_sd), tmp):
                return self._keep_in_local_tier(model, optimizer, scheduler, state)
            if number == 1:
                fault_injection.fill_storage(fault_injection.GLOBAL_SAVE, rank(), iteration, root)
            try:
                request = self._write(sharded_sd, tmp, iteration)
                if self._queue is None:
                    self._commit(iteration, attempt, progress)
                break
            except StorageGuard.SAVE_ERRORS as err:
                if self._queue is None and self._retried(err, iteration, tmp, number, since):
                    continue
                if not self._save_failed(err, iteration, tmp, number):  # full or unavailable: stops, or goes on
                    raise
                return self._keep_in_local_tier(model, optimizer, scheduler, state)
        if self._queue is None:
            what = "saved checkpoint"
        else:
            request.add_finalize_fn(lambda: self._commit(iteration, attempt, progress))
            self._queue.schedule_async_request(request)
            self._pending, self._pending_tmp = iteration, tmp
            what = "Scheduling async checkpoint save"
        self.last_blocking_seconds = time.perf_counter() - start
        logger.info(
            "%s at iteration %d to %s (blocking %.3f s)",
            what,
            iteration,
            layout.iter_dir(root, iteration),
            self.last_blocking_seconds,
        )

    def _write(self, sharded_sd: dict, tmp: str, iteration: int) -> Any:
        """Write this rank's part of a global save into ``tmp`` (sync), or prepare its background write (async).

        Both go through the writer of ``async_writer.py`` (a synchronous save runs it here, then megatron-core's
        finalize, which agrees every rank's write results): a failed write raises on every rank alike. The writer of
        an async save retries a write that failed on an unavailable file system itself (``checkpoint.save_retries``).
        """
        asynchronous = self._queue is not None
        retry = save_retry.RetryPolicy(self.cfg.save_retries, self.cfg.save_retry_backoff) if asynchronous else None
        fail = None
        for phase in fault_injection.IO_PHASES[:2]:  # an io-error due in this save's write (fault drills)
            if asynchronous:  # every attempt is the background writer's: it fails the first x<N>
                error, attempts = fault_injection.io_errors_in_writer(phase, rank(), iteration, tmp) or (None, None)
            else:  # this attempt only: SavePath.save retries
                error, attempts = fault_injection.io_error(phase, rank(), iteration, tmp), 1
            if fail is None and error is not None:
                fail = async_writer.InjectedIoError(phase, error, attempts)
        with die_with_this_process():  # a writer forked here must not outlive a rank killed mid-save
            request = dist_checkpointing.save(
                sharded_sd,
                tmp,
                sharded_strategy=self._save_strategy(),
                # The sharding layout cannot change within a run: check it (a collective) on the first save only.
                validate_access_integrity=self._saves == 1,
                async_sharded_save=True,
                # The extra entries differ between ranks by design: leave them out of the cross-rank comparison.
                preprocess_common_before_consistancy_check=lambda common: {
                    k: v for k, v in common.items() if k not in self._common_extra
                },
            )
            if request.async_fn is not None:  # None when this rank has nothing to write
                writer = async_writer.writer(request.async_fn, tmp, rank(), iteration, fail, retry)
                request = request._replace(async_fn=writer)
            if self._queue is None:
                request.execute_sync()
        return request

    def _retried(self, err: BaseException, iteration: int, tmp: Optional[str], number: int, since: float) -> bool:
        """Whether attempt ``number`` of a save that raised ``err`` is tried again (all ranks agree).

        A synchronous save is tried again whole; an async save's commit alone (``tmp`` ``None``: its files are
        written and kept). Only a failure every rank raised (``storage_guard``'s collective ones) of an unavailable
        file system is retried, while ``checkpoint.save_retries`` allows. Then the attempt's temporary directory is
        removed (a synchronous save writes it again), the failure recorded (event, goodput's ``save_retry``) and every
        rank waits the backoff before the next attempt.
        """
        if number > self.cfg.save_retries or not raised_by_every_rank(err):
            return False
        fault = save_retry.retry_fault(all_gather_object(storage.classify(err)))
        if fault is None:
            return False
        if tmp is not None:
            on_rank0(lambda: shutil.rmtree(tmp, ignore_errors=True), "removing the failed save attempt")
        wait = save_retry.wait_before(number, self.cfg.save_retry_backoff)
        logger.warning(
            "checkpoint.save=%s: attempt %d of the global checkpoint of iteration %d failed (%s, seen by rank %s); "
            "%s; retry %d of checkpoint.save_retries (%d) in %g s",
            self.cfg.save,
            number,
            iteration,
            fault.text,
            fault.rank,
            "its partial files were removed"
            if tmp is not None
            else "its files are written and kept: only the commit is tried again",
            number,
            self.cfg.save_retries,
            wait,
        )
        self._attempt_failed(iteration, number, fault, wait)
        self._strategy = None  # planned afresh: nothing cached from the failed attempt
        time.sleep(wait)
        if self.on_save_retry is not None:
            self.on_save_retry(time.perf_counter() - since)
        return True

    def _save_failed(self, err: BaseException, iteration: int, tmp: str, number: int) -> bool:
        """:meth:`StorageGuard.save_failed`; the error says how often the save was tried when it was retried."""
        try:
            handled = self.storage.save_failed(err, GLOBAL, iteration, tmp)
        except TrainingExit as stop:
            if self._queue is None:
                fault = storage.StorageFault(stop.exit_code, 0, storage.failure_text(err), None)
                self._attempt_failed(iteration, number, fault, None)
            if number == 1:
                raise
            note = save_retry.exhausted_note(number, self.cfg.save_retries, self.cfg.save_retry_backoff)
            raise TrainingExit(stop.exit_code, f"{stop.reason} {note}") from None
        return handled

    def _attempt_failed(self, iteration: int, number: int, fault: Any, wait: Optional[float]) -> None:
        event_stream.emit(
            EventKind.SAVE_ATTEMPT_FAILED,
            tier=GLOBAL,
            iteration=iteration,
            save_attempt=number,
            retrying=wait is not None,
            seconds=wait,
            exit_code=int(fault.code),
            detail=fault.text,
        )

    def _writer_retried(self, iteration: int, views: list[Any], waited: float) -> None:
        """Report the failed attempts of an async save's background writes (``views``: every rank's, agreed).

        Each failed attempt is a ``save_attempt_failed`` event (per attempt number, the first rank's that saw it).
        Goodput's ``save_retry`` counts what the retries cost the loop: training went on while the writers retried,
        so only a blocking finalize lost time, by waiting for the writes (``waited`` seconds); of that wait, the part
        the retries added to the slowest writer (its failed attempts and backoffs) counts, at most the wait itself.
        """
        merged = save_retry.merged_attempts(views)
        if not merged:
            return
        for attempt in merged:
            self._attempt_failed(iteration, attempt.number, attempt.fault, attempt.wait)
        lost = min(waited, save_retry.retry_seconds(views))
        logger.warning(
            "checkpoint.save=%s: %d attempt(s) of the background write of the global checkpoint of iteration %d "
            "failed (%s, first seen by rank %s); the writer retries (checkpoint.save_retries=%d); the loop waited "
            "%.3f s for the retries",
            self.cfg.save,
            len(merged),
            iteration,
            merged[0].fault.text,
            merged[0].fault.rank,
            self.cfg.save_retries,
            lost,
        )
        if lost > 0 and self.on_save_retry is not None:
            self.on_save_retry(lost)

    def _waited(self, now: float) -> float:
        """Seconds the running finalize blocked on the global save's background writes until ``now`` (0: a poll)."""
        return 0.0 if self._blocked_since is None else max(0.0, now - self._blocked_since)

    def _commit(self, iteration: int, attempt: str, progress: dict[str, Any]) -> None:
        """After every rank wrote its files: add the per-checkpoint files, hash, write the manifest, commit (all ranks).

        ``progress``: the train state of the save's step, for ``train_state.pt``; retention runs after the commit.
        """
        start = time.perf_counter()
        root = self.cfg.save
        tmp = layout.tmp_dir(root, iteration, attempt)
        layout.crash_point("during_write", rank(), iteration)
        on_rank0(lambda: layout.write_iteration_files(tmp, progress, self._run_config), "writing train_state.pt")
        barrier()
        entries, attempts = hash_checkpoint(tmp, async_writer.take_failed_attempts())
        self._writer_retried(iteration, attempts, self._waited(start))

        def publish() -> None:
            manifest.write_manifest(tmp, iteration, entries)
            refused = fault_injection.io_error(fault_injection.IO_PHASES[2], 0, iteration, tmp)
            if refused is not None:  # an io-error drill: the rename into iter_N fails, nothing is published
                raise refused
            layout.commit(root, iteration, attempt, rank=0)
            layout.apply_retention(
                root, self.cfg.most_recent_k, protect={iteration}, retain_interval=self.cfg.save_retain_interval
            )

        number = 0
        while True:
            number += 1
            since = time.perf_counter()
            try:
                on_rank0(publish, "the checkpoint commit")
                break
            except StorageGuard.SAVE_ERRORS as err:
                # An async save's files are written: only its commit is tried again (a sync save retries whole), and
                # only while nothing was published: once the rename is done, a failure after it is not retried.
                if self._queue is None or not on_rank0(lambda: os.path.isdir(tmp), "looking for the unpublished save"):
                    raise
                if not self._retried(err, iteration, None, number, since):
                    raise
        self.last_saved_iteration = iteration
        self.storage.sizes[GLOBAL] = sum(entry.size for entry in entries.values())
        self.last_finalize_seconds = time.perf_counter() - start
        self._on_saved(layout.iter_dir(root, iteration), self.api.CheckpointType.GLOBAL, iteration, self._in_finalize())

    def save_local(self, model: list[torch.nn.Module], optimizer: Any, scheduler: Any, state: TrainState) -> None:
        """Save the current state into the local tier (same content as a global checkpoint)."""
        assert self.local is not None, "validate() guarantees the local tier when a local save is due"
        sharded_sd = contents.sharded_state_dict(
            model, optimizer, scheduler, state, ckpt_cfg=self.cfg, generator_states=self._generator_states()
        )
        with self._global_save_kept_on_a_local_stop():
            self.storage.before_save(LOCAL, state.step, storage.tensor_bytes(sharded_sd))
            fault_injection.fill_storage(fault_injection.LOCAL_SAVE, rank(), state.step, self.storage.local_dir)
            try:
                self.local.save(sharded_sd, state.step, common_extra=self._extras())
            except StorageGuard.SAVE_ERRORS as err:
                if not self.storage.save_failed(err, LOCAL, state.step):
                    raise

    @contextlib.contextmanager
    def _global_save_kept_on_a_local_stop(self) -> Iterator[None]:
        """When the local tier stops training (its storage failed), commit the global save in flight first.

        The stop is agreed by every rank at the same point (the storage guard's verdict, or a failed background
        write that every rank sees in the same poll), so the commit's collectives are safe; the global write is
        healthy and would otherwise be abandoned (its writer may still be busy when the stop comes, under load).
        """
        try:
            yield
        except TrainingExit:
            if self._queue is not None and self._pending is not None:
                logger.warning(
                    "the local tier stopped training: committing the global save of iteration %d first", self._pending
                )
                self._finalize_global(blocking=True)
            raise

    def _keep_in_local_tier(self, model: list[torch.nn.Module], optimizer: Any, scheduler: Any, state: Any) -> None:
        """``global_save_failure_policy="continue_local"``: the global save failed; keep the state in the local tier."""
        if self.local is not None and self.local.last_saved_iteration != state.step:
            self.save_local(model, optimizer, scheduler, state)

    def _local_saved(self, iteration: int) -> None:
        self.storage.sizes[LOCAL] = self.local.node_bytes(iteration) if self.local is not None else None
        self._on_saved(
            self.cfg.non_persistent_local_ckpt_dir, self.api.CheckpointType.LOCAL, iteration, self._in_finalize()
        )

    def _in_finalize(self) -> Optional[float]:
        """Seconds since the running finalize began; ``None`` outside one (a synchronous save commits in its call)."""
        return None if self._finalizing_since is None else time.perf_counter() - self._finalizing_since

    @contextlib.contextmanager
    def _finalizing(self) -> Iterator[None]:
        self._finalizing_since = time.perf_counter()
        try:
            yield
        finally:
            self._finalizing_since = None

    def _generator_states(self) -> dict[str, Any]:
        """The generator states of this rank, collected by :func:`get_rng_state` (each rank stores its own)."""
        return self.api.get_rng_state(False, "torch_dist", pg_collection=checkpoint_process_groups()).data[0]

    def _extras(self) -> dict[str, Any]:
        return {name: provide() for name, provide in self._common_extra.items()}

    @property
    def async_save_in_flight(self) -> bool:
        """Whether an async save of either tier was scheduled and not committed yet (the same on every rank)."""
        local = self.local is not None and self.local.pending_iteration is not None
        return local or (self._queue is not None and self._pending is not None)

    def busy_here(self) -> AsyncSavesBusy:
        """Which tiers have an async save in flight whose background write has not finished on this rank.

        No collective: the training loop agrees every rank's answer in the one collective of its step and hands the
        result to :meth:`finalize`.
        """
        busy = self._queue is not None and self._pending is not None
        return AsyncSavesBusy(
            busy and not upstream.async_call_finished_here(self._queue),
            self.local is not None and self.local.busy_here(),
        )

    def finalize(self, blocking: bool = False, busy_anywhere: Optional[AsyncSavesBusy] = None) -> None:
        """Commit a finished async save; with ``blocking``, wait for it. Call on every rank at the same step.

        Args:
            blocking: wait for the saves in flight.
            busy_anywhere: :meth:`busy_here` of every rank, combined (any rank busy) and agreed by every rank
                beforehand: a tier no rank is busy with is committed without a poll collective, the others are left
                for a later step. ``None``: each tier polls every rank itself (one all-reduce each).
        """
        local_iteration = self.local.pending_iteration if self.local is not None else None
        with self._global_save_kept_on_a_local_stop():
            try:
                if self.local is not None:
                    with self._finalizing():
                        self.local.finalize(blocking, None if busy_anywhere is None else busy_anywhere.local_tier)
            except StorageGuard.SAVE_ERRORS as err:  # the background write failed: seen here, on the training thread
                if not self.storage.save_failed(err, LOCAL, local_iteration or 0):
                    raise
        if busy_anywhere is not None and busy_anywhere.global_tier and not blocking:
            return
        with self._finalizing():
            self._finalize_global(blocking, no_dist=busy_anywhere is not None and not blocking)

    def _finalize_global(self, blocking: bool, no_dist: bool = False) -> None:
        """Commit the global save in flight if every rank finished writing it (wait for it with ``blocking``)."""
        if self._queue is None or self._pending is None:
            return
        iteration = self._pending
        self._blocked_since = time.perf_counter() if blocking else None
        try:
            done = self._queue.maybe_finalize_async_calls(blocking=blocking, no_dist=no_dist)
        except StorageGuard.SAVE_ERRORS as err:  # the background write failed: seen here, on the training thread
            self._pending = None
            waited = self._waited(time.perf_counter())
            mine = async_writer.take_failed_attempts()
            views = all_gather_object(mine) if raised_by_every_rank(err) else [mine]
            # The attempts of a rank whose writer gave up (its last one was not retried): what the final error names.
            number = max((a.number for attempts in views for a in attempts if a.wait is None), default=1)
            try:
                handled = self._save_failed(err, iteration, self._pending_tmp, number)
            finally:  # reported once the failed save's files are gone: on a full disk, its events need that space
                self._writer_retried(iteration, views, waited)
            if not handled:
                raise
            return
        finally:
            self._blocked_since = None
        if done:
            self._pending = None
            logger.info(
                "finalized async checkpoint save at iteration %d (commit %.3f s)",
                iteration,
                self.last_finalize_seconds,
            )
