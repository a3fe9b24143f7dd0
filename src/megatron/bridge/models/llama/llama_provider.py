"""Llama model providers: the Llama architecture as ``GPTModelProvider`` defaults, and the published sizes.

:class:`LlamaModelProvider` holds what every Llama shares (RMSNorm, SwiGLU, rotary positions, no linear biases,
untied embeddings, no dropout); :class:`Llama3ModelProvider` and :class:`Llama31ModelProvider` add the Llama 3 and
3.1 vocabulary, rotary base, grouped-query attention and context length; the classes named after a size
(``Llama3ModelProvider8B``, ``Llama32ModelProvider1B``, ...) fix the published dimensions. The names are
Megatron-Bridge's. :class:`LlamaTinyModelProvider` is ours: a Llama small enough to train on two CPU ranks, with
tensor or pipeline parallelism of 2.

Every size is a dataclass default, so a recipe or a dotted override changes any of them, and a subclass may too::

    @dataclass
    class MyLlama(Llama3ModelProvider8B):
        num_layers: int = 16
        \"\"\"Half the layers of the published 8B.\"\"\"

The fused kernels Megatron-Bridge turns on for Llama (bias-activation, masked-softmax, rope fusion, ...) stay at
megatron-core's defaults (off) here: they need a GPU; turn them on through overrides on one.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Optional

import torch.nn.functional as F

from megatron.bridge.models.gpt_provider import GPTModelProvider


@dataclass
class LlamaModelProvider(GPTModelProvider):
    """A Llama-architecture GPT: pre-RMSNorm, SwiGLU MLP, rotary positions, no biases, untied embeddings."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    """RMSNorm before attention, before the MLP and after the last layer."""
    activation_func: Callable = F.silu
    """SiLU, the gate's activation in the SwiGLU MLP."""
    gated_linear_unit: bool = True
    """A gated MLP (with SiLU: SwiGLU); the first projection is twice ``ffn_hidden_size`` wide."""
    position_embedding_type: Literal["learned_absolute", "rope"] = "rope"
    """Rotary position embeddings."""
    add_bias_linear: bool = False
    """No bias in any linear layer."""
    share_embeddings_and_output_weights: bool = False
    """A separate output projection (the published Llama 3.2 sizes tie it to the embedding)."""
    hidden_dropout: float = 0.0
    """No dropout after attention and the MLP."""
    attention_dropout: float = 0.0
    """No dropout on the attention probabilities."""
    layernorm_epsilon: float = 1e-5
    """RMSNorm's epsilon."""
    seq_length: int = 4096
    """Sequence length of the training samples (Llama 2's context)."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialization."""
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention, each shared by ``num_attention_heads / num_query_groups`` query
    heads; ``None``: one per query head (multi-head attention)."""

    def finalize(self) -> None:
        """megatron-core's checks, then that the query heads split evenly over the key/value groups."""
        super().finalize()
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_query_groups "
                f"({self.num_query_groups}): every key/value group serves the same number of query heads"
            )


@dataclass
class Llama3ModelProvider(LlamaModelProvider):
    """Llama 3: a 128K-token vocabulary, 8 key/value groups, rotary base 500,000 and an 8K context."""

    vocab_size: Optional[int] = 128256
    """Llama 3's tokenizer vocabulary (a multiple of 128: not padded further)."""
    num_query_groups: Optional[int] = 8
    """Eight key/value groups at every published size."""
    rotary_base: int = 500_000
    """Rotary embedding base (theta)."""
    seq_length: int = 8192
    """Llama 3's context length."""
    init_method_std: float = 0.01
    """Standard deviation of the normal weight initialization (Megatron-Bridge's for Llama 3)."""


@dataclass
class Llama31ModelProvider(Llama3ModelProvider):
    """Llama 3.1 (and 3.2): Llama 3 with rotary frequency scaling for a 128K context."""

    rope_scaling: bool = True
    """Llama 3.1's rotary frequency scaling (original context 8192, low/high frequency factors 1 and 4)."""
    rope_scaling_factor: float = 8.0
    """What the lowest rotary frequencies are divided by."""
    seq_length: int = 131072
    """Llama 3.1's context length."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialization (Megatron-Bridge's for Llama 3.1)."""


