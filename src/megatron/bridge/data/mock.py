"""Mock pretraining data: deterministic token sequences addressed by their global sample index.

Sample ``i`` depends only on ``(seed, i)``, so the data position of a run is fully described by the number of
samples consumed: a resumed run continues with exactly the batches an uninterrupted run would have seen. Each
sequence is an arithmetic progression modulo the vocabulary with a random start and stride, so a model can learn
it and the loss visibly falls.
"""

from collections.abc import Callable, Iterator
from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from megatron.bridge.utils.cpu_shims import training_on_cpu


class MockGPTDataset(Dataset):
    """An endless map-style dataset of next-token-prediction samples."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed

    def __len__(self) -> int:
        return 2**62

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


class PositionedBatchSampler(Sampler[list[int]]):
    """Yields this data-parallel rank's micro-batches of global sample indices, starting at ``consumed_samples``.

    A global batch of ``micro_batch_size * data_parallel_size`` consecutive indices is split so that rank ``r``
    takes the ``r``-th ``micro_batch_size`` slice.
    """

    def __init__(self, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __len__(self) -> int:
        return 2**62

    def __iter__(self) -> Iterator[list[int]]:
        stride = self.micro_batch_size * self.dp_size
        start = self.consumed_samples + self.dp_rank * self.micro_batch_size
        while True:
            yield list(range(start, start + self.micro_batch_size))
            start += stride


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
    """Iterator of this rank's micro-batches of ``dataset`` (:class:`PositionedBatchSampler`), mock or real.

    ``pin_memory`` applies only where a GPU is present. ``worker_init_fn`` runs in each worker process at its start
    (e.g. to ignore the preemption signal).
    """
    loader = DataLoader(
        dataset,
        batch_sampler=PositionedBatchSampler(consumed_samples, micro_batch_size, dp_rank, dp_size),
        num_workers=num_workers,
        # Workers are spawned, not forked: a rank forks them from a process with dozens of threads (gloo's loops,
        # the hang watch, checkpoint writers), and a lock one of them holds at that instant stays held forever in
        # the child; a worker's start-up then hung now and then (``torch.set_num_threads(1)`` in the worker takes
        # the C runtime's atexit lock). A spawned worker starts from a fresh interpreter.
        multiprocessing_context="spawn" if num_workers > 0 else None,
        persistent_workers=persistent_workers and num_workers > 0,
        pin_memory=pin_memory and not training_on_cpu(),  # pinning needs CUDA, untouched with dist.device=cpu
        worker_init_fn=worker_init_fn,
        # A private generator: creating the iterator must not draw from the global RNG, or a resumed run (which
        # creates it after restoring the RNG) would diverge from one that never stopped.
        generator=torch.Generator().manual_seed(seed),
    )
    return iter(loader)
