"""Tokenizer configuration (``TokenizerConfig``), as Megatron-Bridge spells it."""

from megatron.bridge.training.tokenizers.config import TokenizerConfig

__all__ = ["TokenizerConfig"]
