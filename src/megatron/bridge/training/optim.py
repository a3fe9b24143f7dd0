"""Optimizer and learning-rate scheduler from megatron-core, as the config describes them."""

import copy
from typing import Any

import torch

from megatron.bridge.training.config import ConfigContainer


def optimizer_config(cfg: ConfigContainer) -> Any:
    """A copy of ``cfg.optimizer`` whose precision follows the model (mixed precision keeps fp32 master weights).

    ``min_lr`` of ``None`` is 0, as in Megatron-LM.
    """
    opt = copy.deepcopy(cfg.optimizer)
    model = cfg.model
    opt.bf16 = model.bf16 or model.params_dtype == torch.bfloat16
    opt.fp16 = model.fp16
    opt.params_dtype = torch.bfloat16 if opt.bf16 else torch.float32
    if opt.min_lr is None:
        opt.min_lr = 0.0
    return opt


def build_optimizer(cfg: ConfigContainer, model: list[torch.nn.Module]) -> Any:
    """megatron-core's optimizer for the model chunks (``get_megatron_optimizer`` on :func:`optimizer_config`).

    With ``optimizer.use_distributed_optimizer`` each data-parallel rank keeps the state of its share of the
    parameters only (and saves only that share).
    """
    from megatron.core.optimizer import get_megatron_optimizer

    return get_megatron_optimizer(optimizer_config(cfg), model)


def build_scheduler(cfg: ConfigContainer, optimizer: Any) -> Any:
    """megatron-core's ``OptimizerParamScheduler``, counted in samples, with the lengths ``validate()`` computed."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s = cfg.scheduler
    opt = optimizer_config(cfg)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=s.lr_warmup_init,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=s.lr_warmup_steps,
        lr_decay_steps=s.lr_decay_steps,
        lr_decay_style=s.lr_decay_style,
        start_wd=s.start_weight_decay if s.start_weight_decay is not None else opt.weight_decay,
        end_wd=s.end_weight_decay if s.end_weight_decay is not None else opt.weight_decay,
        wd_incr_steps=s.wd_incr_steps,
        wd_incr_style=s.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=s.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=s.override_opt_param_scheduler,
        wsd_decay_steps=s.wsd_decay_steps,
        lr_wsd_decay_style=s.lr_wsd_decay_style,
    )
