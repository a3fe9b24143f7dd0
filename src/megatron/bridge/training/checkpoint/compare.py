"""Compare two committed checkpoints value by value, to tell whether the training state is bit-for-bit the same.

Used by the resiliency drill (a run with faults against a fault-free one) and by the tests. Everything a checkpoint
holds is compared (model, optimizer, scheduler, RNG states, progress) except the entries in
:data:`NOT_TRAINING_STATE`, which record how the run went (wall-clock accounting), not what it computed.
"""

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

NOT_TRAINING_STATE = ("goodput",)
"""Top-level entries of a checkpoint's common part that differ between equal runs (timing, not state)."""


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists as one flat dict keyed by dotted paths (``prefix`` first)."""
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
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt_dir = Path(ckpt_dir)
    with tempfile.TemporaryDirectory() as tmp:
        flat_path = os.path.join(tmp, "flat.pt")
        dcp_to_torch_save(str(ckpt_dir), flat_path)
        sharded = torch.load(flat_path, weights_only=False)
    common = torch.load(ckpt_dir / "common.pt", weights_only=True)
    common = {k: v for k, v in common.items() if k not in NOT_TRAINING_STATE}
    return {**flatten(sharded, "sharded."), **flatten(common, "common.")}


def differences(a: dict[str, Any], b: dict[str, Any], limit: int = 20) -> list[str]:
    """What differs between two :func:`checkpoint_state` results (empty: bit-for-bit equal), at most ``limit``."""
    found = [f"{key}: only in one of the two" for key in sorted(set(a) ^ set(b))]
    for key in sorted(set(a) & set(b)):
        va, vb = a[key], b[key]
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
            if va.dtype != vb.dtype or va.shape != vb.shape:
                found.append(f"{key}: {va.dtype}{tuple(va.shape)} vs {vb.dtype}{tuple(vb.shape)}")
            elif not torch.equal(va, vb):
                diff = (va.double() - vb.double()).abs().max().item() if va.is_floating_point() else "n/a"
                found.append(f"{key}: values differ (max abs difference {diff})")
        elif isinstance(va, torch.Tensor) or isinstance(vb, torch.Tensor) or va != vb:
            found.append(f"{key}: {va!r} != {vb!r}")
        if len(found) >= limit:
            break
    return found[:limit]


def tensor_count(state: dict[str, Any]) -> int:
    """How many tensors a :func:`checkpoint_state` result holds."""
    return sum(isinstance(v, torch.Tensor) for v in state.values())
