"""The load half of the checkpoint manager: resume from the newest checkpoint that verifies, whichever tier.

Failures handled: a checkpoint damaged after its commit (a truncated or bit-flipped file, a missing shard) must not
be trained on, and a crash in the middle of a commit must not hide the good checkpoints behind it. The directory to
resume from is chosen once (``resume.py``); its committed checkpoints newer than the tracker are ignored (their
commit never finished); each candidate, newest first, is checked against its manifest with the hashing split over
ranks, and one that fails is reported (a ``fault_detected`` event) and skipped for the next older one. A local-tier
checkpoint newer than every global one is loaded first when it verifies (``local_tier.py``), and one followed within
:data:`LOCAL_LOAD_SUSPECT_STEPS` steps by a bad loss is blamed and deleted, so the restart falls back to the global
tier. A checkpoint Megatron-Bridge wrote (no manifest) is loaded unverified, with a warning.
"""

import logging
import os
from collections.abc import Callable
from typing import Any, Optional

import torch

from megatron.bridge.training.checkpoint import contents, layout, manifest
from megatron.bridge.training.checkpoint.local_tier import LocalTier
from megatron.bridge.training.checkpoint.resume import resolve_resume_path
from megatron.bridge.training.checkpoint.storage_guard import StorageGuard, missing_checkpoint
from megatron.bridge.training.config import CheckpointConfig
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind, Mechanism
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.training.faults import injection as fault_injection
from megatron.bridge.training.state import TrainState
from megatron.bridge.training.utils.pg_utils import checkpoint_process_groups
from megatron.bridge.utils.dist import all_gather_object, on_rank0, rank, world_size

logger = logging.getLogger("megatron.bridge.training.checkpointing")  # the name the run's load lines always had

LOCAL_LOAD_SUSPECT_STEPS = 10
"""A non-finite loss this many steps or fewer after a local-tier load is blamed on the local checkpoint."""


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


