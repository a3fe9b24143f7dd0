"""Llama 3, 3.1 and 3.2 pretraining recipes for H100 nodes in bf16, named as Megatron-Bridge names them.

``<model>_pretrain_<gpus>gpu_h100_bf16_config``: the GPU count is the smallest the recipe's parallelism fills. Each
function takes no argument and returns a ``ConfigContainer`` with Megatron-Bridge's defaults for that model: batches
of 512 x 8192 tokens, 1,168,251 iterations, 2,000 warmup iterations, a validation every 2,000 and a checkpoint every
500 iterations, the ``NullTokenizer`` with ``DEFAULT_NULL_TOKENIZER_VOCAB_SIZE`` ids and ``COMMON_RECIPE_ENV_VARS``;
change any field afterwards, or with dotted overrides (``recipes/run.py``).

The model config is this package's Llama provider of that size (``models/llama/``), built offline: Megatron-Bridge
reads it from the model's Hugging Face config, which needs the network. The fused cross entropy is Transformer
Engine's (off where Transformer Engine is not usable). Differences from Megatron-Bridge: context parallelism is 1
(not supported here; Megatron-Bridge uses 2 for the 8B and 70B recipes), and no tensor-parallel communication
overlap (the 70B recipes' userbuffers need Transformer Engine).
"""

from megatron.bridge.models.llama import (
    Llama3ModelProvider8B,
    Llama3ModelProvider70B,
    Llama31ModelProvider8B,
    Llama31ModelProvider70B,
    Llama32ModelProvider1B,
    Llama32ModelProvider3B,
    LlamaModelProvider,
)
from megatron.bridge.recipes.common import _pretrain_common
from megatron.bridge.recipes.utils.environment_utils import COMMON_RECIPE_ENV_VARS
from megatron.bridge.recipes.utils.tokenizer_utils import DEFAULT_NULL_TOKENIZER_VOCAB_SIZE
from megatron.bridge.training.config import ConfigContainer

SEQUENCE_LENGTH_8K = 8192
"""The sequence length of the Llama 3 pretraining recipes."""
SEQUENCE_LENGTH_128K = 131072
"""The sequence length of the Llama 3.1 70B recipe (Llama 3.1's context)."""


def _llama3_pretrain(
    model: LlamaModelProvider,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    virtual_pipeline_parallel: int | None = None,
    seq_length: int = SEQUENCE_LENGTH_8K,
) -> ConfigContainer:
    """``_pretrain_common`` for ``model`` with the Llama 3 pretraining schedule and the given parallelism."""
    cfg = _pretrain_common(model)
    model.tensor_model_parallel_size = tensor_parallel
    model.pipeline_model_parallel_size = pipeline_parallel
    model.virtual_pipeline_model_parallel_size = virtual_pipeline_parallel
    model.pipeline_dtype = None  # the compute dtype, when pipelined
    model.context_parallel_size = 1
    model.sequence_parallel = tensor_parallel > 1
    model.seq_length = seq_length
    model.cross_entropy_loss_fusion = True
    model.cross_entropy_fusion_impl = "te"
    cfg.dataset.seq_length = seq_length
    cfg.train.train_iters = 1_168_251
    cfg.train.global_batch_size = 512
    cfg.train.micro_batch_size = 1
    cfg.validation.eval_interval = 2000
    cfg.scheduler.lr_warmup_iters = 2000
    cfg.checkpoint.save_interval = 500
    cfg.tokenizer.vocab_size = DEFAULT_NULL_TOKENIZER_VOCAB_SIZE  # mock token ids: every Llama vocabulary holds them
    cfg.env_vars = {**COMMON_RECIPE_ENV_VARS}
    return cfg


def llama32_1b_pretrain_1gpu_h100_bf16_config() -> ConfigContainer:
    """Llama 3.2 1B (1.24 B parameters, tied embeddings) on one GPU: no model parallelism."""
    return _llama3_pretrain(Llama32ModelProvider1B())


def llama32_3b_pretrain_1gpu_h100_bf16_config() -> ConfigContainer:
    """Llama 3.2 3B (3.21 B parameters, tied embeddings) on one GPU: no model parallelism."""
    return _llama3_pretrain(Llama32ModelProvider3B())


def llama3_8b_pretrain_2gpu_h100_bf16_config() -> ConfigContainer:
    """Llama 3 8B (8.03 B parameters): no model parallelism (Megatron-Bridge: context parallel 2)."""
    return _llama3_pretrain(Llama3ModelProvider8B())


def llama3_70b_pretrain_32gpu_h100_bf16_config() -> ConfigContainer:
    """Llama 3 70B (70.6 B parameters): tensor parallel 4 with sequence parallelism, pipeline 4 x 5 virtual stages."""
    return _llama3_pretrain(Llama3ModelProvider70B(), 4, 4, 5)


def llama31_8b_pretrain_2gpu_h100_bf16_config() -> ConfigContainer:
    """Llama 3.1 8B: no model parallelism (Megatron-Bridge: context parallel 2), 8K sequences."""
    return _llama3_pretrain(Llama31ModelProvider8B())


def llama31_70b_pretrain_32gpu_h100_bf16_config() -> ConfigContainer:
    """Llama 3.1 70B on 128K sequences: tensor parallel 4 with sequence parallelism, pipeline 4 x 5 virtual stages."""
    return _llama3_pretrain(Llama31ModelProvider70B(), 4, 4, 5, seq_length=SEQUENCE_LENGTH_128K)


__all__ = [
    "llama31_70b_pretrain_32gpu_h100_bf16_config",
    "llama31_8b_pretrain_2gpu_h100_bf16_config",
    "llama32_1b_pretrain_1gpu_h100_bf16_config",
    "llama32_3b_pretrain_1gpu_h100_bf16_config",
    "llama3_70b_pretrain_32gpu_h100_bf16_config",
    "llama3_8b_pretrain_2gpu_h100_bf16_config",
]
