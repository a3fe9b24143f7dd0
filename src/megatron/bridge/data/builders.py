"""megatron-core's ``GPTDataset`` splits from real files, and the guards around building them.

:func:`build_gpt_datasets` builds the train, validation and test splits of a ``GPTDatasetConfig`` through
``BlendedMegatronDatasetBuilder`` (``blend`` with weights and ``split``, or ``blend_per_split``); the data
provider (:mod:`megatron.bridge.data.utils`) wraps each in :class:`Samples` and :mod:`megatron.bridge.data.loaders`
reads them with the same samplers as every other dataset: sample ``i`` of a split is a fixed function of the data,
``random_seed`` and ``i``, so a run resumed at ``consumed_train_samples`` sees exactly the batches an uninterrupted
run would have.

Index cache: megatron-core writes ``.npy`` index files to ``dataset.path_to_cache``, by default ``index-cache/``
next to the first prefix (:func:`megatron.bridge.data.checks.default_path_to_cache`). With several ranks, every
rank must call the builder: megatron-core builds on rank 0, holds the others at a barrier of the default process
group, then they load rank 0's files. Every rank builds its datasets (``is_built_on_rank`` is always true) because
every rank draws its own batches (``gpt_step.get_batch``); there is no broadcast across tensor-parallel ranks.

Guards against: a run that hangs or fails mid-way on its data (files, blend, split sizes and the cache directory
are checked first, :func:`megatron.bridge.data.checks.check_dataset_files`); a resumed run on different data than
an uninterrupted one; a restart loop on a truncated index cache. megatron-core writes its ``.npy`` files in place
and takes any set whose files exist for complete, so a rank 0 killed while writing them (a preemption during
start-up) left every later start failing to load them; rank 0 first removes such sets
(:func:`repair_index_cache`) and megatron-core rebuilds them.
"""

import copy
import itertools
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional

import numpy
import torch
from torch.utils.data import Dataset

from megatron.bridge.data.checks import SPLITS, check_dataset_files, is_mock, path_to_cache
from megatron.bridge.utils.cpu_shims import before_megatron_core_import
from megatron.bridge.utils.fields import fail

before_megatron_core_import()  # noqa: E402 - on CPU, before megatron-core's fused ops are imported

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MCoreGPTDatasetConfig  # noqa: E402

if TYPE_CHECKING:
    from megatron.bridge.data.config import GPTDatasetConfig

logger = logging.getLogger(__name__)

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
"""What a batch holds (``attention_mask`` only when the dataset makes one: ``create_attention_mask``)."""

DataIterator = Iterator[dict[str, torch.Tensor]]


def _built_on_every_rank() -> bool:
    return True


def build_gpt_datasets(
    dataset_cfg: "GPTDatasetConfig", tokenizer: Any, train_samples: int, valid_samples: int, test_samples: int
) -> tuple[Optional[Dataset], Optional[Dataset], Optional[Dataset]]:
    """megatron-core's train, validation and test datasets of ``dataset_cfg`` (``None`` for a split without data).

    Every rank must call this (see the module doc). ``dataset_cfg`` is not changed: megatron-core gets a copy with
    ``tokenizer`` and the resolved ``path_to_cache``.

    Args:
        dataset_cfg: a ``GPTDatasetConfig`` with ``blend`` or ``blend_per_split``.
        tokenizer: from ``build_tokenizer`` (megatron-core reads ``eod``, ``vocab_size``, ``unique_identifiers``).
        train_samples: samples the training split must hold (it may hold more).
        valid_samples: samples the validation split must hold.
        test_samples: samples the test split must hold.

    Raises:
        ValueError: a check of :func:`~megatron.bridge.data.checks.check_dataset_files` fails, or a split that must
            hold samples gets no data.
    """
    if is_mock(dataset_cfg):
        fail("dataset.blend", "names no data files", "give dataset.blend or dataset.blend_per_split")
    check_dataset_files(dataset_cfg)
    for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        if getattr(dataset_cfg, name) is None:
            fail(f"dataset.{name}", "is not set (megatron-core requires it)", "set it to False or True")
    sizes = [int(train_samples), int(valid_samples), int(test_samples)]
    cfg = copy.copy(dataset_cfg)
    cfg.tokenizer = tokenizer
    cfg.path_to_cache = path_to_cache(dataset_cfg)
    MCoreGPTDatasetConfig.__post_init__(cfg)  # megatron-core's checks, the GPT ones included (need the tokenizer)
    for i, (name, size) in enumerate(zip(SPLITS, sizes)):
        if size < 0:
            raise ValueError(f"{name}_samples must be >= 0, got {size}")
        if name == "test":  # never read by the training loop: a split without data is just absent
            continue
        if cfg.blend is not None and size and cfg.split_matrix[i] is None:
            fail(
                "dataset.split",
                f"{cfg.split!r} gives the {name} split no data, but {size} {name} samples are needed",
                f'give the {name} split a share, e.g. split="98,2,0"',
            )
        if cfg.blend is None and size and cfg.blend_per_split[i] is None:
            fail(
                f"dataset.blend_per_split[{i}]",
                f"is None, but {size} {name} samples are needed",
                f"give the {name} split a blend",
            )
    if _blends_datasets(cfg) and not torch.distributed.is_initialized():
        raise RuntimeError(
            "blending several datasets needs torch.distributed initialized (megatron-core's BlendedDataset asks for "
            "the rank); initialize the process group first (one process: gloo with world_size=1)"
        )
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        repair_index_cache(cfg.path_to_cache)  # the other ranks wait at megatron-core's barrier until rank 0 built
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, sizes, _built_on_every_rank, cfg).build()
    return train, valid, test


