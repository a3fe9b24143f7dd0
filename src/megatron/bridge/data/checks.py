"""Data checks run before training starts; each failure a ``ValueError`` naming the field or file and the fix.

:func:`check_dataset_files` is what config validation calls for real data (after megatron-core's own checks of the
dataset config; the tokenizer-against-model check is validation's own), and the dataset builder (``builders.py``)
runs it again before megatron-core sees the config. They read the ``.idx`` headers and file sizes and write
nothing.

Guards against bad input found late or not at all:

- a dataset prefix whose ``<prefix>.bin`` or ``<prefix>.idx`` is missing (a typo, a prefix given with its
  extension, a preprocessing run that never finished): megatron-core fails with a bare assertion on every rank;
- a ``.bin`` whose size is not the ``.idx``'s tokens times its dtype size (a truncated copy, files of two different
  runs): megatron-core reads it and serves garbage or fails mid-run;
- blend weights that do not parse (a length mismatch, a negative, non-numeric or NaN weight, all zero): megatron-core
  asserts without saying which, or normalizes them into nonsense;
- a sequence length the data cannot serve: a split with fewer than ``sequence_length + 1`` tokens makes megatron-core
  loop forever looking for a sample (``GPTDataset._get_num_epochs``): a hang, not an error;
- a tokenizer vocabulary larger than the model's ``vocab_size``: token ids past the embedding;
- an index cache directory (``dataset.path_to_cache``, default :func:`default_path_to_cache`) rank 0 cannot write.
"""

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy

from megatron.bridge.utils.cpu_shims import before_megatron_core_import
from megatron.bridge.utils.fields import fail

before_megatron_core_import()  # noqa: E402 - on CPU, before megatron-core's fused ops are imported

