"""Checks of the ``checkpoint`` section (global and local tiers), run by ``ConfigContainer.validate()`` at start.

Failures are ``ValueError("<field>: <problem>. Fix: <fix>.")``, like every other config check. A save directory or
local-tier directory that cannot be written (a read-only mount, no permission; probed by creating a file) is one
too: nothing has started, and the job stops with exit code 2 like any rejected config (``checkpoint/storage.py``).
"""

from __future__ import annotations

import logging
import os

from megatron.bridge.training.checkpoint.storage import write_problem
from megatron.bridge.training.config_checks.types import Section
from megatron.bridge.utils import launch_env
from megatron.bridge.utils.fields import fail as _fail

logger = logging.getLogger(__name__)


def validate_checkpoint(c: Section, world_size: int) -> None:
    """Check the checkpoint fields and their combinations for a job of ``world_size`` ranks."""
    _validate_global(c)
    _validate_local(c, world_size)


def _validate_global(c: Section) -> None:
    if c.ckpt_format != "torch_dist":
        _fail("checkpoint.ckpt_format", f"unsupported format {c.ckpt_format!r}", 'use "torch_dist"')
    if c.save_interval is not None and c.save_interval < 1:
        _fail("checkpoint.save_interval", f"must be >= 1 or None, got {c.save_interval}", "use a positive interval")
    if c.save_interval is not None and c.save is None:
        _fail("checkpoint.save_interval", "is set but checkpoint.save is not", "set checkpoint.save to a directory")
    if c.async_save and c.save is None:
        _fail("checkpoint.async_save", "is on but checkpoint.save is not set", "set checkpoint.save to a directory")
    if isinstance(c.save_retries, bool) or not isinstance(c.save_retries, int) or c.save_retries < 0:
        _fail(
            "checkpoint.save_retries",
            f"must be a whole number >= 0, got {c.save_retries!r}",
            "use 0 (no retry) or more",
        )
    backoff = c.save_retry_backoff
    if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or not 0 <= backoff < float("inf"):
        _fail("checkpoint.save_retry_backoff", f"must be seconds >= 0, got {backoff!r}", "use 0 or a positive number")
    if c.most_recent_k == 0 or c.most_recent_k < -1:
        _fail(
            "checkpoint.most_recent_k",
            f"must be -1 (keep all) or >= 1, got {c.most_recent_k}",
            "use -1 or a positive count",
        )
    if c.async_save and c.async_strategy != "nvrx":
        _fail(
            "checkpoint.async_strategy",
            f"{c.async_strategy!r} is not supported: asynchronous saves run on nvidia-resiliency-ext's queue",
            'use "nvrx"',
        )
    if c.dist_ckpt_strictness.startswith("return_"):
        _fail(
            "checkpoint.dist_ckpt_strictness",
            f"{c.dist_ckpt_strictness!r} hands the mismatched keys to the caller, and pretraining has no use for them",
            'use "log_unexpected", "raise_all" or another mode that logs, raises or ignores',
        )
    if c.ckpt_step is not None and (c.load is None or c.ckpt_step < 0):
        _fail(
            "checkpoint.ckpt_step",
            f"{c.ckpt_step} needs checkpoint.load and an iteration >= 0",
            "set checkpoint.load to the directory holding iter_<ckpt_step>",
        )
    if c.exit_on_missing_checkpoint and c.load is None:
        _fail(
            "checkpoint.exit_on_missing_checkpoint",
            "is set but checkpoint.load is not",
            "set checkpoint.load to the directory to resume from",
        )
    local_fields = ("non_persistent_save_interval", "non_persistent_local_ckpt_dir")
    for name in local_fields:
        if getattr(c, name) is not None and c.non_persistent_ckpt_type is None:
            _fail(
                f"checkpoint.{name}",
                "is set but checkpoint.non_persistent_ckpt_type is not",
                "set checkpoint.non_persistent_ckpt_type or remove this field",
            )
    if c.save is not None and os.path.exists(c.save) and not os.path.isdir(c.save):
        _fail("checkpoint.save", f"{c.save!r} exists and is not a directory", "point it at a directory")
    if c.load is not None and os.path.exists(c.load) and not os.path.isdir(c.load):
        _fail("checkpoint.load", f"{c.load!r} exists and is not a directory", "point it at a checkpoint directory")
    _check_writable("checkpoint.save", c.save)


_UNWRITABLE_FIX = (
    "remount it read-write or fix its owner or mode so that this job's user can create files in it, or point the "
    "field at a writable directory (one that does not exist yet is created when its parent is writable)"
)


def _check_writable(field: str, path: str | None) -> None:
    """``path`` (a directory to save into) can be written, or created: a file is really created and deleted."""
    problem = write_problem(path) if path is not None else None
    if problem is not None:
        _fail(field, f"{path!r} {problem}", _UNWRITABLE_FIX)


