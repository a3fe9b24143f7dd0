"""Compare two committed checkpoints value by value, to tell whether the training state is bit-for-bit the same.

Used by the resiliency drill (a run with faults against a fault-free one) and by the tests. Everything a checkpoint
holds is compared (model, optimizer, scheduler, RNG states, progress) except the entries in
:data:`NOT_TRAINING_STATE`, which record how the run went (wall-clock accounting), not what it computed.

Equal means nothing if nothing was compared: two empty snapshots, or two whose optimizer section is empty, hold
the same (nothing) and prove nothing. :func:`compare_states` therefore requires the parts a resumed run needs
(:func:`missing_parts`): model weights, every pipeline stage's optimizer state (moments and step counts; its master
weights, where it keeps them, are compared too), the scheduler, the train state, the data position and every
rank's RNG state. A missing or empty part is a difference that names the part; what was compared is counted per
part (:class:`PartCount`).
"""

import os
import re
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

STEP_COUNTS = ("step", "common_step")
"""An optimizer state's step counts: one per parameter (the distributed optimizer), or one for all of them
(megatron-core's other optimizers keep ``state.common_step``)."""
COMMON_STATE_SHARD = "common_state"
"""The shard that holds a checkpoint's common part from megatron-core 0.19 on (before, ``common.pt``)."""
NOT_TRAINING_STATE = ("goodput", "parallel_layout")
"""Top-level entries of a checkpoint's common part that are not training state: how the run went (timing), and the
layout it was saved under (``contents.parallel_layout``: which loads are refused, not what was computed)."""