def _npy_is_complete(path: str) -> bool:
    """Whether the ``.npy`` file holds as many bytes as its header promises."""
    try:
        with open(path, "rb") as f:
            major, _minor = numpy.lib.format.read_magic(f)
            read_header = (
                numpy.lib.format.read_array_header_1_0 if major == 1 else numpy.lib.format.read_array_header_2_0
            )
            shape, _fortran_order, dtype = read_header(f)
            expected = f.tell() + int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
    except (OSError, ValueError):
        return False
    return os.path.getsize(path) == expected


def repair_index_cache(path: Optional[str]) -> list[str]:
    """Remove every index set in ``path`` with a truncated ``.npy`` file; return the removed files.

    megatron-core names a set's files ``<hash>-<class>-<split>-<part>`` (``.npy`` and ``description.txt``); a set
    with one bad file is removed whole, so megatron-core sees a cache miss and rebuilds it. Run on rank 0 only,
    before megatron-core's build (the other ranks read the cache only after its barrier). A set another job is
    writing into the same directory at that moment would look truncated too: give concurrent jobs their own
    ``dataset.path_to_cache``.
    """
    if not path or not os.path.isdir(path):
        return []
    names = sorted(os.listdir(path))
    broken = {
        name.rsplit("-", 1)[0] + "-"
        for name in names
        if name.endswith(".npy") and not _npy_is_complete(os.path.join(path, name))
    }
    removed = []
    for name in names:
        if any(name.startswith(group) for group in broken):
            try:
                os.remove(os.path.join(path, name))
                removed.append(os.path.join(path, name))
            except FileNotFoundError:
                pass
    if removed:
        logger.warning("data: removed %d files of interrupted index builds from %s: %s", len(removed), path, removed)
    return removed


def _blends_datasets(cfg: Any) -> bool:
    """Whether megatron-core will build a ``BlendedDataset`` (several prefixes, or one with a weight)."""
    blends = [cfg.blend] if cfg.blend is not None else [b for b in cfg.blend_per_split if b is not None]
    return any(len(prefixes) > 1 or (cfg.blend is not None and weights is not None) for prefixes, weights in blends)


class Samples(Dataset):
    """A split's samples by index, holding only the batch keys (:data:`BATCH_KEYS`)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.length = len(dataset)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.dataset[index]
        return {key: sample[key] for key in BATCH_KEYS if key in sample}


def started(iterator: Optional[DataIterator]) -> Optional[DataIterator]:
    """``iterator`` with its first batch already fetched (``None`` stays ``None``).

    Loader workers start when the first batch is asked for; fetched during set-up, their start-up (a fresh
    interpreter each) is not counted as the first training step's time, which fault tolerance learns its step
    timeout from.
    """
    if iterator is None:
        return None
    first = next(iterator)
    return itertools.chain([first], iterator)


__all__ = ["BATCH_KEYS", "Samples", "build_gpt_datasets", "repair_index_cache", "started"]
