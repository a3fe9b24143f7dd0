"""From a dataset provider to the train, validation and test loaders and iterators (Megatron-Bridge's ``data.loaders``).

Training set-up calls :func:`setup_data_iterators` once per run: the provider builds the splits for the sample
counts of :func:`get_train_valid_test_num_samples`, :func:`build_train_valid_test_data_loaders` wraps each in a
loader positioned at the samples the run already consumed (``TrainState.consumed_*``), so a resumed run reads exactly
what an uninterrupted one would, and :func:`build_train_valid_test_data_iterators` turns the loaders into what the
loop reads: micro-batches.

Guards against: a split that runs out mid-run, which fails naming the split and its size instead of ending the loop
with a bare ``StopIteration``; a ``"batch"`` loader padding its last global batch with duplicated samples that the
loss would then count (refused unless the dataset is a whole number of global batches); data-parallel ranks that
disagree on whether there is training, validation or test data (rank 0's answer is broadcast).
"""

import functools
import json
import logging
import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional, Protocol

import torch

from megatron.bridge.data.samplers import build_pretraining_data_loader
from megatron.bridge.utils.dist import collective_device

logger = logging.getLogger(__name__)


class TrainState(Protocol):
    """What the loaders read and set of ``training.state.TrainState`` (data/ does not import training/)."""

    consumed_train_samples: int
    consumed_valid_samples: int
    do_train: bool
    do_valid: bool
    do_test: bool


Loaders = tuple[Optional[Any], Optional[Any], Optional[Any]]


def ignore_signal_in_worker(sig: int, worker_id: int = 0) -> None:
    """A loader worker's ``worker_init_fn``: ignore ``sig``, the run's exit signal.

    A scheduler's signal to the whole process group then leaves the workers serving batches while the main process
    saves; the main process stops them itself.
    """
    signal.signal(sig, signal.SIG_IGN)


def get_blend_and_blend_per_split(
    data_paths: Optional[list[str]] = None,
    data_args_path: Optional[str] = None,
    per_split_data_args_path: Optional[str] = None,
    train_data_paths: Optional[list[str]] = None,
    valid_data_paths: Optional[list[str]] = None,
    test_data_paths: Optional[list[str]] = None,
) -> tuple[Optional[Any], Optional[list[Any]]]:
    """``(blend, blend_per_split)`` of a ``GPTDatasetConfig`` from lists of data paths; at most one is not ``None``.

    A list is prefixes, or weights and prefixes interleaved (megatron-core's ``get_blend_from_list`` reads it).
    ``data_paths`` or ``data_args_path`` (a file holding such a list, whitespace-separated) give one blend for all
    splits; otherwise ``train/valid/test_data_paths`` or ``per_split_data_args_path`` (JSON: ``{"train": ...,
    "valid": ..., "test": ...}``, each a list or a whitespace-separated string) give one per split.

    Raises:
        ValueError: both ``data_paths`` and ``data_args_path``, or a per-split file without one of its splits.
        OSError: a file that cannot be read (its path is in the error).
    """
    from megatron.bridge.utils.cpu_shims import before_megatron_core_import

    before_megatron_core_import()
    from megatron.core.datasets.utils import get_blend_from_list

    if data_paths is not None and data_args_path is not None:
        raise ValueError("give data_paths or data_args_path, not both (each names the whole blend)")
    if data_args_path is not None:
        with open(data_args_path) as f:
            return get_blend_from_list(f.read().split()), None
    if data_paths is not None:
        return get_blend_from_list(data_paths), None
    if per_split_data_args_path is not None:
        with open(per_split_data_args_path) as f:
            per_split = json.load(f)
        missing = [split for split in ("train", "valid", "test") if split not in per_split]
        if missing:
            raise ValueError(f"{per_split_data_args_path} has no {missing[0]!r} entry (it needs train, valid and test)")
        lists = [per_split[split] for split in ("train", "valid", "test")]
        return None, [get_blend_from_list(p.split() if isinstance(p, str) else p) for p in lists]
    if any(paths is not None for paths in (train_data_paths, valid_data_paths, test_data_paths)):
        return None, [get_blend_from_list(paths) for paths in (train_data_paths, valid_data_paths, test_data_paths)]
    return None, None


def cyclic_iter(iterable: Iterable) -> Iterator:
    """Endless iteration over ``iterable``, starting it again each time it ends (a ``"batch"`` loader's epochs)."""
    while True:
        yield from iterable


def get_train_valid_test_num_samples(cfg: Any) -> tuple[int, int, int]:
    """Global samples the run reads from each split: training, validation over all evaluations, one test pass.

    Training: ``train.train_samples``, else ``train_iters * global_batch_size``. Validation: ``eval_iters`` global
    evaluation batches (``validation.eval_global_batch_size``, else the training one) per evaluation, one evaluation
    every ``eval_interval`` steps and one at the end (``validation.skip_train``: one in all; no ``eval_interval``:
    none). Test: ``eval_iters`` evaluation batches.
    """
    t, v = cfg.train, cfg.validation
    train = t.train_samples if t.train_samples is not None else t.train_iters * t.global_batch_size
    if getattr(v, "skip_train", False):
        evaluations = 1
    else:
        evaluations = t.train_iters // v.eval_interval + 1 if v.eval_interval else 0
    eval_gbs = v.eval_global_batch_size if v.eval_global_batch_size is not None else t.global_batch_size
    return train, evaluations * v.eval_iters * eval_gbs, v.eval_iters * eval_gbs


