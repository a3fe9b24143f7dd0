"""Model providers: megatron-core ``TransformerConfig`` subclasses that build the model they describe.

Each implements ``ModelProviderMixin`` (``model_provider.py``), whose ``provide_distributed_model`` builds the model
a rank trains.
"""

from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.bridge.models.llama import (
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
from megatron.bridge.models.model_provider import ModelProviderMixin

__all__ = [
    "GPTModelProvider",
    "ModelProviderMixin",
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
