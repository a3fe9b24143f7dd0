"""Pretrain the tiny GPT recipe; every config field can be overridden with a dotted ``key=value``.

torchrun --nproc-per-node=2 examples/pretrain_tiny_gpt.py checkpoint.save=/tmp/ckpt checkpoint.load=/tmp/ckpt
"""

from megatron.bridge.models.gpt import gpt_forward_step
from megatron.bridge.recipes.tiny_gpt import tiny_gpt_config
from megatron.bridge.training.pretrain import main

if __name__ == "__main__":  # the guard matters: checkpoint writers spawn helper processes
    main(tiny_gpt_config, gpt_forward_step)
