"""The optimizer's part of a checkpoint: how the distributed optimizer lays out its state, and loading it fresh.

Failure handled: a distributed optimizer built without Apex or Transformer Engine (every CPU run, and GPU runs
without them) cannot describe its state before its first step (megatron-core reads the Adam step counter of every
parameter), so resuming a run crashed in ``sharded_state_dict(is_loading=True)``. Before a load, its state is
created by one step at learning rate 0 (megatron-core's own dummy-state initialisation), which leaves every
parameter bit for bit as it was; the checkpoint then overwrites the state.

Failure handled: on the same path, the per-parameter Adam ``step`` counters torch reads came out of a load shared
between parameters (torch increments each in place: the shared one advanced once per parameter per step) and not
at the checkpoint's step; every update after a resume used the wrong bias correction (losses diverged from an
uninterrupted run one step after the resume). :func:`after_loading` sets each from the step the checkpoint holds.
"""

from typing import Any, Optional

import torch

from megatron.bridge.utils import upstream

_DUMMY_STATES = (
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._init_optimizer_states_with_dummy_values"
)


def optimizer_metadata(model: list[torch.nn.Module]) -> Optional[dict[str, Any]]:
    """How the distributed optimizer lays out its state in a checkpoint (``None``: not distributed).

    ``dp_reshardable``: each data-parallel rank writes and reads its own shard, with no gather on save.
    """
    ddp_config = getattr(model[0], "ddp_config", None)
    if ddp_config is None or not ddp_config.use_distributed_optimizer:
        return None
    return {"distrib_optim_sharding_type": "dp_reshardable"}


def prime_for_loading(optimizer: Any) -> None:
    """Give every distributed optimizer without state its state (zeros), leaving the parameters unchanged."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(part, DistributedOptimizer) or part.optimizer.state:
            continue
        groups = part.optimizer.param_groups
        saved = [(group["lr"], group.get("weight_decay")) for group in groups]
        for group in groups:  # lr 0: Adam's update and decoupled weight decay are both exactly 0
            group["lr"] = 0.0
        try:
            upstream.bound(part, _DUMMY_STATES)()
        finally:
            for group, (lr, weight_decay) in zip(groups, saved):
                group["lr"] = lr
                if weight_decay is not None:
                    group["weight_decay"] = weight_decay


def after_loading(optimizer: Any) -> None:
    """Set each parameter's Adam ``step`` of a loaded distributed optimizer from its group's (see the module doc).

    Without Apex/TE megatron-core keeps one step count per optimizer in the param groups; the per-parameter counters
    torch's Adam reads came out of the load shared between parameters (and, after :func:`prime_for_loading`, at 1).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(part, DistributedOptimizer):
            continue
        for group in part.optimizer.param_groups:
            if group.get("step") is None:
                continue  # Apex/TE optimizers keep the step in the group only: nothing to mend
            for param in group["params"]:
                state = part.optimizer.state.get(param)
                if state and isinstance(state.get("step"), torch.Tensor):
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)
