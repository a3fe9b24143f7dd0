"""Checks for an elastic job (``--nnodes=MIN:MAX``): every node count of the range must give a layout to train on.

A job that loses a node goes on with fewer (``utils/elastic.py``): fewer data-parallel replicas, the same global
batch (more micro-batches per step), the model-parallel layout unchanged. So the model-parallel size (tensor x
pipeline; context parallelism is not supported here) must divide the world size at every node count from MIN to MAX,
and the global batch must be a whole number of micro-batches at each data-parallel size. Both are checked at start,
when the range is known (the launcher exports it as ``MBRIDGE_NNODES``), not at the shrink, where a failed check
would end a job that has been training for hours. A world size the model-parallel size does not divide at a shrink
anyway (a range given to another launcher) is refused by ``check_world_divisible`` with the shrink named.
"""

from __future__ import annotations

import math

from megatron.bridge.training.config_checks.types import Container
from megatron.bridge.utils import launch_env
from megatron.bridge.utils.fields import fail as _fail


def validate_elastic(cfg: Container) -> None:
    """Refuse an elastic range some node count of which cannot train ``cfg``; nothing to check without a range.

    Each node count's world is its nodes times the ranks per node (in-process restart's reserve ranks are not
    subtracted: an elastic range with reserve ranks is not checked more closely than that).
    """
    env = launch_env.current()
    if not env.elastic:
        return
    assert env.node_range is not None
    low, high = env.node_range
    per_node = env.ranks_per_node
    given = f"--nnodes={low}:{high} with {per_node} rank(s) per node"
    m, t = cfg.model, cfg.train
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size
    bad = [n for n in range(low, high + 1) if (n * per_node) % model_parallel]
    if bad:
        _fail(
            "model.tensor_model_parallel_size",
            f"{given}: tensor parallel {m.tensor_model_parallel_size} x pipeline parallel "
            f"{m.pipeline_model_parallel_size} = {model_parallel} does not divide the world size on "
            f"{', '.join(map(str, bad))} node(s) (world size {', '.join(str(n * per_node) for n in bad)}); a shrink "
            "keeps the model-parallel layout and changes only the data-parallel size",
            f"choose MIN:MAX so that every node count in it times {per_node} is a multiple of {model_parallel}, or "
            "model-parallel sizes that divide each of those world sizes",
        )
    if "global_batch_size" in t.derived:
        _fail(
            "train.global_batch_size",
            f"{given}: it is unset, so it would follow the data-parallel size and change at a shrink (another "
            "training run from then on)",
            f"set it, to a multiple of micro_batch_size x the data-parallel size at every node count of {low}:{high}",
        )
    sizes = {nodes: t.micro_batch_size * (nodes * per_node // model_parallel) for nodes in range(low, high + 1)}
    for nodes, batch in sizes.items():
        if t.global_batch_size % batch:
            _fail(
                "train.global_batch_size",
                f"{given}: {t.global_batch_size} is not a multiple of micro_batch_size x data-parallel size = "
                f"{batch} on {nodes} node(s); a shrink keeps the global batch",
                f"use a multiple of {math.lcm(*sizes.values())} (a whole number of micro-batches at every node "
                "count of the range)",
            )
    c = cfg.checkpoint
    if c.replication:
        jump = c.replication_jump if c.replication_jump is not None else per_node
        if (high * per_node) % (jump * c.replication_factor):
            _fail(
                "checkpoint.replication_factor",
                f"{given}: the world size on {high} nodes ({high * per_node}) is not divisible by replication_jump x "
                f"replication_factor = {jump} x {c.replication_factor}",
                "choose a factor that divides MAX (after a shrink to a node count it does not divide, local "
                "checkpoints are saved without replicas)",
            )


def shrink_note(world_size: int) -> str:
    """Words for a message about a world of ``world_size`` ranks, naming the elastic range when there is one."""
    env = launch_env.current()
    if not env.elastic:
        return ""
    assert env.node_range is not None
    return f" (an elastic job, --nnodes={env.node_range[0]}:{env.node_range[1]}, now on {world_size} rank(s))"
