"""The checkpoint comparison requires its content: equal means every part of the state was there and the same.

Snapshots here have the shape ``compare.checkpoint_state`` gives a drill's checkpoint (two pipeline stages, each with
its distributed optimizer's state, and one row of serialized generators per rank), shrunk to a few values.
"""

import pytest
import torch

from megatron.bridge.training.checkpoint import compare
from megatron.bridge.training.checkpoint.rng import rng_blob_length, rng_blob_to_tensor, serialize_rng_state

MODEL_NUMEL = 12


def _rng_rows(seeds: tuple[int, ...]) -> torch.Tensor:
    blobs = []
    for seed in seeds:
        torch.manual_seed(seed)
        blobs.append(serialize_rng_state({"torch": torch.get_rng_state(), "tracker": {}, "rank_extra": None}))
    width = max(rng_blob_length(b) for b in blobs)
    return torch.stack([rng_blob_to_tensor(b, width) for b in blobs])


def _snapshot(stages: int = 2, seeds: tuple[int, ...] = (1, 2)) -> dict:
    state = {
        "sharded.embedding.word_embeddings.weight": torch.ones(4, 2),
        "sharded.output_layer.weight": torch.ones(2, 2),
        "sharded.decoder.layers.mlp.linear_fc1._extra_state/shard_0_4.0": None,
        "common.checkpoint_version": 1,
        "common.opt_param_scheduler.num_steps": 48,
        "common.train_state.step": 6,
        "common.train_state.consumed_train_samples": 48,
        "common.train_state.consumed_valid_samples": 0,
        "common.rng_world_size": len(seeds),
        "sharded.rng_state": _rng_rows(seeds),
        "common.optimizer.param_state_sharding_type": "dp_reshardable",
    }
    for stage in range(stages):
        group = f"sharded.optimizer.distributed.dp_group_idx_{stage}"
        for name in ("exp_avg", "exp_avg_sq", "param"):
            state[f"{group}.gbuf_idx_0.bucket_idx_0.{name}"] = torch.full((MODEL_NUMEL // stages,), 0.5)
        state[f"{group}.optimizer/shard_0_1.0.param_groups.0.step"] = 6.0
    return state


def _without(state: dict, *fragments: str) -> dict:
    return {k: v for k, v in state.items() if not any(f in k for f in fragments)}


def test_two_empty_snapshots_are_not_equal_and_every_missing_part_is_named():
    result = compare.compare_states({}, {}, names=("reference", "drill"))
    assert not result.equal and result.tensors == 0 and result.entries == 0
    for part in ("model", "optimizer", "scheduler", "train state", "data position", "RNG"):
        assert any(line.startswith(f"{part}: ") and line.endswith("in the reference") for line in result.differences)
        assert any(line.startswith(f"{part}: ") and line.endswith("in the drill") for line in result.differences)


def test_a_complete_pair_is_equal_and_counted_part_by_part():
    result = compare.compare_states(_snapshot(), _snapshot())
    assert result.equal, result.differences
    counts = {p.part: p for p in result.parts}
    assert (counts["model"].tensors, counts["model"].entries) == (2, 1)
    assert (counts["optimizer"].tensors, counts["optimizer"].entries) == (6, 3)
    assert counts["optimizer"].detail == "2 pipeline stage(s): 4 moments, 2 master weights, 2 step counts"
    assert (counts["scheduler"].entries, counts["train state"].entries, counts["data position"].entries) == (1, 1, 2)
    assert (counts["RNG"].tensors, counts["RNG"].detail) == (1, "2 ranks")
    assert result.tensors == 9 and result.entries == 10  # the format version is "other"
    assert counts["RNG"].describe() == "RNG 1 tensor, 1 entry (2 ranks)"


def test_an_emptied_optimizer_section_fails_and_is_not_dropped():
    emptied = {**_without(_snapshot(), "optimizer"), **compare.flatten({"optimizer": {}}, "common.")}
    assert emptied["common.optimizer"] == {}  # an empty section stays an entry
    result = compare.compare_states(emptied, emptied, names=("reference", "drill"))
    assert "optimizer: no state (moments, step counts) in the reference" in result.differences
    assert "optimizer: no state (moments, step counts) in the drill" in result.differences
    one_sided = compare.compare_states(_snapshot(), emptied)
    assert "common.optimizer: only in one of the two" in one_sided.differences


def test_a_pipeline_stage_without_its_optimizer_state_fails():
    one_stage = _without(_snapshot(), "dp_group_idx_1")
    result = compare.compare_states(one_stage, one_stage)
    assert not result.equal
    assert result.differences[0].startswith("optimizer: moments for 6 of the model's 12 parameters"), result.differences


@pytest.mark.parametrize(
    "dropped,problem",
    [
        ("dp_group_idx_1.gbuf_idx_0.bucket_idx_0.exp_avg", "optimizer (dp_group_idx_1): no moments"),
        ("dp_group_idx_0.optimizer/shard_0_1.0.param_groups.0.step", "optimizer (dp_group_idx_0): no step counts"),
        ("opt_param_scheduler", "scheduler: no state"),
        ("train_state.step", "train state: no iteration"),
        ("consumed_train_samples", "data position: no consumed samples"),
        ("rng_state", "RNG: no generator states"),
        ("word_embeddings", None),  # the other weight is still there
    ],
)
def test_a_missing_part_fails_naming_the_part_and_the_side(dropped, problem):
    lacking = _without(_snapshot(), dropped)
    if dropped == "dp_group_idx_1.gbuf_idx_0.bucket_idx_0.exp_avg":
        lacking = _without(lacking, "dp_group_idx_1.gbuf_idx_0.bucket_idx_0.exp_avg_sq")
    result = compare.compare_states(_snapshot(), lacking, names=("reference", "drill"))
    assert not result.equal  # at least the key held by one side only
    missing = [line for line in result.differences if line.endswith("in the drill")]
    assert [line for line in missing if line.startswith(problem)] if problem else not missing, result.differences
    assert not [line for line in result.differences if line.endswith("in the reference")]


def test_every_rank_needs_its_generators():
    state = _snapshot()
    state["sharded.rng_state"] = state["sharded.rng_state"].clone()
    state["sharded.rng_state"][1] = 0
    assert compare.missing_parts(state) == ["RNG: rank 1's generator state is empty"]
    assert compare.missing_parts({**_snapshot(), "common.rng_world_size": 3}) == [
        "RNG: 2 rank(s)' states for a world of 3 (rng_world_size)"
    ]
    assert compare.missing_parts(_snapshot()) == []


def test_a_rank_whose_generators_moved_is_named_with_its_generators():
    result = compare.compare_states(_snapshot(seeds=(1, 2)), _snapshot(seeds=(1, 3)))
    assert result.differences == ["sharded.rng_state: the generators of rank 1 (torch) differ"]


def test_differences_list_the_small_parts_first_and_say_how_many_were_left_out():
    a = {f"sharded.decoder.layer{i}.weight": torch.zeros(2) for i in range(5)} | {"common.train_state.step": 6}
    b = {f"sharded.decoder.layer{i}.weight": torch.ones(2) for i in range(5)} | {"common.train_state.step": 7}
    a["sharded.optimizer.exp_avg"], b["sharded.optimizer.exp_avg"] = torch.zeros(1), torch.ones(1)
    found = compare.differences(a, b, limit=3)
    assert found[:2] == [
        "common.train_state.step: 6 != 7",
        "sharded.optimizer.exp_avg: values differ (max abs difference 1.0)",
    ]
    assert found[2] == "sharded.decoder.layer0.weight: values differ (max abs difference 1.0)"
    assert found[3] == "... and 4 more"


def test_one_step_count_for_all_parameters_counts_as_the_step_counts():
    # megatron-core's non-distributed optimizers keep one step count, state.common_step, for every parameter.
    snapshot = _without(_snapshot(), "param_groups.0.step")
    assert "no step counts" in " ".join(compare.missing_parts(snapshot))
    for stage in ("dp_group_idx_0", "dp_group_idx_1"):
        snapshot[f"sharded.optimizer.distributed.{stage}.optimizer/shard_0_1.0.state.common_step"] = torch.tensor(6.0)
    assert not compare.missing_parts(snapshot)
