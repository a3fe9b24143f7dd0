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
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from megatron.bridge.training.state import TrainState
from megatron.bridge.utils.common_utils import get_rank_safe, get_world_size_safe, print_rank_0

TRAIN_STATE_FILE = "train_state.pt"
"""A checkpoint's train state (``TrainState.state_dict()``, ``torch.save``), in each ``iter_*`` directory."""
TRACKER_PREFIX = "latest"
"""Prefix of the top-level copy of the newest checkpoint's train state (``latest_train_state.pt``)."""
CONFIG_FILE = "run_config.yaml"
"""The run's configuration as plain YAML, in each ``iter_*`` directory."""
TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""The tracker: the iteration of the newest committed checkpoint, as text (Megatron-LM's name)."""

logger = logging.getLogger(__name__)

_RUNTIME_ONLY_TARGETS = frozenset({"megatron.core.timers.Timers"})
"""``_target_`` entries of a run config that describe run-time objects, not settings: dropped when read."""

_ITERATION_DIR_MARKERS = (CONFIG_FILE, TRAIN_STATE_FILE, "metadata.json", ".metadata")
"""Files only a checkpoint of one iteration holds: run config, train state, torch_dist and PyTorch DCP metadata."""


def file_exists(path: str) -> bool:
    """Whether ``path`` exists (a file or a directory)."""
    return os.path.exists(path)


def join_paths(*paths: str) -> str:
    """``paths`` joined into one path string.

    Raises:
        ValueError: no path was given.
    """
    if not paths:
        raise ValueError("join_paths needs at least one path")
    return str(Path(paths[0]).joinpath(*paths[1:]))


def ensure_directory_exists(filename: str, check_parent: bool = True) -> None:
    """Create the directory of ``filename`` (``check_parent``), or ``filename`` itself as a directory, if missing."""
    directory = os.path.dirname(filename) if check_parent else filename
    if directory:
        os.makedirs(directory, exist_ok=True)


def get_checkpoint_name(checkpoints_path: str, iteration: int, release: bool = False) -> str:
    """The directory of the checkpoint of ``iteration`` (``iter_0000100``), or ``release`` with ``release=True``."""
    return join_paths(checkpoints_path, "release" if release else f"iter_{iteration:07d}")


def get_checkpoint_train_state_filename(checkpoints_path: str, prefix: Optional[str] = None) -> str:
    """The train state file in ``checkpoints_path``: ``train_state.pt``, or ``<prefix>_train_state.pt``."""
    name = TRAIN_STATE_FILE if prefix is None else f"{prefix}_{TRAIN_STATE_FILE}"
    return join_paths(checkpoints_path, name)


def get_checkpoint_run_config_filename(checkpoints_path: str) -> str:
    """The run config file (``run_config.yaml``) of the checkpoint directory ``checkpoints_path``."""
    return join_paths(checkpoints_path, CONFIG_FILE)


def get_checkpoint_tracker_filename(checkpoints_path: str) -> str:
    """The tracker file (``latest_checkpointed_iteration.txt``) of the save directory ``checkpoints_path``."""
    return join_paths(checkpoints_path, TRACKER_FILE)


def is_checkpoint_iteration_directory(path: Optional[str]) -> bool:
    """Whether ``path`` is one checkpoint's directory (it holds a run config, train state or checkpoint metadata)."""
    if path is None:
        return False
    return any(file_exists(join_paths(path, marker)) for marker in _ITERATION_DIR_MARKERS)


def checkpoint_exists(checkpoints_path: Optional[str]) -> bool:
    """Whether ``checkpoints_path`` holds a checkpoint: it is one, or it is a save directory with a tracker."""
    if not checkpoints_path:
        return False
    if is_checkpoint_iteration_directory(checkpoints_path):
        return True
    if file_exists(get_checkpoint_train_state_filename(checkpoints_path, prefix=TRACKER_PREFIX)):
        return True
    return os.path.isfile(get_checkpoint_tracker_filename(checkpoints_path))


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
