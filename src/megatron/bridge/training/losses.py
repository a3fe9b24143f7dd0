"""Losses: one micro-batch's language-model loss, and a step's reported losses averaged over micro-batches and ranks.

``masked_next_token_loss`` has the form megatron-core's schedule and Megatron-Bridge expect.
"""

import torch
import torch.distributed as dist


def masked_next_token_loss(
    loss_mask: torch.Tensor,
    output_tensor: torch.Tensor,
    check_for_nan_in_loss: bool = True,
    check_for_spiky_loss: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of the per-token losses where ``loss_mask`` is set, the number of such tokens, and the value to report.

    megatron-core's schedule divides the sum by the token count (and by the number of micro-batches) before the
    backward pass; the reported ``{"lm loss": [sum, count]}`` lets the loop average over every token of the step.

    Args:
        loss_mask: 1 where a token counts, 0 where it does not; any shape with as many elements as the output.
        output_tensor: per-token losses from the model (called with ``labels``).
        check_for_nan_in_loss: accepted for Megatron-Bridge compatibility. Every loss of every forward step is
            checked by the loop as ``rerun_state_machine.check_for_nan_in_loss`` says, whatever is passed here.
        check_for_spiky_loss: likewise, ``rerun_state_machine.check_for_spiky_loss`` decides.
    """
    del check_for_nan_in_loss, check_for_spiky_loss  # the loop checks every loss (``rerun.check_losses``)
    losses = output_tensor.float().view(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    reported = torch.stack([loss_sum.detach().clone(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": reported}


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
