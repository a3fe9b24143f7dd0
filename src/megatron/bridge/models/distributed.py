"""The model a rank trains: its pipeline chunks, in mixed precision when asked, each wrapped in megatron-core DDP.

``provide_distributed_model`` is Megatron-Bridge's name for this step. A rank builds one chunk per virtual pipeline
stage (one chunk without interleaving) with the provider's ``provide(pre_process, post_process, vp_stage)``; each
chunk is wrapped in megatron-core's ``DistributedDataParallel`` (its gradient buffers are what the optimizer,
distributed or not, works on), and the shared model config gets the hooks megatron-core's pipeline schedules call:
``no_sync_func`` (one per chunk when interleaved), ``finalize_model_grads_func`` (data-parallel reduction, tied
embedding and layer-norm gradients across stages) and the gradient scale function of the optimizer later.
"""

import copy
from typing import Any, Optional

import torch


def provide_distributed_model(
    provider: Any,
    device: torch.device,
    ddp_config: Any,
    wrap_with_ddp: bool = True,
) -> list[torch.nn.Module]:
    """The model chunks of this rank on ``device`` (seed the generators first for a reproducible init).

    Args:
        provider: a finalized ``GPTModelProvider`` (or subclass); a copy of it is specialised for ``device``.
        device: where the parameters live.
        ddp_config: megatron-core's ``DistributedDataParallelConfig`` (the config's ``ddp``).
        wrap_with_ddp: wrap each chunk in megatron-core DDP (the training loop needs it; inspection does not).

    Returns:
        One module per virtual pipeline stage of this rank, in stage order.
    """
    from megatron.core import parallel_state

    config = provider.for_device(device)
    if not torch.distributed.is_initialized() or torch.distributed.get_backend() == "gloo":
        from megatron.bridge.utils.cpu_shims import gloo_pipeline_settings

        gloo_pipeline_settings(config)
    vp_size = config.virtual_pipeline_model_parallel_size
    stages: list[Optional[int]] = list(range(vp_size)) if vp_size is not None else [None]
    chunks = []
    for vp_stage in stages:
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
        chunk = config.provide(pre_process=first, post_process=last, vp_stage=vp_stage).to(device)
        if config.bf16:
            from megatron.core.transformer.module import Float16Module

            chunk = Float16Module(config, chunk)  # bf16 compute, fp32 logits out
        chunks.append(chunk)
    if not wrap_with_ddp:
        return chunks
    return _wrap_data_parallel(chunks, ddp_config)


def _wrap_data_parallel(chunks: list[torch.nn.Module], ddp_config: Any) -> list[torch.nn.Module]:
    """Each chunk in megatron-core DDP; the schedule's hooks set on the shared config."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    config = chunks[0].config
    wrapped = [
        # Only the first chunk's gradients are bucketed for overlap; the other chunks' reduce at the end of the step.
        DistributedDataParallel(
            config=config, ddp_config=copy.deepcopy(ddp_config), module=chunk, disable_bucketing=index > 0
        )
        for index, chunk in enumerate(chunks)
    ]
    no_sync = [chunk.no_sync for chunk in wrapped]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The megatron-core model inside a chunk's DDP and mixed-precision wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


__all__ = ["provide_distributed_model", "unwrap"]