def _validate_local(c: Section, world_size: int) -> None:
    """The local tier (``non_persistent_*``) and its replication."""
    if c.replication and c.non_persistent_ckpt_type != "local":
        _fail(
            "checkpoint.replication",
            "replicates local-tier checkpoints, but there is no local tier",
            ('set checkpoint.non_persistent_ckpt_type="local" or checkpoint.replication=false'),
        )
    for name, default in (("replication_jump", None), ("replication_factor", 2)):
        if getattr(c, name) != default and not c.replication:
            _fail(
                f"checkpoint.{name}",
                "is set but checkpoint.replication is false",
                f"set checkpoint.replication=true or leave checkpoint.{name} at its default",
            )
    kind = c.non_persistent_ckpt_type
    if c.global_save_failure_policy == "continue_local" and kind != "local":
        _fail(
            "checkpoint.global_save_failure_policy",
            f'"continue_local" keeps training on the local tier, but checkpoint.non_persistent_ckpt_type is {kind!r} '
            "(there is no local tier)",
            'set checkpoint.non_persistent_ckpt_type="local" with checkpoint.non_persistent_local_ckpt_dir and '
            'checkpoint.non_persistent_save_interval, or use checkpoint.global_save_failure_policy="stop"',
        )
    if kind is None or kind == "None":  # Megatron-Bridge spells "no local tier" both ways
        return
    if kind != "local":
        _fail(
            "checkpoint.non_persistent_ckpt_type",
            f"{kind!r} is not supported (only node-local checkpoints are)",
            'use "local" with checkpoint.non_persistent_local_ckpt_dir, or leave it unset',
        )
    if not c.non_persistent_local_ckpt_dir:
        _fail(
            "checkpoint.non_persistent_local_ckpt_dir",
            'is required by non_persistent_ckpt_type="local"',
            "set it to fast node-local storage (a local SSD or /dev/shm)",
        )
    if os.path.exists(c.non_persistent_local_ckpt_dir) and not os.path.isdir(c.non_persistent_local_ckpt_dir):
        _fail(
            "checkpoint.non_persistent_local_ckpt_dir",
            f"{c.non_persistent_local_ckpt_dir!r} is not a directory",
            "point it at a directory",
        )
    _check_writable("checkpoint.non_persistent_local_ckpt_dir", c.non_persistent_local_ckpt_dir)
    if c.non_persistent_save_interval is None or c.non_persistent_save_interval < 1:
        _fail(
            "checkpoint.non_persistent_save_interval",
            f"must be >= 1, got {c.non_persistent_save_interval}",
            "set how often (in iterations) to save to the local tier",
        )
    if c.load is None:
        _fail(
            "checkpoint.non_persistent_ckpt_type",
            "local checkpoints are only loaded from checkpoint.load's job, which is not set",
            "set checkpoint.load (usually the same directory as checkpoint.save)",
        )
    if c.save is None:
        logger.warning(
            "checkpoint.save is not set: the local tier is the only one, and a node lost without a replica "
            "loses the run's progress"
        )
    elif c.save_interval is not None and c.save_interval <= c.non_persistent_save_interval:
        logger.warning(
            "checkpoint.non_persistent_save_interval=%d is not shorter than checkpoint.save_interval=%d: "
            "a global save replaces the local one at the same step",
            c.non_persistent_save_interval,
            c.save_interval,
        )
    if c.replication:
        _validate_replication(c, world_size)


def _validate_replication(c: Section, world_size: int) -> None:
    per_node = launch_env.current().local_world_size  # None: not set
    jump = c.replication_jump if c.replication_jump is not None else per_node
    if jump is None:
        _fail(
            "checkpoint.replication_jump",
            "defaults to ranks per node (LOCAL_WORLD_SIZE), which is not set",
            "launch with torchrun/ft_launcher/megatron.bridge.launch, or set checkpoint.replication_jump",
        )
    if jump < 1:
        _fail("checkpoint.replication_jump", f"must be >= 1, got {jump}", "use the number of ranks per node")
    if c.replication_factor < 2:
        _fail(
            "checkpoint.replication_factor",
            f"must be >= 2 (copies of each shard), got {c.replication_factor}",
            "use 2 or more, or checkpoint.replication=false",
        )
    if world_size % (jump * c.replication_factor):
        env = launch_env.current()
        if env.elastic and env.node_range is not None and world_size < env.node_range[1] * env.ranks_per_node:
            logger.warning(
                "checkpoint.replication: world size %d after an elastic shrink (--nnodes=%d:%d) is not divisible by "
                "replication_jump * replication_factor = %d * %d: local checkpoints are saved without replicas until "
                "the job is back on enough nodes (the global tier still protects against a lost node)",
                world_size,
                *env.node_range,
                jump,
                c.replication_factor,
            )
            return
        _fail(
            "checkpoint.replication_factor",
            f"world size {world_size} is not divisible by replication_jump * "
            f"replication_factor = {jump} * {c.replication_factor}",
            "choose a factor (and jump) that divide the "
            "world size, e.g. jump = ranks per node and a factor that divides the number of nodes",
        )
    if per_node is not None and jump < per_node:
        logger.warning(
            "checkpoint.replication_jump=%d is smaller than the %d ranks per node: some replicas are "
            "kept on their owner's node and do not survive its loss",
            jump,
            per_node,
        )
    if per_node >= 1 and world_size <= per_node:
        logger.warning(
            "checkpoint.replication on a single node: every replica is on the same node, so replication "
            "protects against a lost rank directory but not a lost node"
        )
