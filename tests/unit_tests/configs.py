"""The config unit tests start from: every section at its default, the tiny GPT recipe's model."""

from megatron.bridge.recipes.tiny_gpt import tiny_gpt_optimizer, tiny_gpt_provider
from megatron.bridge.training.config import ConfigContainer


def base_config() -> ConfigContainer:
    """A ``ConfigContainer`` with the tiny GPT model and optimizer and every other section at its defaults."""
    return ConfigContainer(model=tiny_gpt_provider(), optimizer=tiny_gpt_optimizer())
