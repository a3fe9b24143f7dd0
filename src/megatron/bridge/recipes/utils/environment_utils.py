"""Environment the hardware recipes set for their processes (Megatron-Bridge's ``recipes.utils.environment_utils``).

A recipe puts these into ``cfg.env_vars``; training applies them at start-up (``apply_environment_variables``).
On a CPU-only machine they change nothing: every one is read by NCCL or by PyTorch's CUDA allocator.
"""

COMMON_RECIPE_ENV_VARS: dict[str, str | int | float | bool] = {
    "NCCL_GRAPH_REGISTER": 0,  # no NCCL buffer registration with CUDA graphs: the allocator below is expandable
    "NCCL_NVLS_ENABLE": 0,  # no NVLink SHARP: the recipes do not use NCCL user buffers
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",  # long runs grow allocator segments instead of fragmenting
    "TORCH_NCCL_AVOID_RECORD_STREAMS": 1,  # free communication buffers without recordStream
    "TORCH_NCCL_HIGH_PRIORITY": 1,  # NCCL work on high-priority CUDA streams
}
"""The variables, with the value each recipe gives them."""

__all__ = ["COMMON_RECIPE_ENV_VARS"]