from megatron.core.datasets.blended_megatron_dataset_config import (  # noqa: E402
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset  # noqa: E402

if TYPE_CHECKING:
    from megatron.bridge.data.config import GPTDatasetConfig

SPLITS = ("train", "validation", "test")
"""megatron-core's splits, in its order."""
CACHE_DIRECTORY = "index-cache"
"""The default index cache: this directory next to the first dataset prefix (see :func:`default_path_to_cache`)."""
_PREPROCESS = "python -m megatron.bridge.data.preprocess --input <corpus.jsonl> --output-prefix <prefix>"


@dataclass(frozen=True)
class BlendPart:
    """One dataset prefix and the splits it feeds."""

    field: str
    """The config field naming it, e.g. ``dataset.blend`` or ``dataset.blend_per_split[1]``."""
    prefix: str
    """The path prefix of ``<prefix>.bin`` and ``<prefix>.idx``."""
    ranges: tuple[Optional[tuple[float, float]], ...]
    """Per split, the fraction of its sequences it contributes (megatron-core's split matrix row), or ``None``."""


def is_mock(dataset_cfg: Any) -> bool:
    """Whether the config names no data files (megatron-core then makes mock data; here, the mock stream)."""
    per_split = getattr(dataset_cfg, "blend_per_split", None)
    return getattr(dataset_cfg, "blend", None) is None and not (per_split and any(b is not None for b in per_split))


def check_dataset_files(dataset_cfg: "GPTDatasetConfig") -> list[BlendPart]:
    """Check the blend, every prefix's files, the split sizes and the cache directory; return the blend's parts."""
    parts = blend_parts(dataset_cfg)
    needed = dataset_cfg.sequence_length + int(bool(getattr(dataset_cfg, "add_extra_token_to_sequence", True)))
    for part in parts:
        lengths = sequence_lengths(part.prefix, part.field)
        total = int(lengths.sum())
        if total < needed:
            fail(
                "dataset.sequence_length",
                f"{part.prefix} ({part.field}) holds {total} tokens, fewer than sequence_length + 1 = {needed}",
                "lower dataset.sequence_length, or add data to that dataset",
            )
        for split, bounds in zip(SPLITS, part.ranges):
            if bounds is None:
                continue
            begin, end = (int(round(b * float(len(lengths)))) for b in bounds)
            tokens = int(lengths[begin:end].sum())
            if tokens < needed:
                fail(
                    "dataset.split" if part.field == "dataset.blend" else part.field,
                    f"gives the {split} split sequences {begin}..{end} of the {len(lengths)} of {part.prefix}: "
                    f"{tokens} tokens, fewer than sequence_length + 1 = {needed} (megatron-core would search for a "
                    "sample forever)",
                    f"give the {split} split a larger share or none (0) in dataset.split, or add data",
                )
    check_cache_directory(dataset_cfg)
    return parts


def blend_parts(dataset_cfg: "GPTDatasetConfig") -> list[BlendPart]:
    """The prefixes of ``blend`` or ``blend_per_split`` with their splits; the blend's form checked first."""
    blend, per_split, split = dataset_cfg.blend, dataset_cfg.blend_per_split, dataset_cfg.split
    if blend is not None and per_split is not None and any(b is not None for b in per_split):
        fail("dataset.blend_per_split", "and dataset.blend are both set", "give one of them")
    if blend is not None:
        if split is None:
            fail("dataset.split", "is not set, and a blend needs it", 'set it, e.g. split="99,1,0"')
        matrix = tuple(split_matrix(split))
        prefixes, _weights = parse_blend(blend, "dataset.blend")
        return [BlendPart("dataset.blend", prefix, matrix) for prefix in prefixes]
    if per_split is None:
        return []
    if not isinstance(per_split, (list, tuple)) or len(per_split) != len(SPLITS):
        fail(
            "dataset.blend_per_split",
            f"needs {len(SPLITS)} entries (train, validation, test), got {per_split!r}",
            "give one blend or None per split",
        )
    if split is not None:
        fail("dataset.split", "is not read with dataset.blend_per_split", "set it to None")
    parts = []
    for i, entry in enumerate(per_split):
        if entry is None:
            continue
        name = f"dataset.blend_per_split[{i}]"
        ranges = tuple((0.0, 1.0) if j == i else None for j in range(len(SPLITS)))
        parts += [BlendPart(name, prefix, ranges) for prefix in parse_blend(entry, name)[0]]
    return parts


def parse_blend(blend: Any, field: str) -> tuple[list[str], Optional[list[float]]]:
    """``blend`` as megatron-core's ``([prefix, ...], [weight, ...] or None)``, or the error naming ``field``."""
    form = "[[prefix, ...], [weight, ...]] or [[prefix, ...], None]"
    if not isinstance(blend, (list, tuple)) or len(blend) != 2 or not isinstance(blend[0], (list, tuple)):
        fail(
            field,
            f"{blend!r} is not {form}",
            "give it in that form (a flat list such as [30, 'a', 70, 'b'] converts with "
            "megatron.core.datasets.utils.get_blend_from_list)",
        )
    prefixes, weights = list(blend[0]), blend[1]
    if not prefixes or not all(isinstance(p, str) and p.strip() for p in prefixes):
        fail(field, f"the prefixes {prefixes!r} are not a non-empty list of paths", f"give {form}")
    if weights is None:
        return prefixes, None
    if not isinstance(weights, (list, tuple)) or len(weights) != len(prefixes):
        count = len(weights) if isinstance(weights, (list, tuple)) else "not a list of"
        fail(
            field,
            f"{len(prefixes)} prefixes but {count} weights ({weights!r})",
            "give one weight per prefix, or None to weigh them by their size",
        )
    for weight in weights:
        numeric = isinstance(weight, (int, float)) and not isinstance(weight, bool)
        if not numeric or not math.isfinite(weight) or weight < 0:
            fail(field, f"weight {weight!r} is not a finite number >= 0", "give each prefix a weight >= 0")
    if sum(weights) <= 0:
        fail(field, f"the weights {list(weights)} are all zero", "give at least one prefix a positive weight")
    return prefixes, [float(w) for w in weights]


def split_matrix(split: Any) -> list[Optional[tuple[float, float]]]:
    """megatron-core's split matrix of the ``dataset.split`` string (e.g. ``"99,1,0"``), or the error naming it."""
    try:
        with numpy.errstate(invalid="ignore", divide="ignore"):  # all-zero weights: refused below, not warned
            vector = parse_and_normalize_split(split)
        if not all(math.isfinite(v) for v in vector):
            raise ValueError("the weights sum to zero")
    except (AssertionError, TypeError, ValueError) as err:
        fail(
            "dataset.split",
            f"{split!r} is not a train,validation,test weighting ({err or 'at most 3 weights, each >= 0'})",
            'give up to three weights >= 0 with a positive sum, e.g. "99,1,0"',
        )
    return convert_split_vector_to_split_matrix(vector)


def sequence_lengths(prefix: str, field: str) -> numpy.ndarray:
    """The token count of every sequence of the dataset ``prefix``, after checking both files exist and match."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    missing = [path for path in (bin_path, idx_path) if not os.path.isfile(path)]
    if missing:
        hint = "; drop the extension from the prefix" if prefix.endswith((".bin", ".idx")) else ""
        fail(
            field,
            f"{' and '.join(missing)} {'do' if len(missing) > 1 else 'does'} not exist (dataset prefix {prefix!r})",
            f"give the path prefix of an existing <prefix>.bin/<prefix>.idx pair{hint}, or make it with {_PREPROCESS}",
        )
    try:
        dataset = IndexedDataset(prefix, mmap=False)  # reads the index only
    except Exception as err:  # megatron-core asserts on a bad header; numpy raises on a short file
        fail(
            idx_path,
            f"is not a readable megatron-core index ({err or type(err).__name__})",
            f"re-make it: {_PREPROCESS}",
        )
    try:
        lengths = numpy.array(dataset.sequence_lengths, dtype=numpy.int64)
        dtype = dataset.index.dtype
    finally:
        del dataset
    expected = int(lengths.sum()) * DType.size(dtype)
    actual = os.path.getsize(bin_path)
    if actual != expected:
        fail(
            bin_path,
            f"is {actual} bytes, but {idx_path} describes {int(lengths.sum())} tokens of {numpy.dtype(dtype).name} "
            f"({expected} bytes): truncated, or the two files are from different runs",
            f"re-make the pair: {_PREPROCESS}",
        )
    return lengths


def default_path_to_cache(dataset_cfg: "GPTDatasetConfig") -> Optional[str]:
    """Where megatron-core's index files go when ``path_to_cache`` is unset: ``index-cache/`` next to the first prefix.

    Next to the data, because every rank must read what rank 0 built (megatron-core builds on rank 0, then the
    others load it after a barrier): a node-local default would break multi-node runs. ``None`` without data files.
    """
    prefixes = [part.prefix for part in blend_parts(dataset_cfg)]
    if not prefixes:
        return None
    return os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), CACHE_DIRECTORY)


def path_to_cache(dataset_cfg: "GPTDatasetConfig") -> Optional[str]:
    """``dataset.path_to_cache``, or :func:`default_path_to_cache` when unset."""
    return dataset_cfg.path_to_cache or default_path_to_cache(dataset_cfg)


def check_cache_directory(dataset_cfg: "GPTDatasetConfig") -> None:
    """The index cache directory is a directory (or can be made) that this process may write; nothing is made."""
    path = path_to_cache(dataset_cfg)
    if path is None:
        return
    fix = "set dataset.path_to_cache to a directory every rank can read and rank 0 can write"
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        fail("dataset.path_to_cache", f"{path} cannot be a directory: {existing} is a file", fix)
    if not os.access(existing, os.W_OK | os.X_OK):
        fail("dataset.path_to_cache", f"{path} is not writable ({existing} is not)", fix)


__all__ = [
    "BlendPart",
    "check_cache_directory",
    "check_dataset_files",
    "default_path_to_cache",
    "is_mock",
    "parse_blend",
    "path_to_cache",
    "sequence_lengths",
    "split_matrix",
]
