"""Llama recipes: functions of no argument returning a ``ConfigContainer``.

``__all__`` lists Megatron-Bridge's short names (aliases of the H100 recipes in ``recipes/llama/h100/``).
``llama3_tiny_pretrain_config``, this package's CPU-sized Llama on the byte-level tokenizer, is importable from here
too and runs by name (``recipes/run.py``).
"""

from megatron.bridge.recipes.llama.llama3 import (
    llama3_8b_pretrain_config,
    llama3_70b_pretrain_config,
    llama31_8b_pretrain_config,
    llama31_70b_pretrain_config,
    llama32_1b_pretrain_config,
    llama32_3b_pretrain_config,
)
from megatron.bridge.recipes.llama.llama3 import llama3_tiny_pretrain_config as llama3_tiny_pretrain_config

__all__ = [
    "llama3_8b_pretrain_config",
    "llama3_70b_pretrain_config",
    "llama31_8b_pretrain_config",
    "llama31_70b_pretrain_config",
    "llama32_1b_pretrain_config",
    "llama32_3b_pretrain_config",
]
"""Megatron-Bridge's names; ``llama3_tiny_pretrain_config`` (ours) is imported above but not listed."""
