"""The data-parallel wrapping of the model a rank trains, and its undoing (:func:`unwrap`).

The provider's ``provide_distributed_model`` (``models/model_provider.py``, Megatron-Bridge's name for the step)
builds one chunk per virtual pipeline stage (one chunk without interleaving); :func:`wrap_data_parallel` wraps each
chunk in megatron-core's ``DistributedDataParallel`` (its gradient buffers are what the optimizer,
distributed or not, works on), and the shared model config gets the hooks megatron-core's pipeline schedules call:
``no_sync_func`` (one per chunk when interleaved), ``finalize_model_grads_func`` (data-parallel reduction, tied
embedding and layer-norm gradients across stages) and the gradient scale function of the optimizer later.
"""

import copy
from typing import Any

import torch


def wrap_data_parallel(
    chunks: list[torch.nn.Module], ddp_config: Any, overlap_param_gather_with_optimizer_step: bool = False
) -> list[torch.nn.Module]:
    """Each chunk in megatron-core DDP; the schedule's hooks set on the shared config.

    With ``overlap_param_gather_with_optimizer_step`` no chunk is bucketed (the optimizer step gathers them).
    """
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    config = chunks[0].config
    wrapped = [
        # Only the first chunk's gradients are bucketed for overlap; the other chunks' reduce at the end of the step.
        DistributedDataParallel(
            config=config,
            ddp_config=copy.deepcopy(ddp_config),
            module=chunk,
            disable_bucketing=index > 0 or overlap_param_gather_with_optimizer_step,
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


__all__ = ["unwrap", "wrap_data_parallel"]
