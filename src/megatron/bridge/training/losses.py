"""Losses: one micro-batch's language-model loss, and a step's reported losses averaged over micro-batches and ranks.

``masked_next_token_loss`` has the form megatron-core's schedule and Megatron-Bridge expect, and checks the loss it
computes with megatron-core's re-run state machine as its ``check_for_*`` flags say (``health/rerun.py`` describes what
each ``rerun_mode`` then does). The train loop checks the loss of any other loss function the same way
(``rerun.check_losses``), so every loss is checked exactly once.
"""

from functools import partial
from typing import Union

import torch
import torch.distributed as dist
from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind, Mechanism

_DEFAULT_SPIKY_LOSS_FACTOR: float = 10.0
"""A loss this many times the running maximum is a spike, unless the state machine carries ``spiky_loss_factor``
(``rerun.build_rerun_state_machine`` sets ``rerun_state_machine.spiky_loss_factor`` on it)."""

NAN_MESSAGE = "found NaN in local forward loss calculation"
INF_MESSAGE = "found Inf in local forward loss calculation"
SPIKY_MESSAGE = "Spiky loss"


def create_masked_next_token_loss_function(
    loss_mask: torch.Tensor, check_for_nan_in_loss: bool, check_for_spiky_loss: bool
) -> partial:
    """``masked_next_token_loss`` bound to ``loss_mask`` and the checks: what a forward step returns."""
    return partial(
        masked_next_token_loss,
        loss_mask,
        check_for_nan_in_loss=check_for_nan_in_loss,
        check_for_spiky_loss=check_for_spiky_loss,
    )


def masked_next_token_loss(
    loss_mask: torch.Tensor,
    output_tensor: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]],
    check_for_nan_in_loss: bool = True,
    check_for_spiky_loss: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of the per-token losses where the mask is set, the number of such tokens, and the value to report.

    megatron-core's schedule divides the sum by the token count (and by the number of micro-batches) before the
    backward pass; the reported ``{"lm loss": [sum, count]}`` lets the loop average over every token of the step.

    Args:
        loss_mask: 1 where a token counts, 0 where it does not; any shape with as many elements as the losses.
        output_tensor: per-token losses from the model (called with ``labels``), or ``(losses, loss_mask)`` from a
            model that makes its own mask; that mask then replaces ``loss_mask``.
        check_for_nan_in_loss: validate that the loss is finite (``rerun_state_machine.check_for_nan_in_loss``).
        check_for_spiky_loss: validate that the loss is no spike (``rerun_state_machine.check_for_spiky_loss``).
    """
    if isinstance(output_tensor, tuple):
        losses = output_tensor[0].reshape(-1).float()
        loss_mask = output_tensor[1]
    else:
        losses = output_tensor.reshape(-1).float()
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    # A copy: the schedule divides the returned loss in place by the number of micro-batches, and the state machine
    # keeps the tensor to compare with its re-run.
    validate_loss_value(loss.detach().clone(), check_for_nan_in_loss, check_for_spiky_loss)
    num_tokens = mask.sum().to(torch.int)
    reported = torch.stack([loss.detach().clone(), num_tokens.detach().float()])
    return loss, num_tokens, {"lm loss": reported}


def validate_loss_value(loss: torch.Tensor, check_for_nan_in_loss: bool, check_for_spiky_loss: bool) -> None:
    """Check one micro-batch's loss with the re-run state machine (inside the forward-backward passes).

    With ``rerun_mode=disabled`` a NaN/Inf is not raised here, on this rank alone: the loop's NaN guard decides for
    every rank after the passes (``rerun.RerunController.end_step``). A rank whose loss fails a check writes a
    ``fault_detected`` event.
    """
    if not (check_for_nan_in_loss or check_for_spiky_loss):
        return
    machine = get_rerun_state_machine()
    flagged = machine.rerun_requested
    if check_for_nan_in_loss and machine.get_mode() != RerunMode.DISABLED:
        machine.validate_result(result=loss, rejection_func=torch.isnan, message=NAN_MESSAGE, tolerance=0.0, fatal=True)
        machine.validate_result(result=loss, rejection_func=torch.isinf, message=INF_MESSAGE, tolerance=0.0, fatal=True)
    if check_for_spiky_loss:
        factor = getattr(machine, "spiky_loss_factor", _DEFAULT_SPIKY_LOSS_FACTOR)
        is_spiky = partial(machine.is_unexpectedly_large, threshold=factor, context="loss")
        machine.validate_result(result=loss, rejection_func=is_spiky, message=SPIKY_MESSAGE, tolerance=0.0, fatal=False)
    if machine.rerun_requested is True and not flagged and machine.failed_validation_call is not None:
        message = machine.failed_validation_call.caller.message
        mechanism = Mechanism.RERUN_SPIKE if message == SPIKY_MESSAGE else Mechanism.RERUN_NAN
        rank = dist.get_rank() if dist.is_initialized() else 0
        iteration = machine.current_iteration
        event_stream.emit(EventKind.FAULT_DETECTED, mechanism=mechanism, rank=rank, iteration=iteration, detail=message)


def reduce_losses(losses: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each reported loss averaged over the step's micro-batches and data-parallel ranks, on every rank.

    A loss function reports either one value per micro-batch (averaged over micro-batches), or ``[sum, count]``
    (``losses.masked_next_token_loss``; averaged over every counted token of the step). With pipeline parallelism only
    the last stage computes losses (``losses`` is empty on the others): it sends the averages to the other stages, so
    every rank logs and hands its callbacks the same values.
    """
    from megatron.core import parallel_state

    reduced = _reduce_over_data_parallel(losses) if losses else {}
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        reduced = _from_last_stage(reduced)
    return reduced


def _reduce_over_data_parallel(losses: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    dp_size = parallel_state.get_data_parallel_world_size()
    reduced = {}
    for name in losses[0]:
        values = torch.stack([x[name].detach().float().reshape(-1) for x in losses])
        if values.shape[1] == 2:
            total = values.sum(dim=0)
            dist.all_reduce(total, group=group)
            reduced[name] = total[0] / total[1].clamp(min=1)
        else:
            mean = values.mean(dim=0)
            dist.all_reduce(mean, group=group)
            reduced[name] = mean[0] / dp_size
    return reduced


def _from_last_stage(reduced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The last pipeline stage's reduced losses, on every stage of its pipeline (one broadcast)."""
    from megatron.core import parallel_state

    payload = [{name: value.item() for name, value in reduced.items()}]
    dist.broadcast_object_list(
        payload,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return {name: torch.tensor(value, dtype=torch.float32) for name, value in payload[0].items()}
