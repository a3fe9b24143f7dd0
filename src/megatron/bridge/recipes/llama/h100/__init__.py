"""Llama recipes for H100 nodes, named by model, GPU count, hardware and precision (Megatron-Bridge's names)."""

from megatron.bridge.recipes.llama.h100.llama3 import (
    llama3_8b_pretrain_2gpu_h100_bf16_config,
    llama3_70b_pretrain_32gpu_h100_bf16_config,
    llama31_8b_pretrain_2gpu_h100_bf16_config,
    llama31_70b_pretrain_32gpu_h100_bf16_config,
    llama32_1b_pretrain_1gpu_h100_bf16_config,
    llama32_3b_pretrain_1gpu_h100_bf16_config,
)

__all__ = [
    "llama31_70b_pretrain_32gpu_h100_bf16_config",
    "llama31_8b_pretrain_2gpu_h100_bf16_config",
    "llama32_1b_pretrain_1gpu_h100_bf16_config",
    "llama32_3b_pretrain_1gpu_h100_bf16_config",
    "llama3_70b_pretrain_32gpu_h100_bf16_config",
    "llama3_8b_pretrain_2gpu_h100_bf16_config",
]
