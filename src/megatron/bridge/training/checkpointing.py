"""Global checkpoints: save (sync or async) with an atomic, verified commit; load the newest valid one.

A checkpoint holds the model, optimizer and scheduler states, every RNG state, the iteration and the data
position (consumed samples), so a resumed run continues bit-identically. Files are written by megatron-core
``dist_checkpointing`` (``torch_dist`` format) into a temporary directory; after every rank finished, the ranks
hash the files in parallel, rank 0 writes the manifest and commits (see ``checkpoint/layout.py``).

Loading recovers what an interrupted save left behind, verifies the candidate against its manifest (hashing split
over ranks) and falls back to the next older checkpoint when verification fails.

Megatron-Bridge's function API lives here too, and :class:`CheckpointManager` is built on it: the state dict comes
from :func:`generate_state_dict` with the RNG states of :func:`get_rng_state`, a verified checkpoint is read by
:func:`_load_base_checkpoint`, and :func:`save_checkpoint` / :func:`load_checkpoint` (and
:class:`DefaultCheckpointManager`, Megatron-Bridge's pluggable manager) drive the same manager the training loop uses.
"""

import contextlib
import enum
import logging
import os
import random
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Literal, Optional

import numpy as np
import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from megatron.core.utils import get_pg_size

from megatron.bridge.training.checkpoint import async_writer, contents, layout, manifest, snapshot_writer, storage
from megatron.bridge.training.checkpoint.async_writer import AsyncSavesBusy
from megatron.bridge.training.checkpoint.contexts import CheckpointLoadContext, CheckpointSaveContext
from megatron.bridge.training.checkpoint.discovery import (  # noqa: F401 - Megatron-Bridge's names, re-exported
    _get_checkpoint_format,
    _has_global_non_persistent_checkpoint,
    cleanup_old_non_persistent_checkpoint,
)
from megatron.bridge.training.checkpoint.local_tier import LocalTier, local_tier_of
from megatron.bridge.training.checkpoint.resume import resolve_resume_path
from megatron.bridge.training.checkpoint.state_dict import (  # noqa: F401 - Megatron-Bridge's names, re-exported
    _build_sharded_state_dict_metadata,
    _generate_model_state_dict,
    _get_train_state_from_state_dict,
    _is_model_section,
    delete_extra_state,
    generate_state_dict,
)
from megatron.bridge.training.checkpoint.storage_guard import GLOBAL, LOCAL, StorageGuard, missing_checkpoint
from megatron.bridge.training.config import CheckpointConfig
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind, Mechanism
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.training.faults import injection as fault_injection
from megatron.bridge.training.state import TrainState
from megatron.bridge.training.utils.checkpoint_utils import (  # noqa: F401 - Megatron-Bridge's names, re-exported
    TRACKER_PREFIX,
    checkpoint_exists,
    ensure_directory_exists,
    file_exists,
    get_checkpoint_name,
    get_checkpoint_run_config_filename,
    get_checkpoint_tracker_filename,
    get_checkpoint_train_state_filename,
    is_checkpoint_iteration_directory,
    read_run_config,
    read_train_state,
)
from megatron.bridge.training.utils.config_utils import to_plain, yaml_text
from megatron.bridge.utils import upstream
from megatron.bridge.utils.common_utils import print_rank_0
from megatron.bridge.utils.cpu_shims import training_on_cpu
from megatron.bridge.utils.dist import all_gather_object, barrier, broadcast_from_rank0, on_rank0, rank, world_size
from megatron.bridge.utils.orphans import die_with_this_process

try:
    import nvidia_resiliency_ext.checkpointing  # noqa: F401

    HAVE_RESIL = True
except ImportError:
    HAVE_RESIL = False

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


_DIRECT_ITERATION_DIR_SENTINEL = -2
"""What :func:`_resolve_checkpoint_iteration` returns when the load directory is itself one checkpoint's directory."""

_NON_PERSISTENT_TYPES = ("global", "local")


def _tracker_device() -> torch.device:
    """Where a tensor for a collective of the default process group must live (chosen at run time)."""
    return torch.device("cpu" if training_on_cpu() or not torch.cuda.is_available() else "cuda")


