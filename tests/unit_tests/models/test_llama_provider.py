"""The Llama providers: published sizes counted on the meta device, the CPU-sized Llama built and run, their checks.

The published sizes are built under ``torch.device("meta")`` without initialization: shapes only, no memory, a
fraction of a second each. Building any megatron-core model needs its model-parallel state: one process, gloo.
"""

import ast
import importlib.util
import inspect
import sys
from dataclasses import dataclass

import pytest
import torch

import megatron.bridge.models as models
from megatron.bridge.models import (
    GPTModelProvider,
    Llama3ModelProvider,
    Llama3ModelProvider8B,
    Llama3ModelProvider70B,
    Llama31ModelProvider8B,
    Llama32ModelProvider1B,
    Llama32ModelProvider3B,
    LlamaModelProvider,
    LlamaTinyModelProvider,
    gpt_provider,
)
from megatron.bridge.models.llama import llama_provider

CPU = torch.device("cpu")
LLAMA3_8B_LAYER = 218_112_000
"""Parameters of one Llama 3 8B layer: attention 4096 x (4096 + 2 x 1024) + 4096 x 4096, SwiGLU MLP
4096 x 2 x 14336 + 14336 x 4096, two RMSNorms of 4096."""


@pytest.fixture(scope="module")
def model_parallel():
    """megatron-core's model-parallel state for this one process (every parallel size 1, gloo), torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron.bridge.utils.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _on_meta(provider: GPTModelProvider) -> torch.nn.Module:
    """``provider``'s model on the meta device: shapes without memory, weights not initialized."""
    provider.perform_initialization = False
    config = provider.for_device(CPU)
    with torch.device("meta"):
        return config.provide()


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight is counted once


@pytest.mark.parametrize(
    "provider_class, published",
    [
        (Llama3ModelProvider8B, 8_030_261_248),
        (Llama3ModelProvider70B, 70_553_706_496),
        (Llama31ModelProvider8B, 8_030_261_248),
        (Llama32ModelProvider1B, 1_235_814_400),
        (Llama32ModelProvider3B, 3_212_749_824),
    ],
)
def test_a_published_size_has_its_published_parameter_count(model_parallel, provider_class, published):
    model = _on_meta(provider_class())
    assert all(p.is_meta for p in model.parameters())
    assert _parameters(model) == published
    tied = provider_class.share_embeddings_and_output_weights
    assert (model.output_layer.weight is None) == tied


def test_llama_defaults_are_the_architectures():
    provider = LlamaModelProvider()
    assert provider.normalization == "RMSNorm"
    assert provider.activation_func is torch.nn.functional.silu
    assert provider.gated_linear_unit and not provider.add_bias_linear
    assert provider.position_embedding_type == "rope"
    assert not provider.share_embeddings_and_output_weights
    assert (provider.hidden_dropout, provider.attention_dropout) == (0.0, 0.0)
    assert (provider.layernorm_epsilon, provider.seq_length, provider.init_method_std) == (1e-5, 4096, 0.02)
    llama3 = Llama3ModelProvider()
    assert (llama3.rotary_base, llama3.seq_length, llama3.vocab_size, llama3.num_query_groups) == (
        500_000,
        8192,
        128256,
        8,
    )
    assert not llama3.rope_scaling
    assert models.__all__[:2] == ["GPTModelProvider", "ModelProviderMixin"]
    for name in models.__all__[2:]:
        assert getattr(models, name) is getattr(llama_provider, name)


def test_llama_31_and_32_scale_the_low_rotary_frequencies(model_parallel):
    plain = _on_meta(Llama3ModelProvider8B()).rotary_pos_emb.inv_freq
    by_8 = _on_meta(Llama31ModelProvider8B()).rotary_pos_emb.inv_freq
    by_32 = _on_meta(Llama32ModelProvider3B()).rotary_pos_emb.inv_freq  # also 128 dimensions per head
    assert plain.shape == by_8.shape == by_32.shape == (64,)
    assert by_8[0] == by_32[0] == plain[0]  # the highest frequency is kept
    assert by_8[-1].item() == pytest.approx(plain[-1].item() / 8)
    assert by_32[-1].item() == pytest.approx(plain[-1].item() / 32)


