"""Llama 3 recipes by their short names (Megatron-Bridge's aliases of the H100 recipes), and the CPU-sized Llama.

``llama3_8b_pretrain_config`` is ``llama3_8b_pretrain_2gpu_h100_bf16_config`` (``recipes/llama/h100/llama3.py``),
and so on for each size; every recipe takes no argument and returns a ``ConfigContainer`` that validates. Change
any field on the returned config, or with dotted overrides (``recipes/run.py``): ``dataset.blend`` for real data,
``checkpoint.save``/``load``, ``train.train_iters``, the parallel sizes under ``model.``.

``llama3_tiny_pretrain_config`` is this package's: a Llama small enough to train on two CPU ranks, the model the
resiliency drills train.
"""

from megatron.bridge.models.llama import LlamaTinyModelProvider
from megatron.bridge.recipes.common import _pretrain_common
from megatron.bridge.recipes.llama.h100.llama3 import (
    llama3_8b_pretrain_2gpu_h100_bf16_config as llama3_8b_pretrain_config,
)
from megatron.bridge.recipes.llama.h100.llama3 import (
    llama3_70b_pretrain_32gpu_h100_bf16_config as llama3_70b_pretrain_config,
)
from megatron.bridge.recipes.llama.h100.llama3 import (
    llama31_8b_pretrain_2gpu_h100_bf16_config as llama31_8b_pretrain_config,
)
from megatron.bridge.recipes.llama.h100.llama3 import (
    llama31_70b_pretrain_32gpu_h100_bf16_config as llama31_70b_pretrain_config,
)
from megatron.bridge.recipes.llama.h100.llama3 import (
    llama32_1b_pretrain_1gpu_h100_bf16_config as llama32_1b_pretrain_config,
)
from megatron.bridge.recipes.llama.h100.llama3 import (
    llama32_3b_pretrain_1gpu_h100_bf16_config as llama32_3b_pretrain_config,
)
from megatron.bridge.training.config import ConfigContainer, TokenizerConfig

BYTE_LEVEL = {"library": "byte-level"}
"""megatron-core's byte-level tokenizer (512 ids), selected through ``tokenizer.metadata_path``."""


def llama3_tiny_pretrain_config() -> ConfigContainer:
    """The CPU-sized Llama (4 layers, width 64, GQA 4/2) on 2 ranks; the byte-level tokenizer.

    40 iterations of 8 x 64 tokens, a checkpoint every 10, a log line every step, the distributed optimizer without
    overlap, batches read in the training process (``dataset.num_workers=0``: on a CPU machine a loader worker
    competes with the ranks for the cores, and waiting on two workers per rank took 11% of the step time here,
    against about 1-2% in-process). Mock data with the byte-level vocabulary; set ``dataset.blend`` (e.g. to the
    corpus ``megatron.bridge.data.preprocess`` made) for real data, split 90/8/2.
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    model = LlamaTinyModelProvider()
    cfg = _pretrain_common(model)
    model.seq_length = 64
    model.cross_entropy_loss_fusion = True
    model.cross_entropy_fusion_impl = "te"  # as the published recipes; off on CPU (no kernel)
    cfg.ddp = DistributedDataParallelConfig(use_distributed_optimizer=True)
    cfg.train.train_iters = 40
    cfg.train.global_batch_size = 8
    cfg.train.micro_batch_size = 2
    cfg.optimizer.lr = 3e-3
    cfg.optimizer.min_lr = 3e-4
    cfg.scheduler.lr_warmup_iters = 2
    cfg.validation.eval_interval = None
    cfg.validation.eval_iters = 2
    cfg.checkpoint.save_interval = 10
    cfg.logger.log_interval = 1
    cfg.dataset.seq_length = 64
    cfg.dataset.num_workers = 0
    cfg.dataset.split = "90,8,2"
    cfg.tokenizer = TokenizerConfig(metadata_path=dict(BYTE_LEVEL))
    return cfg


__all__ = [
    "llama3_8b_pretrain_config",
    "llama3_70b_pretrain_config",
    "llama31_8b_pretrain_config",
    "llama31_70b_pretrain_config",
    "llama32_1b_pretrain_config",
    "llama32_3b_pretrain_config",
    "llama3_tiny_pretrain_config",
]
