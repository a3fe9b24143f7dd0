"""Which Megatron-Bridge config fields this framework cannot honour, and the one check that refuses them.

A config written for Megatron-Bridge carries fields for features this framework does not have (Weights & Biases,
FSDP, profilers, ...). Ignoring such a field would let a run silently differ from what its author asked for, so
each one is listed in :data:`REFUSED` with the reason, and :func:`refused_fields` reports every such field whose
value differs from its default: ``validate()`` turns the first into a ``ValueError`` naming the field and the fix.
Every field not listed here is honoured; ``docs/training/config-reference.md`` (made by
``python -m megatron.bridge.training.utils.config_reference``) shows both.

This module names fields by their dotted path and imports nothing from ``config.py`` (the checks get the config).
"""

import dataclasses
from collections.abc import Iterator
from typing import Any

REFUSED: dict[str, str] = {
    # rng
    "rng.te_rng_tracker": "Transformer Engine's RNG tracker needs Transformer Engine",
    "rng.inference_rng_tracker": "there is no inference here",
    "rng.data_parallel_random_init": "every data-parallel rank starts from the same weights",
    # train
    "train.rampup_batch_size": "batch-size ramp-up is not implemented",
    "train.decrease_batch_size_if_needed": "the global batch size is never changed behind your back",
    "train.empty_unused_memory_level": "CUDA cache emptying is not implemented",
    "train.train_sync_interval": "CPU-GPU synchronization intervals are not implemented",
    "train.iterations_to_skip": "skipping iterations is not implemented",
    "train.num_epochs": (
        "epoch-based training needs a finite SFT dataset (Megatron-Bridge refuses it for every other dataset too); "
        "give the length as train_iters or train_samples"
    ),
    # checkpoint
    "checkpoint.save_optim": "every checkpoint holds the optimizer state (exact resume needs it)",
    "checkpoint.save_rng": "every checkpoint holds the generator states (exact resume needs them)",
    "checkpoint.load_optim": "the optimizer state is always loaded (exact resume needs it)",
    "checkpoint.load_rng": "the generator states are always loaded (exact resume needs them)",
    "checkpoint.load_main_params_from_ckpt": "loading main parameters alone is not implemented",
    "checkpoint.non_persistent_global_ckpt_dir": 'only the "local" non-persistent tier exists',
    "checkpoint.finetune": "finetuning from a checkpoint is not implemented",
    "checkpoint.pretrained_checkpoint": "finetuning from a checkpoint is not implemented",
    "checkpoint.use_checkpoint_args": "model arguments always come from the config",
    "checkpoint.fully_parallel_load": "fully parallel loading is not implemented",
    "checkpoint.use_persistent_ckpt_worker": "async saves use one persistent writer (on CPU: fed by shared memory)",
    # dataset
    "dataset.inter_document_masking": "per-document attention (the samples' cu_seqlens) is not passed to the model",
    # logger
    "logger.log_params_norm": "the parameter norm is not logged",
    "logger.log_throughput": "throughput is not logged",
    "logger.log_progress": "progress.txt is not written (goodput/ holds the run's progress)",
    "logger.timing_log_level": "only the step time is logged",
    "logger.timing_log_option": "only the step time is logged",
    "logger.log_timers_to_tensorboard": "timers are not written to TensorBoard",
    "logger.log_validation_ppl_to_tensorboard": "validation perplexity is not written to TensorBoard",
    "logger.log_memory_to_tensorboard": "memory statistics are not written to TensorBoard",
    "logger.wandb_project": "Weights & Biases is not supported",
    "logger.wandb_exp_name": "Weights & Biases is not supported",
    "logger.wandb_save_dir": "Weights & Biases is not supported",
    "logger.wandb_entity": "Weights & Biases is not supported",
    # dist
    "dist.align_grad_reduce": "gradients are reduced the one way megatron-core's DDP does by default",
    "dist.lazy_mpu_init": "model-parallel state is always initialized here, never by an external manager",
    "dist.use_megatron_fsdp": "FSDP is not supported",
    "dist.use_torch_fsdp2": "FSDP is not supported",
    "dist.nccl_communicator_config_path": "per-communicator NCCL settings are not supported",
    "dist.use_tp_pp_dp_mapping": "ranks are always ordered tensor-data-pipeline",
    "dist.use_gloo_process_groups": "megatron-core's gloo groups are always created",
    "dist.use_sharp": "SHARP is not supported",
    "dist.external_gpu_device_mapping": "the GPU is always picked by the local rank",
    "dist.enable_megatron_core_experimental": "megatron-core's experimental features are not enabled",
    "dist.distributed_timeout_seconds_after_init": "one collective timeout holds for the whole run",
    # profiling
    "profiling.use_nsys_profiler": "no profiler runs here",
    "profiling.use_pytorch_profiler": "no profiler runs here",
    "profiling.record_memory_history": "no profiler runs here",
    "profiling.record_shapes": "no profiler runs here",
    "profiling.nvtx_ranges": "no profiler runs here",
    # whole sections
    "peft": "parameter-efficient finetuning is not supported",
    "comm_overlap": "communication-overlap settings are not supported",
    "mixed_precision": "mixed-precision recipes are not supported; set model.bf16 and model.params_dtype",
    "tensor_inspect": "tensor inspection is not supported",
}
"""Dotted field -> why this framework cannot honour a value other than the field's default."""