def build_train_valid_test_datasets(cfg: Any, build_train_valid_test_datasets_provider: Callable) -> Loaders:
    """The provider's train, validation and test datasets for :func:`get_train_valid_test_num_samples`."""
    counts = get_train_valid_test_num_samples(cfg)
    if _rank() == 0:
        logger.info("data: building datasets for %d train, %d validation and %d test samples", *counts)
    return build_train_valid_test_datasets_provider(counts, cfg.dataset)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _check_train_dataset(cfg: Any, dataset: Any, dataloader_type: str) -> None:
    """Refuse a training set the loader would misread: padded with counted samples, or under one global batch."""
    if dataset is None or dataloader_type == "external":
        return
    gbs, size = cfg.train.global_batch_size, len(dataset)
    if dataloader_type == "batch" and not cfg.dataset.drop_last and size % gbs:
        raise ValueError(
            f'dataloader_type="batch" with drop_last=False fills the last global batch with index -1 (padding), and '
            f"only a dataset that reads -1 as a loss-masked padding sample may get it (Megatron-Bridge's GPT SFT "
            f"datasets; none of this package's). This one holds {size} samples, not a multiple of global_batch_size="
            f"{gbs}: set dataset.drop_last=True, or give the dataset a whole number of global batches"
        )
    if cfg.dataset.drop_last and size < gbs:
        raise RuntimeError(
            f"Not enough train samples for a single global batch: train dataset size ({size}) < global batch size "
            f"({gbs})"
        )


def _sampler_seed(cfg: Any) -> Optional[int]:
    """The dataset's seed (``seed`` or ``random_seed``), else ``rng.seed``: the same on every pipeline stage."""
    for owner, name in ((cfg.dataset, "seed"), (cfg.dataset, "random_seed"), (getattr(cfg, "rng", None), "seed")):
        value = getattr(owner, name, None)
        if value is not None:
            return value
    return None


def build_train_valid_test_data_loaders(
    cfg: Any,
    train_state: "TrainState",
    build_train_valid_test_datasets_provider: Callable,
    dp_group: Any,
    *,
    eval_dp_group: Any = None,
) -> Loaders:
    """The train, validation and test loaders of this data-parallel rank (``None`` where there is no data).

    Sets ``train_state.do_train``/``do_valid``/``do_test`` from rank 0's loaders.

    Args:
        cfg: the run's ``ConfigContainer``.
        train_state: where the loaders start (``consumed_train_samples``, ``consumed_valid_samples``).
        build_train_valid_test_datasets_provider: from :func:`megatron.bridge.data.utils.get_dataset_provider`.
        dp_group: the data-parallel group the training data is sharded over.
        eval_dp_group: the group the validation and test data are sharded over (``None``: ``dp_group``).

    Raises:
        ValueError: ``train.num_epochs`` is set (it needs Megatron-Bridge's finite SFT datasets), or a ``"batch"``
            loader would pad with counted samples.
        RuntimeError: the training set holds less than one global batch.
    """
    if cfg.train.num_epochs is not None:
        raise ValueError(
            "train.num_epochs needs a finite fine-tuning dataset, which this package does not provide: give "
            "train.train_iters or train.train_samples"
        )
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(cfg, build_train_valid_test_datasets_provider)
    dataloader_type = cfg.dataset.dataloader_type or "single"
    _check_train_dataset(cfg, train_ds, dataloader_type)
    exit_signal = cfg.train.exit_signal
    worker_init_fn = (
        functools.partial(ignore_signal_in_worker, int(exit_signal))
        if cfg.train.exit_signal_handler_for_dataloader
        else None
    )
    eval_dp_group = dp_group if eval_dp_group is None else eval_dp_group
    v = cfg.validation
    common = {
        "dataloader_type": dataloader_type,
        "num_workers": cfg.dataset.num_workers,
        "data_sharding": cfg.dataset.data_sharding,
        "worker_init_fn": worker_init_fn,
        "pin_memory": cfg.dataset.pin_memory,
        "persistent_workers": cfg.dataset.persistent_workers,
        "seed": _sampler_seed(cfg),
    }
    train_loader = build_pretraining_data_loader(
        train_ds,
        train_state.consumed_train_samples,
        micro_batch_size=cfg.train.micro_batch_size,
        collate_fn=getattr(train_ds, "collate_fn", None),
        data_parallel_rank=torch.distributed.get_rank(group=dp_group),
        data_parallel_size=torch.distributed.get_world_size(group=dp_group),
        global_batch_size=cfg.train.global_batch_size,
        drop_last=cfg.dataset.drop_last,
        **common,
    )
    evaluation = {
        "micro_batch_size": v.eval_micro_batch_size or cfg.train.micro_batch_size,
        "data_parallel_rank": torch.distributed.get_rank(group=eval_dp_group),
        "data_parallel_size": torch.distributed.get_world_size(group=eval_dp_group),
        "global_batch_size": v.eval_global_batch_size or cfg.train.global_batch_size,
        "drop_last": True,
        **common,
    }
    valid_loader = test_loader = None
    if v.eval_iters > 0:
        valid_start = 0 if v.skip_train else train_state.consumed_valid_samples
        valid_collate = getattr(valid_ds, "collate_fn", None)
        valid_loader = build_pretraining_data_loader(valid_ds, valid_start, collate_fn=valid_collate, **evaluation)
        test_collate = getattr(test_ds, "collate_fn", None)
        test_loader = build_pretraining_data_loader(test_ds, 0, collate_fn=test_collate, **evaluation)
    flags = [
        train_loader is not None and cfg.train.train_iters > 0,
        valid_loader is not None and v.eval_iters > 0,
        test_loader is not None and v.eval_iters > 0,
    ]
    on_rank_0 = torch.tensor([int(flag) for flag in flags], dtype=torch.long, device=collective_device())
    if torch.distributed.is_initialized():
        torch.distributed.broadcast(on_rank_0, 0)
    train_state.do_train, train_state.do_valid, train_state.do_test = (bool(flag) for flag in on_rank_0.tolist())
    return train_loader, valid_loader, test_loader