@dataclass
class Llama3ModelProvider8B(Llama3ModelProvider):
    """Llama 3 8B: 32 layers of width 4096, 32 query heads over 8 key/value groups (8,030,261,248 parameters)."""

    num_layers: int = 32
    """Transformer layers."""
    hidden_size: int = 4096
    """Model width."""
    ffn_hidden_size: int = 14336
    """Width of the SwiGLU MLP."""
    num_attention_heads: int = 32
    """Query heads."""


@dataclass
class Llama3ModelProvider70B(Llama3ModelProvider):
    """Llama 3 70B: 80 layers of width 8192, 64 query heads over 8 key/value groups (70,553,706,496 parameters)."""

    num_layers: int = 80
    """Transformer layers."""
    hidden_size: int = 8192
    """Model width."""
    ffn_hidden_size: int = 28672
    """Width of the SwiGLU MLP."""
    num_attention_heads: int = 64
    """Query heads."""
    init_method_std: float = 0.008944
    """Standard deviation of the normal weight initialization (Megatron-Bridge's for Llama 3 70B)."""


@dataclass
class Llama31ModelProvider8B(Llama31ModelProvider):
    """Llama 3.1 8B: the Llama 3 8B dimensions with a 128K context."""

    num_layers: int = 32
    """Transformer layers."""
    hidden_size: int = 4096
    """Model width."""
    ffn_hidden_size: int = 14336
    """Width of the SwiGLU MLP."""
    num_attention_heads: int = 32
    """Query heads."""


@dataclass
class Llama31ModelProvider70B(Llama31ModelProvider):
    """Llama 3.1 70B: the Llama 3 70B dimensions with a 128K context."""

    num_layers: int = 80
    """Transformer layers."""
    hidden_size: int = 8192
    """Model width."""
    ffn_hidden_size: int = 28672
    """Width of the SwiGLU MLP."""
    num_attention_heads: int = 64
    """Query heads."""


@dataclass
class Llama32ModelProvider1B(Llama31ModelProvider):
    """Llama 3.2 1B: 16 layers of width 2048, 32 query heads over 8 groups, tied embeddings (1,235,814,400)."""

    num_layers: int = 16
    """Transformer layers."""
    hidden_size: int = 2048
    """Model width."""
    ffn_hidden_size: int = 8192
    """Width of the SwiGLU MLP."""
    num_attention_heads: int = 32
    """Query heads."""
    share_embeddings_and_output_weights: bool = True
    """The output projection is the input embedding, as published."""
    rope_scaling_factor: float = 32.0
    """Llama 3.2's rotary scaling factor."""


@dataclass
class Llama32ModelProvider3B(Llama31ModelProvider):
    """Llama 3.2 3B: 28 layers of width 3072, 24 query heads over 8 groups, tied embeddings (3,212,749,824)."""

    num_layers: int = 28
    """Transformer layers."""
    hidden_size: int = 3072
    """Model width."""
    ffn_hidden_size: int = 8192
    """Width of the SwiGLU MLP."""
    num_attention_heads: int = 24
    """Query heads."""
    share_embeddings_and_output_weights: bool = True
    """The output projection is the input embedding, as published."""
    rope_scaling_factor: float = 32.0
    """Llama 3.2's rotary scaling factor."""


@dataclass
class LlamaTinyModelProvider(LlamaModelProvider):
    """A 4-layer Llama of width 64 for CPU runs: 262,720 parameters, a few hundredths of a second per step.

    4 query heads over 2 key/value groups and an MLP of 192 split evenly over 2 tensor-parallel ranks; 4 layers split
    evenly over 2 pipeline stages. The vocabulary of 512 fits megatron-core's byte-level tokenizer.
    """

    num_layers: int = 4
    """Transformer layers."""
    hidden_size: int = 64
    """Model width."""
    ffn_hidden_size: int = 192
    """Width of the SwiGLU MLP."""
    num_attention_heads: int = 4
    """Query heads (16 dimensions each)."""
    num_query_groups: Optional[int] = 2
    """Key/value groups: grouped-query attention with 2 query heads per group."""
    vocab_size: Optional[int] = 512
    """megatron-core's byte-level tokenizer's default vocabulary (256 byte values and room for special tokens)."""
    seq_length: int = 64
    """Sequence length of the training samples."""