NEWER_UPSTREAM: dict[str, str] = {"dataset.inter_document_masking": "megatron-core 0.19"}
"""Listed fields that only newer upstream releases declare, and the first that does: with an older one installed,
the field does not exist and nothing is checked."""

INERT: dict[str, str] = {
    "profiling.profile_step_start": "read only by a profiler, and none runs here",
    "profiling.profile_step_end": "read only by a profiler, and none runs here",
    "profiling.profile_ranks": "read only by a profiler, and none runs here",
    "profiling.memory_snapshot_path": "read only by a profiler, and none runs here",
    **{
        f"tokenizer.{name}": "read only by tokenizers other than the ones built here (null, byte-level, HuggingFace)"
        for name in (
            "vocab_file",
            "merge_file",
            "vocab_extra_ids",
            "chat_template",
            "tiktoken_pattern",
            "tiktoken_num_special_tokens",
            "tiktoken_special_tokens",
            "tokenizer_prompt_format",
            "image_tag_type",
            "force_system_message",
            "sp_tokenizer_kwargs",
        )
    },
    "dataset.trust_remote_code": "read only by HuggingFace datasets, and none is built here",
    "dataset.data_sharding": "read only by the 'cyclic' sampler, which serves fine-tuning datasets not provided here",
    **{
        f"dataset.{name}": "no loader here saves a stream position: the checkpointed sample count is the position"
        for name in ("dataloader_save", "dataloader_load")
    },
    **{
        f"dataset.{name}": "megatron-core declares it, but none of its dataset code reads it"
        for name in ("data_parallel_size", "sequence_parallel_size", "context_parallel_size")
    },
    "straggler.enable_straggler_on_startup": "read only by the legacy detector, which is refused",
    "straggler.straggler_ctrlr_port": "read only by the legacy detector, which is refused",
    "straggler.straggler_minmax_count": "read only by the legacy detector, which is refused",
    "straggler.disable_straggler_on_startup": "read only by the legacy detector, which is refused",
}
"""Dotted field -> why any value is accepted but changes nothing (it only configures a refused feature)."""


def _default(section: Any, name: str) -> Any:
    """The default of field ``name`` of dataclass ``section``."""
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def refused_fields(cfg: Any) -> Iterator[tuple[str, Any, Any, str]]:
    """``(dotted field, value, default, why)`` for every refused field of ``cfg`` set away from its default."""
    for dotted, why in REFUSED.items():
        section_name, _, name = dotted.rpartition(".")
        section = getattr(cfg, section_name) if section_name else cfg
        if section is None or (dotted in NEWER_UPSTREAM and not hasattr(section, name)):
            continue
        value = getattr(section, name)
        default = _default(section, name)
        if value != default:
            yield dotted, value, default, why
