"""The GPT forward step: one micro-batch through the model, and the loss function that reduces its output.

Megatron-Bridge's signature, ``forward_step(state, data_iterator, model)``; the loop binds ``state`` (see
``utils/train_utils.py``), so megatron-core's schedule calls it with the data iterator and the model.

Which pipeline stage reads what: the first stage (first virtual chunk) reads ``tokens`` and ``position_ids``, the
last stage (last virtual chunk) ``labels`` and ``loss_mask``; a stage in between reads the whole batch when it
uses the dataset's attention mask, else nothing (see :func:`get_batch`).

Packed sequences, context parallelism, multi-token prediction and schedule plans are Megatron-Bridge features this
package does not provide (``docs/training/upstream-compatibility.md``): a batch's packed-sequence metadata is not
read, and ``return_schedule_plan=True`` is refused.
"""

from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING, Any, Optional

import torch
from megatron.core.pipeline_parallel.utils import (
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron.core.utils import get_batch_on_this_cp_rank, get_model_config, unwrap_model

from megatron.bridge.training.losses import create_masked_next_token_loss_function
from megatron.bridge.training.utils.pg_utils import get_pg_collection
from megatron.bridge.utils.cpu_shims import training_on_cpu

if TYPE_CHECKING:
    from megatron.bridge.training.state import GlobalState

BATCH_FIELDS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
"""What a batch holds, in the order :func:`get_batch` returns them (``attention_mask`` only when the dataset makes
one)."""


def _batch_device() -> torch.device:
    """Where a batch goes: this rank's GPU, or the CPU when training on CPU."""
    return torch.device("cpu") if training_on_cpu() else torch.device("cuda", torch.cuda.current_device())


def get_batch_from_iterator(
    data_iterator: Iterable,
    include_mtp_inputs: bool = False,
    skip_getting_attention_mask_from_dataset: bool = True,
    *,
    is_first_pp_stage: bool,
    is_last_pp_stage: bool,
    include_full_batch_fields: bool = False,
) -> dict[str, Optional[torch.Tensor]]:
    """The next batch, with the fields this stage needs on the device and every other field ``None``.

    Args:
        data_iterator: yields dicts of the :data:`BATCH_FIELDS`.
        include_mtp_inputs: this stage also needs ``tokens`` and ``position_ids`` (multi-token prediction).
        skip_getting_attention_mask_from_dataset: leave the dataset's ``attention_mask`` out (a causal mask is made
            where the model runs).
        is_first_pp_stage: the stage embeds the tokens.
        is_last_pp_stage: the stage computes the loss.
        include_full_batch_fields: every field, whatever the stage.
    """
    batch = next(data_iterator)
    wanted: set[str] = set()
    if include_full_batch_fields:
        wanted.update(BATCH_FIELDS)
    else:
        if not skip_getting_attention_mask_from_dataset:
            wanted.add("attention_mask")
        if is_first_pp_stage or include_mtp_inputs:
            wanted.update(("tokens", "position_ids"))
        if is_last_pp_stage:
            wanted.update(("labels", "loss_mask"))
    device = _batch_device()
    out: dict[str, Optional[torch.Tensor]] = {key: None for key in BATCH_FIELDS}
    for key, value in batch.items():
        keep = key in wanted and value is not None
        out[key] = value.to(device, non_blocking=True) if keep else None
    return out


def get_batch(
    data_iterator: Iterable,
    cfg: Any,
    use_mtp: bool = False,
    *,
    pg_collection: Any,
    vp_stage: Optional[int] = None,
) -> tuple[
    Optional[torch.Tensor],
    Optional[torch.Tensor],
    Optional[torch.Tensor],
    Optional[torch.Tensor],
    Optional[torch.Tensor],
    Optional[dict[str, Any]],
]:
    """The ``(tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_metadata)`` of this stage.

    A stage between the first and the last returns six ``None`` without reading the iterator when the dataset's
    attention mask is not wanted (``dataset.skip_getting_attention_mask_from_dataset=True``) and it needs no
    multi-token-prediction inputs; else it reads the whole batch. This package's dataset configs have no such field:
    the dataset's mask is then used where it makes one, and every stage reads its batch (each interleaved chunk has
    its own copy of the iterator, ``pretrain.per_chunk``). ``packed_seq_metadata`` is always ``None`` here.

    Args:
        data_iterator: the chunk's data iterator.
        cfg: the run's ``ConfigContainer`` (``dataset`` and ``model`` are read).
        use_mtp: multi-token-prediction layers are on (the last stage then reads the inputs too).
        pg_collection: the model's process groups (``pp`` and ``cp`` are read).
        vp_stage: the virtual pipeline stage of the model chunk (``None`` without interleaving).
    """
    vp_size = getattr(getattr(cfg, "model", None), "virtual_pipeline_model_parallel_size", None)
    is_first = is_pp_first_stage(pg_collection.pp) and (
        vp_stage is None or is_vp_first_stage(vp_stage=vp_stage, vp_size=vp_size)
    )
    is_last = is_pp_last_stage(pg_collection.pp) and (
        vp_stage is None or is_vp_last_stage(vp_stage=vp_stage, vp_size=vp_size)
    )
    skip_mask = getattr(getattr(cfg, "dataset", None), "skip_getting_attention_mask_from_dataset", False)
    is_middle = not is_first and not is_last
    full_batch = is_middle and not skip_mask
    mtp_inputs = use_mtp and is_last
    if is_middle and not full_batch and not mtp_inputs:
        return None, None, None, None, None, None
    batch = get_batch_from_iterator(
        data_iterator,
        include_mtp_inputs=mtp_inputs,
        skip_getting_attention_mask_from_dataset=skip_mask,
        is_first_pp_stage=is_first,
        is_last_pp_stage=is_last,
        include_full_batch_fields=full_batch,
    )
    if pg_collection.cp.size() > 1:  # slice along the sequence for context parallelism
        batch = get_batch_on_this_cp_rank(batch, cp_group=pg_collection.cp)
    return (
        batch["tokens"],
        batch["labels"],
        batch["loss_mask"],
        batch["attention_mask"],
        batch["position_ids"],
        None,
    )


def _causal_mask(seq_length: int, device: torch.device) -> torch.Tensor:
    """``True`` above the diagonal: the positions a token may not attend to (one causal document per row)."""
    return torch.triu(torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1)


def _model_chunk_vp_stage(model: Any) -> Optional[int]:
    """The virtual pipeline stage a model chunk was built for (``None`` without interleaving)."""
    return getattr(unwrap_model(model), "vp_stage", None)


def _forward_step_common(
    state: "GlobalState",
    data_iterator: Iterable,
    model: Any,
    return_schedule_plan: bool = False,
    *,
    _get_batch_fn: Optional[Any] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Read this stage's batch and run the model chunk on it; return its output and the loss mask.

    The batch read is timed (``state.timers``' ``batch-generator``, log level 2) and attributed to data loading by
    the straggler timer (``state.straggler_timer``). A stage that runs attention without a mask from the dataset
    gets a causal mask, made on the model's device.

    Args:
        state: the run's ``GlobalState``.
        data_iterator: the chunk's data iterator.
        model: the model chunk.
        return_schedule_plan: Megatron-Bridge builds a schedule plan for overlapped MoE communication here; that
            needs Transformer Engine and is not available in this package.
        _get_batch_fn: replaces :func:`get_batch` (for callers with their own batches).
    """
    if return_schedule_plan:
        raise NotImplementedError(
            "forward_step(return_schedule_plan=True): schedule plans (overlapped MoE expert communication) need "
            "Transformer Engine, which this package does not use; leave overlap_moe_expert_parallel_comm off"
        )
    timers = state.timers
    straggler_timer = state.straggler_timer
    config = get_model_config(model)
    pg_collection = get_pg_collection(model)
    use_mtp = (getattr(config, "mtp_num_layers", None) or 0) > 0
    vp_stage = _model_chunk_vp_stage(model)

    timers("batch-generator", log_level=2).start()
    with straggler_timer(bdata=True):
        tokens, labels, loss_mask, attention_mask, position_ids, _packed = (_get_batch_fn or get_batch)(
            data_iterator, state.cfg, use_mtp, pg_collection=pg_collection, vp_stage=vp_stage
        )
    timers("batch-generator").stop()

    if attention_mask is None:
        seq_length = tokens.shape[1] if tokens is not None else labels.shape[1] if labels is not None else None
        seq_length = seq_length or getattr(config, "seq_length", None)
        device = next(model.parameters()).device
        attention_mask = _causal_mask(seq_length, device) if seq_length else None
    with straggler_timer:
        output = model(input_ids=tokens, position_ids=position_ids, attention_mask=attention_mask, labels=labels)
    return output, loss_mask


def forward_step(
    state: "GlobalState", data_iterator: Iterable, model: Any, return_schedule_plan: bool = False
) -> tuple[torch.Tensor, partial]:
    """Forward one micro-batch; return the model's output and the function that reduces it to the loss.

    Args:
        state: the run's ``GlobalState``; its ``rerun_state_machine`` config decides which losses are checked.
        data_iterator: yields dicts with ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (and optionally
            ``attention_mask``).
        model: the model chunk.
        return_schedule_plan: refused (see :func:`_forward_step_common`).
    """
    output, loss_mask = _forward_step_common(state, data_iterator, model, return_schedule_plan)
    checks = state.cfg.rerun_state_machine
    loss_function = create_masked_next_token_loss_function(
        loss_mask,
        check_for_nan_in_loss=checks.check_for_nan_in_loss,
        check_for_spiky_loss=checks.check_for_spiky_loss,
    )
    return output, loss_function
