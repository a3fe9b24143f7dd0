"""An elastic job's config (``--nnodes=MIN:MAX``) is checked at start for every node count of its range."""

import logging

import pytest
from tests.unit_tests.configs import base_config
from tests.unit_tests.training import test_config

from megatron.bridge.training.checkpoint.contents import layout_refusal
from megatron.bridge.training.config import ConfigContainer
from megatron.bridge.training.utils.overrides import apply_overrides
from megatron.bridge.utils.elastic import NNODES_ENV

pytestmark = pytest.mark.timeout(60)

LOCAL_TIER = [*test_config.LOCAL_TIER, "checkpoint.replication=true"]


@pytest.fixture
def nodes(monkeypatch):
    """Set the launcher's node range (``MIN:MAX``) and one rank per node."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")

    def set_range(text: str) -> None:
        monkeypatch.setenv(NNODES_ENV, text)

    return set_range


def _config(*overrides: str) -> ConfigContainer:
    return apply_overrides(base_config(), list(overrides))


def test_a_range_that_trains_at_every_node_count_is_valid(nodes):
    nodes("1:2")
    _config().validate(world_size=2)
    _config().validate(world_size=1)  # after the shrink: the same global batch, 4 micro-batches


def test_a_node_count_the_model_parallel_size_does_not_divide_is_refused_at_start(nodes):
    nodes("2:4")
    with pytest.raises(
        ValueError, match=r"^model.tensor_model_parallel_size: --nnodes=2:4 with 1 rank\(s\) per node"
    ) as err:
        _config("model.tensor_model_parallel_size=2").validate(world_size=4)
    assert "does not divide the world size on 3 node(s) (world size 3)" in str(err.value)
    assert "Fix: choose MIN:MAX so that every node count in it times 1 is a multiple of 2" in str(err.value)


def test_a_shrink_to_a_world_the_model_parallel_size_does_not_divide_names_the_range(nodes):
    nodes("2:4")
    with pytest.raises(ValueError, match=r"world size \(3\) \(an elastic job, --nnodes=2:4, now on 3 rank\(s\)\)"):
        _config("model.tensor_model_parallel_size=2").validate(world_size=3)


def test_an_unset_global_batch_would_change_at_a_shrink(nodes):
    nodes("1:2")
    cfg = _config()
    cfg.train.global_batch_size = None
    with pytest.raises(ValueError, match="^train.global_batch_size: --nnodes=1:2 .* it is unset, so it would follow"):
        cfg.validate(world_size=2)


def test_a_global_batch_that_is_not_whole_micro_batches_at_some_node_count_is_refused(nodes):
    nodes("1:3")
    with pytest.raises(ValueError, match=r"^train.global_batch_size: .* 8 is not a multiple of .* = 6 on 3 node\(s\)"):
        _config().validate(world_size=1)
    with pytest.raises(ValueError, match="use a multiple of 12"):
        _config().validate(world_size=1)
    _config("train.global_batch_size=12").validate(world_size=3)


def test_replication_that_max_nodes_cannot_hold_is_refused(nodes):
    nodes("1:3")
    with pytest.raises(ValueError, match=r"^checkpoint.replication_factor: .* on 3 nodes \(3\) is not divisible"):
        _config(*LOCAL_TIER, "train.global_batch_size=12").validate(world_size=3)


def test_after_a_shrink_local_checkpoints_go_on_without_replicas(nodes, caplog):
    nodes("1:2")
    with caplog.at_level(logging.WARNING):
        _config(*LOCAL_TIER).validate(world_size=1)
    assert "world size 1 after an elastic shrink (--nnodes=1:2)" in caplog.text
    assert "saved without replicas" in caplog.text


def test_without_a_range_replication_that_does_not_fit_is_still_an_error(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv(NNODES_ENV, raising=False)
    with pytest.raises(ValueError, match="world size 1 is not divisible by replication_jump"):
        _config(*LOCAL_TIER).validate(world_size=1)


LAYOUT = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "model_chunks": 1}


def test_a_distributed_optimizer_checkpoint_of_another_model_parallel_layout_is_refused():
    saved = {**LAYOUT, "distributed_optimizer": True}
    current = {
        **LAYOUT,
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "distributed_optimizer": True,
    }
    refused = layout_refusal(saved, current, "/ckpt/iter_0000006")
    assert refused is not None and refused.startswith("/ckpt/iter_0000006 was saved with the distributed optimizer")
    assert "model.tensor_model_parallel_size 1 in the checkpoint, 2 now" in refused
    assert "model.pipeline_model_parallel_size 1 in the checkpoint, 2 now" in refused
    assert "Fix: resume with the checkpoint's model-parallel sizes" in refused


@pytest.mark.parametrize(
    ("saved", "current"),
    [
        ({**LAYOUT, "distributed_optimizer": True}, {**LAYOUT, "distributed_optimizer": True}),  # only DP changed
        ({**LAYOUT, "distributed_optimizer": False}, {**LAYOUT, "tensor_model_parallel_size": 2}),  # reshardable
        (None, {**LAYOUT, "tensor_model_parallel_size": 2}),  # written before the layout was recorded
    ],
)
def test_what_megatron_core_reshards_is_not_refused(saved, current):
    assert layout_refusal(saved, {**current, "distributed_optimizer": True}, "/ckpt") is None


def test_a_local_shard_tells_the_layout_it_was_saved_under():
    from megatron.bridge.training.checkpoint import shard_hashes

    class Shard:
        pass

    shard = Shard()
    assert shard_hashes.saved_layout(shard) is None  # not written by this package
    layout = "world size 2, tensor parallel 1, pipeline parallel 1"
    setattr(shard, shard_hashes.HASHES_ATTR, {shard_hashes.OWNER: shard_hashes.owner_tag(1, 8, layout)})
    assert shard_hashes.saved_layout(shard) == layout
    setattr(shard, shard_hashes.HASHES_ATTR, {shard_hashes.OWNER: shard_hashes.owner_tag(1, 8)})
    assert shard_hashes.saved_layout(shard) == ""  # saved before layouts were recorded: not skipped for it
