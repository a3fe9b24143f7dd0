"""A GPT model from megatron-core (local layer spec, no Transformer Engine); forward step: ``training/gpt_step.py``."""

from typing import Any

import torch

from megatron.bridge.training.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def transformer_config(cfg: ModelConfig, device: torch.device) -> Any:
    """megatron-core ``TransformerConfig`` for ``cfg``; parameters are created on CPU when ``device`` is a CPU."""
    from megatron.core.transformer import TransformerConfig

    dtype = _DTYPES[cfg.params_dtype]
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device.type == "cpu",
    )


def build_gpt_model(cfg: ModelConfig, device: torch.device) -> torch.nn.Module:
    """Build the GPT model of ``cfg`` on ``device`` (seed the generators first for a reproducible init)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(cfg, device)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
        position_embedding_type="learned_absolute",
    ).to(device)
    if config.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)  # bf16 compute, fp32 logits out, as megatron-core expects
    return model
