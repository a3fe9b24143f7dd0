"""Global checkpoints: save (sync or async) with an atomic, verified commit; load the newest valid one.

A checkpoint holds the model, optimizer and scheduler states, every RNG state, the iteration and the data
position (consumed samples), so a resumed run continues bit-identically. Files are written by megatron-core
``dist_checkpointing`` (``torch_dist`` format) into a temporary directory; after every rank finished, the ranks
hash the files in parallel, rank 0 writes the manifest and commits (see ``checkpoint/layout.py``).

Loading recovers what an interrupted save left behind, verifies the candidate against its manifest (hashing split
over ranks) and falls back to the next older checkpoint when verification fails.
"""

import enum
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, Optional

import torch

from megatron.bridge.training import event_stream, fault_injection
from megatron.bridge.training.checkpoint import async_writer, contents, layout, manifest, storage
from megatron.bridge.training.checkpoint.local_tier import LocalTier, local_tier_of
from megatron.bridge.training.checkpoint.resume import resolve_resume_path
from megatron.bridge.training.checkpoint.storage_guard import GLOBAL, LOCAL, StorageGuard, missing_checkpoint
from megatron.bridge.training.config import CheckpointConfig
from megatron.bridge.training.event_stream import EventKind, Mechanism
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.training.state import TrainState
from megatron.bridge.utils.dist import all_gather_object, barrier, broadcast_from_rank0, on_rank0, rank, world_size
from megatron.bridge.utils.orphans import die_with_this_process

logger = logging.getLogger(__name__)


class CheckpointType(enum.Enum):
    """A checkpoint's tier (Megatron-Bridge's name; what checkpoint callbacks receive as ``checkpoint_type``)."""

    GLOBAL = "global"
    """``checkpoint.save``: persistent, shared storage."""
    LOCAL = "local"
    """``checkpoint.non_persistent_local_ckpt_dir``: node-local storage (nvidia-resiliency-ext)."""


def schedule_async_save(global_state: Any, async_request: Any) -> None:
    """Schedule ``async_request`` (megatron-core's ``AsyncRequest``) on the run's asynchronous save queue.

    Megatron-Bridge's module function: the queue is ``global_state.async_calls_queue``, the one the run's own async
    saves use (``checkpoint.async_save``); without it the request is not scheduled.
    """
    queue = global_state.async_calls_queue
    if queue is not None:
        queue.schedule_async_request(async_request)


def maybe_finalize_async_save(
    global_state: Any, ckpt_cfg: CheckpointConfig, blocking: bool = False, terminate: bool = False
) -> None:
    """Run the finalize functions of the asynchronous saves that finished on every rank (all of them: ``blocking``).

    Megatron-Bridge's module function; call it on every rank at the same point. ``terminate`` then closes the queue.
    """
    queue = global_state.async_calls_queue
    if not ckpt_cfg.async_save or queue is None:
        return
    queue.maybe_finalize_async_calls(blocking=blocking)
    if terminate:
        queue.close()
        global_state.async_calls_queue = None


LOCAL_LOAD_SUSPECT_STEPS = 10
"""A non-finite loss this many steps or fewer after a local-tier load is blamed on the local checkpoint."""


def _hash_checkpoint(ckpt_dir: str) -> dict[str, manifest.FileEntry]:
    """Hash every file of ``ckpt_dir`` not hashed yet by a background writer, split over ranks; table on rank 0."""

    def scan() -> tuple[dict[str, manifest.FileEntry], list[str]]:
        known = manifest.take_partial_manifests(ckpt_dir)
        return known, [rel for rel in manifest.list_files(ckpt_dir) if rel not in known]

    known, todo = on_rank0(scan, "listing the checkpoint's files")
    share = manifest.hash_share(ckpt_dir, todo, rank(), world_size())
    merged = dict(known)
    for part in all_gather_object(share):
        merged.update(part)
    return merged


