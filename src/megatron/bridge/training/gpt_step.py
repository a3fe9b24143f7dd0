"""The GPT forward step: one micro-batch through the model, and the loss function that reduces its output.

Megatron-Bridge's signature, ``forward_step(state, data_iterator, model)``; the loop binds ``state`` (see
``utils/train_utils.py``), so megatron-core's schedule calls it with the data iterator and the model.
"""

from functools import partial
from typing import Any

import torch

from megatron.bridge.training.losses import masked_next_token_loss


def get_batch(data_iterator: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """The next micro-batch on ``device``: tokens, labels, loss mask, position ids and a causal attention mask."""
    batch = next(data_iterator)
    out = {key: batch[key].to(device, non_blocking=True) for key in ("tokens", "labels", "loss_mask", "position_ids")}
    mask = batch.get("attention_mask")
    if mask is None:  # mock and indexed GPT data carry none: every sequence is one causal document
        seq = out["tokens"].shape[1]
        out["attention_mask"] = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)
    else:
        out["attention_mask"] = mask.to(device, non_blocking=True)
    return out


def forward_step(
    state: Any, data_iterator: Any, model: torch.nn.Module, return_schedule_plan: bool = False
) -> tuple[torch.Tensor, partial]:
    """Forward one micro-batch; return the per-token losses and the function that reduces them.

    Args:
        state: the run's ``GlobalState``; its ``rerun_state_machine`` config decides which losses are checked.
        data_iterator: yields dicts with ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (and optionally
            ``attention_mask``).
        model: the model chunk.
        return_schedule_plan: Megatron-Bridge builds a schedule plan for overlapped MoE communication here; that
            needs Transformer Engine and is not available in this package.
    """
    if return_schedule_plan:
        raise NotImplementedError(
            "forward_step(return_schedule_plan=True): schedule plans (overlapped MoE expert communication) need "
            "Transformer Engine, which this package does not use; leave overlap_moe_expert_parallel_comm off"
        )
    device = next(model.parameters()).device
    batch = get_batch(data_iterator, device)
    output = model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
    )
    checks = state.cfg.rerun_state_machine if state is not None and state.cfg is not None else None
    return output, partial(
        masked_next_token_loss,
        batch["loss_mask"],
        check_for_nan_in_loss=checks.check_for_nan_in_loss if checks is not None else True,
        check_for_spiky_loss=checks.check_for_spiky_loss if checks is not None else False,
    )
