"""The config unit tests start from: the tiny GPT recipe's model, optimizer and data, the rest at defaults."""

from megatron.bridge.recipes.tiny_gpt import tiny_gpt_dataset, tiny_gpt_optimizer, tiny_gpt_provider
from megatron.bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    LoggerConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
)


def base_config() -> ConfigContainer:
    """A ``ConfigContainer`` with the tiny GPT model, optimizer and mock data, 100 steps of 8 samples, and every other
    section at its defaults."""
    return ConfigContainer(
        model=tiny_gpt_provider(),
        optimizer=tiny_gpt_optimizer(),
        train=TrainingConfig(train_iters=100, micro_batch_size=2, global_batch_size=8),
        scheduler=SchedulerConfig(),
        dataset=tiny_gpt_dataset(),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=128),
        logger=LoggerConfig(),
        checkpoint=CheckpointConfig(),
    )
