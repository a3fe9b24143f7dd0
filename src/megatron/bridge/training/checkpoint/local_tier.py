"""The local checkpoint tier: fast node-local saves, optionally replicated to other nodes, verified on every load.

Saves go through nvidia-resiliency-ext's ``LocalCheckpointManager`` (one ``torch.save`` file per rank and
iteration) with megatron-core's ``MCoreTensorAwareStateDict``; with ``checkpoint.replication`` each rank's file is
also written on the other members of its replication clique (``CliqueReplicationStrategy``), so a lost node's shards
can be fetched from a replica after a restart.

Layout on each node (``<dir>`` is ``checkpoint.non_persistent_local_ckpt_dir``)::

    <dir>/local_ckpt/<hostname>/<session>/<rank>/iter_0000120_<owner rank>_local.pt

``<session>`` is derived from ``checkpoint.save``, so jobs sharing a node-local directory never load each other's
checkpoints. A node scans every rank directory under its session: after a restart that hands ranks to other nodes,
the files a node holds are still found (upstream looks only in the current rank's directory).

What upstream lacks and this module adds: the owner of each shard hashes its content (every tensor, every object)
before the shard leaves it, and the hashes travel inside the shard (``shard_hashes.py``). On load, every rank
verifies each shard it reads from disk *before* sending it to a peer, and each rank verifies the shard it ends up
with again after the exchange. If any rank finds a problem, all ranks agree to discard this local checkpoint (its
files are deleted) and the caller loads the global one; the log names the bad shard and where it was read, and every
rank writes a ``fault_detected`` event (mechanism ``local_checkpoint_hash``, ``events/stream.py``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from megatron.bridge.training.checkpoint import shard_hashes, snapshot_writer, storage
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind, Mechanism
from megatron.bridge.training.faults import injection as fault_injection
from megatron.bridge.utils import dist as dist_utils
from megatron.bridge.utils import launch_env, upstream

if TYPE_CHECKING:
    from megatron.bridge.training.config import CheckpointConfig

logger = logging.getLogger(__name__)

_MANAGER = "nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager:LocalCheckpointManager"


def node_root(local_dir: str) -> str:
    """The directory of this node for local checkpoints under ``checkpoint.non_persistent_local_ckpt_dir``."""
    return os.path.join(local_dir, "local_ckpt", socket.gethostname())


def session_id(save_dir: Optional[str]) -> str:
    """A name for the job's local checkpoints: a digest of the global save directory's absolute path."""
    key = os.path.abspath(save_dir) if save_dir else "no-global-save-dir"
    return "session_" + hashlib.sha256(key.encode()).hexdigest()[:12]


# ---------------------------------------------------------------------------------------------------- the manager


def _manager_class() -> type:
    """``LocalCheckpointManager`` that finds a node's files in every rank directory of its session.

    Built once, when first needed (it imports nvidia-resiliency-ext), and kept as this module's
    ``NodeLocalCheckpointManager``: an async save sends a bound method of the manager to the persistent writer.
    """
    built = globals().get("NodeLocalCheckpointManager")
    if built is not None:
        return built

    class NodeLocalCheckpointManager(upstream.base_class(_MANAGER)):
        def _session_dir(self) -> Path:
            return Path(self.root_local_ckpt_dir) / self.session_id

        def _node_files(self, pattern: str) -> list[Path]:
            session = self._session_dir()
            return sorted(session.glob(f"*/{pattern}")) if session.is_dir() else []

        def _my_ckpt_ids(self) -> list:
            import re

            self._ensure_dir()
            template = re.compile(self._filename_from_template("\\d+", "\\d+", "\\"))
            ids = {
                self._filename_to_id(p.name) for p in self._node_files("iter_*_local.pt") if template.fullmatch(p.name)
            }
            return sorted(ids)

        def path_of(self, ckpt_id: Any) -> Path:
            name = self._local_ckpt_path_from_id(ckpt_id).name
            own = self.local_ckpt_dir / name
            if own.exists():
                return own
            found = self._node_files(name)
            return found[0] if found else own

        def _load(self, ckpt_id: Any) -> Any:
            from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import CheckpointingException

            path = self.path_of(ckpt_id)
            try:
                return torch.load(path, weights_only=False)  # nosec: written by this job on this node
            except FileNotFoundError as err:
                raise CheckpointingException(f"{path} does not exist") from err

        def _save(self, state_dict: Any, ckpt_id: Any) -> None:
            # torch.save's per-record CRC32 duplicates the owner's SHA-256 content hashes: skip it (~20% of the write).
            previous = upstream.get("torch.utils.serialization:config.save.compute_crc32")
            torch.serialization.set_crc32_options(False)
            try:
                super()._save(state_dict, ckpt_id)
            except Exception as err:
                # A full or failing disk: drop the partial file and report the error (storage.take_writer_errors);
                # the save then fails on every rank together, in the manager's collective check of the files.
                if storage.note_writer_error(err, dist_utils.rank()) is None:
                    raise
                self._local_ckpt_path_from_id(ckpt_id, True).unlink(missing_ok=True)
                logger.error("local checkpoint %s not written: %s", self._local_ckpt_path_from_id(ckpt_id), err)
                return
            finally:
                torch.serialization.set_crc32_options(previous)
            # In the writer (its own process when async): the file is complete now, whenever the save finalizes.
            iteration, owner = ckpt_id[0], ckpt_id[1]
            if owner == dist_utils.rank():
                fault_injection.corrupt_written_local_checkpoint(owner, iteration, lambda: str(self.path_of(ckpt_id)))

        def _remove(self, keep: Callable[[int], bool]) -> None:
            for path in self._node_files(self._filename_from_template("*", "*", "*")):
                if not keep(self._filename_to_id(path.name)[0]):
                    path.unlink(missing_ok=True)  # ranks of one node clean the same files

        def _cleanup(self, iteration: int) -> None:
            self._remove(keep=lambda it: it >= iteration)

        def _cleanup_failed_save(self, iteration: int) -> None:
            self._remove(keep=lambda it: it != iteration)

    NodeLocalCheckpointManager.__qualname__ = "NodeLocalCheckpointManager"  # found by pickle under this module
    globals()["NodeLocalCheckpointManager"] = NodeLocalCheckpointManager
    return NodeLocalCheckpointManager


def _prepare_tensors(tasd: Any, replicating: bool) -> None:
    """Put the tensors where the manager needs them, without copies it does not need.

    Replicating over NCCL: the exchange broadcasts every tensor over the process group, which needs device tensors,
    so the few host tensors (the RNG row) go to the device; the exchange stages this rank's own shard on the host.
    Otherwise every tensor is copied to the host here, blocking: the manager's own copy is non-blocking and a
    synchronous save writes right after it. A CPU tensor needs no copy (a synchronous save finishes before training
    changes it, and an async save's writer gets a copy: ``snapshot_writer.py``, or a fork's memory as it was); the
    ``orig_device`` attribute that megatron-core's ``copy_tensors_to_cpu`` uses for staged tensors marks it so.
    """
    for _, sh in shard_hashes.sharded_items(tasd):
        if isinstance(sh.data, torch.Tensor) and sh.data.device.type == "cpu":
            sh.orig_device = "cpu"
    nccl = dist.is_initialized() and "nccl" in str(dist.get_backend())  # may read "cpu:gloo,cuda:nccl"
    if nccl and replicating:
        for _, sh in shard_hashes.sharded_items(tasd):
            if getattr(sh, "orig_device", None) == "cpu":
                sh.data = sh.data.to(torch.cuda.current_device())
                del sh.orig_device
        return
    tasd.copy_tensors_to_cpu(non_blocking=False)


def _poison_for_drills(tasd: Any, rank: int, iteration: int) -> None:
    """Save this local checkpoint with NaN model weights when the fault registry says so (``nan@N:R:local_save``).

    For drills: a local checkpoint whose bytes are intact (its hashes are computed after this) but whose state is
    bad, as a replica assembled from the wrong pieces would be.
    """
    if not fault_injection.poisons_local_save(rank, iteration):
        return
    for name, sh in shard_hashes.sharded_items(tasd):
        is_weight = isinstance(sh.data, torch.Tensor) and not sh.key.startswith(("optimizer", "rng_state"))
        if is_weight and sh.data.is_floating_point():
            sh.data = torch.full_like(sh.data, float("nan"))
            logger.error("fault injection: local checkpoint of iteration %d saved with NaN in %s", iteration, name)
            return


def _agreed(problems: list[str]) -> list[str]:
    """Every rank's problems, on every rank."""
    return [p for part in dist_utils.all_gather_object(problems) for p in part]


