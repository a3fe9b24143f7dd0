"""Checkpoints on disk: which format one is, whether a global non-persistent one exists, pruning old ones.

Failure handled: a checkpoint of another format loaded as ``torch_dist`` fails deep inside megatron-core; its
format is detected from its files first, with a clear error for an unknown one. Pruning renames each checkpoint
before deleting it (``layout.remove_checkpoints``), so a crash mid-delete never leaves a half-deleted ``iter_*``.
"""

import os
from pathlib import Path
from typing import Optional

import torch
from megatron.core import dist_checkpointing

from megatron.bridge.training.checkpoint import layout
from megatron.bridge.training.config import CheckpointConfig
from megatron.bridge.training.utils.checkpoint_utils import checkpoint_exists
from megatron.bridge.utils.common_utils import print_rank_0


def _get_checkpoint_format(checkpoint_path: str) -> str:
    """The format of the checkpoint in ``checkpoint_path``: ``torch_dist`` or ``fsdp_dtensor`` (PyTorch DCP).

    Raises:
        NotImplementedError: neither.
    """
    if dist_checkpointing.check_is_distributed_checkpoint(checkpoint_path):
        return "torch_dist"
    if os.path.exists(os.path.join(checkpoint_path, ".metadata")):
        return "fsdp_dtensor"
    raise NotImplementedError(f"Unknown checkpoint format in {checkpoint_path}")


def _has_global_non_persistent_checkpoint(load_dir: Optional[str], ckpt_cfg: CheckpointConfig) -> bool:
    """Whether a global non-persistent checkpoint exists.

    It is looked for in ``non_persistent_global_ckpt_dir``, else in ``<save or load>/non_persistent``; always
    ``False`` unless ``non_persistent_ckpt_type="global"``.
    """
    if ckpt_cfg.non_persistent_ckpt_type != "global":
        return False
    if ckpt_cfg.non_persistent_global_ckpt_dir:
        candidates = [ckpt_cfg.non_persistent_global_ckpt_dir]
    else:
        candidates = [os.path.join(root, "non_persistent") for root in (ckpt_cfg.save, load_dir) if root]
    return any(checkpoint_exists(path) for path in candidates)


def cleanup_old_non_persistent_checkpoint(
    save_dir: str, leave_ckpt_num: int = 1, do_async: bool = False, *, max_iteration: Optional[int] = None
) -> None:
    """Delete the ``iter_*`` checkpoints of ``save_dir`` but the newest ``leave_ckpt_num`` (rank 0 only).

    ``max_iteration``: newer directories (a save still in progress) are left alone. Each checkpoint is renamed
    before it is deleted, so a crash never leaves a half-deleted ``iter_*`` that looks loadable
    (``checkpoint/layout.py``); ``do_async`` deletes in a background thread.
    """
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    found = []
    for path in Path(save_dir).glob("iter_*"):
        suffix = path.name[len("iter_") :]
        if suffix.isdigit() and (max_iteration is None or int(suffix) <= max_iteration):
            found.append(int(suffix))
    found.sort()
    doomed = found[:-leave_ckpt_num] if leave_ckpt_num > 0 else found
    if not doomed:
        return
    print_rank_0(f"Non-persistent checkpoints scheduled for removal: {doomed}; kept: {found[len(doomed) :]}")
    layout.remove_checkpoints(save_dir, doomed, background=do_async)
