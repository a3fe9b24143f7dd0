"""The tiny GPT recipe: a 2-layer model on mock data that trains in seconds on 2 CPU ranks.

Every size is a config field, so the same recipe scales up on GPUs through overrides
(``model.num_layers=24 model.hidden_size=2048 model.tensor_model_parallel_size=8 ...``).
"""

from megatron.bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    ModelConfig,
    TrainConfig,
)


def tiny_gpt_config() -> ConfigContainer:
    """A config that trains the tiny GPT for 20 iterations; set ``checkpoint.save``/``load`` to checkpoint."""
    return ConfigContainer(
        model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32),
        train=TrainConfig(train_iters=20, micro_batch_size=2, global_batch_size=8),
        checkpoint=CheckpointConfig(most_recent_k=3),
    )
