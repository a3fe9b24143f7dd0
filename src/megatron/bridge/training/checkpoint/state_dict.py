"""The state dict of a checkpoint, in Megatron-Bridge's function API: what goes in it and how it is read back.

Failure handled: a checkpoint whose parts disagree with the run that loads it. The same function
(:func:`generate_state_dict`) builds the dict for saving and the scaffold for loading, so model, optimizer, scheduler
and RNG entries carry the same keys and sharding metadata both ways; the optimizer and RNG scaffolds are built for a
load even when the config would not save them (a missing scaffold made a load silently skip those parts).
``checkpoint/contents.py`` adds this project's entries (train state, per-rank RNG blob, extras) on top.
"""

from collections.abc import MutableMapping
from typing import Any, Optional

import torch

from megatron.bridge.training.config import CheckpointConfig
from megatron.bridge.training.state import TrainState

MODEL_SECTION = "model"
"""Key of the model's state for one model chunk; ``model0``, ``model1``, ... with virtual pipeline chunks."""


def model_section_keys(count: int) -> list[str]:
    """The keys of ``count`` model chunks in a state dict."""
    return [MODEL_SECTION] if count == 1 else [f"{MODEL_SECTION}{index}" for index in range(count)]


def _is_model_section(section_key: str) -> bool:
    """Whether ``section_key`` names a model chunk's section (``model``, ``model0``, ``model1``, ...)."""
    suffix = section_key[len(MODEL_SECTION) :]
    return section_key.startswith(MODEL_SECTION) and (suffix == "" or suffix.isdigit())


def _generate_model_state_dict(
    model: list[torch.nn.Module],
    model_sd_kwargs: Optional[dict[str, Any]] = None,
    ckpt_format: str = "torch_dist",
    *,
    pg_collection: Any = None,
) -> dict[str, Any]:
    """The model sections of a checkpoint: sharded state dicts for ``torch_dist``, plain ones for other formats."""
    sections = {}
    for key, chunk in zip(model_section_keys(len(model)), model):
        if ckpt_format == "torch_dist":
            sections[key] = chunk.sharded_state_dict(**(model_sd_kwargs or {}))
        else:
            sections[key] = chunk.state_dict_for_save_checkpoint()
    return sections


def generate_state_dict(
    ckpt_cfg: CheckpointConfig,
    model: list[torch.nn.Module],
    optimizer: Optional[Any],
    opt_param_scheduler: Optional[Any],
    rng_state: Optional[Any],
    iteration: Optional[int] = None,
    optim_sd_kwargs: Optional[dict[str, Any]] = None,
    model_sd_kwargs: Optional[dict[str, Any]] = None,
    rerun_state: Optional[dict[str, Any]] = None,
    *,
    pg_collection: Any = None,
) -> dict[str, Any]:
    """The state dict of a checkpoint (to save), or the scaffold to load one into (``optim_sd_kwargs["is_loading"]``).

    Args:
        ckpt_cfg: ``ckpt_format``, ``save_optim`` and ``save_rng`` are read.
        model: the model chunks (unwrapped modules with ``sharded_state_dict``).
        optimizer: its sharded state is included when saving with ``save_optim`` and always when loading; a stub
            optimizer (``is_stub_optimizer``) or ``None`` contributes nothing.
        opt_param_scheduler: its state goes with the optimizer's.
        rng_state: included with ``save_rng``, and when loading whenever given.
        iteration: stored as ``iteration`` when given.
        optim_sd_kwargs: keyword arguments of ``optimizer.sharded_state_dict`` (``is_loading``, ``metadata``).
        model_sd_kwargs: keyword arguments of each chunk's ``sharded_state_dict``.
        rerun_state: the re-run state machine's state, stored as ``rerun_state_machine`` when given.
        pg_collection: the process groups (accepted for Megatron-Bridge's signature).
    """
    state_dict: dict[str, Any] = {"checkpoint_version": 3.0}
    if iteration is not None:
        state_dict["iteration"] = iteration
    state_dict.update(
        _generate_model_state_dict(model, model_sd_kwargs, ckpt_cfg.ckpt_format, pg_collection=pg_collection)
    )
    optim_kwargs = dict(optim_sd_kwargs or {})
    is_loading = bool(optim_kwargs.get("is_loading"))
    if ckpt_cfg.save_optim or is_loading:
        if optimizer is not None and not getattr(optimizer, "is_stub_optimizer", False):
            if ckpt_cfg.ckpt_format == "torch_dist":
                state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, **optim_kwargs)
            elif ckpt_cfg.ckpt_format == "fsdp_dtensor":
                optim_kwargs.setdefault("metadata", {})
                state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, **optim_kwargs)
            else:
                state_dict["optimizer"] = optimizer.state_dict()
        if opt_param_scheduler is not None:
            state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rerun_state is not None:
        state_dict["rerun_state_machine"] = rerun_state
    if ckpt_cfg.save_rng or (is_loading and rng_state is not None):
        state_dict["rng_state"] = rng_state
    return state_dict