MODEL, OPTIMIZER, SCHEDULER, TRAIN_STATE, DATA_POSITION, RNG, OTHER = (
    "model", "optimizer", "scheduler", "train state", "data position", "RNG", "other",
)  # fmt: skip
PARTS = (MODEL, OPTIMIZER, SCHEDULER, TRAIN_STATE, DATA_POSITION, RNG, OTHER)
"""The parts of a checkpoint, in the order reports list them (``other``: e.g. the format version)."""
DATA_POSITION_FIELDS = ("consumed_train_samples", "consumed_valid_samples")
"""Train state fields that are the data position: where the training and validation streams resume."""
MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
"""Names of an optimizer's per-parameter moments (Adam's two, SGD's momentum)."""
MASTER_WEIGHTS = ("param", "fp32_param", "master_param")
"""Names of an optimizer's own copy of the parameters (the distributed optimizer's main parameters)."""
_STAGE = re.compile(r"dp_group_idx_\d+")
"""The distributed optimizer's key of one model-parallel rank's state (one pipeline stage here)."""
_RNG_HEADER = 8
"""Bytes of the length header in front of each rank's serialized generators (``training/checkpoint/rng.py``)."""


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists as one flat dict keyed by dotted paths (``prefix`` first).

    An empty dict or list stays an entry of its own (its value ``{}`` or ``[]``): an emptied section must show.
    """
    if isinstance(obj, (dict, list, tuple)) and len(obj) == 0 and prefix:
        return {prefix.rstrip("."): type(obj)() if not isinstance(obj, tuple) else []}
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, value in enumerate(obj):
            out.update(flatten(value, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): obj}


def checkpoint_state(ckpt_dir: Path) -> dict[str, Any]:
    """Every tensor and value of a committed global checkpoint, flat, keyed ``sharded.…`` and ``common.…``.

    Args:
        ckpt_dir: an ``iter_XXXXXXX`` directory.
    """
    from megatron.core.dist_checkpointing import load_common_state_dict
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt_dir = Path(ckpt_dir)
    with tempfile.TemporaryDirectory() as tmp:
        flat_path = os.path.join(tmp, "flat.pt")
        dcp_to_torch_save(str(ckpt_dir), flat_path)
        sharded = torch.load(flat_path, weights_only=False)
    # The common part: common.pt up to megatron-core 0.18, a "common_state" object among the shards from 0.19
    # (megatron-core's reader takes both; the object is compared here as the common part, not as a shard).
    sharded = {k: v for k, v in sharded.items() if not k.startswith(COMMON_STATE_SHARD)}
    common = load_common_state_dict(str(ckpt_dir))
    common = {k: v for k, v in common.items() if k not in NOT_TRAINING_STATE}
    return {**flatten(sharded, "sharded."), **flatten(common, "common.")}


def part_of(key: str) -> str:
    """The part of the training state a :func:`checkpoint_state` key belongs to (one of :data:`PARTS`)."""
    where, _, name = key.partition(".")
    head = name.split(".", 1)[0]
    if head == "optimizer":
        return OPTIMIZER
    if head in ("rng_state", "rng_bytes", "rng_world_size"):
        return RNG
    if where == "common" and head == "opt_param_scheduler":
        return SCHEDULER
    if where == "common" and head == "train_state":
        return DATA_POSITION if name.split(".")[-1] in DATA_POSITION_FIELDS else TRAIN_STATE
    return MODEL if where == "sharded" else OTHER


def _components(key: str) -> list[str]:
    return re.split(r"[./]", key)


def optimizer_stage(key: str) -> str:
    """The optimizer state an optimizer key belongs to: ``dp_group_idx_<n>`` (a pipeline stage), else ``optimizer``."""
    found = _STAGE.search(key)
    return found.group(0) if found else "optimizer"


def _numel(value: Any) -> int:
    return value.numel() if isinstance(value, torch.Tensor) else 0


def _is_empty(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.numel() == 0) or (isinstance(value, (dict, list)) and not value)


@dataclass(frozen=True)
class PartCount:
    """What was compared of one part of the training state."""

    part: str
    """One of :data:`PARTS`."""
    tensors: int
    entries: int
    """Plain values (numbers, strings, ...), not tensors."""
    detail: str = ""
    """What the count is made of, for people (optimizer: stages, moments, step counts; RNG: ranks)."""

    def describe(self) -> str:
        """E.g. ``optimizer 6 tensors, 44 entries (2 pipeline stages: ...)``."""
        counts = [f"{self.tensors} tensor{'' if self.tensors == 1 else 's'}"] if self.tensors else []
        counts += [f"{self.entries} entr{'y' if self.entries == 1 else 'ies'}"] if self.entries else []
        text = f"{self.part} {', '.join(counts) or 'nothing'}"
        return f"{text} ({self.detail})" if self.detail else text


def _rng_ranks(state: dict[str, Any]) -> tuple[int, list[str]]:
    """How many ranks' RNG states ``state`` holds, and what is wrong with them (``RNG: …`` lines)."""
    rows = state.get("sharded.rng_state")
    world = state.get("common.rng_world_size")
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.numel() == 0:
        return 0, [f"{RNG}: no generator states (sharded.rng_state)"]
    problems = []
    if world is not None and int(world) != rows.shape[0]:
        problems.append(f"{RNG}: {rows.shape[0]} rank(s)' states for a world of {int(world)} (rng_world_size)")
    for rank, row in enumerate(rows):
        if row.numel() < _RNG_HEADER or int.from_bytes(bytes(row[:_RNG_HEADER].tolist()), "little") == 0:
            problems.append(f"{RNG}: rank {rank}'s generator state is empty")
    return rows.shape[0], problems


def _stages(keys: list[str]) -> dict[str, list[str]]:
    """Optimizer keys by :func:`optimizer_stage`; the section's common metadata is no stage when stages exist."""
    stages: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        stages[optimizer_stage(key)].append(key)
    if len(stages) > 1:
        stages.pop("optimizer", None)
    return dict(stages)


