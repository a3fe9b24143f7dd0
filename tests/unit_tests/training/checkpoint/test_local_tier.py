"""The local tier's own logic: content hashes, verification, and finding a node's files in any rank directory."""

import io
import pickle

import pytest
import torch

from megatron.bridge.training.checkpoint import local_tier, shard_hashes


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """megatron-core's state-dict preprocessing asks the default process group for ranks: a world of one."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _tasd():
    """A small MCoreTensorAwareStateDict as one rank would save it (no process group: atomic algorithm)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    sharded = {
        "weight": ShardedTensor.from_rank_offsets("weight", torch.arange(12, dtype=torch.float32).reshape(3, 4)),
        "bias": ShardedTensor.from_rank_offsets("bias", torch.zeros(2)),
        "extra": ShardedObject("extra", io.BytesIO(b"te-extra-state"), (1,), (0,)),
        "train_state": {"iteration": 8, "consumed_train_samples": 64},
        "opt": {"lr": 1e-3, "style": "cosine", "again": "cosine", "betas": (0.9, 0.95)},
    }
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(sharded, algo="atomic")
    hashes = {**shard_hashes.content_hashes(tasd), shard_hashes.OWNER: shard_hashes.owner_tag(0, 8)}
    setattr(tasd, shard_hashes.HASHES_ATTR, hashes)
    return tasd


def _round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_a_saved_shard_verifies_after_a_save_and_load():
    tasd = _tasd()
    names = set(getattr(tasd, shard_hashes.HASHES_ATTR))
    assert {"tensor weight[0,0]", "object extra/shard_0_1", "<common>"} <= names, names
    assert shard_hashes.verify_content(_round_trip(tasd)) == []


def test_a_flipped_bit_in_a_tensor_is_named():
    tasd = _round_trip(_tasd())
    weight = next(sh for sh in tasd.sharded_state_dict.values() if getattr(sh, "key", "") == "weight")
    weight.data.view(torch.int32)[1, 2] ^= 1
    assert shard_hashes.verify_content(tasd) == ["tensor weight[0,0]: content differs from what its owner saved"]


def test_changed_common_state_and_missing_hashes_are_problems():
    tasd = _round_trip(_tasd())
    tasd.common["train_state"]["iteration"] = 9
    assert shard_hashes.verify_content(tasd) == ["<common>: content differs from what its owner saved"]
    delattr(tasd, shard_hashes.HASHES_ATTR)
    assert shard_hashes.verify_content(tasd) == ["carries no content hashes (not written by this version)"]


def test_value_digest_is_stable_across_pickling_shared_references():
    shared = "cosine"
    value = {"a": shared, "b": shared, "t": torch.ones(3), "n": None, "f": 0.1}
    again = pickle.loads(pickle.dumps(value))
    assert shard_hashes.value_digest(again) == shard_hashes.value_digest(value)
    again["f"] = 0.1000001
    assert shard_hashes.value_digest(again) != shard_hashes.value_digest(value)


def test_session_names_jobs_apart_and_node_root_is_per_host():
    assert local_tier.session_id("/ckpt/job_a") != local_tier.session_id("/ckpt/job_b")
    assert local_tier.session_id("/ckpt/job_a") == local_tier.session_id("/ckpt/job_a/")
    assert local_tier.node_root("/local").startswith("/local/local_ckpt/")


@pytest.fixture
def manager(tmp_path):
    """The real NVRx-based manager of rank 0 (no process group), for a session under ``tmp_path``."""
    return local_tier._manager_class()(str(tmp_path), session_id="s")


def _touch(tmp_path, rank_dir: int, iteration: int, owner: int) -> None:
    path = tmp_path / "s" / str(rank_dir) / f"iter_{iteration:07d}_{owner}_local.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"owner": owner, "iteration": iteration}, path)


def test_files_in_any_rank_directory_of_the_node_are_found_and_loaded(tmp_path, manager):
    _touch(tmp_path, rank_dir=1, iteration=8, owner=1)  # written when this node ran rank 1
    _touch(tmp_path, rank_dir=1, iteration=8, owner=0)  # its replica of rank 0
    (tmp_path / "s" / "1" / "iter_0000010_1_local.pt.dirty").write_bytes(b"unfinished")
    assert manager._my_ckpt_ids() == [(8, 0, "s"), (8, 1, "s")]
    assert manager._load((8, 0, "s")) == {"owner": 0, "iteration": 8}


def test_cleanup_keeps_the_newest_and_a_failed_save_removes_only_its_iteration(tmp_path, manager):
    for rank_dir, iteration in [(0, 6), (0, 8), (1, 8), (1, 10)]:
        _touch(tmp_path, rank_dir, iteration, owner=rank_dir)
    manager._cleanup(8)
    assert sorted(p.name for p in tmp_path.rglob("*.pt")) == [
        "iter_0000008_0_local.pt",
        "iter_0000008_1_local.pt",
        "iter_0000010_1_local.pt",
    ]
    manager._cleanup_failed_save(10)
    assert sorted(p.name for p in tmp_path.rglob("*.pt")) == ["iter_0000008_0_local.pt", "iter_0000008_1_local.pt"]


def test_a_shard_of_another_rank_or_iteration_is_refused():
    tasd = _round_trip(_tasd())
    assert shard_hashes.verify_content(tasd, shard_hashes.owner_tag(0, 8)) == []
    assert shard_hashes.verify_content(tasd, shard_hashes.owner_tag(1, 8)) == [
        "holds the state of rank 0, iteration 8, not of rank 1, iteration 8"
    ]


def test_a_shard_saved_under_another_parallel_layout_is_refused():
    tasd = _tasd()
    hashes = getattr(tasd, shard_hashes.HASHES_ATTR)
    hashes[shard_hashes.OWNER] = shard_hashes.owner_tag(0, 8, "world size 2, tensor parallel 1")
    assert shard_hashes.verify_content(tasd, shard_hashes.owner_tag(0, 8, "world size 2, tensor parallel 2")) == [
        "holds the state of rank 0, iteration 8, world size 2, tensor parallel 1, "
        "not of rank 0, iteration 8, world size 2, tensor parallel 2"
    ]
