"""Model providers: megatron-core ``TransformerConfig`` subclasses that build the model they describe."""

from megatron.bridge.models.gpt_provider import GPTModelProvider

__all__ = ["GPTModelProvider"]
