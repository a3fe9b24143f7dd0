"""A loaded checkpoint is put back part by part; a ``no-<part>-restore`` fault leaves out exactly its part."""

import pytest
import torch

from megatron.bridge.training.checkpoint import contents
from megatron.bridge.training.checkpoint.rng import (
    get_rng_state,
    rng_blob_length,
    rng_blob_to_tensor,
    serialize_rng_state,
)
from megatron.bridge.training.state import TrainState


class _Optimizer:
    """Records what is loaded into it (no distributed optimizer: nothing to mend after the load)."""

    def __init__(self) -> None:
        self.loaded: list[dict] = []

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state)


class _Scheduler(_Optimizer):
    pass


def _checkpoint_of(model: torch.nn.Module) -> dict:
    """What a load returns for ``model``, with the generators as they are now and a rank extra."""
    payload = serialize_rng_state({**get_rng_state(), contents.RANK_EXTRA_KEY: {"rerun": 3}})
    return {
        "model": model.state_dict(),
        "optimizer": {"state": "saved"},
        "opt_param_scheduler": {"num_steps": 6},
        "train_state": {"step": 6, "consumed_train_samples": 48},
        "rng_state": rng_blob_to_tensor(payload, rng_blob_length(payload)).unsqueeze(0),
    }


@pytest.mark.parametrize("skip", [(), ("rng",), ("optimizer",), ("rng", "optimizer")])
def test_each_part_is_restored_unless_it_is_skipped(skip):
    torch.manual_seed(1)
    saved_model = torch.nn.Linear(3, 2)
    loaded = _checkpoint_of(saved_model)
    saved_generator = torch.get_rng_state()
    torch.manual_seed(2)  # the fresh start's seeds
    model, optimizer, scheduler, state = torch.nn.Linear(3, 2), _Optimizer(), _Scheduler(), TrainState()
    fresh_generator = torch.get_rng_state()

    extra = contents.apply_loaded(loaded, [model], optimizer, scheduler, state, skip=skip)

    assert torch.equal(model.weight, saved_model.weight)  # never skipped
    assert scheduler.loaded == [{"num_steps": 6}] and (state.step, state.consumed_train_samples) == (6, 48)
    assert extra == {"rerun": 3}  # the rank's extra state travels with its generators, but is always restored
    assert optimizer.loaded == ([] if "optimizer" in skip else [{"state": "saved"}])
    assert torch.equal(torch.get_rng_state(), fresh_generator if "rng" in skip else saved_generator)