def _optimizer_problems(state: dict[str, Any], model_numel: int) -> list[str]:
    """``optimizer…: …`` lines: no state, a stage without moments or step counts, moments not covering the model."""
    keys = [k for k in state if part_of(k) == OPTIMIZER and not _is_empty(state[k])]
    if not keys:
        return [f"{OPTIMIZER}: no state (moments, step counts)"]
    problems = []
    covered: dict[str, int] = defaultdict(int)
    for stage, stage_keys in sorted(_stages(keys).items()):
        moments = [k for k in stage_keys if set(_components(k)) & set(MOMENTS) and _numel(state[k])]
        for key in moments:
            covered[next(m for m in MOMENTS if m in _components(key))] += _numel(state[key])
        if not moments:
            problems.append(f"{OPTIMIZER} ({stage}): no moments ({', '.join(MOMENTS)})")
        if not any(_components(k)[-1] in STEP_COUNTS for k in stage_keys):
            problems.append(f"{OPTIMIZER} ({stage}): no step counts")
    most = max(covered.values(), default=0)
    if covered and most < model_numel:
        problems.append(
            f"{OPTIMIZER}: moments for {most:,} of the model's {model_numel:,} parameters (a pipeline stage's "
            "optimizer state is missing)"
        )
    return problems


def missing_parts(state: dict[str, Any]) -> list[str]:
    """What a :func:`checkpoint_state` result lacks of the training state; each line starts with the part's name.

    Required: model weights; optimizer state with moments and step counts for every stage present, its moments
    covering every model parameter (so no pipeline stage's optimizer state is missing); the scheduler; the train
    state's iteration; the data position (consumed samples); a generator state for every rank.
    """
    model_numel = sum(_numel(v) for k, v in state.items() if part_of(k) == MODEL)
    problems = [] if model_numel else [f"{MODEL}: no weights"]
    problems += _optimizer_problems(state, model_numel)
    if not any(part_of(k) == SCHEDULER and not _is_empty(v) for k, v in state.items()):
        problems.append(f"{SCHEDULER}: no state (common.opt_param_scheduler)")
    if "common.train_state.step" not in state:
        problems.append(f"{TRAIN_STATE}: no iteration (common.train_state.step)")
    if "common.train_state.consumed_train_samples" not in state:
        problems.append(f"{DATA_POSITION}: no consumed samples (common.train_state.consumed_train_samples)")
    return problems + _rng_ranks(state)[1]


def part_counts(state: dict[str, Any]) -> list[PartCount]:
    """Tensors and plain entries of each part of ``state``, in :data:`PARTS` order (parts with nothing left out)."""
    tensors: dict[str, int] = defaultdict(int)
    entries: dict[str, int] = defaultdict(int)
    for key, value in state.items():
        (tensors if isinstance(value, torch.Tensor) else entries)[part_of(key)] += 1
    opt = [k for k in state if part_of(k) == OPTIMIZER]

    def named(names: tuple[str, ...]) -> int:
        return sum(1 for k in opt if isinstance(state[k], torch.Tensor) and set(_components(k)) & set(names))

    steps = sum(1 for k in opt if _components(k)[-1] in STEP_COUNTS)
    details = {
        MODEL: f"{sum(_numel(v) for k, v in state.items() if part_of(k) == MODEL):,} values",
        OPTIMIZER: f"{len(_stages(opt))} pipeline stage(s): {named(MOMENTS)} moments, "
        f"{named(MASTER_WEIGHTS)} master weights, {steps} step counts",
        RNG: f"{_rng_ranks(state)[0]} ranks",
    }
    return [
        PartCount(part, tensors[part], entries[part], details.get(part, ""))
        for part in PARTS
        if tensors[part] or entries[part]
    ]


_LISTED_FIRST = (TRAIN_STATE, DATA_POSITION, SCHEDULER, RNG, OPTIMIZER, MODEL, OTHER)
"""The order differences are listed in: the small parts, which often name the cause, before the weights it moved."""


def _same(va: Any, vb: Any) -> bool:
    if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
        return va.dtype == vb.dtype and va.shape == vb.shape and torch.equal(va, vb)
    return not isinstance(va, torch.Tensor) and not isinstance(vb, torch.Tensor) and va == vb