def read_metadata(tracker_filename: str) -> tuple[int, bool]:
    """The iteration in a Megatron-LM tracker file and whether it names the ``release`` checkpoint.

    With ``torch.distributed`` initialized every rank must call it: the ranks agree on the largest iteration any
    of them read (a rank that read an older tracker on a lagging file system is warned about and overruled).

    Raises:
        SystemExit: the file holds neither an iteration nor ``release`` (Megatron-LM's behaviour).
    """
    iteration, release = 0, False
    with open(tracker_filename) as f:
        text = f.read().strip()
    try:
        iteration = int(text)
    except ValueError:
        release = text == "release"
        if not release:
            print_rank_0(f"ERROR: invalid metadata file {tracker_filename}: {text[:40]!r}. Exiting")
            sys.exit()
    assert iteration > 0 or release, f"error parsing metadata file {tracker_filename}"
    if not torch.distributed.is_initialized():
        return iteration, release
    agreed = torch.tensor([iteration], dtype=torch.long, device=_tracker_device())
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
    max_iteration = agreed[0].item()
    if max_iteration != iteration:
        print_rank_0(
            f"WARNING: rank {torch.distributed.get_rank()} read iteration {iteration} from {tracker_filename} "
            f"while the largest across ranks is {max_iteration}; using {max_iteration}"
        )
    return max_iteration, release


def find_checkpoint_rank_0(checkpoints_path: str, iteration: int, release: bool = False) -> Optional[str]:
    """The directory of the checkpoint of ``iteration`` if it is a ``torch_dist`` checkpoint, else ``None``."""
    checkpoint_dir = get_checkpoint_name(checkpoints_path, iteration, release=release)
    return checkpoint_dir if dist_checkpointing.check_is_distributed_checkpoint(checkpoint_dir) else None


def get_rng_state(
    data_parallel_random_init: bool,
    ckpt_format: str = "torch_dist",
    *,
    pg_collection: Any,
    module_name: Optional[str] = None,
) -> Any:
    """The states of every random generator of this rank (python, numpy, torch, CUDA, megatron-core's tracker).

    Args:
        data_parallel_random_init: gather the states of every data-parallel rank (they differ then).
        ckpt_format: ``torch_dist``: a ``ShardedObject`` sharded over (pipeline, tensor) ranks with the
            data-parallel rank as replica id, or over (pipeline, tensor, data) ranks with expert parallelism;
            ``fsdp_dtensor``: a dict keyed ``"(pp_rank, tp_rank)"``.
        pg_collection: the process groups (``pp``, ``tp``, ``dp_cp``, ``ep``).
        module_name: names the sharded object ``rng_state.<module_name>`` (several models in one run).
    """
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if not training_on_cpu():  # a GPU node running with dist.device=cpu leaves CUDA untouched
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    states = [state]
    if torch.distributed.is_initialized() and data_parallel_random_init and pg_collection.dp_cp.size() > 1:
        states = [None] * pg_collection.dp_cp.size()
        torch.distributed.all_gather_object(states, state, group=pg_collection.dp_cp)
    pp_rank, tp_rank = pg_collection.pp.rank(), pg_collection.tp.rank()
    if ckpt_format == "fsdp_dtensor":
        return {f"({pp_rank}, {tp_rank})": states}
    if ckpt_format != "torch_dist":
        return states
    key = f"rng_state.{module_name}" if module_name else "rng_state"
    shape, offset = (pg_collection.pp.size(), pg_collection.tp.size()), (pp_rank, tp_rank)
    if get_pg_size(pg_collection.ep) > 1:  # expert-parallel ranks of one data-parallel group differ
        return ShardedObject(
            key,
            states,
            shape + (pg_collection.dp_cp.size(),),
            offset + (pg_collection.dp_cp.rank(),),
            replica_id=0,
        )
    return ShardedObject(key, states, shape, offset, replica_id=pg_collection.dp_cp.rank())


