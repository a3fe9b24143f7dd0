"""Pretrain a small GPT from a config written the Megatron-Bridge way, with a callback that records progress.

    torchrun --nproc-per-node=2 examples/training_features/callbacks/pretrain_with_callbacks.py \
        --record /tmp/progress.jsonl checkpoint.save=/tmp/ckpt checkpoint.load=/tmp/ckpt

Every other argument is a dotted override (``train.train_iters=12``). Rank 0 appends one JSON line per event to
``--record``: the checkpoint the run resumed from, where training starts (step, consumed samples), every finished
step with its loss, every committed checkpoint, every evaluation, and the end of training.
"""

import argparse
import json

import torch.distributed as dist

from megatron.bridge.models import GPTModelProvider
from megatron.bridge.training.callbacks import Callback, CallbackContext, CheckpointCallbackContext
from megatron.bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    DistributedInitConfig,
    LoggerConfig,
    MockGPTDatasetConfig,
    OptimizerConfig,
    RNGConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
)
from megatron.bridge.training.gpt_step import forward_step
from megatron.bridge.training.pretrain import main


def config() -> ConfigContainer:
    """The tiny GPT recipe's run (same model, optimizer, data and seed), spelled out field by field."""
    return ConfigContainer(
        model=GPTModelProvider(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            vocab_size=128,
            seq_length=32,
            hidden_dropout=0.1,
            attention_dropout=0.1,
            init_method_std=0.02,
        ),
        train=TrainingConfig(train_iters=20, micro_batch_size=2, global_batch_size=8),
        optimizer=OptimizerConfig(
            optimizer="adam", lr=1e-3, min_lr=1e-5, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0
        ),
        scheduler=SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=2),
        dataset=MockGPTDatasetConfig(
            seq_length=32,
            random_seed=1234,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            num_workers=0,
        ),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=128),
        logger=LoggerConfig(log_interval=1),
        checkpoint=CheckpointConfig(most_recent_k=3),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(distributed_backend="nccl"),  # gloo on a machine without GPUs
    )


class ProgressRecorder(Callback):
    """Appends what rank 0 sees at the resume, after each step and at the end, as JSON lines."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, record: dict) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def on_checkpoint_load(self, context: CheckpointCallbackContext) -> None:
        self._write({"event": "loaded", "checkpoint": context.checkpoint_name, "tier": context.checkpoint_type.value})

    def on_checkpoint_save(self, context: CheckpointCallbackContext) -> None:
        step = context.state.train_state.step
        self._write({"event": "saved", "step": step, "checkpoint": context.checkpoint_name,
                     "tier": context.checkpoint_type.value})  # fmt: skip

    def on_train_start(self, context: CallbackContext) -> None:
        progress = context.state.train_state
        self._write({"event": "start", "step": progress.step, "consumed": progress.consumed_train_samples})

    def on_train_step_end(self, context: CallbackContext) -> None:
        progress = context.state.train_state  # counts the step after this event
        loss = float(context.loss_dict["lm loss"]) if context.loss_dict else None
        self._write({"event": "step", "step": progress.step + 1, "loss": loss, "skipped": context.skipped_iter})

    def on_eval_end(self, context: CallbackContext) -> None:
        progress = context.state.train_state
        loss = context.total_loss_dict.get("lm loss")
        self._write(
            {"event": "eval", "step": progress.step, "consumed_valid": progress.consumed_valid_samples, "loss": loss}
        )

    def on_train_end(self, context: CallbackContext) -> None:
        progress = context.state.train_state
        self._write({"event": "end", "step": progress.step, "consumed": progress.consumed_train_samples})


if __name__ == "__main__":  # the guard matters: checkpoint writers spawn helper processes
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", required=True, help="JSON-lines file rank 0 appends its progress to")
    args, overrides = parser.parse_known_args()
    main(config, forward_step, overrides, callbacks=[ProgressRecorder(args.record)])
