"""What a checkpoint holds, in either tier, and how a loaded one is put back into the run.

The model chunks, the optimizer and scheduler states, the train state (iteration, consumed samples), every rank's
RNG states and a per-rank extra (plain values, e.g. the re-run state machine's state): all a resumed run needs to
continue bit-identically. The sharded state dict is built the same way for saving and for loading, so both tiers
(``saving.py`` and ``loading.py``, ``local_tier.py``) agree on it.
"""

import os
from collections.abc import Callable, Collection
from typing import Any, Optional

import torch

from megatron.bridge.models.distributed import unwrap
from megatron.bridge.training.checkpoint import manifest, optimizer_state
from megatron.bridge.training.checkpoint.rng import (
    get_rng_state,
    restore_rng_state,
    rng_blob_length,
    rng_blob_to_tensor,
    rng_state_from_tensor,
    serialize_rng_state,
    set_rng_state,
)
from megatron.bridge.training.checkpoint.state_dict import generate_state_dict, safe_rng_state
from megatron.bridge.training.config import CheckpointConfig
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.training.state import TrainState
from megatron.bridge.utils.cpu_shims import training_on_cpu
from megatron.bridge.utils.dist import all_gather_object, rank, world_size

CHECKPOINT_VERSION = 1

WRITER_KEY = "megatron_bridge_resiliency"
"""Entry of the common part that marks a checkpoint this package wrote (its value: :data:`CHECKPOINT_VERSION`).

A checkpoint of ours without its manifest is damaged (refused); one without the entry was written elsewhere
(Megatron-Bridge, a conversion tool) and carries no manifest by design (see :func:`written_here`)."""
_OWN_LAYOUT_KEY = "rng_bytes"
"""Common entry every checkpoint of this package has had, from before :data:`WRITER_KEY` existed."""

RANK_EXTRA_KEY = "rank_extra"
"""Key of the per-rank extra state inside the per-rank RNG blob."""


PARALLEL_LAYOUT_KEY = "parallel_layout"
"""Entry of the common part: the model-parallel layout the checkpoint was saved under (:func:`parallel_layout`)."""

_MODEL_PARALLEL = (
    ("tensor_model_parallel_size", "model.tensor_model_parallel_size"),
    ("pipeline_model_parallel_size", "model.pipeline_model_parallel_size"),
    ("model_chunks", "model.virtual_pipeline_model_parallel_size"),
)


def parallel_layout(model: list[torch.nn.Module]) -> dict[str, Any]:
    """The model-parallel sizes of this run and whether its optimizer is distributed (what a checkpoint records)."""
    from megatron.core import parallel_state

    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "model_chunks": len(model),
        "distributed_optimizer": optimizer_state.optimizer_metadata(model) is not None,
    }


def layout_refusal(saved: Any, current: dict[str, Any], ckpt_dir: str) -> Optional[str]:
    """Why the checkpoint saved under layout ``saved`` cannot be loaded into a run of layout ``current`` (or ``None``).

    The distributed optimizer's state is saved in megatron-core's ``dp_reshardable`` form (``optimizer_state.py``):
    its buffers, laid out by the model-parallel sizes, which megatron-core reshards along the data-parallel dimension
    only. A checkpoint of it is loaded at any data-parallel size (an elastic shrink) but not under other tensor or
    pipeline sizes: refused, naming what changed. Without the distributed optimizer nothing is refused here (model
    weights and a per-parameter optimizer state are saved with their global shapes); nor for a checkpoint that
    recorded no layout (written before it was recorded).
    """
    if not isinstance(saved, dict) or not saved.get("distributed_optimizer"):
        return None
    changed = [
        f"{field} {saved.get(key)} in the checkpoint, {current[key]} now"
        for key, field in _MODEL_PARALLEL
        if key in saved and saved[key] != current[key]
    ]
    if not changed:
        return None
    return (
        f"{ckpt_dir} was saved with the distributed optimizer under another model-parallel layout ("
        f"{'; '.join(changed)}): its optimizer state can be resharded across data-parallel ranks only (a shrink or "
        "growth of the data-parallel size), not across tensor or pipeline ranks. Fix: resume with the checkpoint's "
        "model-parallel sizes (only the number of nodes may change), or start a new run from its weights"
    )


