"""Llama 3 recipes, Megatron-Bridge style: each function returns a ``ConfigContainer`` that validates.

``llama3_8b_pretrain_config``, ``llama3_70b_pretrain_config`` and ``llama32_1b_pretrain_config`` carry the
published model sizes and Megatron-Bridge's training defaults (parallelism, batch sizes, learning rates);
``llama3_tiny_pretrain_config`` is this package's CPU-sized Llama that the resiliency drills train. Every argument
is a keyword with Megatron-Bridge's name (``Llama3CommonKwargs``); calling a recipe with none gives its defaults, and
any field can be changed afterwards on the returned config or by dotted overrides (``recipes/run.py``).

Data: ``data_paths`` (megatron indexed dataset prefixes, optionally weighted: ``["0.7", "a", "0.3", "b"]``) split
by ``split``, or ``train_data_path``/``valid_data_path``/``test_data_path`` per split; with neither (or
``mock=True``) the mock token stream. Tokenizer: nothing is downloaded. ``tokenizer_model`` (a local HuggingFace
``tokenizer.json`` or its directory) selects the HuggingFace tokenizer; else the NullTokenizer with the model's
vocabulary (mock data) or, for the tiny recipe, megatron-core's byte-level tokenizer.

Precision: bf16 where CUDA is available, fp32 on a CPU-only machine (megatron-core's mixed-precision optimizer
needs CUDA tensors).
"""

import os
from typing import Any, Optional, TypedDict

import torch

from megatron.bridge.models.llama import (
    Llama3ModelProvider8B,
    Llama3ModelProvider70B,
    Llama32ModelProvider1B,
    LlamaModelProvider,
    LlamaTinyModelProvider,
)
from megatron.bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    GPTDatasetConfig,
    LoggerConfig,
    OptimizerConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidationConfig,
)

BYTE_LEVEL = {"library": "byte-level"}
"""megatron-core's byte-level tokenizer (512 ids), selected through ``tokenizer.metadata_path``."""


class Llama3CommonKwargs(TypedDict, total=False):
    """The keyword arguments every Llama 3 recipe takes (Megatron-Bridge's names)."""

    dir: Optional[str]
    """Run directory (default ``./nemo_experiments``): checkpoints in ``<dir>/<name>/checkpoints``, TensorBoard
    in ``<dir>/<name>/tb_logs``."""
    name: str
    """The run's name under ``dir``."""
    data_paths: Optional[list[str]]
    """Indexed dataset prefixes, optionally preceded by weights, split by ``split``."""
    train_data_path: Optional[list[str]]
    """Prefixes of the training split (with ``valid_data_path``/``test_data_path``, instead of ``data_paths``)."""
    valid_data_path: Optional[list[str]]
    """Prefixes of the validation split."""
    test_data_path: Optional[list[str]]
    """Prefixes of the test split."""
    split: str
    """Train/validation/test proportions of ``data_paths``."""
    mock: bool
    """Train on the mock token stream even if data paths are given."""
    tensor_model_parallel_size: int
    """Tensor parallelism."""
    pipeline_model_parallel_size: int
    """Pipeline parallelism."""
    pipeline_dtype: Optional[torch.dtype]
    """dtype of the activations pipeline stages exchange (``None``: the compute dtype)."""
    virtual_pipeline_model_parallel_size: Optional[int]
    """Interleaved (virtual) stages per pipeline rank."""
    context_parallel_size: int
    """Context parallelism (only 1 is supported here)."""
    sequence_parallel: bool
    """Sequence parallelism alongside tensor parallelism."""
    use_distributed_optimizer: bool
    """Shard the optimizer state over data-parallel ranks."""
    train_iters: int
    """Training iterations."""
    global_batch_size: int
    """Samples per iteration over all data-parallel ranks."""
    micro_batch_size: int
    """Samples per forward pass."""
    seq_length: int
    """Sequence length."""
    lr: float
    """Peak learning rate."""
    min_lr: float
    """Final learning rate."""
    lr_warmup_iters: int
    """Linear warmup iterations."""
    lr_decay_iters: Optional[int]
    """Cosine decay iterations (``None``: ``train_iters``)."""
    eval_interval: Optional[int]
    """Iterations between validations (``None``: none)."""
    save_interval: Optional[int]
    """Iterations between checkpoints."""
    use_null_tokenizer: bool
    """Use the NullTokenizer (ids only, no text)."""
    tokenizer_model: Optional[str]
    """A local HuggingFace ``tokenizer.json`` or its directory."""