class LocalTier:
    """Saves, finds and loads this job's local checkpoints (every method is called by all ranks together).

    Args:
        local_dir: ``checkpoint.non_persistent_local_ckpt_dir``.
        save_dir: ``checkpoint.save`` (names the session).
        algo: ``checkpoint.non_persistent_local_ckpt_algo``.
        replication: ``None``, or ``(jump, factor)`` for clique replication.
        async_save: write files in a background process (``checkpoint.async_save``).
        parallelization_group: the data-parallel group ``fully_parallel`` spreads the work over.
        layout: the job's parallel layout (world size, model parallel sizes); a checkpoint saved under another one
            is not loaded from this tier (the global tier can reshard).
    """

    def __init__(
        self,
        local_dir: str,
        save_dir: Optional[str],
        algo: str,
        replication: Optional[tuple[int, int]],
        async_save: bool,
        parallelization_group: Any,
        layout: str = "",
        on_saved: Optional[Callable[[int], None]] = None,
    ) -> None:
        self.layout = layout
        self._on_saved = on_saved
        strategy = None
        if replication is not None:
            from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

            strategy = CliqueReplicationStrategy.from_replication_params(*replication)
        self.root = node_root(local_dir)
        self.manager = _manager_class()(self.root, session_id=session_id(save_dir), repl_strategy=strategy)
        self.algo = algo
        self.group = parallelization_group
        self._distribution: Any = None  # fully_parallel's work split, computed at the first save
        self._queue = None
        if async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            from megatron.bridge.utils.cpu_shims import use_persistent_async_worker

            if use_persistent_async_worker():
                self._queue = AsyncCallsQueue(persistent=False)  # on GPU: a forked writer per save
            else:  # on CPU: one writer, forked now, before the model exists (snapshot_writer.py)
                self._queue = snapshot_writer.calls_queue(dist_utils.rank())
        self._pending: Optional[int] = None
        self.last_saved_iteration: Optional[int] = None
        self.last_blocking_seconds = 0.0

    # ------------------------------------------------------------------ save

    def save(self, sharded_state_dict: dict, iteration: int, common_extra: Optional[dict] = None) -> None:
        """Save ``sharded_state_dict`` as the local checkpoint of ``iteration`` (in the background with async).

        ``common_extra``: entries for the common part that may differ between ranks (added after megatron-core's
        cross-rank comparison of the common part).
        """
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

        if self._pending is not None:
            self.finalize(blocking=True)
        start = time.perf_counter()
        tasd, self._distribution = MCoreTensorAwareStateDict.from_state_dict(
            sharded_state_dict, algo=self.algo, parallelization_group=self.group, cached_metadata=self._distribution
        )
        tasd.common.update(common_extra or {})
        _prepare_tensors(tasd, replicating=self.manager.repl_strategy is not None)
        rank = dist_utils.rank()
        _poison_for_drills(tasd, rank, iteration)
        hashes = {**shard_hashes.content_hashes(tasd), shard_hashes.OWNER: self._owner(rank, iteration)}
        setattr(tasd, shard_hashes.HASHES_ATTR, hashes)  # of exactly what is written and sent to replicas
        request = self.manager.save(tasd, iteration, is_async=self._queue is not None)
        if self._queue is not None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

            self._queue.schedule_async_request(
                AsyncRequest(
                    request.async_fn, request.async_fn_args, [*request.finalize_fns, lambda: self._saved(iteration)]
                )
            )
            self._pending = iteration
        else:
            self._saved(iteration)
        self.last_blocking_seconds = time.perf_counter() - start
        logger.info(
            "%s local checkpoint at iteration %d in %s (blocking %.3f s)",
            "Scheduling async" if self._queue is not None else "saved",
            iteration,
            self.manager.local_ckpt_dir,
            self.last_blocking_seconds,
        )

    def _saved(self, iteration: int) -> None:
        self.last_saved_iteration = iteration
        if self._on_saved is not None:
            self._on_saved(iteration)

    @property
    def pending_iteration(self) -> Optional[int]:
        """The iteration of the async save in flight (``None``: none)."""
        return self._pending

    def busy_here(self) -> bool:
        """Whether an async save is in flight and its background write has not finished on this rank (no collective)."""
        in_flight = self._queue is not None and self._pending is not None
        return in_flight and not upstream.async_call_finished_here(self._queue)

    def finalize(self, blocking: bool = False, busy_anywhere: Optional[bool] = None) -> None:
        """Finish an async save that completed on every rank (wait for it with ``blocking``).

        Args:
            blocking: wait for the save in flight.
            busy_anywhere: whether some rank's :meth:`busy_here` was true, agreed by every rank beforehand (the step's
                one agreement carries it): the poll then needs no collective of its own. ``None``: poll every rank.

        A save that failed raises here, on every rank (its files were removed); none is in flight afterwards.
        """
        if self._queue is None or self._pending is None or (busy_anywhere and not blocking):
            return
        try:
            done = self._queue.maybe_finalize_async_calls(
                blocking=blocking, no_dist=busy_anywhere is not None and not blocking
            )
        except BaseException:
            self._pending = None
            raise
        if done:
            logger.info("finalized async local checkpoint at iteration %d", self._pending)
            self._pending = None

    def node_bytes(self, iteration: Optional[int] = None) -> Optional[int]:
        """Bytes of this node's files (own shards and replicas) of the local checkpoint of ``iteration``.

        ``None``: of the newest iteration this node holds files of. Returns ``None`` when there are none.
        """
        session = Path(self.manager.root_local_ckpt_dir) / self.manager.session_id
        files = {p: int(p.name.split("_")[1]) for p in session.glob("*/iter_*_local.pt")}  # iter_<it>_<owner>_local.pt
        if iteration is None and files:
            iteration = max(files.values())
        mine = [p for p, it in files.items() if it == iteration]
        return storage.files_bytes(mine) if mine else None

    def close(self, abort: bool = False) -> None:
        """Wait for an async save (unless ``abort``) and stop the background writer."""
        if self._queue is not None:
            if not abort:
                self.finalize(blocking=True)
            self._queue.close(abort=abort)
            self._queue = None

    # ------------------------------------------------------------------ load

    def latest_iteration(self) -> int:
        """The newest iteration whose shards (own or replicas) are all on some node; -1 if none."""
        self.manager.latest_iteration = -1
        return self.manager.find_latest()

    def load(self, iteration: int, build_sharded_state_dict: Callable[[dict], dict]) -> Optional[dict]:
        """Load, verify and assemble the local checkpoint of ``iteration``; ``None`` (after discarding it) if bad.

        Args:
            iteration: what :meth:`latest_iteration` returned.
            build_sharded_state_dict: the sharded state dict to load into, given the checkpoint's common part.

        Returns:
            The loaded state dict (as ``dist_checkpointing.load`` returns it), or ``None`` when any rank found a
            problem; then every rank deleted this iteration's local files and the caller should load the global tier.
        """
        manager, strategy = self.manager, self.manager.repl_strategy
        manager.latest_iteration = iteration
        wanted = upstream.bound(manager, f"{_MANAGER}._ckpt_id")(iteration)
        load_shard = upstream.bound(manager, f"{_MANAGER}._load_fn")
        plan, mine, problems = None, {}, []
        if strategy is not None:
            plan = strategy.retrieve_plan(manager.globally_available_ids, [wanted])
            needed = sorted(plan.required_ids())
        else:
            needed = [wanted]
        for ckpt_id in needed:  # every shard this rank keeps or sends, verified before it leaves this node
            where = f"rank {ckpt_id[1]}'s shard {manager.path_of(ckpt_id)} on {socket.gethostname()}"
            try:
                mine[ckpt_id] = load_shard(ckpt_id)
            except Exception as err:  # noqa: BLE001 - any unreadable shard makes the tier unusable
                problems.append(f"{where}: cannot be read ({type(err).__name__}: {err})")
                continue
            problems += [
                f"{where}: {p}" for p in shard_hashes.verify_content(mine[ckpt_id], self._owner(ckpt_id[1], iteration))
            ]
        if self._other_layout(iteration, [shard_hashes.saved_layout(shard) for shard in mine.values()]):
            return None
        if self._reject(iteration, _agreed(problems)):
            return None
        retrieved = False
        if plan is not None:
            received = strategy.retrieve_execute(plan, mine)
            retrieved = wanted not in mine
            tasd = received[wanted]
            where = f"rank {wanted[1]}'s shard as received from a replica by rank {dist.get_rank()}"
            bad = shard_hashes.verify_content(tasd, self._owner(wanted[1], iteration)) if retrieved else []
            if self._reject(iteration, _agreed([f"{where}: {p}" for p in bad])):
                return None
        else:
            tasd = mine[wanted]
        state_dict = tasd.to_state_dict(
            build_sharded_state_dict(tasd.common_state_dict),
            algo=self.algo,
            exchange_algo=_exchange_algo(),
            parallelization_group=self.group,
        )
        counts = _agreed(["replica"] if retrieved else [])
        logger.info(
            "loaded verified local checkpoint at iteration %d from %s (%d of %d ranks' shards fetched from replicas)",
            iteration,
            self.manager.local_ckpt_dir.parent,
            len(counts),
            dist_utils.world_size(),
        )
        return state_dict

    def discard(self, iteration: int) -> None:
        """Delete the local checkpoint of ``iteration`` on every node (all ranks call this)."""
        upstream.bound(self.manager, f"{_MANAGER}._cleanup_failed_save")(iteration)
        self.manager.latest_iteration = -1
        dist_utils.barrier()

    def _owner(self, rank: int, iteration: int) -> str:
        """The owner tag of ``rank``'s shard of ``iteration`` under this run's layout (``shard_hashes.owner_tag``)."""
        return shard_hashes.owner_tag(rank, iteration, self.layout)

    def _other_layout(self, iteration: int, layouts: list[Optional[str]]) -> bool:
        """Whether the shards read (any rank's ``layouts``) are of another layout (a shrink): skip them, not blame."""
        other = sorted({layout for layout in _agreed([x for x in layouts if x and x != self.layout])})
        if not other:
            return False
        logger.warning(
            "local checkpoint at iteration %d was saved under another parallel layout (%s; this run: %s): the local "
            "tier cannot reshard, so it is skipped and the global checkpoint is loaded instead",
            iteration,
            "; ".join(other),
            self.layout,
        )
        self.manager.latest_iteration = -1  # not loaded: this run's own saves of the same iterations replace it
        return True

    def _reject(self, iteration: int, problems: list[str]) -> bool:
        if not problems:
            return False
        logger.error(
            "local checkpoint at iteration %d failed verification (%d problem(s)): %s; discarding the local tier's "
            "iteration %d and loading the global checkpoint instead",
            iteration,
            len(problems),
            "; ".join(problems[:8]),
            iteration,
        )
        event_stream.emit(
            EventKind.FAULT_DETECTED,
            mechanism=Mechanism.LOCAL_CHECKPOINT_HASH,
            rank=None,  # the problems name the bad shard's owner; every rank agreed to discard
            tier="local",
            iteration=iteration,
            detail=problems[0],
        )
        self.discard(iteration)
        return True


