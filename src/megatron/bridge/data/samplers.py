"""Batch samplers and the pretraining data loader (Megatron-Bridge's ``data.samplers``).

:class:`MegatronPretrainingSampler` hands each data-parallel rank its slice of consecutive global batches, from
sample ``consumed_samples`` on: a resumed run reads exactly the samples an uninterrupted run would have read next.
:class:`MegatronPretrainingBatchSampler` hands it its share of whole global batches
(``dataloader_type="batch"``). :func:`build_pretraining_data_loader` wraps either in a ``DataLoader``; every
loader of this package's data (``data.loaders``) is made by it.

Guards against: data-parallel ranks drifting apart at the end of a split. A final partial global batch that cannot
give every rank a batch (``drop_last=False`` with several ranks) is an error, not a silently shorter batch on some
ranks: a rank with fewer micro-batches than its peers would hang in the gradient all-reduce.
"""

from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from megatron.bridge.utils.cpu_shims import training_on_cpu


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


class MegatronPretrainingBatchSampler:
    """Whole global batches, shuffled per epoch: each yield is this data-parallel rank's share of one global batch.

    The epoch's order is a permutation seeded by ``seed + epoch``; the epoch and the offset in it follow from
    ``consumed_samples``, which advances as batches are yielded, so a resumed run (and every later epoch when the
    loader is iterated again) reads what an uninterrupted run would. Rank ``r`` takes every ``data_parallel_size``-th
    index of a global batch from ``r`` on; the loop splits that share into micro-batches.

    Args:
        total_samples: samples in the dataset (one epoch).
        consumed_samples: global samples already read (a resumed run's ``consumed_train_samples``).
        micro_batch_size: rows of a micro-batch.
        global_batch_size: rows of a global batch, a multiple of ``micro_batch_size * data_parallel_size``.
        data_parallel_rank: this rank's data-parallel rank.
        data_parallel_size: the data-parallel size.
        drop_last: drop an epoch's final partial global batch.
        pad_samples_to_global_batch_size: fill a final partial global batch with index ``-1``, for a dataset that
            reads ``-1`` as a loss-masked padding sample.
        shuffle: permute each epoch (``False``: in order).
        seed: the permutation's base seed; ``None``: ``torch.initial_seed()``.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        global_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
        pad_samples_to_global_batch_size: bool = False,
        shuffle: bool = True,
        seed: Optional[int] = None,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"total_samples must be > 0, got {total_samples} (no sample to read)")
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(
                f"micro_batch_size ({micro_batch_size}) and data_parallel_size ({data_parallel_size}) must be > 0"
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank={data_parallel_rank} is not below data_parallel_size")
        per_step = micro_batch_size * data_parallel_size
        if global_batch_size % per_step:
            raise RuntimeError(
                f"`global_batch_size` ({global_batch_size}) is not divisible by `micro_batch_size "
                f"({micro_batch_size}) x data_parallel_size ({data_parallel_size})`"
            )
        if drop_last and total_samples < global_batch_size:
            raise ValueError(
                f"drop_last=True needs at least one full global batch: total_samples={total_samples} < "
                f"global_batch_size={global_batch_size}"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = per_step
        self.drop_last = drop_last
        self.pad_samples_to_global_batch_size = pad_samples_to_global_batch_size
        self.shuffle = shuffle
        self.seed = int(torch.initial_seed() if seed is None else seed)
        self._global_batch_size = global_batch_size
        self._num_micro_batches = global_batch_size // per_step
        self._global_batch_size_on_this_data_parallel_rank = self._num_micro_batches * micro_batch_size

    def _epoch_samples(self) -> int:
        """Samples one epoch advances ``consumed_samples`` by."""
        gbs = self._global_batch_size
        if self.drop_last:
            return self.total_samples // gbs * gbs
        if self.pad_samples_to_global_batch_size:
            return -(-self.total_samples // gbs) * gbs
        return self.total_samples

    def __len__(self) -> int:
        """Global batches left in the current epoch."""
        left = self._epoch_samples() - self.consumed_samples % self._epoch_samples()
        return left // self._global_batch_size if self.drop_last else -(-left // self._global_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        epoch, offset = divmod(self.consumed_samples, self._epoch_samples())
        if self.shuffle:
            order = torch.randperm(self.total_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
            indices = order.tolist()[offset:]
        else:
            indices = list(range(offset, self.total_samples))
        gbs, rank, size = self._global_batch_size, self.data_parallel_rank, self.data_parallel_size
        full = len(indices) // gbs * gbs
        for start in range(0, full, gbs):
            self.consumed_samples += gbs
            yield indices[start + rank : start + gbs : size]
        tail = indices[full:]
        if not tail or self.drop_last:
            return
        share = tail[rank::size]
        if self.pad_samples_to_global_batch_size:
            share += [-1] * (gbs // size - len(share))
            self.consumed_samples += gbs
        else:
            self.consumed_samples += len(tail)
        yield share


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
) -> Any:
    """A ``DataLoader`` of this rank's batches of ``dataset`` from global sample ``consumed_samples`` on.

    Args:
        dataset: the samples (``None``: returns ``None``).
        consumed_samples: the first global sample index.
        dataloader_type: ``"single"`` (:class:`MegatronPretrainingSampler`: micro-batches), ``"batch"``
            (:class:`MegatronPretrainingBatchSampler`: this rank's share of a global batch, padded when
            ``drop_last`` is off) or ``"external"`` (``dataset`` is already a loader and is returned as is).
            Megatron-Bridge's ``"cyclic"`` sampler serves its fine-tuning datasets, which this package does not
            provide: it raises ``ValueError``.
        micro_batch_size: samples per micro-batch.
        num_workers: loader worker processes (spawned, not forked: see below).
        data_sharding: read by the ``"cyclic"`` sampler only.
        worker_init_fn: run in each worker at its start (e.g. to ignore the preemption signal).
        collate_fn: the loader's collate function (``None``: PyTorch's default).
        pin_memory: pin batches in page-locked memory; applies only where a GPU is present.
        persistent_workers: keep the workers between epochs (only with ``num_workers > 0``).
        data_parallel_rank: this rank's data-parallel rank.
        data_parallel_size: the data-parallel size.
        drop_last: drop a final partial batch (``None`` counts as ``True``).
        global_batch_size: the ``"batch"`` sampler's global batch (required by it).
        seed: seeds the ``"batch"`` sampler's shuffle and the loader's private generator (the workers' seeds);
            ``None``: 0 for the generator. Making the iterator never draws from the global RNG, so a resumed run
            (which makes it after restoring the RNG) does not diverge.

    Raises:
        RuntimeError: ``"batch"`` without ``global_batch_size``.
        ValueError: an unsupported ``dataloader_type``.
    """
    del data_sharding  # read by the "cyclic" sampler, which this package does not provide
    if dataset is None:
        return None
    if dataloader_type == "external":
        return dataset
    drop_last = True if drop_last is None else drop_last
    where = {
        "total_samples": len(dataset),
        "consumed_samples": consumed_samples,
        "micro_batch_size": micro_batch_size,
        "data_parallel_rank": data_parallel_rank,
        "data_parallel_size": data_parallel_size,
        "drop_last": drop_last,
    }
    if dataloader_type == "single":
        sampler: Any = MegatronPretrainingSampler(**where)
    elif dataloader_type == "batch":
        if global_batch_size is None:
            raise RuntimeError("dataloader_type='batch' needs global_batch_size: the sampler loads global batches")
        sampler = MegatronPretrainingBatchSampler(
            **where, global_batch_size=global_batch_size, pad_samples_to_global_batch_size=not drop_last, seed=seed
        )
    else:
        raise ValueError(
            f"dataloader_type={dataloader_type!r} is not supported: this package reads data with the 'single' or "
            "'batch' sampler (or takes an 'external' loader as is)"
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


__all__ = [
    "MegatronPretrainingBatchSampler",
    "MegatronPretrainingSampler",
    "build_pretraining_data_loader",
]
