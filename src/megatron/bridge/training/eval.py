"""Evaluation: ``validation.eval_iters`` forward-only steps on validation data, every ``validation.eval_interval``.

Validation samples come from a stream of their own, addressed by ``train_state.consumed_valid_samples``, so a
resumed run evaluates on the samples an uninterrupted one would. The model is in eval mode (no dropout) and no
random number is drawn: evaluating changes nothing of the training that follows. Callbacks see
``on_eval_start``, ``on_eval_step_start``/``_end`` for each step and ``on_eval_end`` with the averaged losses.
"""

import logging
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

from megatron.bridge.training.callbacks import CallbackManager, fire_event
from megatron.bridge.training.losses import reduce_losses

logger = logging.getLogger(__name__)


def evaluate(
    global_state: Any,
    model: list[torch.nn.Module],
    forward_step_func: Callable,
    data_iterator: Iterator,
    callbacks: Optional[CallbackManager] = None,
) -> dict[str, float]:
    """Run one evaluation; return each reported loss averaged over it (every rank calls it at the same step)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg = global_state.cfg
    progress = global_state.train_state
    dp = parallel_state.get_data_parallel_world_size()
    # Evaluation's batch sizes: validate() fills in the training ones where none is set.
    global_batch = cfg.validation.eval_global_batch_size or cfg.train.global_batch_size
    micro_batch = cfg.validation.eval_micro_batch_size or cfg.train.micro_batch_size
    num_microbatches = global_batch // (micro_batch * dp)
    fire_event(callbacks, "on_eval_start", global_state, model)
    for chunk in model:
        chunk.eval()
    losses: list[dict[str, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for _ in range(cfg.validation.eval_iters):
                fire_event(callbacks, "on_eval_step_start", global_state, model)
                losses += get_forward_backward_func()(
                    forward_step_func=forward_step_func,
                    data_iterator=data_iterator,
                    model=model,
                    num_microbatches=num_microbatches,
                    seq_length=cfg.model.seq_length,
                    micro_batch_size=micro_batch,
                    forward_only=True,
                )
                progress.consumed_valid_samples += global_batch
                fire_event(callbacks, "on_eval_step_end", global_state, model)
    finally:
        for chunk in model:
            chunk.train()
    totals = {name: value.item() for name, value in reduce_losses(losses).items()}
    logger.info(
        "validation at iteration %d (%d steps): %s",
        progress.step,
        cfg.validation.eval_iters,
        " | ".join(f"{name} {value!r}" for name, value in totals.items()),
    )
    fire_event(callbacks, "on_eval_end", global_state, model, total_loss_dict=totals)
    return totals


def is_due(global_state: Any) -> bool:
    """Whether the step just finished is one to evaluate after."""
    interval = global_state.cfg.validation.eval_interval
    return interval is not None and global_state.train_state.step % interval == 0