def model_state_keys(model: list[torch.nn.Module]) -> list[str]:
    """Checkpoint keys of the model chunks: ``model`` for one chunk, ``model0``, ``model1``, ... when interleaved."""
    return ["model"] if len(model) == 1 else [f"model{index}" for index in range(len(model))]


def sharded_state_dict(
    model: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    state: TrainState,
    rng_bytes: Optional[int] = None,
    rank_extra: Optional[dict] = None,
    common_extra: Optional[dict[str, Any]] = None,
    ckpt_cfg: Optional[CheckpointConfig] = None,
    generator_states: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """What a checkpoint holds; ``rng_bytes`` is ``None`` when saving and the stored blob length when loading.

    Model, optimizer, scheduler and RNG entries come from Megatron-Bridge's ``generate_state_dict`` (``ckpt_cfg``:
    the run's checkpoint config; defaults when ``None``). ``generator_states``: this rank's generator states as
    ``checkpointing.get_rng_state`` collects them (collected here when ``None``).

    RNG states differ per rank, so each rank stores its own as one row of a ``(world, rng_bytes)`` uint8 tensor
    (a tensor, unlike a pickled object, loads without unpickling arbitrary code). ``rank_extra`` (plain values, per
    rank) travels in the same row. ``common_extra``: more top-level entries of plain values for the common part
    (e.g. goodput accounting). Saving gathers the blob lengths from every rank (a collective).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    is_loading = rng_bytes is not None
    if is_loading:
        rng_row = torch.zeros(rng_bytes, dtype=torch.uint8)
    else:
        generators = get_rng_state() if generator_states is None else safe_rng_state(generator_states)
        payload = serialize_rng_state({**generators, RANK_EXTRA_KEY: rank_extra})
        rng_bytes = max(all_gather_object(rng_blob_length(payload)))
        rng_row = rng_blob_to_tensor(payload, rng_bytes)
    if is_loading:
        optimizer_state.prime_for_loading(optimizer)
    parts = generate_state_dict(
        ckpt_cfg if ckpt_cfg is not None else CheckpointConfig(),
        [unwrap(chunk) for chunk in model],
        optimizer,
        scheduler,
        ShardedTensor.from_rank_offsets("rng_state", rng_row.unsqueeze(0), (0, rank(), world_size()), replica_id=0),
        optim_sd_kwargs={"is_loading": is_loading, "metadata": optimizer_state.optimizer_metadata(model)},
    )
    return {
        **(common_extra or {}),
        **parts,
        "checkpoint_version": CHECKPOINT_VERSION,  # this package's layout, not Megatron-LM's 3.0
        WRITER_KEY: CHECKPOINT_VERSION,
        "train_state": state.state_dict(),
        "rng_bytes": rng_bytes,
        "rng_world_size": world_size(),
        PARALLEL_LAYOUT_KEY: parallel_layout(model),
    }


def written_here(common: dict[str, Any]) -> bool:
    """Whether the checkpoint whose common part is ``common`` was written by this package (either tier)."""
    return WRITER_KEY in common or _OWN_LAYOUT_KEY in common


def foreign_without_manifest(ckpt_dir: str) -> Optional[str]:
    """Why ``ckpt_dir`` is loaded unverified, or ``None`` when it is verified (or refused) as usual.

    Unverified: it has no manifest and was written elsewhere (Megatron-Bridge, a conversion tool). ``None``: it has
    a manifest, or was written by this package (without its manifest it is damaged), or its common part is
    unreadable. Runs on one rank.
    """
    from megatron.core import dist_checkpointing

    if os.path.exists(os.path.join(ckpt_dir, manifest.MANIFEST_NAME)):
        return None
    try:
        common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    except Exception:  # noqa: BLE001 - unreadable: verification reports the missing manifest
        return None
    if written_here(common):
        return None
    files = manifest.list_files(ckpt_dir)
    return (
        f"checkpoint {ckpt_dir} was not written by this package and has no {manifest.MANIFEST_NAME}: the sizes and "
        f"SHA-256 hashes of its {len(files)} files ({', '.join(files[:6])}{', ...' if len(files) > 6 else ''}) "
        "cannot be verified, so a truncated or corrupted file is not detected before the load; loading it unverified"
    )


def apply_loaded(
    loaded: dict[str, Any],
    model: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    state: TrainState,
    skip: Collection[str] = (),
    load_model: Optional[Callable[[torch.nn.Module, dict, bool], None]] = None,
) -> Optional[dict]:
    """Put a loaded checkpoint into the run; return this rank's extra state (``None`` when RNG states were not loaded).

    ``load_model(module, state_dict, strict)`` loads each model chunk (strictly); ``module.load_state_dict`` when
    ``None``.

    ``skip``: parts left as they are, on purpose (fault injection's ``no-<part>-restore`` kinds): ``"optimizer"``,
    ``"rng"`` (the generators; the extra state is restored).

    Raises:
        TrainingExit: ``CONFIG_ERROR`` when the config's learning-rate schedule differs from the checkpoint's and
            neither scheduler override is set.
    """
    for key, chunk in zip(model_state_keys(model), model):
        if load_model is None:
            unwrap(chunk).load_state_dict(loaded[key], strict=True)
        else:
            load_model(unwrap(chunk), loaded[key], True)
    if "optimizer" not in skip:
        with torch.no_grad():  # fp32 parameters are the distributed optimizer's main params: views of model leaves
            optimizer.load_state_dict(loaded["optimizer"])
        optimizer_state.after_loading(optimizer)
    try:
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    except AssertionError as err:  # megatron-core: the config's schedule differs from the checkpoint's
        raise TrainingExit(
            ExitCode.CONFIG_ERROR,
            f"scheduler: {err}; set scheduler.use_checkpoint_opt_param_scheduler=True to keep the checkpoint's "
            "schedule, or scheduler.override_opt_param_scheduler=True to use the config's",
        ) from None
    state.load_state_dict(loaded["train_state"])
    if "rng_state" not in loaded:
        return None
    blob = rng_state_from_tensor(loaded["rng_state"][0])
    extra = blob.pop(RANK_EXTRA_KEY, None)
    if "rng" not in skip:
        set_rng_state(blob)
    return extra


def apply_foreign_loaded(
    loaded: dict[str, Any],
    train_state: TrainState,
    model: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    state: TrainState,
    data_parallel_rank: int,
    skip: Collection[str] = (),
) -> None:
    """Put a loaded checkpoint written elsewhere (Megatron-Bridge's content) into the run.

    Model, optimizer and scheduler sections have the keys of ours; the train state comes from the checkpoint's
    ``train_state.pt`` (``train_state``); the RNG states are Megatron-Bridge's ``rng_state`` object: one dict of
    generator states per data-parallel rank, or one for all (``data_parallel_random_init`` off). ``skip`` as in
    :func:`apply_loaded`.
    """
    rng = loaded.get("rng_state")
    apply_loaded(
        {key: value for key, value in loaded.items() if key != "rng_state"} | {"train_state": train_state.state_dict()},
        model,
        optimizer,
        scheduler,
        state,
        skip=skip,
    )
    if not rng or "rng" in skip:
        return
    saved = rng[data_parallel_rank] if len(rng) > 1 else rng[0]
    cuda = saved.get("cuda_rng_state") if not training_on_cpu() else None
    restore_rng_state(
        (
            saved["random_rng_state"],
            saved["np_rng_state"],
            saved["torch_rng_state"],
            cuda,
            saved["rng_tracker_states"],
        )
    )
