"""Llama recipes (Megatron-Bridge's names): functions returning a ``ConfigContainer``."""

from megatron.bridge.recipes.llama.llama3 import (
    Llama3CommonKwargs,
    llama3_8b_pretrain_config,
    llama3_70b_pretrain_config,
    llama3_tiny_pretrain_config,
    llama32_1b_pretrain_config,
)

__all__ = [
    "Llama3CommonKwargs",
    "llama3_8b_pretrain_config",
    "llama3_70b_pretrain_config",
    "llama32_1b_pretrain_config",
    "llama3_tiny_pretrain_config",
]