def _dataset(kw: dict[str, Any], seq_length: int, seed: int, num_workers: int) -> Any:
    common = {
        "seq_length": seq_length,
        "random_seed": seed,
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "num_workers": num_workers,
    }
    per_split = [kw.get("train_data_path"), kw.get("valid_data_path"), kw.get("test_data_path")]
    split = kw.get("split", "9999,8,2")
    if kw.get("mock") or (kw.get("data_paths") is None and all(p is None for p in per_split)):
        # No files: the mock stream; a dotted override of dataset.blend later turns it into real data.
        return GPTDatasetConfig(blend=None, split=split, **common)
    if kw.get("data_paths") is not None:
        return GPTDatasetConfig(blend=_blend(kw["data_paths"]), split=split, **common)
    return GPTDatasetConfig(blend_per_split=[_blend(p) if p else None for p in per_split], split=None, **common)


def _blend(paths: list[str]) -> tuple[list[str], Optional[list[float]]]:
    """``["a", "b"]`` (equal weights) or ``["0.7", "a", "0.3", "b"]`` as megatron-core's ``(prefixes, weights)``."""
    try:
        weights = [float(w) for w in paths[0::2]]
    except ValueError:
        return list(paths), None
    if len(paths) % 2:
        raise ValueError(f"data_paths {paths!r}: weights and prefixes must alternate ('0.7', 'a', '0.3', 'b')")
    return list(paths[1::2]), weights


def _tokenizer(kw: dict[str, Any], vocab_size: int, byte_level: bool) -> TokenizerConfig:
    if kw.get("tokenizer_model"):
        return TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=kw["tokenizer_model"])
    if byte_level and not kw.get("use_null_tokenizer", False):
        return TokenizerConfig(metadata_path=dict(BYTE_LEVEL))
    return TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=vocab_size)


def _llama3_common(provider: LlamaModelProvider, defaults: dict[str, Any], kw: Llama3CommonKwargs) -> ConfigContainer:
    """A pretraining config for ``provider`` with ``defaults`` overridden by the caller's keywords."""
    unknown = set(kw) - set(Llama3CommonKwargs.__annotations__)
    if unknown:
        known = sorted(Llama3CommonKwargs.__annotations__)
        raise TypeError(f"unknown recipe argument(s) {sorted(unknown)}; known: {known}")
    k: dict[str, Any] = {**defaults, **kw}
    on_gpu = torch.cuda.is_available()
    provider.tensor_model_parallel_size = k.get("tensor_model_parallel_size", 1)
    provider.pipeline_model_parallel_size = k.get("pipeline_model_parallel_size", 1)
    provider.pipeline_dtype = k.get("pipeline_dtype")
    provider.virtual_pipeline_model_parallel_size = k.get("virtual_pipeline_model_parallel_size")
    provider.context_parallel_size = k.get("context_parallel_size", 1)
    provider.sequence_parallel = k.get("sequence_parallel", False)
    provider.seq_length = k["seq_length"]
    provider.bf16 = on_gpu
    provider.params_dtype = torch.bfloat16 if on_gpu else torch.float32
    byte_level = k.get("byte_level_tokenizer", False)
    tokenizer = _tokenizer(k, provider.vocab_size, byte_level)
    run_dir = os.path.join(k.get("dir") or os.path.join(os.getcwd(), "nemo_experiments"), k.get("name", "default"))
    distributed = k.get("use_distributed_optimizer", True)
    from megatron.core.distributed import DistributedDataParallelConfig

    return ConfigContainer(
        model=provider,
        train=TrainingConfig(
            train_iters=k["train_iters"],
            global_batch_size=k["global_batch_size"],
            micro_batch_size=k["micro_batch_size"],
        ),
        validation=ValidationConfig(eval_interval=k.get("eval_interval"), eval_iters=k.get("eval_iters", 32)),
        optimizer=OptimizerConfig(
            optimizer="adam",
            lr=k["lr"],
            min_lr=k["min_lr"],
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_eps=1e-5,
            clip_grad=1.0,
            bf16=on_gpu,
            params_dtype=provider.params_dtype,
            use_distributed_optimizer=distributed,
        ),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=distributed),
        scheduler=SchedulerConfig(
            lr_decay_style="cosine", lr_warmup_iters=k["lr_warmup_iters"], lr_decay_iters=k.get("lr_decay_iters")
        ),
        dataset=_dataset(k, k["seq_length"], k.get("seed", 1234), k.get("num_workers", 8)),
        tokenizer=tokenizer,
        logger=LoggerConfig(
            log_interval=k.get("log_interval", 10),
            tensorboard_dir=os.path.join(run_dir, "tb_logs"),
        ),
        checkpoint=CheckpointConfig(
            save=os.path.join(run_dir, "checkpoints"),
            load=os.path.join(run_dir, "checkpoints"),
            save_interval=k.get("save_interval"),
            ckpt_format="torch_dist",
            fully_parallel_save=True,
            async_save=False,
        ),
    )


