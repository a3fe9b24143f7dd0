"""Data-parallel wrapping, optimizer and learning-rate scheduler from megatron-core, as the config describes them."""

import copy
from typing import Any

import torch

from megatron.bridge.training.config import ConfigContainer


def wrap_data_parallel(model: torch.nn.Module, ddp_config: Any) -> torch.nn.Module:
    """Wrap ``model`` in megatron-core DDP (``ddp_config``, the config's ``ddp``) and set the schedule's hooks."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    config = model.config
    wrapped = DistributedDataParallel(config=config, ddp_config=copy.deepcopy(ddp_config), module=model)
    config.no_sync_func = wrapped.no_sync
    config.finalize_model_grads_func = finalize_model_grads  # data-parallel gradient all-reduce
    return wrapped


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


def build_optimizer(cfg: ConfigContainer, model: torch.nn.Module) -> Any:
    """megatron-core's optimizer for ``model`` (``get_megatron_optimizer`` on :func:`optimizer_config`)."""
    from megatron.core.optimizer import get_megatron_optimizer

    return get_megatron_optimizer(optimizer_config(cfg), [model])


def build_scheduler(cfg: ConfigContainer, optimizer: Any) -> Any:
    """Learning-rate schedule counted in samples, as megatron-core's ``OptimizerParamScheduler`` expects."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = cfg.train.global_batch_size
    decay_iters = cfg.scheduler.lr_decay_iters or cfg.train.train_iters
    opt = optimizer_config(cfg)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=cfg.scheduler.lr_warmup_iters * gbs,
        lr_decay_steps=decay_iters * gbs,
        lr_decay_style=cfg.scheduler.lr_decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=decay_iters * gbs,
        wd_incr_style="constant",
    )