def _process_groups() -> Any:
    """The run's process groups as megatron-core's ``ProcessGroupCollection`` (pp, tp, dp_cp, ep)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(
        tp=parallel_state.get_tensor_model_parallel_group(),
        pp=parallel_state.get_pipeline_model_parallel_group(),
        dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True),
        ep=parallel_state.get_expert_model_parallel_group(check_initialized=False),
    )


def _load_model_state_dict(module: torch.nn.Module, state_dict: dict[str, Any], strict: bool) -> None:
    """Load ``state_dict`` into ``module``; a strict load tolerates Transformer Engine ``._extra_state`` keys only.

    A strict load that fails is retried non-strictly and accepted when every missing or unexpected key is an
    ``._extra_state`` (their format changes between Transformer Engine releases; they hold no weights). Any other
    mismatch is logged and raised: a model with weights missing must not train on silently.

    Raises:
        RuntimeError: strict loading found mismatched weights; any error of a non-strict load.
    """
    try:
        module.load_state_dict(state_dict, strict=strict)
    except Exception as err:
        if not strict:
            raise
        result = module.load_state_dict(state_dict, strict=False)
        mismatched = [k for k in [*result.missing_keys, *result.unexpected_keys] if not k.endswith("._extra_state")]
        if mismatched:
            print_rank_0(f"Warning: Exception during strict loading: {err}")
            print_rank_0(f"Non-extra-state mismatched keys: {mismatched}")
            raise RuntimeError(
                f"the checkpoint's model state does not match the model: {mismatched[:10]} (not only Transformer "
                "Engine extra states); load a checkpoint of this model or fix the model config"
            ) from err


def _resolve_checkpoint_iteration(load_dir: Optional[str], ckpt_step_override: Optional[int]) -> tuple[int, bool]:
    """Which iteration of ``load_dir`` to load, and whether it is the ``release`` checkpoint.

    ``load_dir`` that is itself one checkpoint's directory gives :data:`_DIRECT_ITERATION_DIR_SENTINEL`;
    ``ckpt_step_override`` that iteration (its directory must exist); otherwise the tracker decides
    (``latest_train_state.pt``, else Megatron-LM's ``latest_checkpointed_iteration.txt``); ``-1``: none found.

    Raises:
        FileNotFoundError: ``ckpt_step_override`` names a checkpoint that does not exist.
    """
    if is_checkpoint_iteration_directory(load_dir):
        print_rank_0(f"Loading checkpoint directly from iteration directory {load_dir}")
        return _DIRECT_ITERATION_DIR_SENTINEL, False
    if ckpt_step_override is not None:
        checkpoint_dir = get_checkpoint_name(load_dir, ckpt_step_override, release=False)
        if not file_exists(checkpoint_dir):
            raise FileNotFoundError(
                f"ckpt_step={ckpt_step_override} specified but checkpoint directory does not exist: "
                f"{checkpoint_dir}\nAvailable checkpoints can be listed with: ls {load_dir}/iter_*"
            )
        return ckpt_step_override, False
    if load_dir is None:
        return -1, False
    train_state_file = get_checkpoint_train_state_filename(load_dir, prefix=TRACKER_PREFIX)
    if file_exists(train_state_file):
        read_train_state.cache_clear()  # a later save of this run rewrote it: never trust a cached copy here
        return read_train_state(train_state_file).step, False
    tracker = get_checkpoint_tracker_filename(load_dir)
    if file_exists(tracker):
        return read_metadata(tracker)
    return -1, False


def _get_non_persistent_iteration(
    non_persistent_global_dir: str,
    non_persistent_ckpt_type: Optional[Literal["global", "local"]] = None,
    checkpointing_context: Optional[dict[str, Any]] = None,
) -> int:
    """The iteration of the newest non-persistent checkpoint; ``-1`` when there is none (or no such tier).

    ``local``: asks ``checkpointing_context["local_checkpoint_manager"]``; ``global``: the train state tracker of
    ``non_persistent_global_dir``.

    Raises:
        ValueError: another ``non_persistent_ckpt_type``.
    """
    if non_persistent_ckpt_type is None:
        return -1
    if non_persistent_ckpt_type == "local":
        return checkpointing_context["local_checkpoint_manager"].find_latest()
    if non_persistent_ckpt_type != "global":
        raise ValueError(f"Please use local or global non-persistent checkpoints. Got: {non_persistent_ckpt_type}")
    tracker = get_checkpoint_train_state_filename(non_persistent_global_dir, prefix=TRACKER_PREFIX)
    if not file_exists(tracker):
        print_rank_0(f"WARNING: no non-persistent checkpoint tracker {tracker}; not loading a non-persistent one")
        return -1
    return read_train_state(tracker).step


def init_checkpointing_context(checkpoint_config: CheckpointConfig) -> dict[str, Any]:
    """The context shared by the saves and loads of a run (load strategy, local checkpoint manager, the manager).

    Empty at first: :class:`CheckpointManager` adds ``checkpoint_manager`` (itself) and, for the local tier,
    ``local_checkpoint_manager`` (nvidia-resiliency-ext's manager behind ``checkpoint/local_tier.py``) when
    :func:`save_checkpoint` or :func:`load_checkpoint` first runs with this context.

    Raises:
        RuntimeError: ``non_persistent_ckpt_type="local"`` without nvidia-resiliency-ext installed.
    """
    if checkpoint_config.non_persistent_ckpt_type == "local" and not HAVE_RESIL:
        raise RuntimeError(
            "local checkpointing (checkpoint.non_persistent_ckpt_type='local') needs the 'nvidia_resiliency_ext' "
            "package, which is not installed: install it or unset checkpoint.non_persistent_ckpt_type"
        )
    return {}


def _load_global_dist_base_checkpoint(
    load_dir: str,
    ckpt_cfg: CheckpointConfig,
    rank0: bool,
    sharded_state_dict: Optional[dict[str, Any]],
    iteration: Optional[int],
    release: bool,
    checkpoint_path_override: Optional[str] = None,
    checkpointing_context: Optional[dict[str, Any]] = None,
    *,
    pg_collection: Any = None,
) -> tuple[dict[str, Any], str, bool, "CheckpointType"]:
    """Read a ``torch_dist`` checkpoint: its common part only (``rank0``), or ``sharded_state_dict`` filled.

    ``checkpoint_path_override``: the checkpoint's directory, instead of ``iteration``'s in ``load_dir``. The load
    strategy (fully parallel with ``fully_parallel_load``) is kept in ``checkpointing_context["load_strategy"]``.

    Raises:
        RuntimeError: a full load without ``sharded_state_dict``.
    """
    if rank0:
        name = checkpoint_path_override or find_checkpoint_rank_0(load_dir, iteration, release)
        return dist_checkpointing.load_common_state_dict(name), name, release, CheckpointType.GLOBAL
    if sharded_state_dict is None:
        raise RuntimeError("Detected load from a distributed checkpoint, but sharded state dict is not provided.")
    name = checkpoint_path_override or get_checkpoint_name(load_dir, iteration, release)
    strategy = TorchDistLoadShardedStrategy()
    if ckpt_cfg.fully_parallel_load:
        group = pg_collection.dp_cp if pg_collection is not None else _process_groups().dp_cp
        strategy = FullyParallelLoadStrategyWrapper(strategy, group)
    if checkpointing_context is not None:
        checkpointing_context["load_strategy"] = strategy
    state_dict = dist_checkpointing.load(sharded_state_dict, name, strategy, strict=ckpt_cfg.dist_ckpt_strictness)
    return state_dict, name, release, CheckpointType.GLOBAL


def _load_non_persistent_base_checkpoint(
    non_persistent_global_dir: str,
    ckpt_cfg: CheckpointConfig,
    rank0: bool,
    sharded_state_dict: Optional[dict[str, Any]],
    non_persistent_iteration: int,
    checkpointing_context: Optional[dict[str, Any]] = None,
    cfg: Any = None,
    *,
    pg_collection: Any = None,
) -> tuple[dict[str, Any], Any, bool, "CheckpointType"]:
    """Read the newest non-persistent checkpoint.

    A global one from ``non_persistent_global_dir``, or the local tier's
    (``checkpointing_context["local_checkpoint_manager"]``; ``rank0`` needs no metadata from it).
    """
    if ckpt_cfg.non_persistent_ckpt_type == "global":
        return _load_global_dist_base_checkpoint(
            non_persistent_global_dir,
            ckpt_cfg,
            rank0,
            sharded_state_dict,
            non_persistent_iteration,
            False,
            checkpointing_context=checkpointing_context,
            pg_collection=pg_collection,
        )
    if ckpt_cfg.non_persistent_ckpt_type != "local":
        raise ValueError(
            f"Please use local or global non-persistent checkpoints. Got: {ckpt_cfg.non_persistent_ckpt_type}"
        )
    if rank0:
        return {}, non_persistent_iteration, False, CheckpointType.LOCAL
    intermediate, name = checkpointing_context["local_checkpoint_manager"].load()
    group = pg_collection.dp_cp if pg_collection is not None else _process_groups().dp_cp
    state_dict = intermediate.to_state_dict(
        sharded_state_dict, algo=ckpt_cfg.non_persistent_local_ckpt_algo, parallelization_group=group
    )
    return state_dict, name, False, CheckpointType.LOCAL


def _load_base_checkpoint(
    load_dir: Optional[str],
    ckpt_cfg: CheckpointConfig,
    rank0: bool = False,
    sharded_state_dict: Optional[dict[str, Any]] = None,
    checkpointing_context: Optional[dict[str, Any]] = None,
    ignore_ckpt_step: bool = False,
    cfg: Any = None,
    *,
    pg_collection: Any = None,
) -> tuple[Optional[dict[str, Any]], Any, bool, Optional["CheckpointType"]]:
    """Read the checkpoint of ``load_dir`` that :func:`_resolve_checkpoint_iteration` picks.

    Its common part (``rank0``), or ``sharded_state_dict`` filled; a newer non-persistent checkpoint wins when
    ``ckpt_step`` is unset. :class:`CheckpointManager` passes the directory of the checkpoint it verified (a direct
    iteration directory), so the files read are the ones checked against the manifest. Returns
    ``(state_dict, checkpoint name, release, CheckpointType)``; ``(None, "", False, None)`` when there is none.

    Raises:
        TrainingExit: ``NO_VALID_CHECKPOINT`` when there is none and ``exit_on_missing_checkpoint`` is set.
        NotImplementedError: the checkpoint is not ``torch_dist``, or not in the configured format.
    """
    step = None if ignore_ckpt_step else ckpt_cfg.ckpt_step
    iteration, release = _resolve_checkpoint_iteration(load_dir, step)
    if iteration == _DIRECT_ITERATION_DIR_SENTINEL:
        checkpoint_format = _get_checkpoint_format(load_dir)
        if checkpoint_format != "torch_dist":
            raise NotImplementedError(f"Checkpoint format {checkpoint_format} not supported")
        return _load_global_dist_base_checkpoint(
            load_dir,
            ckpt_cfg,
            rank0,
            sharded_state_dict,
            None,
            False,
            checkpoint_path_override=load_dir,
            checkpointing_context=checkpointing_context,
            pg_collection=pg_collection,
        )
    non_persistent_dir, non_persistent_iteration = "", -1
    if step is None and ckpt_cfg.non_persistent_ckpt_type in _NON_PERSISTENT_TYPES:
        if ckpt_cfg.non_persistent_ckpt_type == "global":
            non_persistent_dir = ckpt_cfg.non_persistent_global_ckpt_dir or os.path.join(
                ckpt_cfg.save or load_dir or "", "non_persistent"
            )
        non_persistent_iteration = _get_non_persistent_iteration(
            non_persistent_dir, ckpt_cfg.non_persistent_ckpt_type, checkpointing_context
        )
    if non_persistent_iteration != -1 and non_persistent_iteration >= iteration:
        return _load_non_persistent_base_checkpoint(
            non_persistent_dir,
            ckpt_cfg,
            rank0,
            sharded_state_dict,
            non_persistent_iteration,
            checkpointing_context,
            cfg,
            pg_collection=pg_collection,
        )
    if iteration == -1:
        if ckpt_cfg.exit_on_missing_checkpoint:
            raise TrainingExit(
                ExitCode.NO_VALID_CHECKPOINT,
                missing_checkpoint("checkpoint.load", str(load_dir), bool(load_dir) and os.path.isdir(load_dir)),
            )
        print_rank_0(f"WARNING: no checkpoint tracker in {load_dir}; not loading a checkpoint, training from scratch")
        return None, "", False, None
    checkpoint_path = get_checkpoint_name(load_dir, iteration, release)
    checkpoint_format = _get_checkpoint_format(checkpoint_path)
    if checkpoint_format != ckpt_cfg.ckpt_format or checkpoint_format != "torch_dist":
        raise NotImplementedError(
            f"{checkpoint_path} is a {checkpoint_format} checkpoint; checkpoint.ckpt_format={ckpt_cfg.ckpt_format} "
            "and this package reads torch_dist checkpoints only"
        )
    return _load_global_dist_base_checkpoint(
        load_dir,
        ckpt_cfg,
        rank0,
        sharded_state_dict,
        iteration,
        release,
        checkpointing_context=checkpointing_context,
        pg_collection=pg_collection,
    )


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
        on_saved: called ``(directory, tier, iteration, finalize_seconds)`` on every rank once a checkpoint is
            committed; ``finalize_seconds``: the loop's time so far in the finalize committing an async save (``None``
            for a synchronous save).
        run_config: the run's whole config (``ConfigContainer``), saved as ``run_config.yaml`` into every global
            checkpoint (Megatron-Bridge's layout); ``None`` leaves the file out.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        common_extra: Optional[dict[str, Callable[[], Any]]] = None,
        on_saved: Optional[Callable[[str, CheckpointType, int, Optional[float]], None]] = None,
        run_config: Any = None,
    ) -> None:
        self.cfg = cfg
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
        progress = state.state_dict()  # train_state.pt holds the state of this step, not of the async commit's
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
                self._commit(iteration, attempt, progress)
        except StorageGuard.SAVE_ERRORS as err:
            if not self.storage.save_failed(err, GLOBAL, iteration, tmp):  # full or unavailable: stops, or goes on
                raise
            return self._keep_in_local_tier(model, optimizer, scheduler, state)
        if self._queue is None:
            what = "saved checkpoint"
        else:
            if request.async_fn is not None:  # None when this rank has nothing to write
                request = request._replace(async_fn=async_writer.writer(request.async_fn, tmp, rank(), iteration))
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
        self._on_saved(layout.iter_dir(root, iteration), CheckpointType.GLOBAL, iteration, self._in_finalize())

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
        self._on_saved(self.cfg.non_persistent_local_ckpt_dir, CheckpointType.LOCAL, iteration, self._in_finalize())

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
        return get_rng_state(False, "torch_dist", pg_collection=_process_groups()).data[0]

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
        try:
            done = self._queue.maybe_finalize_async_calls(blocking=blocking, no_dist=no_dist)
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
        common, *_ = _load_base_checkpoint(ckpt_dir, self.cfg, rank0=True, checkpointing_context=context)
        if not contents.written_here(common):
            return self._load_foreign(ckpt_dir, common, model, optimizer, scheduler, state)
        sharded_sd = self._state_dict_to_load(common, model, optimizer, scheduler, state)
        loaded, *_ = _load_base_checkpoint(
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

        saved = {}
        if file_exists(get_checkpoint_run_config_filename(ckpt_dir)):
            saved = (read_run_config(get_checkpoint_run_config_filename(ckpt_dir)) or {}).get("checkpoint") or {}
        if not saved.get("save_optim", True):
            raise TrainingExit(
                ExitCode.NO_VALID_CHECKPOINT,
                f"{ckpt_dir} was saved without its optimizer state (checkpoint.save_optim=false in its "
                "run_config.yaml): a run cannot resume from it; start a new run from its weights instead",
            )
        metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
        if metadata is None:
            distributed = optimizer_state.optimizer_metadata(model) is not None
            metadata = _build_sharded_state_dict_metadata(distributed, self.cfg)
        optimizer_state.prime_for_loading(optimizer)
        rng = get_rng_state(False, self.cfg.ckpt_format, pg_collection=_process_groups())
        sharded_sd = generate_state_dict(
            self.cfg,
            [unwrap(chunk) for chunk in model],
            optimizer,
            scheduler,
            rng if saved.get("save_rng", True) else None,
            optim_sd_kwargs={"is_loading": True, "metadata": metadata},
            model_sd_kwargs={"metadata": metadata},
        )
        context = self.checkpointing_context
        loaded, *_ = _load_base_checkpoint(
            ckpt_dir, self.cfg, rank0=False, sharded_state_dict=sharded_sd, checkpointing_context=context
        )
        train_state_file = get_checkpoint_train_state_filename(ckpt_dir)
        if file_exists(train_state_file):
            progress = read_train_state(train_state_file)
        else:
            progress = _get_train_state_from_state_dict(common)
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
        progress = TrainState()
        progress.load_state_dict(loaded["train_state"])
        self.skipped_restores = fault_injection.skipped_restores(rank(), progress.step)
        self.loaded_rank_extra = contents.apply_loaded(
            loaded, model, optimizer, scheduler, state, skip=self.skipped_restores, load_model=_load_model_state_dict
        )


# ---------------------------------------------------------------------- Megatron-Bridge's save/load entry points


def _manager_of(state: Any, checkpointing_context: Optional[dict[str, Any]]) -> CheckpointManager:
    """The :class:`CheckpointManager` of ``checkpointing_context`` (``checkpoint_manager``), created on first use.

    A new manager registers itself and its context entries in ``checkpointing_context`` and its async queue as
    ``state.async_calls_queue``. Without a context every call builds a new manager: pass one per run.
    """
    context = {} if checkpointing_context is None else checkpointing_context
    manager = context.get("checkpoint_manager")
    if manager is None:
        manager = CheckpointManager(state.cfg.checkpoint, run_config=state.cfg)
        context.update(manager.checkpointing_context)
        manager.checkpointing_context = context
        state.async_calls_queue = manager.async_queue
    return manager


def save_checkpoint(
    state: Any,
    model: list[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    num_floating_point_operations_so_far: int,
    checkpointing_context: Optional[dict[str, Any]] = None,
    pg_collection: Any = None,
    non_persistent_ckpt: bool = False,
    train_data_iterator: Any = None,
    callback_manager: Any = None,
    module_name: Optional[str] = None,
) -> None:
    """Save a checkpoint of ``state.train_state`` at its step: Megatron-Bridge's entry point to the run's manager.

    Global (``checkpoint.save``, atomic commit, manifest, retention) or, with ``non_persistent_ckpt``, the local
    tier. ``num_floating_point_operations_so_far`` is stored in the train state. The data position is the train
    state's consumed samples (``train_data_iterator`` is not read); ``callback_manager``, ``pg_collection`` and
    ``module_name`` are accepted for Megatron-Bridge's signature (saves are reported through the manager's
    ``on_saved``).

    Raises:
        ValueError: ``non_persistent_ckpt`` with a ``non_persistent_ckpt_type`` other than ``local`` or ``global``,
            or without the local tier configured (this package has no global non-persistent tier).
    """
    kind = state.cfg.checkpoint.non_persistent_ckpt_type
    if non_persistent_ckpt and kind not in _NON_PERSISTENT_TYPES:
        raise ValueError(f"Invalid non_persistent_ckpt_type: {kind!r}. Must be 'local' or 'global'.")
    manager = _manager_of(state, checkpointing_context)
    if non_persistent_ckpt and manager.local is None:
        raise ValueError(
            f"non_persistent_ckpt_type={kind!r}: this package keeps non-persistent checkpoints in the local tier "
            "only; set checkpoint.non_persistent_ckpt_type='local' and checkpoint.non_persistent_local_ckpt_dir"
        )
    state.train_state.floating_point_operations_so_far = num_floating_point_operations_so_far
    if non_persistent_ckpt:
        manager.save_local(model, optimizer, opt_param_scheduler, state.train_state)
    else:
        manager.save(model, optimizer, opt_param_scheduler, state.train_state)


def load_checkpoint(
    state: Any,
    model: list[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    strict: bool = True,
    checkpointing_context: Optional[dict[str, Any]] = None,
    skip_load_to_model_and_opt: bool = False,
    pg_collection: Any = None,
    module_name: Optional[str] = None,
) -> tuple[int, int]:
    """Load the newest valid checkpoint into the run: Megatron-Bridge's entry point to the run's manager.

    Returns ``(iteration, floating point operations so far)``; ``(0, 0)`` when there was none to load.
    """
    return _load_checkpoint_from_path(
        state.cfg.checkpoint.load,
        state,
        model,
        optimizer,
        opt_param_scheduler,
        strict,
        checkpointing_context,
        skip_load_to_model_and_opt=skip_load_to_model_and_opt,
        pg_collection=pg_collection,
        module_name=module_name,
    )


def _load_checkpoint_from_path(
    load_dir: Optional[str],
    state: Any,
    model: list[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    strict: bool = True,
    checkpointing_context: Optional[dict[str, Any]] = None,
    skip_load_to_model_and_opt: bool = False,
    ignore_ckpt_step: bool = False,
    pg_collection: Any = None,
    module_name: Optional[str] = None,
) -> tuple[int, int]:
    """Load from ``load_dir`` (the run's ``checkpoint.load``) through the run's :class:`CheckpointManager`.

    The manager picks the directory (``checkpoint.load``, else ``checkpoint.save``: ``checkpoint/resume.py``),
    verifies the checkpoint against its manifest and falls back to an older one, or takes a newer local-tier one.

    Raises:
        ValueError: ``load_dir`` is not the run's ``checkpoint.load``, ``strict=False``, or
            ``skip_load_to_model_and_opt``: this package restores whole checkpoints strictly (a model or optimizer
            left partly unrestored must not train on silently).
    """
    cfg = state.cfg.checkpoint
    if load_dir != cfg.load:
        raise ValueError(f"this package resumes from checkpoint.load ({cfg.load}) only, not from {load_dir}")
    if not strict or skip_load_to_model_and_opt:
        raise ValueError(
            "this package restores a checkpoint's model, optimizer and scheduler strictly; "
            f"strict={strict} and skip_load_to_model_and_opt={skip_load_to_model_and_opt} are not supported"
        )
    manager = _manager_of(state, checkpointing_context)
    if manager.load(model, optimizer, opt_param_scheduler, state.train_state) is None:
        return 0, 0
    return state.train_state.step, state.train_state.floating_point_operations_so_far


class DefaultCheckpointManager:
    """Megatron-Bridge's default pluggable checkpoint manager.

    :func:`save_checkpoint`, :func:`load_checkpoint` and :func:`maybe_finalize_async_save` over one checkpointing
    context, which holds the run's :class:`CheckpointManager` once the first save or load ran.
    """

    def __init__(self, checkpoint_config: CheckpointConfig) -> None:
        self.checkpoint_config = checkpoint_config
        self._context: dict[str, Any] = init_checkpointing_context(checkpoint_config)

    @property
    def checkpointing_context(self) -> dict[str, Any]:
        """The context passed to every save and load (see :func:`init_checkpointing_context`)."""
        return self._context

    def save(self, ctx: CheckpointSaveContext, callback_manager: Any) -> None:
        """Save with :func:`save_checkpoint`."""
        save_checkpoint(
            state=ctx.state,
            model=ctx.model,
            optimizer=ctx.optimizer,
            opt_param_scheduler=ctx.opt_param_scheduler,
            num_floating_point_operations_so_far=ctx.num_floating_point_operations_so_far,
            checkpointing_context=self._context,
            non_persistent_ckpt=ctx.non_persistent_ckpt,
            train_data_iterator=ctx.train_data_iterator,
            pg_collection=ctx.pg_collection,
            callback_manager=callback_manager,
            module_name=ctx.module_name,
        )

    def load(self, ctx: CheckpointLoadContext) -> tuple[int, int]:
        """Load with :func:`load_checkpoint`; ``(iteration, floating point operations so far)``."""
        return load_checkpoint(
            state=ctx.state,
            model=ctx.model,
            optimizer=ctx.optimizer,
            opt_param_scheduler=ctx.opt_param_scheduler,
            strict=ctx.strict,
            checkpointing_context=self._context,
            skip_load_to_model_and_opt=ctx.skip_load_to_model_and_opt,
            pg_collection=ctx.pg_collection,
            module_name=ctx.module_name,
        )

    def finalize_async_saves(self, state: Any, blocking: bool = False, terminate: bool = False) -> None:
        """Commit the finished asynchronous saves (all of them: ``blocking``) with :func:`maybe_finalize_async_save`."""
        maybe_finalize_async_save(
            global_state=state, ckpt_cfg=self.checkpoint_config, blocking=blocking, terminate=terminate
        )


def create_checkpoint_manager(checkpoint_config: CheckpointConfig) -> DefaultCheckpointManager:
    """The checkpoint manager for ``checkpoint_config``: a :class:`DefaultCheckpointManager`.

    Megatron-Bridge's ``checkpoint.custom_manager_class`` (a class imported by name from the config) is not
    offered by this package: its managers are this module's.
    """
    return DefaultCheckpointManager(checkpoint_config)
