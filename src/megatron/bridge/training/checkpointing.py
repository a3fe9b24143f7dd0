"""Megatron-Bridge's checkpoint API: save/load entry points, RNG states, tracker reading, checkpoint readers.

This module keeps Megatron-Bridge's names (users and Megatron-Bridge's tests import and patch them here):
:func:`save_checkpoint`, :func:`load_checkpoint`, :func:`get_rng_state`, :func:`read_metadata`,
:func:`_load_base_checkpoint` and the readers it dispatches to, :class:`CheckpointType`; re-exported: the
state-dict builders (``checkpoint/state_dict.py``) and the path helpers of ``utils/checkpoint_utils.py``.

The run's own machinery lives in ``checkpoint/``: :class:`CheckpointManager` (``checkpoint/manager.py``, re-exported
here) saves with an atomic, verified commit (``checkpoint/saving.py``) and resumes from the newest checkpoint that
verifies, falling back to older ones and taking a newer local-tier one (``checkpoint/loading.py``). The manager is
built on this module's functions, which it is given (``api=``: this module, never imported by ``checkpoint/``, so no
import circle) and looks up at each call (a patch here reaches it); :func:`save_checkpoint` / :func:`load_checkpoint`
drive the same manager the training loop uses, and :class:`DefaultCheckpointManager` is Megatron-Bridge's pluggable
manager over them (``checkpoint/pluggable.py``).
"""

import enum
import os
import random
import sys
from typing import Any, Literal, Optional

import numpy as np
import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from megatron.core.utils import get_pg_size

from megatron.bridge.training.checkpoint.contexts import (  # noqa: F401 - Megatron-Bridge's names, re-exported
    CheckpointLoadContext,
    CheckpointSaveContext,
)
from megatron.bridge.training.checkpoint.discovery import (  # noqa: F401 - Megatron-Bridge's names, re-exported
    _get_checkpoint_format,
    _has_global_non_persistent_checkpoint,
    cleanup_old_non_persistent_checkpoint,
)
from megatron.bridge.training.checkpoint.manager import CheckpointManager
from megatron.bridge.training.checkpoint.pluggable import FunctionCheckpointManager
from megatron.bridge.training.checkpoint.state_dict import (  # noqa: F401 - Megatron-Bridge's names, re-exported
    _build_sharded_state_dict_metadata,
    _generate_model_state_dict,
    _get_train_state_from_state_dict,
    _is_model_section,
    delete_extra_state,
    generate_state_dict,
)
from megatron.bridge.training.checkpoint.storage_guard import missing_checkpoint
from megatron.bridge.training.config import CheckpointConfig
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
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
from megatron.bridge.training.utils.pg_utils import checkpoint_process_groups
from megatron.bridge.utils.common_utils import print_rank_0
from megatron.bridge.utils.cpu_shims import training_on_cpu

try:
    import nvidia_resiliency_ext.checkpointing  # noqa: F401

    HAVE_RESIL = True
except ImportError:
    HAVE_RESIL = False


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
        group = pg_collection.dp_cp if pg_collection is not None else checkpoint_process_groups().dp_cp
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
    group = pg_collection.dp_cp if pg_collection is not None else checkpoint_process_groups().dp_cp
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


# ---------------------------------------------------------------------- Megatron-Bridge's save/load entry points


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
    manager = CheckpointManager.for_run(state, checkpointing_context, api=sys.modules[__name__])
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
    manager = CheckpointManager.for_run(state, checkpointing_context, api=sys.modules[__name__])
    if manager.load(model, optimizer, opt_param_scheduler, state.train_state) is None:
        return 0, 0
    return state.train_state.step, state.train_state.floating_point_operations_so_far


class DefaultCheckpointManager(FunctionCheckpointManager):
    """Megatron-Bridge's default pluggable checkpoint manager: this module's save and load functions."""

    def __init__(self, checkpoint_config: CheckpointConfig) -> None:
        super().__init__(checkpoint_config, api=sys.modules[__name__])


def create_checkpoint_manager(checkpoint_config: CheckpointConfig) -> DefaultCheckpointManager:
    """The checkpoint manager for ``checkpoint_config``: a :class:`DefaultCheckpointManager`.

    Megatron-Bridge's ``checkpoint.custom_manager_class`` (a class imported by name from the config) is not offered.
    """
    return DefaultCheckpointManager(checkpoint_config)
