"""Megatron-Bridge's checkpoint function API as the manager uses it: state dict, RNG states, strict model loads,
tracker resolution and the rename-first cleanup of non-persistent checkpoints."""

import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.bridge.training import checkpointing
from megatron.bridge.training.checkpoint.rng import (
    rng_blob_length,
    rng_blob_to_tensor,
    rng_state_from_tensor,
    serialize_rng_state,
    set_rng_state,
)
from megatron.bridge.training.checkpoint.state_dict import (
    delete_extra_state,
    generate_state_dict,
    safe_rng_state,
)
from megatron.bridge.training.config import CheckpointConfig
from megatron.bridge.training.state import TrainState


class _Chunk(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)

    def sharded_state_dict(self, **kwargs):
        return {"weight": self.linear.weight}


class _Optimizer:
    def __init__(self) -> None:
        self.calls = []

    def sharded_state_dict(self, model_sd, **kwargs):
        self.calls.append((sorted(model_sd), kwargs))
        return {"state": "optimizer"}


class _Scheduler:
    def state_dict(self):
        return {"num_steps": 3}


@pytest.mark.parametrize("is_loading", [False, True])
def test_state_dict_holds_every_part_and_the_optimizer_sees_the_model_sections(is_loading):
    optimizer = _Optimizer()
    sd = generate_state_dict(
        CheckpointConfig(),
        [_Chunk(), _Chunk()],
        optimizer,
        _Scheduler(),
        rng_state="rng",
        iteration=7,
        optim_sd_kwargs={"is_loading": is_loading, "metadata": None},
    )
    assert sorted(sd) == [
        "checkpoint_version",
        "iteration",
        "model0",
        "model1",
        "opt_param_scheduler",
        "optimizer",
        "rng_state",
    ]
    assert optimizer.calls == [
        (["checkpoint_version", "iteration", "model0", "model1"], {"is_loading": is_loading, "metadata": None})
    ]


def test_a_load_gets_the_optimizer_and_rng_scaffolds_even_when_saves_leave_them_out():
    cfg = CheckpointConfig(save_optim=False, save_rng=False)
    saving = generate_state_dict(cfg, [_Chunk()], _Optimizer(), _Scheduler(), rng_state="rng")
    loading = generate_state_dict(
        cfg, [_Chunk()], _Optimizer(), _Scheduler(), rng_state="rng", optim_sd_kwargs={"is_loading": True}
    )
    assert sorted(saving) == ["checkpoint_version", "model"]
    assert sorted(loading) == ["checkpoint_version", "model", "opt_param_scheduler", "optimizer", "rng_state"]


def test_extra_states_are_dropped_from_the_model_section_only():
    sd = {"model": {"w": 1, "layer._extra_state": 2}, "optimizer": {"x_extra_state": 3}}
    assert delete_extra_state(sd) == {"model": {"w": 1}, "optimizer": {"x_extra_state": 3}}


def test_generator_states_survive_the_safe_blob_of_a_checkpoint():
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    groups = SimpleNamespace(pp=_Group(), tp=_Group(), dp_cp=_Group(), ep=None)
    collected = checkpointing.get_rng_state(False, "torch_dist", pg_collection=groups)
    assert (collected.key, collected.global_shape, collected.replica_id) == ("rng_state", (1, 1), 0)
    payload = serialize_rng_state(safe_rng_state(collected.data[0]))
    blob = rng_blob_to_tensor(payload, rng_blob_length(payload))
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(4)
    np.random.seed(4)
    torch.manual_seed(4)
    set_rng_state(rng_state_from_tensor(blob))  # loads with weights_only: nothing pickled is trusted
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(1), expected[2])


class _Group:
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def test_a_strict_model_load_tolerates_only_transformer_engine_extra_states():
    module = torch.nn.Linear(2, 2)
    state = module.state_dict()
    checkpointing._load_model_state_dict(module, {**state, "x._extra_state": None}, strict=True)
    with pytest.raises(RuntimeError, match="does not match the model"):
        checkpointing._load_model_state_dict(module, {"weight": state["weight"]}, strict=True)


def test_the_tracker_is_read_fresh_and_a_checkpoint_directory_is_loaded_as_it_is(tmp_path):
    tracker = checkpointing.get_checkpoint_train_state_filename(str(tmp_path), prefix="latest")
    for step in (5, 10):
        torch.save(TrainState(step=step).state_dict(), tracker)
        assert checkpointing._resolve_checkpoint_iteration(str(tmp_path), None) == (step, False)
    ckpt = tmp_path / "iter_0000010"
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text("{}")
    assert checkpointing._resolve_checkpoint_iteration(str(ckpt), 3)[0] == checkpointing._DIRECT_ITERATION_DIR_SENTINEL
    with pytest.raises(FileNotFoundError, match="ckpt_step=3"):
        checkpointing._resolve_checkpoint_iteration(str(tmp_path), 3)


def test_cleanup_renames_before_deleting_and_leaves_newer_saves_alone(tmp_path, monkeypatch):
    for step in (10, 20, 30, 40):
        (tmp_path / f"iter_{step:07d}").mkdir()
    deleted = []
    monkeypatch.setattr("shutil.rmtree", lambda path, ignore_errors=False: deleted.append(os.path.basename(path)))
    checkpointing.cleanup_old_non_persistent_checkpoint(str(tmp_path), leave_ckpt_num=1, max_iteration=30)
    assert deleted == [".deleting_iter_0000010", ".deleting_iter_0000020"]
    assert sorted(os.listdir(tmp_path)) == [
        ".deleting_iter_0000010",
        ".deleting_iter_0000020",
        "iter_0000030",
        "iter_0000040",
    ]


def test_save_checkpoint_refuses_an_unknown_non_persistent_tier():
    state = SimpleNamespace(cfg=SimpleNamespace(checkpoint=SimpleNamespace(non_persistent_ckpt_type="memory")))
    with pytest.raises(ValueError, match="Must be 'local' or 'global'"):
        checkpointing.save_checkpoint(state, [], None, None, 0, checkpointing_context={}, non_persistent_ckpt=True)
