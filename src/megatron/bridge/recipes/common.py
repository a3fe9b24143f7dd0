"""The pretraining config every recipe starts from (Megatron-Bridge's ``_pretrain_common``), for a given model.

Megatron-Bridge's common defaults: adam with cosine decay (3e-4 to 3e-5, 500 warmup iterations; ``recipes.utils.
optimizer_utils``, whose scheduler applies a constant weight decay of 0.033), batches of 32 x 4096
tokens, mock data, a checkpoint and a validation every 500 iterations into ``./nemo_experiments/default``, the
distributed optimizer with gradient reduction overlapped and in fp32. The tokenizer is the NullTokenizer with the
model's vocabulary: nothing is downloaded, and ids from mock data always fit the embedding.

Precision: bf16 where CUDA is available, fp32 on a CPU-only machine (megatron-core's mixed-precision optimizer
needs CUDA tensors).
"""

import os

import torch

from megatron.bridge.models import GPTModelProvider
from megatron.bridge.recipes.utils.optimizer_utils import distributed_fused_adam_with_cosine_annealing
from megatron.bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    GPTDatasetConfig,
    LoggerConfig,
    RNGConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidationConfig,
)


def _pretrain_common(model: GPTModelProvider) -> ConfigContainer:
    """A pretraining config for ``model`` with the common defaults above; recipes change what differs."""
    from megatron.core.distributed import DistributedDataParallelConfig

    on_gpu = torch.cuda.is_available()
    model.bf16 = on_gpu
    model.params_dtype = torch.bfloat16 if on_gpu else torch.float32
    run_dir = os.path.join(os.getcwd(), "nemo_experiments", "default")
    optimizer, scheduler = distributed_fused_adam_with_cosine_annealing(
        precision="bf16-mixed" if on_gpu else "fp32",
        lr_warmup_iters=500,
        lr_decay_iters=None,  # validate() sets it to train.train_iters
        max_lr=3e-4,
        min_lr=3e-5,
    )
    optimizer.params_dtype = model.params_dtype
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=300_000, global_batch_size=32, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=500, eval_iters=32),
        optimizer=optimizer,
        scheduler=scheduler,
        ddp=DistributedDataParallelConfig(
            check_for_nan_in_grad=True,
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            average_in_collective=True,
            use_distributed_optimizer=True,
        ),
        dataset=GPTDatasetConfig(
            random_seed=1234,
            seq_length=4096,
            blend=None,  # mock data; a dotted override of dataset.blend gives real data
            split="9999,8,2",
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            num_workers=8,
        ),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=model.vocab_size),
        logger=LoggerConfig(log_interval=10, tensorboard_dir=os.path.join(run_dir, "tb_logs")),
        checkpoint=CheckpointConfig(
            save=os.path.join(run_dir, "checkpoints"),
            load=os.path.join(run_dir, "checkpoints"),
            save_interval=500,
            ckpt_format="torch_dist",
            fully_parallel_save=True,
            async_save=False,
        ),
        rng=RNGConfig(seed=1234),
    )
