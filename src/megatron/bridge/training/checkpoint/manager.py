"""The run's checkpoint manager: one object that owns both tiers, the async save queue and the storage guard.

Failure handled: a run restarted after any fault must resume from the newest good state and keep saving safely. The
manager joins the two halves: :class:`~megatron.bridge.training.checkpoint.saving.SavePath` (atomic, verified
commits; async saves finalized at an agreed step) and :class:`~megatron.bridge.training.checkpoint.loading.LoadPath`
(newest verified checkpoint, older ones as fallback, the local tier when newer). At construction it first recovers
what a crash left in ``checkpoint.save`` (temporary directories, a half-finished commit: ``layout.recover``), and on
CPU forks the async writer before the model exists (``snapshot_writer.py``). Megatron-Bridge's function API
(``training/checkpointing.py``) reaches the same manager through :meth:`CheckpointManager.for_run`.
"""

import uuid
from collections.abc import Callable
from typing import Any, Optional

from megatron.bridge.training.checkpoint import async_writer, layout, snapshot_writer
from megatron.bridge.training.checkpoint.loading import LoadPath
from megatron.bridge.training.checkpoint.local_tier import LocalTier, local_tier_of
from megatron.bridge.training.checkpoint.saving import SavePath
from megatron.bridge.training.checkpoint.storage_guard import StorageGuard
from megatron.bridge.training.config import CheckpointConfig
from megatron.bridge.training.utils.config_utils import to_plain, yaml_text
from megatron.bridge.utils.dist import broadcast_from_rank0, on_rank0, rank


class CheckpointManager(SavePath, LoadPath):
    """Saves and loads global checkpoints for one run; owns the async save queue.

    Args:
        cfg: the checkpoint section of the run's config.
        common_extra: entries added to the common part of every checkpoint, global and local tier: name -> a
            function returning plain values, called at each save. Their values may differ between ranks and runs
            (rank 0's are in a global checkpoint); :attr:`loaded_common_extra` holds them after a load.
        on_saved: called ``(directory, tier, iteration, finalize_seconds)`` on every rank once a checkpoint is
            committed (``tier``: a ``CheckpointType``); ``finalize_seconds``: the loop's time so far in the finalize
            committing an async save (``None`` for a synchronous save).
        run_config: the run's whole config (``ConfigContainer``), saved as ``run_config.yaml`` into every global
            checkpoint (Megatron-Bridge's layout); ``None`` leaves the file out.
        api: Megatron-Bridge's function API the manager is built on: the module ``training.checkpointing`` (its
            RNG states, base-checkpoint readers and run-config files), passed in because that module imports this
            one; each name is looked up at the call, so a patch of one reaches the manager.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        common_extra: Optional[dict[str, Callable[[], Any]]] = None,
        on_saved: Optional[Callable[[str, Any, int, Optional[float]], None]] = None,
        run_config: Any = None,
        *,
        api: Any,
    ) -> None:
        self.cfg = cfg
        self.api = api
        # Rendered once: every global save's commit writes the same text (YAML rendering took most of rank 0's part).
        self._run_config = yaml_text(to_plain(run_config)) if run_config is not None else None
        self._on_saved = on_saved or (lambda name, kind, iteration, finalize_seconds=None: None)
        self._finalizing_since: Optional[float] = None
        """When the running finalize began (``perf_counter``): an async commit's blocking time is measured from it."""
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

            if use_persistent_async_worker():
                self._queue = AsyncCallsQueue(persistent=True)
            else:  # on CPU: forked now, before the model exists (checkpoint/snapshot_writer.py)
                self._queue = snapshot_writer.calls_queue(rank())
        self.local: Optional[LocalTier] = local_tier_of(cfg, on_saved=self._local_saved)
        """The local tier (``checkpoint.non_persistent_ckpt_type="local"``), or ``None``."""
        self.checkpointing_context: dict[str, Any] = {"checkpoint_manager": self}
        """Megatron-Bridge's checkpointing context of this run: this manager, the load strategy of the last load and,
        with the local tier, nvidia-resiliency-ext's ``local_checkpoint_manager``."""
        if self.local is not None:
            self.checkpointing_context["local_checkpoint_manager"] = self.local.manager
        self.loaded_local_iteration: Optional[int] = None
        """The iteration of the local-tier checkpoint this run started from (``None``: global tier or none)."""
        self.resumed: dict[str, Any] = {"tier": None, "iteration": None, "directory": None, "why": "not loaded yet"}
        """What :meth:`load` resumed from: tier (``"global"``, ``"local"`` or ``None``), iteration, directory, why."""
        self.skipped_restores: frozenset[str] = frozenset()
        """Parts of the loaded checkpoint this rank left unrestored on purpose (fault injection's ``no-<part>-restore``:
        ``"rng"``, ``"optimizer"``, ``"data"``; the data position is the caller's to skip)."""

    @property
    def async_queue(self) -> Any:
        """The queue of this run's asynchronous saves (``None`` when they are off or after :meth:`close`)."""
        return self._queue

    @classmethod
    def for_run(cls, state: Any, checkpointing_context: Optional[dict[str, Any]], api: Any) -> "CheckpointManager":
        """The manager of ``checkpointing_context`` (its ``checkpoint_manager``), created on first use.

        Megatron-Bridge's ``save_checkpoint``/``load_checkpoint`` take a ``GlobalState`` and a context; a new manager
        registers itself and its context entries in ``checkpointing_context`` and its async queue as
        ``state.async_calls_queue``. Without a context every call builds a new manager: pass one per run.
        """
        context = {} if checkpointing_context is None else checkpointing_context
        manager = context.get("checkpoint_manager")
        if manager is None:
            manager = cls(state.cfg.checkpoint, run_config=state.cfg, api=api)
            context.update(manager.checkpointing_context)
            manager.checkpointing_context = context
            state.async_calls_queue = manager.async_queue
        return manager

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
