"""Llama model providers: the Llama architecture on ``GPTModelProvider``, its published sizes and a CPU-sized one."""

from megatron.bridge.models.llama.llama_provider import (
    Llama3ModelProvider,
    Llama3ModelProvider8B,
    Llama3ModelProvider70B,
    Llama31ModelProvider,
    Llama31ModelProvider8B,
    Llama31ModelProvider70B,
    Llama32ModelProvider1B,
    Llama32ModelProvider3B,
    LlamaModelProvider,
    LlamaTinyModelProvider,
)

__all__ = [
    "LlamaModelProvider",
    "Llama3ModelProvider",
    "Llama3ModelProvider8B",
    "Llama3ModelProvider70B",
    "Llama31ModelProvider",
    "Llama31ModelProvider8B",
    "Llama31ModelProvider70B",
    "Llama32ModelProvider1B",
    "Llama32ModelProvider3B",
    "LlamaTinyModelProvider",
]
