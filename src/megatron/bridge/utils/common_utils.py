"""Rank helpers that work before, during and without ``torch.distributed`` (Megatron-Bridge's ``common_utils``).

A file read by one rank for all (a checkpoint's run config or train state) must know its rank even when no process
group exists yet, e.g. in a tool that inspects a checkpoint: these helpers fall back to the launcher's ``RANK`` and
``WORLD_SIZE`` variables (:mod:`megatron.bridge.utils.launch_env`), then to a single process.
"""

import torch.distributed as dist

from megatron.bridge.utils import launch_env


def get_rank_safe() -> int:
    """The global rank of this process: the process group's, else ``$RANK``, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return launch_env.current().rank


def get_world_size_safe() -> int:
    """The number of ranks: the process group's, else ``$WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return launch_env.current().world_size


def print_rank_0(message: str) -> None:
    """Print ``message`` (flushed) on global rank 0 only."""
    if get_rank_safe() == 0:
        print(message, flush=True)