def _exchange_algo() -> str:
    """How ``fully_parallel`` loading exchanges shards: broadcasts on GPU, pickled objects on CPU (see cpu_shims)."""
    from megatron.bridge.utils.cpu_shims import local_checkpoint_exchange_algo

    return local_checkpoint_exchange_algo()


def local_tier_of(cfg: CheckpointConfig, on_saved: Callable[[int], None]) -> Optional[LocalTier]:
    """The local tier the config asks for, or ``None``; ``on_saved(iteration)`` runs when a local save is done."""
    if cfg.non_persistent_ckpt_type != "local":
        return None
    from megatron.core import parallel_state

    replication = None
    if cfg.replication:
        jump = cfg.replication_jump or launch_env.current().ranks_per_node  # validate() checked both
        replication = (jump, cfg.replication_factor)
        if dist_utils.world_size() % (jump * cfg.replication_factor):  # validate() allows it after a shrink only
            replication = None
    assert cfg.non_persistent_local_ckpt_dir is not None, "validate() guarantees the local directory"
    return LocalTier(
        cfg.non_persistent_local_ckpt_dir,
        cfg.save or cfg.load,
        cfg.non_persistent_local_ckpt_algo,
        replication,
        cfg.async_save,
        parallel_state.get_data_parallel_group(with_context_parallel=True),
        layout=(
            f"world size {dist_utils.world_size()}, tensor parallel "
            f"{parallel_state.get_tensor_model_parallel_world_size()}, "
            f"pipeline parallel {parallel_state.get_pipeline_model_parallel_world_size()}"
        ),
        on_saved=on_saved,
    )
