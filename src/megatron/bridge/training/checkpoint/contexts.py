"""Megatron-Bridge's save and load contexts: what a pluggable checkpoint manager's ``save`` and ``load`` receive.

Failure handled: a custom or default manager given a partial description of the run saves an incomplete
checkpoint. Every save gets the whole run state (model, optimizer, scheduler, FLOPs, data iterator) in one
typed object, and every load the objects to restore into (``checkpointing.DefaultCheckpointManager``).
"""

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class CheckpointSaveContext:
    """What one save needs (Megatron-Bridge's pluggable checkpoint manager API)."""

    state: Any
    """The run's ``GlobalState`` (config, train state)."""
    model: list[torch.nn.Module]
    """The model chunks."""
    optimizer: Any
    """The optimizer (``None``: none to save)."""
    opt_param_scheduler: Any
    """The learning-rate scheduler."""
    num_floating_point_operations_so_far: int
    """Model FLOPs of the run so far."""
    train_data_iterator: Any = None
    """The training data iterator."""
    non_persistent_ckpt: bool = False
    """Save into the non-persistent (local) tier."""
    pg_collection: Any = None
    """The process groups (megatron-core's ``ProcessGroupCollection``)."""
    module_name: Optional[str] = None
    """The module's name when several models share a run."""


@dataclass
class CheckpointLoadContext:
    """What one load needs (Megatron-Bridge's pluggable checkpoint manager API)."""

    state: Any
    """The run's ``GlobalState``."""
    model: list[torch.nn.Module]
    """The model chunks to load into."""
    optimizer: Any
    """The optimizer to load into."""
    opt_param_scheduler: Any
    """The learning-rate scheduler to load into."""
    strict: bool = True
    """Model keys must match exactly."""
    skip_load_to_model_and_opt: bool = False
    """Read metadata only, leave model and optimizer as they are."""
    pg_collection: Any = None
    """The process groups (megatron-core's ``ProcessGroupCollection``)."""
    module_name: Optional[str] = None
    """The module's name when several models share a run."""
