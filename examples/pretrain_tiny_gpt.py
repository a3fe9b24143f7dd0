"""Pretrain the tiny GPT recipe; every config field can be overridden with a dotted ``key=value``.

torchrun --nproc-per-node=2 examples/pretrain_tiny_gpt.py checkpoint.save=/tmp/ckpt checkpoint.load=/tmp/ckpt

The same as ``torchrun --nproc-per-node=2 -m megatron.bridge.recipes.tiny_gpt ...`` (which an installed wheel has).
"""

from megatron.bridge.recipes.tiny_gpt import main

if __name__ == "__main__":  # the guard matters: checkpoint writers spawn helper processes
    main()