def _rng_difference(key: str, va: torch.Tensor, vb: torch.Tensor) -> str:
    """Which ranks' generators differ (each rank's row of ``rng_state``), and which of their generators."""
    from megatron.bridge.training.checkpoint.rng import rng_state_from_tensor

    ranks = []
    for rank in range(va.shape[0]):
        if torch.equal(va[rank], vb[rank]):
            continue
        try:
            fa, fb = flatten(rng_state_from_tensor(va[rank])), flatten(rng_state_from_tensor(vb[rank]))
            names = sorted({k.split(".")[0] for k in set(fa) | set(fb) if k not in fa or k not in fb
                            or not _same(fa[k], fb[k])})  # fmt: skip
        except Exception as err:  # noqa: BLE001 - an unreadable row is a difference all the same
            names = [f"unreadable: {type(err).__name__}"]
        ranks.append(f"rank {rank} ({', '.join(names)})")
    return f"{key}: the generators of {', '.join(ranks)} differ"


def _difference(key: str, a: dict[str, Any], b: dict[str, Any]) -> Optional[str]:
    if key not in a or key not in b:
        return f"{key}: only in one of the two"
    va, vb = a[key], b[key]
    if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
        if va.dtype != vb.dtype or va.shape != vb.shape:
            return f"{key}: {va.dtype}{tuple(va.shape)} vs {vb.dtype}{tuple(vb.shape)}"
        if torch.equal(va, vb):
            return None
        if key == "sharded.rng_state" and va.dim() == 2:
            return _rng_difference(key, va, vb)
        diff = (va.double() - vb.double()).abs().max().item() if va.is_floating_point() else "n/a"
        return f"{key}: values differ (max abs difference {diff})"
    return None if _same(va, vb) else f"{key}: {va!r} != {vb!r}"


def differences(a: dict[str, Any], b: dict[str, Any], limit: int = 20) -> list[str]:
    """What differs between two :func:`checkpoint_state` results (empty: bit-for-bit equal).

    Listed by part (:data:`_LISTED_FIRST`), at most ``limit`` and a last line saying how many more. Values only;
    :func:`compare_states` also requires that there was something to compare.
    """
    keys = sorted(set(a) | set(b), key=lambda k: (_LISTED_FIRST.index(part_of(k)), k))
    found = [line for line in (_difference(key, a, b) for key in keys) if line is not None]
    return found if len(found) <= limit else [*found[:limit], f"... and {len(found) - limit} more"]


@dataclass(frozen=True)
class Comparison:
    """The verdict of :func:`compare_states`."""

    differences: list[str]
    """Missing parts first (``<part>: <what is missing> in the <name>``), then values that differ."""
    parts: list[PartCount]
    """What was compared (the keys both hold), per part."""

    @property
    def equal(self) -> bool:
        """Every required part present in both, every value bit for bit the same."""
        return not self.differences

    @property
    def tensors(self) -> int:
        """Tensors compared."""
        return sum(p.tensors for p in self.parts)

    @property
    def entries(self) -> int:
        """Plain values compared."""
        return sum(p.entries for p in self.parts)


def compare_states(
    a: dict[str, Any], b: dict[str, Any], names: tuple[str, str] = ("reference", "other"), limit: int = 20
) -> Comparison:
    """Compare two :func:`checkpoint_state` results, requiring every part of the training state in both.

    Args:
        a: one state (counted: what both hold).
        b: the other.
        names: what ``a`` and ``b`` are, for the lines about a missing part.
        limit: list at most this many value differences (every missing part is listed).
    """
    missing = [f"{line} in the {name}" for state, name in zip((a, b), names) for line in missing_parts(state)]
    both = {key: a[key] for key in a if key in b}
    return Comparison(missing + differences(a, b, limit), part_counts(both))
