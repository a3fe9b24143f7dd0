"""Names of a checkpoint directory's files and the readers of its small metadata files (Megatron-Bridge's layout).

A checkpoint directory (``checkpoint.save``) holds::

    latest_checkpointed_iteration.txt   the tracker (Megatron-LM's name): the newest committed iteration
    latest_train_state.pt               the train state of that checkpoint (Megatron-Bridge's tracker)
    iter_0000100/                       one checkpoint: run_config.yaml, train_state.pt, the torch_dist files
                                        (and manifest.json when this package wrote it)

The same names are used by this package's saves (``training/checkpoint/layout.py``) and by its loads, so a
checkpoint moves between this package and Megatron-Bridge in both directions. :func:`read_run_config` and
:func:`read_train_state` read on rank 0 and broadcast: a file read by thousands of ranks at once on a shared file
system is a load spike, and a rank that cannot read it must not leave the others waiting in the broadcast (rank 0's
error reaches every rank as a ``RuntimeError``). Both are cached per path.
"""

import logging
import sys
from functools import lru_cache
from typing import Any

import torch
import yaml

from megatron.bridge.training.checkpoint.names import (  # noqa: F401 - Megatron-Bridge's names of this module
    CONFIG_FILE,
    TRACKER_FILE,
    TRACKER_PREFIX,
    TRAIN_STATE_FILE,
    checkpoint_exists,
    ensure_directory_exists,
    file_exists,
    get_checkpoint_name,
    get_checkpoint_run_config_filename,
    get_checkpoint_tracker_filename,
    get_checkpoint_train_state_filename,
    is_checkpoint_iteration_directory,
    join_paths,
)
from megatron.bridge.training.state import TrainState
from megatron.bridge.utils.common_utils import get_rank_safe, get_world_size_safe, print_rank_0

logger = logging.getLogger(__name__)

_RUNTIME_ONLY_TARGETS = frozenset({"megatron.core.timers.Timers"})
"""``_target_`` entries of a run config that describe run-time objects, not settings: dropped when read."""


def _load_run_config(run_config_filename: str) -> Any:
    """Parse and sanitize one run config file (on the calling process)."""
    with open(run_config_filename) as f:
        config = yaml.safe_load(f)
    return _sanitize_run_config_object(config)


def _load_train_state(train_state_filename: str) -> TrainState:
    """Read one train state file (on the calling process) into a fresh ``TrainState``."""
    saved = torch.load(train_state_filename, map_location="cpu", weights_only=True)
    train_state = TrainState()
    train_state.load_state_dict(saved)
    return train_state


def _read_on_rank0_and_broadcast(read: Any, path: str, what: str) -> Any:
    """``read(path)`` on rank 0, its result (or its error, raised as ``RuntimeError``) on every rank."""
    message = f"Unable to load {what} file {path}"
    if not torch.distributed.is_initialized():
        try:
            return read(path)
        except Exception as err:
            raise RuntimeError(f"{message}: {err}") from err
    box: list[Any] = [None]
    if get_rank_safe() == 0:
        try:
            box[0] = read(path)
        except Exception as err:  # noqa: BLE001 - sent to every rank and raised there
            error = f"ERROR: {message}: {err}"
            sys.stderr.write(error + "\n")
            box[0] = {"error": True, "msg": error}
    print_rank_0(f"Broadcasting {what} from rank 0 to all {get_world_size_safe()} ranks")
    torch.distributed.broadcast_object_list(box, src=0)
    if isinstance(box[0], dict) and box[0].get("error", False):
        raise RuntimeError(box[0]["msg"])
    return box[0]


@lru_cache
def read_run_config(run_config_filename: str) -> dict[str, Any]:
    """The run config of a checkpoint as a dict (``None`` for an empty file); read on rank 0, sent to every rank.

    Run-time objects serialized into it (``_target_: megatron.core.timers.Timers``) are replaced by ``None``.
    Call on every rank when ``torch.distributed`` is initialized (a broadcast).

    Raises:
        RuntimeError: ``Unable to load config file ...``: the file is missing, unreadable or not YAML.
    """
    return _read_on_rank0_and_broadcast(_load_run_config, run_config_filename, "config")


@lru_cache
def read_train_state(train_state_filename: str) -> TrainState:
    """The ``TrainState`` saved in ``train_state_filename``; read on rank 0 (``weights_only``), sent to every rank.

    The result is cached and shared: copy it (``load_state_dict(ts.state_dict())``) before changing it. Call on
    every rank when ``torch.distributed`` is initialized (a broadcast).

    Raises:
        RuntimeError: ``Unable to load train state file ...``: the file is missing or unreadable.
    """
    return _read_on_rank0_and_broadcast(_load_train_state, train_state_filename, "train state")


def _sanitize_run_config_object(obj: Any) -> Any:
    """``obj`` with every run-time-only ``_target_`` object replaced by ``None`` (nested dicts and lists)."""
    if isinstance(obj, dict):
        if obj.get("_target_") in _RUNTIME_ONLY_TARGETS:
            return None
        return {key: _sanitize_run_config_object(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_sanitize_run_config_object(item) for item in obj]
    return obj