def verify_checkpoint(ckpt_dir: str) -> list[str]:
    """Check ``ckpt_dir`` against its manifest with the hashing split over ranks; same problems on every rank."""

    def read() -> tuple[Optional[dict], Optional[str]]:
        try:
            return manifest.read_manifest(ckpt_dir), None
        except ValueError as err:
            return None, str(err)

    table, error = on_rank0(read, "reading the manifest")
    if error:
        return [error]
    problems = manifest.verify_share(ckpt_dir, table, rank(), world_size())
    return sorted(p for part in all_gather_object(problems) for p in part)


class CheckpointManager:
    """Saves and loads global checkpoints for one run; owns the async save queue.

    Args:
        cfg: the checkpoint section of the run's config.
        common_extra: entries added to the common part of every checkpoint, global and local tier: name -> a
            function returning plain values, called at each save. Their values may differ between ranks and runs
            (rank 0's are in a global checkpoint); :attr:`loaded_common_extra` holds them after a load.
        on_saved: called ``(directory, tier, iteration)`` on every rank once a checkpoint is committed.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        common_extra: Optional[dict[str, Callable[[], Any]]] = None,
        on_saved: Optional[Callable[[str, CheckpointType, int], None]] = None,
    ) -> None:
        self.cfg = cfg
        self._on_saved = on_saved or (lambda name, kind, iteration: None)
        self._common_extra = dict(common_extra or {})
        self.loaded_common_extra: dict[str, Any] = {}
        """The ``common_extra`` entries of the checkpoint :meth:`load` loaded (an entry it lacks is absent)."""
        self._queue = None
        self._pending: Optional[int] = None  # iteration of the async save in flight
        self._pending_tmp: Optional[str] = None  # and its temporary directory
        self.last_blocking_seconds: float = 0.0
        self.last_finalize_seconds: float = 0.0
        self.last_saved_iteration: Optional[int] = None
        self.loaded_rank_extra: Optional[dict] = None
        """This rank's ``rank_extra`` from the checkpoint :meth:`load` loaded (None if it had none)."""
        self._strategy: Any = None
        # Temporary directory names: a run id agreed once plus a counter, so no save needs a collective for it.
        self._run_id = broadcast_from_rank0(uuid.uuid4().hex[:8] if rank() == 0 else None)
        self._saves = 0
        self.storage = StorageGuard(cfg)
        """Free space before saves, failed saves, a save directory replaced mid-run: ``checkpoint/storage_guard.py``."""
        if cfg.save is not None:
            with self.storage.reading("recovering the save directory"):
                on_rank0(lambda: layout.recover(cfg.save), "recovering the save directory")  # what a crash left
            async_writer.install_results_queue()
        if cfg.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            from megatron.bridge.utils.cpu_shims import use_persistent_async_worker

            self._queue = AsyncCallsQueue(persistent=use_persistent_async_worker())
        self.local: Optional[LocalTier] = local_tier_of(cfg, on_saved=self._local_saved)
        """The local tier (``checkpoint.non_persistent_ckpt_type="local"``), or ``None``."""
        self.loaded_local_iteration: Optional[int] = None
        """The iteration of the local-tier checkpoint this run started from (``None``: global tier or none)."""
        self.resumed: dict[str, Any] = {"tier": None, "iteration": None, "directory": None, "why": "not loaded yet"}
        """What :meth:`load` resumed from: tier (``"global"``, ``"local"`` or ``None``), iteration, directory, why."""
        self.skipped_restores: frozenset[str] = frozenset()
        """Parts of the loaded checkpoint this rank left unrestored on purpose (fault injection's ``skip_restore``:
        ``"rng"``, ``"optimizer"``, ``"data"``; the data position is the caller's to skip)."""

    @property
    def async_queue(self) -> Any:
        """The queue of this run's asynchronous saves (``None`` when they are off or after :meth:`close`)."""
        return self._queue

    # ------------------------------------------------------------------ save

    def _save_strategy(self) -> Any:
        if self._strategy is not None:
            return self._strategy  # reused: the fully parallel wrapper caches its work distribution
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        strategy = get_default_save_sharded_strategy(self.cfg.ckpt_format)
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
        A checkpoint of the same iteration is replaced atomically.
        """
        from megatron.core import dist_checkpointing

        root = self.cfg.save
        assert root is not None, "validate() guarantees checkpoint.save when saving"
        iteration = state.step
        if self._pending is not None:
            self.finalize(blocking=True)  # one save in flight at a time
        start = time.perf_counter()
        self._saves += 1
        attempt = f"{self._run_id}-{self._saves}"
        tmp = layout.tmp_dir(root, iteration, attempt)
        sharded_sd = contents.sharded_state_dict(
            model, optimizer, scheduler, state, rank_extra=rank_extra, common_extra=self._extras()
        )
        # Every rank creates tmp and checks the free space, then all agree: nothing is written when it is short.
        if not self.storage.before_save(GLOBAL, iteration, storage.tensor_bytes(sharded_sd), tmp):
            return self._keep_in_local_tier(model, optimizer, scheduler, state)
        fault_injection.fill_storage(fault_injection.GLOBAL_SAVE, rank(), iteration, root)
        try:
            with die_with_this_process():  # a writer forked here must not outlive a rank killed mid-save
                request = dist_checkpointing.save(
                    sharded_sd,
                    tmp,
                    sharded_strategy=self._save_strategy(),
                    # The sharding layout cannot change within a run: check it (a collective) on the first save only.
                    validate_access_integrity=self._saves == 1,
                    async_sharded_save=self._queue is not None,
                    # The extra entries differ between ranks by design: leave them out of the cross-rank comparison.
                    preprocess_common_before_consistancy_check=lambda common: {
                        k: v for k, v in common.items() if k not in self._common_extra
                    },
                )
            if self._queue is None:
                self._commit(iteration, attempt)
        except StorageGuard.SAVE_ERRORS as err:
            if not self.storage.save_failed(err, GLOBAL, iteration, tmp):  # full or unavailable: stops, or goes on
                raise
            return self._keep_in_local_tier(model, optimizer, scheduler, state)
        if self._queue is None:
            what = "saved checkpoint"
        else:
            if request.async_fn is not None:  # None when this rank has nothing to write
                request = request._replace(async_fn=async_writer.writer(request.async_fn, tmp, rank(), iteration))
            request.add_finalize_fn(lambda: self._commit(iteration, attempt))
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

    def _commit(self, iteration: int, attempt: str) -> None:
        """After every rank wrote its files: hash, write the manifest, commit, apply retention (all ranks)."""
        start = time.perf_counter()
        root = self.cfg.save
        tmp = layout.tmp_dir(root, iteration, attempt)
        layout.crash_point("during_write", rank(), iteration)
        barrier()
        entries = _hash_checkpoint(tmp)

        def publish() -> None:
            manifest.write_manifest(tmp, iteration, entries)
            layout.commit(root, iteration, attempt, rank=0)
            layout.apply_retention(
                root, self.cfg.most_recent_k, protect={iteration}, retain_interval=self.cfg.save_retain_interval
            )

        on_rank0(publish, "the checkpoint commit")
        self.last_saved_iteration = iteration
        self.storage.sizes[GLOBAL] = sum(entry.size for entry in entries.values())
        self.last_finalize_seconds = time.perf_counter() - start
        self._on_saved(layout.iter_dir(root, iteration), CheckpointType.GLOBAL, iteration)

    def save_local(self, model: list[torch.nn.Module], optimizer: Any, scheduler: Any, state: TrainState) -> None:
        """Save the current state into the local tier (same content as a global checkpoint)."""
        assert self.local is not None, "validate() guarantees the local tier when a local save is due"
        sharded_sd = contents.sharded_state_dict(model, optimizer, scheduler, state)
        self.storage.before_save(LOCAL, state.step, storage.tensor_bytes(sharded_sd))
        fault_injection.fill_storage(fault_injection.LOCAL_SAVE, rank(), state.step, self.storage.local_dir)
        try:
            self.local.save(sharded_sd, state.step, common_extra=self._extras())
        except StorageGuard.SAVE_ERRORS as err:
            if not self.storage.save_failed(err, LOCAL, state.step):
                raise

    def _keep_in_local_tier(self, model: list[torch.nn.Module], optimizer: Any, scheduler: Any, state: Any) -> None:
        """``global_save_failure_policy="continue_local"``: the global save failed; keep the state in the local tier."""
        if self.local is not None and self.local.last_saved_iteration != state.step:
            self.save_local(model, optimizer, scheduler, state)

    def _local_saved(self, iteration: int) -> None:
        self.storage.sizes[LOCAL] = self.local.node_bytes(iteration) if self.local is not None else None
        self._on_saved(self.cfg.non_persistent_local_ckpt_dir, CheckpointType.LOCAL, iteration)

    def _extras(self) -> dict[str, Any]:
        return {name: provide() for name, provide in self._common_extra.items()}

    def finalize(self, blocking: bool = False) -> None:
        """Commit a finished async save; with ``blocking``, wait for it. Call on every rank at the same step."""
        local_iteration = self.local.pending_iteration if self.local is not None else None
        try:
            if self.local is not None:
                self.local.finalize(blocking=blocking)
        except StorageGuard.SAVE_ERRORS as err:  # the background write failed: seen here, on the training thread
            if not self.storage.save_failed(err, LOCAL, local_iteration or 0):
                raise
        if self._queue is None or self._pending is None:
            return
        iteration = self._pending
        try:
            done = self._queue.maybe_finalize_async_calls(blocking=blocking)
        except StorageGuard.SAVE_ERRORS as err:  # the background write failed: seen here, on the training thread
            self._pending = None
            if not self.storage.save_failed(err, GLOBAL, iteration, self._pending_tmp):
                raise
            return
        if done:
            self._pending = None
            logger.info(
                "finalized async checkpoint save at iteration %d (commit %.3f s)",
                iteration,
                self.last_finalize_seconds,
            )

    def close(self, abort: bool = False) -> None:
        """Wait for any async save and shut the async worker down.

        Args:
            abort: stop without finalizing (an exception is propagating and other ranks may not be here to join the
                collectives of a commit); the unfinished save stays a temporary directory that the next start removes.
        """
        if self.local is not None:
            self.local.close(abort=abort)
        if self._queue is not None:
            if not abort:
                self.finalize(blocking=True)
            self._queue.close(abort=abort)
            self._queue = None

    # ------------------------------------------------------------------ load

    def load(self, model: list[torch.nn.Module], optimizer: Any, scheduler: Any, state: TrainState) -> Optional[int]:
        """Load the newest valid checkpoint into the given objects; return its iteration.

        The directory is chosen by :func:`resolve_resume_path` (``cfg.load`` if it holds checkpoints, else
        ``cfg.save``); :attr:`resumed` records the choice. Returns ``None`` (train from scratch) when neither holds
        a checkpoint, unless ``exit_on_missing_checkpoint`` is set.

        Raises:
            TrainingExit: ``NO_VALID_CHECKPOINT`` when checkpoints exist but none verifies, or none exists and
                ``exit_on_missing_checkpoint`` is set; ``STORAGE_UNAVAILABLE`` (unreadable) or ``STORAGE_FULL`` (the
                start's free-space check): ``checkpoint/storage_guard.py``.
        """
        with self.storage.reading("choosing and loading the checkpoint to resume from"):
            iteration = self._load(model, optimizer, scheduler, state)
        global_bytes = on_rank0(lambda: self.storage.committed_bytes(self.resumed), "sizing the checkpoints")
        self.storage.check_start(state.step, global_bytes, self.local.node_bytes() if self.local is not None else None)
        return iteration

    def _load(self, model: list[torch.nn.Module], optimizer: Any, scheduler: Any, state: TrainState) -> Optional[int]:
        source = on_rank0(lambda: resolve_resume_path(self.cfg.load, self.cfg.save), "choosing the directory to load")
        root = source.directory
        self.resumed = {"tier": None, "iteration": None, "directory": None, "why": source.reason}
        if root is None:
            return None
        candidates = on_rank0(lambda: self._candidates(root), "listing the checkpoints")
        step = self.cfg.ckpt_step
        if step is not None:  # exactly this one: no local tier, no fallback to an older one
            if step not in candidates:
                raise TrainingExit(
                    ExitCode.NO_VALID_CHECKPOINT,
                    f"checkpoint.ckpt_step={step}: {source.field}={root} has no committed checkpoint of that "
                    f"iteration (committed: {sorted(candidates)}); pick one of them or unset checkpoint.ckpt_step",
                )
            candidates = [step]
        elif self.local is not None and self._load_local(candidates, model, optimizer, scheduler, state):
            self.resumed = {
                "tier": "local",
                "iteration": state.step,
                "directory": self.cfg.non_persistent_local_ckpt_dir,
                "why": f"the local checkpoint is newer than the global ones of {root} and verified",
            }
            return state.step
        if not candidates:
            if self.cfg.exit_on_missing_checkpoint:
                exists = on_rank0(lambda: os.path.isdir(root), "looking for the checkpoint directory")
                raise TrainingExit(ExitCode.NO_VALID_CHECKPOINT, missing_checkpoint(str(source.field), root, exists))
            logger.warning("no checkpoint found in %s=%s; training starts at iteration 0", source.field, root)
            return None
        for iteration in candidates:
            ckpt_dir = layout.iter_dir(root, iteration)
            problems = verify_checkpoint(ckpt_dir)
            if problems:
                logger.error(
                    "checkpoint %s failed verification (%d problems): %s; trying an older one",
                    ckpt_dir,
                    len(problems),
                    "; ".join(problems[:5]),
                )
                event_stream.emit(
                    EventKind.FAULT_DETECTED,
                    mechanism=Mechanism.CHECKPOINT_VERIFICATION,
                    rank=None,
                    tier="global",
                    iteration=iteration,
                    detail=problems[0],
                )
                continue
            self._load_dir(ckpt_dir, model, optimizer, scheduler, state)
            why = (
                f"checkpoint.ckpt_step={step}" if step is not None else f"newest verified checkpoint in {source.field}"
            )
            if iteration != candidates[0]:
                logger.warning("fell back to checkpoint at iteration %d (newest was %d)", iteration, candidates[0])
                why += f" (newer {[c for c in candidates if c > iteration]} failed verification)"
            self.resumed = {"tier": "global", "iteration": iteration, "directory": ckpt_dir, "why": why}
            logger.info("successfully loaded verified checkpoint %s at iteration %d", ckpt_dir, state.step)
            return iteration
        raise TrainingExit(
            ExitCode.NO_VALID_CHECKPOINT,
            f"none of the checkpoints {candidates} in {source.field}={root} passed verification; "
            "restore a good copy or point checkpoint.load elsewhere (mbridge-verify-checkpoint lists the damage)",
        )

    def _load_local(
        self, candidates: list[int], model: list[torch.nn.Module], optimizer: Any, scheduler: Any, state: TrainState
    ) -> bool:
        """Load the local tier's newest checkpoint if it is newer than every global one and verifies."""
        assert self.local is not None
        local_iteration = self.local.latest_iteration()
        newest_global = candidates[0] if candidates else -1
        if local_iteration < 0:
            logger.info("no complete local checkpoint on the nodes of this job; using the global tier")
            return False
        if local_iteration <= newest_global:
            logger.info(
                "local checkpoint at iteration %d is not newer than the global one at %d; using the global tier",
                local_iteration,
                newest_global,
            )
            return False
        loaded = self.local.load(
            local_iteration, lambda common: self._state_dict_to_load(common, model, optimizer, scheduler, state)
        )
        if loaded is None:
            return False
        self._apply(loaded, model, optimizer, scheduler, state)
        self.loaded_local_iteration = local_iteration
        return True

    def blame_local_tier(self, iteration: int) -> Optional[str]:
        """Blame a bad loss at ``iteration`` on the local-tier checkpoint this run started from, if it was recent.

        Called by every rank after a loss that failed validation (NaN/Inf, or a spike the re-run state machine
        stops on; all ranks agree on it). If this run loaded a local-tier checkpoint at most
        :data:`LOCAL_LOAD_SUSPECT_STEPS` steps before, that checkpoint is deleted on every node and the reason
        returned. Bounded by construction: the restarted job finds no such local checkpoint and loads the global one.
        """
        loaded = self.loaded_local_iteration
        if self.local is None or loaded is None or iteration - loaded > LOCAL_LOAD_SUSPECT_STEPS:
            return None
        self.local.discard(loaded)
        self.loaded_local_iteration = None
        return (
            f"a bad loss at iteration {iteration}, {iteration - loaded} step(s) after loading the local "
            f"checkpoint of iteration {loaded}: that checkpoint was deleted on every node; a restart loads the "
            "global checkpoint"
        )

    @staticmethod
    def _candidates(root: str) -> list[int]:
        """Committed iterations to try, newest first, none newer than the tracker."""
        committed = layout.committed_iterations(root)
        tracked = layout.read_tracker(root)
        if tracked is None:
            if committed:
                logger.warning("%s has checkpoints but no readable tracker; using the newest", root)
            return committed
        newer = [it for it in committed if it > tracked]
        if newer:
            logger.warning(
                "ignoring checkpoints %s newer than the tracker (%d): their commit never finished", newer, tracked
            )
        if tracked not in committed:
            logger.error(
                "the tracker names iteration %d but %s does not exist", tracked, layout.iter_dir(root, tracked)
            )
        return [it for it in committed if it <= tracked]

    def _load_dir(
        self, ckpt_dir: str, model: list[torch.nn.Module], optimizer: Any, scheduler: Any, state: TrainState
    ) -> None:
        from megatron.core import dist_checkpointing

        common = dist_checkpointing.load_common_state_dict(ckpt_dir)
        sharded_sd = self._state_dict_to_load(common, model, optimizer, scheduler, state)
        loaded = dist_checkpointing.load(sharded_sd, ckpt_dir, strict=self.cfg.dist_ckpt_strictness)
        self._apply(loaded, model, optimizer, scheduler, state)

    def _state_dict_to_load(
        self, common: dict, model: list[torch.nn.Module], optimizer: Any, scheduler: Any, state: TrainState
    ) -> dict[str, Any]:
        """The sharded state dict to load a checkpoint with this ``common`` part into (any tier)."""
        self.loaded_common_extra = {name: common[name] for name in self._common_extra if name in common}
        sharded_sd = contents.sharded_state_dict(model, optimizer, scheduler, state, rng_bytes=int(common["rng_bytes"]))
        if int(common.get("rng_world_size", world_size())) != world_size():
            # Per-rank generator states cannot be mapped onto another world size: keep this run's fresh seeds.
            del sharded_sd["rng_state"]
            logger.warning(
                "checkpoint was saved by %s ranks, this run has %d: random generators are re-seeded, not restored "
                "(training continues, but not bit-identically to an uninterrupted run)",
                common.get("rng_world_size"),
                world_size(),
            )
        return sharded_sd

    def _apply(
        self, loaded: dict[str, Any], model: list[torch.nn.Module], optimizer: Any, scheduler: Any, state: TrainState
    ) -> None:
        progress = TrainState()
        progress.load_state_dict(loaded["train_state"])
        self.skipped_restores = fault_injection.skipped_restores(rank(), progress.step)
        self.loaded_rank_extra = contents.apply_loaded(
            loaded, model, optimizer, scheduler, state, skip=self.skipped_restores
        )