def _read_once(loader: Any, split: str) -> Iterator:
    """``loader``'s batches; past its last one, an error naming the split and its size (not ``StopIteration``)."""
    yield from loader
    sampler = getattr(loader, "batch_sampler", None)
    size = f"all {sampler.total_samples} samples" if sampler is not None else "every batch"
    raise RuntimeError(
        f"the {split} data ran out: {size} of the {split} split were read. Build it with more samples (the run "
        f"asks for them from train.train_iters/train_samples and the validation settings)"
    )


def _micro_batches(global_batches: Iterable, micro_batch_size: int) -> Iterator:
    """Each loaded global-batch share cut into micro-batches of ``micro_batch_size`` rows, in order."""
    for batch in global_batches:
        rows = len(next(iter(batch.values()))) if isinstance(batch, dict) else len(batch)
        for start in range(0, rows, micro_batch_size):
            if isinstance(batch, dict):
                yield {key: value[start : start + micro_batch_size] for key, value in batch.items()}
            else:
                yield batch[start : start + micro_batch_size]


def _iterator(dataloader_type: str, loader: Any, split: str, micro_batch_size: int) -> Any:
    if loader is None:
        return None
    if dataloader_type == "single":
        return _read_once(loader, split)
    if dataloader_type == "batch":
        return _micro_batches(cyclic_iter(loader), micro_batch_size)
    if isinstance(loader, list):  # "external": the provider's own iterables, one per model chunk
        return [iter(item) for item in loader]
    return iter(loader)


def build_train_valid_test_data_iterators(
    cfg: Any,
    train_state: "TrainState",
    build_train_valid_test_datasets_provider: Callable,
    dp_group: Any,
    *,
    eval_dp_group: Any = None,
) -> Loaders:
    """The train, validation and test iterators of this rank: micro-batches (arguments as for the loaders).

    ``"single"`` loaders are read once (running out is an error naming the split); ``"batch"`` loaders cycle over
    their epochs and each loaded global-batch share is cut into micro-batches; ``"external"`` loaders are iterated
    as they are.
    """
    loaders = build_train_valid_test_data_loaders(
        cfg, train_state, build_train_valid_test_datasets_provider, dp_group, eval_dp_group=eval_dp_group
    )
    dataloader_type = cfg.dataset.dataloader_type or "single"
    rows = (cfg.train.micro_batch_size, *(2 * [cfg.validation.eval_micro_batch_size or cfg.train.micro_batch_size]))
    return tuple(  # type: ignore[return-value]
        _iterator(dataloader_type, loader, split, mbs)
        for loader, split, mbs in zip(loaders, ("train", "validation", "test"), rows)
    )


def setup_data_iterators(
    cfg: Any,
    train_state: "TrainState",
    model_length: int,
    train_valid_test_datasets_provider: Callable,
    dp_group: Any,
    *,
    eval_dp_group: Any = None,
) -> Loaders:
    """Training set-up's entry point: :func:`build_train_valid_test_data_iterators`.

    ``model_length`` (the model chunks of virtual pipeline parallelism) does not change the iterators: every chunk's
    schedule reads the same micro-batches, which the loop hands to each chunk.
    """
    del model_length
    return build_train_valid_test_data_iterators(
        cfg, train_state, train_valid_test_datasets_provider, dp_group, eval_dp_group=eval_dp_group
    )


__all__ = [
    "ignore_signal_in_worker",
    "build_train_valid_test_data_iterators",
    "build_train_valid_test_data_loaders",
    "build_train_valid_test_datasets",
    "cyclic_iter",
    "get_blend_and_blend_per_split",
    "get_train_valid_test_num_samples",
    "setup_data_iterators",
]
