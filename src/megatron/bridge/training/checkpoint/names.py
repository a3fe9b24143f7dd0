"""File names of a checkpoint directory (Megatron-Bridge's layout) and the helpers that build and test them.

Kept apart from ``training/utils/checkpoint_utils.py`` (which re-exports every name here, Megatron-Bridge's module
for them) so that the commit protocol (``layout.py``) needs neither megatron-core nor the train state to name a file:
a save's crash points and the start-up recovery stay cheap to import.
"""

import os
from pathlib import Path
from typing import Optional

TRAIN_STATE_FILE = "train_state.pt"
"""A checkpoint's train state (``TrainState.state_dict()``, ``torch.save``), in each ``iter_*`` directory."""
TRACKER_PREFIX = "latest"
"""Prefix of the top-level copy of the newest checkpoint's train state (``latest_train_state.pt``)."""
CONFIG_FILE = "run_config.yaml"
"""The run's configuration as plain YAML, in each ``iter_*`` directory."""
TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""The tracker: the iteration of the newest committed checkpoint, as text (Megatron-LM's name)."""

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
