"""Mock pretraining data: deterministic token sequences addressed by their global sample index.

Sample ``i`` depends only on ``(seed, i)``, so the data position of a run is fully described by the number of
samples consumed: a resumed run continues with exactly the batches an uninterrupted run would have seen. Each
sequence is an arithmetic progression modulo the vocabulary with a random start and stride, so a model can learn
it and the loss visibly falls.
"""

from collections.abc import Callable, Iterator
from typing import Optional

import torch
from torch.utils.data import Dataset

from megatron.bridge.data.samplers import UNBOUNDED_SAMPLES, build_pretraining_data_loader


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


def build_data_iterator(
    *,
    vocab_size: int,
    seq_length: int,
    seed: int,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = True,
    worker_init_fn: Optional[Callable[[int], None]] = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Mock micro-batches for this rank from ``consumed_samples`` on (see :func:`positioned_iterator`)."""
    return positioned_iterator(
        MockGPTDataset(vocab_size, seq_length, seed),
        seed=seed,
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        worker_init_fn=worker_init_fn,
    )


def positioned_iterator(
    dataset: Dataset,
    *,
    seed: int,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = True,
    worker_init_fn: Optional[Callable[[int], None]] = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Iterator of this rank's micro-batches of ``dataset``, mock or real (``samplers.MegatronPretrainingSampler``).

    The sampler is unbounded: the dataset bounds its reads itself (the mock stream is endless; a real split fails
    with a clear error past the samples built for it). ``pin_memory`` applies only where a GPU is present.
    ``worker_init_fn`` runs in each worker process at its start (e.g. to ignore the preemption signal).
    """
    loader = build_pretraining_data_loader(
        dataset,
        consumed_samples,
        "single",
        micro_batch_size,
        num_workers,
        worker_init_fn=worker_init_fn,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        data_parallel_rank=dp_rank,
        data_parallel_size=dp_size,
        drop_last=True,
        seed=seed,
        total_samples=UNBOUNDED_SAMPLES,
    )
    return iter(loader)
