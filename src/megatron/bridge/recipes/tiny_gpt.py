"""The tiny GPT recipe: a 2-layer model on mock data that trains in seconds on 2 CPU ranks.

Every size is a config field, so the same recipe scales up on GPUs through overrides
(``model.num_layers=24 model.hidden_size=2048 model.tensor_model_parallel_size=8 ...``).

Train it with any launcher; the module ships in the package, so this works from an installed wheel too::

    torchrun --nproc-per-node=2 -m megatron.bridge.recipes.tiny_gpt checkpoint.save=/ckpt checkpoint.load=/ckpt
"""

# models first: on CPU it turns megatron-core's jit fuser off before megatron-core loads (1.7 s per rank saved);
# OptimizerConfig (megatron-core's) is imported after it.
from megatron.bridge.models import GPTModelProvider
from megatron.bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    LoggerConfig,
    MockGPTDatasetConfig,
    OptimizerConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
)


def tiny_gpt_provider() -> GPTModelProvider:
    """A 2-layer GPT of width 64 with 4 heads, a vocabulary of 128 and sequences of 32 tokens."""
    return GPTModelProvider(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=128,
        seq_length=32,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        init_method_std=0.02,
    )


def tiny_gpt_optimizer() -> OptimizerConfig:
    """Adam at 1e-3 decaying to 1e-5, weight decay 0.01, betas 0.9/0.95, gradients clipped at norm 1."""
    return OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        min_lr=1e-5,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        clip_grad=1.0,
    )


def tiny_gpt_dataset(seq_length: int = 32, seed: int = 1234) -> MockGPTDatasetConfig:
    """Mock token sequences of ``seq_length`` tokens, loaded in the training process (no worker processes)."""
    return MockGPTDatasetConfig(
        seq_length=seq_length,
        random_seed=seed,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        num_workers=0,
    )


def tiny_gpt_config() -> ConfigContainer:
    """A config that trains the tiny GPT for 20 iterations; set ``checkpoint.save``/``load`` to checkpoint.

    Warmup of 2 steps then cosine decay; a log line every step.
    """
    return ConfigContainer(
        model=tiny_gpt_provider(),
        optimizer=tiny_gpt_optimizer(),
        scheduler=SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=2),
        train=TrainingConfig(train_iters=20, micro_batch_size=2, global_batch_size=8),
        dataset=tiny_gpt_dataset(),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=128),
        logger=LoggerConfig(log_interval=1),
        checkpoint=CheckpointConfig(most_recent_k=3),
    )


def main(argv: list[str] | None = None) -> None:
    """Pretrain the tiny GPT with dotted ``key=value`` overrides (the command line's by default); exits."""
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import main as pretrain_main

    pretrain_main(tiny_gpt_config, forward_step, argv)


if __name__ == "__main__":  # the guard matters: checkpoint writers and data loaders spawn helper processes
    main()
