"""Batch samplers and the pretraining data loader (Megatron-Bridge's ``data.samplers``).

:class:`MegatronPretrainingSampler` hands each data-parallel rank its slice of consecutive global batches, from
sample ``consumed_samples`` on: a resumed run reads exactly the samples an uninterrupted run would have read next.
:func:`build_pretraining_data_loader` wraps it in a ``DataLoader``; every iterator of this package's data
(``data.mock``, ``data.builders``) is made by it.

Guards against: data-parallel ranks drifting apart at the end of a split. A final partial global batch that cannot
give every rank a batch (``drop_last=False`` with several ranks) is an error, not a silently shorter batch on some
ranks: a rank with fewer micro-batches than its peers would hang in the gradient all-reduce.
"""

from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from megatron.bridge.utils.cpu_shims import training_on_cpu

UNBOUNDED_SAMPLES = 2**62
"""``total_samples`` for a dataset that bounds its reads itself (an endless mock stream, or a split that raises a
clear error past the samples built for it)."""


class MegatronPretrainingSampler:
    """Sequential micro-batches of global sample indices for one data-parallel rank.

    A global batch is ``micro_batch_size * data_parallel_size`` consecutive indices; rank ``r`` takes its ``r``-th
    ``micro_batch_size`` slice.

    Args:
        total_samples: samples in the dataset (the indices stop before it).
        consumed_samples: the first global index (a resumed run's ``consumed_train_samples``).
        micro_batch_size: indices per micro-batch.
        data_parallel_rank: this rank's data-parallel rank.
        data_parallel_size: the data-parallel size.
        drop_last: drop a final partial global batch; with ``False`` it is yielded when one rank reads alone, and
            is an error with several ranks (see the module doc).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"total_samples must be > 0, got {total_samples} (no sample to read)")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed_samples={consumed_samples} leaves no sample to read of total_samples={total_samples}"
            )
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(
                f"micro_batch_size ({micro_batch_size}) and data_parallel_size ({data_parallel_size}) must be > 0"
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank={data_parallel_rank} is not below data_parallel_size")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def get_start_end_idx(self) -> tuple[int, int]:
        """The slice ``[start, end)`` of a global batch that is this rank's."""
        start = self.data_parallel_rank * self.micro_batch_size
        return start, start + self.micro_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        stride = self.micro_batch_times_data_parallel_size
        first, last = self.get_start_end_idx()
        start = self.consumed_samples
        while start + stride <= self.total_samples:
            yield list(range(start + first, start + last))
            start += stride
        tail = self.total_samples - start
        if tail == 0 or self.drop_last:
            return
        if self.data_parallel_size > 1:
            raise ValueError(
                f"the last global batch holds {tail} of {stride} samples, too few for every one of "
                f"{self.data_parallel_size} data-parallel ranks to read a full micro-batch; with drop_last=False "
                "the ranks would run different numbers of steps. Set drop_last=True, or size the dataset to a "
                "multiple of micro_batch_size * data_parallel_size (padding it)"
            )
        yield list(range(start, self.total_samples))


def build_pretraining_data_loader(
    dataset: Optional[Dataset],
    consumed_samples: int,
    dataloader_type: str,
    micro_batch_size: int,
    num_workers: int,
    data_sharding: bool = False,
    worker_init_fn: Optional[Callable[[int], None]] = None,
    collate_fn: Optional[Callable] = None,
    pin_memory: bool = True,
    persistent_workers: bool = False,
    data_parallel_rank: int = 0,
    data_parallel_size: int = 1,
    drop_last: Optional[bool] = True,
    global_batch_size: Optional[int] = None,
    seed: Optional[int] = None,
    total_samples: Optional[int] = None,
) -> Any:
    """A ``DataLoader`` of this rank's micro-batches of ``dataset`` from ``consumed_samples`` on.

    Args:
        dataset: the samples (``None``: returns ``None``).
        consumed_samples: the first global sample index.
        dataloader_type: ``"single"`` (:class:`MegatronPretrainingSampler`) or ``"external"`` (``dataset`` is
            already a loader and is returned as is). Megatron-Bridge's ``"cyclic"`` and ``"batch"`` samplers serve
            its fine-tuning datasets, which this package does not provide: they raise ``ValueError``.
        micro_batch_size: samples per micro-batch.
        num_workers: loader worker processes (spawned, not forked: see below).
        data_sharding: accepted for Megatron-Bridge compatibility; only the ``"cyclic"`` sampler reads it.
        worker_init_fn: run in each worker at its start (e.g. to ignore the preemption signal).
        collate_fn: the loader's collate function (``None``: PyTorch's default).
        pin_memory: pin batches in page-locked memory; applies only where a GPU is present.
        persistent_workers: keep the workers between epochs (only with ``num_workers > 0``).
        data_parallel_rank: this rank's data-parallel rank.
        data_parallel_size: the data-parallel size.
        drop_last: drop a final partial global batch (``None`` counts as ``True``).
        global_batch_size: read by the ``"batch"`` sampler only.
        seed: seeds the loader's private generator (the workers' seeds); ``None``: 0. Making the iterator never
            draws from the global RNG, so a resumed run (which makes it after restoring the RNG) does not diverge.
        total_samples: the sampler's bound; ``None``: ``len(dataset)``.
    """
    del data_sharding, global_batch_size  # read by the samplers this package does not provide
    if dataset is None:
        return None
    if dataloader_type == "external":
        return dataset
    if dataloader_type != "single":
        raise ValueError(
            f"dataloader_type={dataloader_type!r} is not supported: this package reads pretraining data with the "
            "'single' sampler (or takes an 'external' loader as is)"
        )
    sampler = MegatronPretrainingSampler(
        total_samples=len(dataset) if total_samples is None else total_samples,
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
        drop_last=True if drop_last is None else drop_last,
    )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        # Workers are spawned, not forked: a rank forks them from a process with dozens of threads (gloo's loops,
        # the hang watch, checkpoint writers), and a lock one of them holds at that instant stays held forever in
        # the child. A spawned worker starts from a fresh interpreter.
        multiprocessing_context="spawn" if num_workers > 0 else None,
        persistent_workers=persistent_workers and num_workers > 0,
        pin_memory=pin_memory and not training_on_cpu(),  # pinning needs CUDA, untouched with dist.device=cpu
        collate_fn=collate_fn,
        worker_init_fn=worker_init_fn,
        generator=torch.Generator().manual_seed(0 if seed is None else seed),
    )


__all__ = ["UNBOUNDED_SAMPLES", "MegatronPretrainingSampler", "build_pretraining_data_loader"]