_LARGE = {
    "train_iters": 1_168_251,
    "global_batch_size": 512,
    "micro_batch_size": 1,
    "seq_length": 8192,
    "lr": 3e-4,
    "min_lr": 3e-5,
    "lr_warmup_iters": 2000,
    "eval_interval": 2000,
    "save_interval": 500,
}


def llama3_8b_pretrain_config(**user_kwargs: Any) -> ConfigContainer:
    """Pretraining Llama 3 8B (8.03 B parameters); Megatron-Bridge's defaults: TP 1, PP 1, batch 512 x 8192."""
    return _llama3_common(Llama3ModelProvider8B(), _LARGE, user_kwargs)


def llama3_70b_pretrain_config(**user_kwargs: Any) -> ConfigContainer:
    """Pretraining Llama 3 70B (70.6 B parameters); defaults: TP 4, PP 4, virtual PP 5, batch 512 x 8192."""
    defaults = {
        **_LARGE,
        "tensor_model_parallel_size": 4,
        "pipeline_model_parallel_size": 4,
        "virtual_pipeline_model_parallel_size": 5,
        "sequence_parallel": True,
    }
    return _llama3_common(Llama3ModelProvider70B(), defaults, user_kwargs)


def llama32_1b_pretrain_config(**user_kwargs: Any) -> ConfigContainer:
    """Pretraining Llama 3.2 1B (1.24 B parameters, tied embeddings); defaults: TP 1, PP 1, batch 512 x 8192."""
    return _llama3_common(Llama32ModelProvider1B(), _LARGE, user_kwargs)


def llama3_tiny_pretrain_config(**user_kwargs: Any) -> ConfigContainer:
    """The CPU-sized Llama (4 layers, width 64, GQA 4/2) on 2 ranks; byte-level tokenizer on real data.

    Defaults: 40 iterations of 8 x 64 tokens, a checkpoint every 10, a log line every step, batches read in the
    training process (``dataset.num_workers=0``: on a CPU machine a loader worker competes with the ranks for the
    cores, and waiting on two workers per rank took 11% of the step time here, against about 1-2% in-process), the
    distributed optimizer. Give ``data_paths`` (e.g. the corpus ``megatron.bridge.data.preprocess``
    made) for real data; without them the mock stream with the byte-level vocabulary.
    """
    defaults = {
        "train_iters": 40,
        "global_batch_size": 8,
        "micro_batch_size": 2,
        "seq_length": 64,
        "lr": 3e-3,
        "min_lr": 3e-4,
        "lr_warmup_iters": 2,
        "eval_interval": None,
        "eval_iters": 2,
        "save_interval": 10,
        "log_interval": 1,
        "num_workers": 0,
        "split": "90,8,2",
        "byte_level_tokenizer": True,
    }
    return _llama3_common(LlamaTinyModelProvider(), defaults, user_kwargs)


__all__ = [
    "Llama3CommonKwargs",
    "llama3_8b_pretrain_config",
    "llama3_70b_pretrain_config",
    "llama32_1b_pretrain_config",
    "llama3_tiny_pretrain_config",
]
