"""Data-parallel wrapping, optimizer and learning-rate scheduler from megatron-core."""

from typing import Any

import torch

from megatron.bridge.training.config import ConfigContainer


def wrap_data_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``model`` in megatron-core DDP and set the hooks the forward-backward schedule calls."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    config = model.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=False,
    )
    wrapped = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.no_sync_func = wrapped.no_sync
    config.finalize_model_grads_func = finalize_model_grads  # data-parallel gradient all-reduce
    return wrapped


def build_optimizer(cfg: ConfigContainer, model: torch.nn.Module) -> Any:
    """megatron-core Adam over ``model``'s parameters (fp32 master weights when the model is bf16)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = cfg.optimizer
    bf16 = cfg.model.bf16 or cfg.model.params_dtype == torch.bfloat16
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=False,
    )
    return get_megatron_optimizer(opt_cfg, [model])


def build_scheduler(cfg: ConfigContainer, optimizer: Any) -> Any:
    """Learning-rate schedule counted in samples, as megatron-core's ``OptimizerParamScheduler`` expects."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = cfg.train.global_batch_size
    decay_iters = cfg.scheduler.lr_decay_iters or cfg.train.train_iters
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=cfg.optimizer.lr,
        min_lr=cfg.optimizer.min_lr,
        lr_warmup_steps=cfg.scheduler.lr_warmup_iters * gbs,
        lr_decay_steps=decay_iters * gbs,
        lr_decay_style=cfg.scheduler.lr_decay_style,
        start_wd=cfg.optimizer.weight_decay,
        end_wd=cfg.optimizer.weight_decay,
        wd_incr_steps=decay_iters * gbs,
        wd_incr_style="constant",
    )
