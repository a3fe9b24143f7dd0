"""Optimizer and learning-rate schedule presets of the recipes (Megatron-Bridge's ``recipes.utils.optimizer_utils``).

Each returns an ``(OptimizerConfig, SchedulerConfig)`` pair: Adam on the distributed optimizer with gradient
clipping, a linear warm-up from 0 and a cosine decay to ``min_lr`` (a tenth of ``max_lr`` unless given), and a
constant weight decay of 0.033 applied by the scheduler. ``precision`` ``"bf16-mixed"`` or ``"16-mixed"`` turns on
the optimizer's mixed precision (which needs CUDA); anything else trains in fp32.
"""

from typing import Optional

from megatron.core.optimizer import OptimizerConfig

from megatron.bridge.training.config import SchedulerConfig

SCHEDULED_WEIGHT_DECAY = 0.033
"""The weight decay the scheduler applies, from the first step to the last (``weight_decay_incr_style="constant"``)."""


def _adam(
    precision: str,
    max_lr: float,
    min_lr: Optional[float],
    weight_decay: float,
    adam_beta1: float,
    adam_beta2: float,
    adam_eps: float,
    clip_grad: float,
) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer="adam",
        lr=max_lr,
        min_lr=0.1 * max_lr if min_lr is None else min_lr,
        weight_decay=weight_decay,
        bf16=precision == "bf16-mixed",
        fp16=precision == "16-mixed",
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        adam_eps=adam_eps,
        use_distributed_optimizer=True,
        clip_grad=clip_grad,
    )


def distributed_fused_adam_with_cosine_annealing(
    precision: str = "bf16-mixed",
    lr_warmup_iters: int = 2000,
    lr_decay_iters: Optional[int] = None,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.95,
    adam_eps: float = 1e-8,
    weight_decay: float = 0.1,
    max_lr: float = 1e-4,
    min_lr: Optional[float] = None,
    clip_grad: float = 1.0,
    start_weight_decay: float = SCHEDULED_WEIGHT_DECAY,
    end_weight_decay: float = SCHEDULED_WEIGHT_DECAY,
    weight_decay_incr_style: str = "constant",
    lr_decay_style: str = "cosine",
) -> tuple[OptimizerConfig, SchedulerConfig]:
    """Adam with a warm-up and a cosine decay counted in iterations.

    Args:
        precision: ``"bf16-mixed"``, ``"16-mixed"`` or another name for fp32.
        lr_warmup_iters: iterations of linear warm-up from 0.
        lr_decay_iters: iterations of decay; ``None``: the run's ``train.train_iters`` (set by ``validate()``).
        adam_beta1: Adam's first-moment decay.
        adam_beta2: Adam's second-moment decay.
        adam_eps: Adam's epsilon.
        weight_decay: the optimizer's weight decay (the scheduler's values replace it while training).
        max_lr: the peak learning rate.
        min_lr: the learning rate at the end of the decay; ``None``: ``0.1 * max_lr``.
        clip_grad: the gradient-norm clip.
        start_weight_decay: the scheduler's weight decay at the first step.
        end_weight_decay: the scheduler's weight decay at the last step.
        weight_decay_incr_style: how it moves between them (``"constant"`` needs them equal).
        lr_decay_style: the decay's shape (``"cosine"``, ``"linear"``, ...).
    """
    optimizer = _adam(precision, max_lr, min_lr, weight_decay, adam_beta1, adam_beta2, adam_eps, clip_grad)
    scheduler = SchedulerConfig(
        start_weight_decay=start_weight_decay,
        end_weight_decay=end_weight_decay,
        weight_decay_incr_style=weight_decay_incr_style,
        lr_decay_style=lr_decay_style,
        lr_wsd_decay_style="minus_sqrt",
        lr_wsd_decay_iters=lr_decay_iters,
        lr_warmup_iters=lr_warmup_iters,
        lr_warmup_init=0.0,
        lr_decay_iters=lr_decay_iters,
        override_opt_param_scheduler=True,
    )
    return optimizer, scheduler


def distributed_fused_adam_with_cosine_annealing_samples(
    precision: str = "bf16-mixed",
    lr_warmup_samples: Optional[int] = None,
    lr_decay_samples: Optional[int] = None,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.95,
    adam_eps: float = 1e-8,
    weight_decay: float = 0.1,
    max_lr: float = 1e-4,
    min_lr: Optional[float] = None,
    clip_grad: float = 1.0,
) -> tuple[OptimizerConfig, SchedulerConfig]:
    """The same for a run counted in samples (``train.train_samples``): warm-up and decay in samples.

    ``lr_warmup_samples``/``lr_decay_samples`` ``None``: no warm-up, and a decay over the run's
    ``train.train_samples`` (set by ``validate()``). The other arguments are those of
    :func:`distributed_fused_adam_with_cosine_annealing`.
    """
    optimizer = _adam(precision, max_lr, min_lr, weight_decay, adam_beta1, adam_beta2, adam_eps, clip_grad)
    scheduler = SchedulerConfig(
        start_weight_decay=SCHEDULED_WEIGHT_DECAY,
        end_weight_decay=SCHEDULED_WEIGHT_DECAY,
        weight_decay_incr_style="constant",
        lr_decay_style="cosine",
        lr_warmup_samples=lr_warmup_samples or 0,
        lr_warmup_init=0.0,
        lr_decay_samples=lr_decay_samples,
        override_opt_param_scheduler=True,
    )
    return optimizer, scheduler


__all__ = ["distributed_fused_adam_with_cosine_annealing", "distributed_fused_adam_with_cosine_annealing_samples"]