def test_the_tiny_llama_builds_on_cpu_and_gives_logits_and_gradients(model_parallel):
    torch.manual_seed(0)
    model = LlamaTinyModelProvider().for_device(CPU).provide()
    assert {p.device for p in model.parameters()} == {CPU}
    assert _parameters(model) == 262_720
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.shape == (64 + 2 * 2 * 16, 64)  # 4 query heads, 2 key/value groups of 16 dimensions

    batch, seq = 2, 64
    tokens = torch.randint(0, 512, (batch, seq))
    positions = torch.arange(seq).expand(batch, seq)
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    logits = model(tokens, positions, causal)
    assert logits.shape == (batch, seq, 512)
    assert torch.isfinite(logits).all()

    losses = model(tokens, positions, causal, labels=tokens)
    assert losses.shape == (batch, seq)
    losses.mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_the_tiny_llama_splits_over_two_tensor_and_two_pipeline_ranks():
    provider = LlamaTinyModelProvider(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32
    )
    provider.finalize()
    assert provider.num_layers % 2 == provider.num_attention_heads % 2 == provider.num_query_groups % 2 == 0
    assert provider.ffn_hidden_size % 2 == provider.vocab_size % 2 == 0


def test_finalize_refuses_query_heads_that_do_not_split_evenly_over_the_key_value_groups():
    provider = LlamaTinyModelProvider(hidden_size=192, num_attention_heads=6, num_query_groups=4)
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) must be a multiple of num_query_groups \(4\)"):
        provider.finalize()


@dataclass
class _ShallowLlama3(Llama3ModelProvider8B):
    num_layers: int = 2
    """Two of the 8B's 32 layers."""


def test_a_subclass_of_a_published_size_overrides_a_field_and_keeps_the_rest(model_parallel):
    provider = _ShallowLlama3(seq_length=1024)
    assert (provider.num_layers, provider.hidden_size, provider.ffn_hidden_size) == (2, 4096, 14336)
    assert (provider.num_attention_heads, provider.num_query_groups, provider.rotary_base) == (32, 8, 500_000)
    assert provider.seq_length == 1024
    assert _parameters(_on_meta(provider)) == 8_030_261_248 - 30 * LLAMA3_8B_LAYER


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine installed")
def test_without_transformer_engine_the_default_layer_spec_is_the_local_one(monkeypatch):
    def refused(**kwargs):
        raise AssertionError("the Transformer Engine spec was asked for without Transformer Engine")

    monkeypatch.setattr(gpt_provider, "get_gpt_layer_with_transformer_engine_spec", refused)
    gpt_provider.transformer_engine_usable.cache_clear()
    loaded = set(sys.modules)
    assert not gpt_provider.transformer_engine_usable()
    assert set(sys.modules) == loaded  # the answer came without importing anything
    provider = LlamaTinyModelProvider()
    assert provider.transformer_layer_spec is gpt_provider.default_layer_spec
    # By their text: from megatron-core 0.19 a spec holds a functools.partial, which equals no other partial.
    assert repr(gpt_provider.default_layer_spec(provider)) == repr(gpt_provider.local_layer_spec(provider))


def test_where_transformer_engine_is_usable_the_default_layer_spec_is_its_own(monkeypatch):
    calls = []
    monkeypatch.setattr(gpt_provider, "transformer_engine_usable", lambda: True)
    monkeypatch.setattr(
        gpt_provider, "get_gpt_layer_with_transformer_engine_spec", lambda **kwargs: calls.append(kwargs) or "te"
    )
    assert gpt_provider.default_layer_spec(LlamaTinyModelProvider(qk_layernorm=True)) == "te"
    assert calls == [{"qk_layernorm": True}]


def test_every_field_a_llama_provider_declares_has_a_docstring_under_it():
    tree = ast.parse(inspect.getsource(llama_provider))
    undocumented = []
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        for statement, following in zip(cls.body, [*cls.body[1:], None]):
            if isinstance(statement, ast.AnnAssign):
                documented = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                if not documented:
                    undocumented.append(f"{cls.name}.{statement.target.id}")
    assert not undocumented, undocumented