class LoadPath:
    """The load half of :class:`~megatron.bridge.training.checkpoint.manager.CheckpointManager` (a mixin).

    The manager's ``__init__`` sets the state below; :meth:`load` is called by every rank once, at the run's start.
    """

    cfg: CheckpointConfig
    storage: StorageGuard
    local: Optional[LocalTier]
    checkpointing_context: dict[str, Any]
    _common_extra: dict[str, Callable[[], Any]]
    loaded_common_extra: dict[str, Any]
    loaded_rank_extra: Optional[dict]
    loaded_local_iteration: Optional[int]
    resumed: dict[str, Any]
    skipped_restores: frozenset[str]

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
            unverified = on_rank0(
                lambda ckpt_dir=ckpt_dir: contents.foreign_without_manifest(ckpt_dir),
                "reading the checkpoint's common part",
            )
            problems = [] if unverified else verify_checkpoint(ckpt_dir)
            if unverified:
                logger.warning(unverified)
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
            logger.info(
                "successfully loaded %s checkpoint %s at iteration %d",
                "unverified" if unverified else "verified",
                ckpt_dir,
                state.step,
            )
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
        """Read the verified checkpoint ``ckpt_dir`` by its own directory (so exactly the files verified)."""
        context = self.checkpointing_context
        common, *_ = self.api._load_base_checkpoint(ckpt_dir, self.cfg, rank0=True, checkpointing_context=context)
        if not contents.written_here(common):
            return self._load_foreign(ckpt_dir, common, model, optimizer, scheduler, state)
        refused = contents.layout_refusal(
            common.get(contents.PARALLEL_LAYOUT_KEY), contents.parallel_layout(model), ckpt_dir
        )
        if refused is not None:
            raise TrainingExit(ExitCode.CONFIG_ERROR, refused)
        sharded_sd = self._state_dict_to_load(common, model, optimizer, scheduler, state)
        loaded, *_ = self.api._load_base_checkpoint(
            ckpt_dir, self.cfg, rank0=False, sharded_state_dict=sharded_sd, checkpointing_context=context
        )
        self._apply(loaded, model, optimizer, scheduler, state)

    def _load_foreign(
        self,
        ckpt_dir: str,
        common: dict,
        model: list[torch.nn.Module],
        optimizer: Any,
        scheduler: Any,
        state: TrainState,
    ) -> None:
        """Load a checkpoint Megatron-Bridge wrote (its content, not this package's).

        Its sections are read with the layout metadata it was saved with, the train state from its
        ``train_state.pt`` (else its ``iteration``), the RNG states from its ``rng_state`` object when it saved them.

        Raises:
            TrainingExit: ``NO_VALID_CHECKPOINT`` when it was saved without its optimizer state.
        """
        from megatron.core import parallel_state

        from megatron.bridge.models.distributed import unwrap
        from megatron.bridge.training.checkpoint import optimizer_state

        api = self.api  # Megatron-Bridge's functions read the checkpoint Megatron-Bridge wrote
        saved, run_config = {}, api.get_checkpoint_run_config_filename(ckpt_dir)
        if api.file_exists(run_config):
            saved = (api.read_run_config(run_config) or {}).get("checkpoint") or {}
        if not saved.get("save_optim", True):
            raise TrainingExit(
                ExitCode.NO_VALID_CHECKPOINT,
                f"{ckpt_dir} was saved without its optimizer state (checkpoint.save_optim=false in its "
                "run_config.yaml): a run cannot resume from it; start a new run from its weights instead",
            )
        metadata = api.dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
        if metadata is None:
            distributed = optimizer_state.optimizer_metadata(model) is not None
            metadata = api._build_sharded_state_dict_metadata(distributed, self.cfg)
        optimizer_state.prime_for_loading(optimizer)
        rng = api.get_rng_state(False, self.cfg.ckpt_format, pg_collection=checkpoint_process_groups())
        sharded_sd = api.generate_state_dict(
            self.cfg,
            [unwrap(chunk) for chunk in model],
            optimizer,
            scheduler,
            rng if saved.get("save_rng", True) else None,
            optim_sd_kwargs={"is_loading": True, "metadata": metadata},
            model_sd_kwargs={"metadata": metadata},
        )
        loaded, *_ = api._load_base_checkpoint(
            ckpt_dir,
            self.cfg,
            rank0=False,
            sharded_state_dict=sharded_sd,
            checkpointing_context=self.checkpointing_context,
        )
        train_state_file = api.get_checkpoint_train_state_filename(ckpt_dir)
        if api.file_exists(train_state_file):
            progress = api.read_train_state(train_state_file)
        else:
            progress = api._get_train_state_from_state_dict(common)
        self.loaded_common_extra, self.loaded_rank_extra = {}, None
        self.skipped_restores = fault_injection.skipped_restores(rank(), progress.step)
        contents.apply_foreign_loaded(
            loaded,
            progress,
            model,
            optimizer,
            scheduler,
            state,
            parallel_state.get_data_parallel_rank(with_context_parallel=True),
            skip=self.skipped_restores,
        )

    def _state_dict_to_load(
        self, common: dict, model: list[torch.nn.Module], optimizer: Any, scheduler: Any, state: TrainState
    ) -> dict[str, Any]:
        """The sharded state dict to load a checkpoint with this ``common`` part into (any tier)."""
        self.loaded_common_extra = {name: common[name] for name in self._common_extra if name in common}
        sharded_sd = contents.sharded_state_dict(
            model, optimizer, scheduler, state, rng_bytes=int(common["rng_bytes"]), ckpt_cfg=self.cfg
        )
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
        """Restore a checkpoint of this package's content (either tier) into the run's objects."""
        progress = TrainState()
        progress.load_state_dict(loaded["train_state"])
        self.skipped_restores = fault_injection.skipped_restores(rank(), progress.step)
        self.loaded_rank_extra = contents.apply_loaded(
            loaded,
            model,
            optimizer,
            scheduler,
            state,
            skip=self.skipped_restores,
            load_model=self.api._load_model_state_dict,
        )
