"""Mock pretraining data: deterministic token sequences addressed by their global sample index.

Sample ``i`` depends only on ``(seed, i)``, so the data position of a run is fully described by the number of
samples consumed: a resumed run continues with exactly the batches an uninterrupted run would have seen. Each
sequence is an arithmetic progression modulo the vocabulary with a random start and stride, so a model can learn
it and the loss visibly falls.
"""

import torch
from torch.utils.data import Dataset

UNBOUNDED_SAMPLES = 2**62
"""The mock stream's length: endless for any run (a sampler bounded by it never stops first)."""


class MockGPTDataset(Dataset):
    """An endless map-style dataset of next-token-prediction samples."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed

    def __len__(self) -> int:
        return UNBOUNDED_SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = torch.randint(0, self.vocab_size, (1,), generator=gen)
        stride = torch.randint(1, 8, (1,), generator=gen)
        seq = (start + stride * torch.arange(self.seq_length + 1)) % self.vocab_size
        return {
            "tokens": seq[:-1].clone(),
            "labels": seq[1:].clone(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length),
        }


__all__ = ["UNBOUNDED_SAMPLES", "MockGPTDataset"]