def delete_extra_state(state_dict: Any) -> Any:
    """Drop every ``*_extra_state*`` key of a model state dict (a whole checkpoint's ``model`` section, or one).

    Transformer Engine's extra states change format between releases; without them a model loads non-strictly.
    Anything that is not a mapping is returned untouched.
    """
    target = state_dict[MODEL_SECTION] if isinstance(state_dict, dict) and MODEL_SECTION in state_dict else state_dict
    if not isinstance(target, MutableMapping):
        return state_dict
    for key in [k for k in target.keys() if isinstance(k, str) and "_extra_state" in k]:
        del target[key]
    return state_dict


def _build_sharded_state_dict_metadata(use_distributed_optimizer: bool, cfg: CheckpointConfig) -> dict[str, Any]:
    """Flags telling the model and optimizer how to lay out their sharded state dicts (saved with the checkpoint).

    The distributed optimizer writes ``dp_reshardable`` shards (each data-parallel rank its own, no gather on save),
    or ``fsdp_dtensor`` ones for that format; a chained optimizer keeps unprefixed keys.
    """
    metadata: dict[str, Any] = {}
    if use_distributed_optimizer:
        if cfg.ckpt_format == "fsdp_dtensor":
            metadata["distrib_optim_sharding_type"] = "fsdp_dtensor"
        elif getattr(cfg, "dist_ckpt_optim_fully_reshardable", False):
            metadata["distrib_optim_sharding_type"] = "fully_reshardable"
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = getattr(
                cfg, "distrib_optim_fully_reshardable_mem_efficient", False
            )
        else:
            metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    return metadata


def _get_train_state_from_state_dict(state_dict: dict[str, Any]) -> TrainState:
    """The train state of a Megatron-LM checkpoint: ``iteration``, the sample counters of ``args``, the FLOPs."""
    args = state_dict.get("args")
    return TrainState(
        step=state_dict.get("iteration", 0),
        consumed_train_samples=getattr(args, "consumed_train_samples", 0) if args is not None else 0,
        skipped_train_samples=getattr(args, "skipped_train_samples", 0) if args is not None else 0,
        consumed_valid_samples=getattr(args, "consumed_valid_samples", 0) if args is not None else 0,
        floating_point_operations_so_far=state_dict.get("num_floating_point_operations_so_far", 0),
        do_train=False,
        do_valid=False,
        do_test=False,
    )


def safe_rng_state(generator_states: dict[str, Any]) -> dict[str, Any]:
    """One rank's ``checkpointing.get_rng_state`` states as tensors and plain values (``checkpoint/rng.py``'s form).

    That form loads with ``torch.load(weights_only=True)``: a checkpoint's RNG states never unpickle arbitrary
    objects. The CUDA state is kept when it was collected.
    """
    py_version, py_state, py_gauss = generator_states["random_rng_state"]
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = generator_states["np_rng_state"]
    state = {
        "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": py_gauss},
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype("int64")),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": generator_states["torch_rng_state"],
        "tracker": dict(generator_states["rng_tracker_states"]),
    }
    if "cuda_rng_state" in generator_states:
        state["cuda"] = generator_states["cuda_rng_state"]
    return state
