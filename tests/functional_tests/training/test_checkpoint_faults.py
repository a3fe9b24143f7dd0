"""Fault drills on checkpoints: a rank killed mid-save, a crash during commit, corrupt and truncated files."""

import shutil

import pytest
from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.harness import assert_same_state, checkpoint_state, tail, torchrun

from megatron.bridge.training.events.stream import EventKind


@pytest.mark.parametrize(
    "crash_at,leftover",
    [
        ("kill@6:1:save.during_write", ".tmp_iter_0000006.*"),  # rank 1 SIGKILLed after writing, before the commit
        ("kill@6:0:save.after_rename", "iter_0000006"),  # rank 0 SIGKILLed after publishing iter_6, before the tracker
    ],
)
def test_rank_killed_during_save_resumes_from_previous(reference_tp1, tmp_path, crash_at, leftover):
    reference, reference_ckpt = reference_tp1
    ckpt = tmp_path / "ckpt"
    crashed = torchrun(ckpt, env={"MBRIDGE_FAULTS": crash_at})
    assert crashed.exit_code == 128 + 9, tail(crashed)  # the SIGKILLed rank is the root cause
    assert [e.fault_kind for e in crashed.events(EventKind.FAULT_INJECTED)] == ["kill"]
    assert [p for p in ckpt.glob(leftover) if p.is_dir()], sorted(p.name for p in ckpt.iterdir())
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"

    resumed = torchrun(ckpt)
    assert resumed.exit_code == 0, tail(resumed)
    assert resumed.loaded() == [3]
    ref_losses = reference.losses()
    assert resumed.losses() == {i: ref_losses[i] for i in range(4, 13)}
    assert not list(ckpt.glob(".tmp_iter_*")), "leftovers of the crashed save are cleaned"
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip_byte", "truncate"])
def test_corrupt_newest_checkpoint_falls_back(reference_tp1, interrupted_copy, damage):
    reference, reference_ckpt = reference_tp1
    shard = interrupted_copy / "iter_0000006" / "__1_0.distcp"
    if damage == "flip_byte":
        _flip_byte(shard)
    else:
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 3)
    resumed = torchrun(interrupted_copy)
    assert resumed.exit_code == 0, tail(resumed)
    assert "iter_0000006 failed verification" in resumed.output
    assert "__1_0.distcp: " + ("sha256" if damage == "flip_byte" else "size") in resumed.output
    assert "fell back to checkpoint at iteration 3 (newest was 6)" in resumed.output
    if damage == "flip_byte":  # the case the docs quote
        assert_doc_log_lines(resumed.output)
    ref_losses = reference.losses()
    assert resumed.losses() == {i: ref_losses[i] for i in range(4, 13)}
    assert_same_state(
        checkpoint_state(interrupted_copy / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012")
    )


def test_no_valid_checkpoint_stops_with_clear_error(interrupted_copy):
    _flip_byte(interrupted_copy / "iter_0000006" / "common.pt")
    (interrupted_copy / "iter_0000003" / "manifest.json").unlink()
    before = sorted(p.name for p in interrupted_copy.iterdir())
    run = torchrun(interrupted_copy)
    assert run.exit_code == 3, tail(run)
    assert "NO_VALID_CHECKPOINT (exit code 3)" in run.output, tail(run)
    assert "none of the checkpoints [6, 3]" in run.output
    assert run.losses() == {}, "must not silently train from iteration 0"
    assert sorted(p.name for p in interrupted_copy.iterdir()) == before, "nothing may be deleted"


def test_missing_checkpoint_is_an_error_when_asked(tmp_path):
    run = torchrun(tmp_path / "empty", "checkpoint.exit_on_missing_checkpoint=true", "train.train_iters=3")
    assert run.exit_code == 3, tail(run)
    assert "NO_VALID_CHECKPOINT (exit code 3)" in run.output, tail(run)
    assert run.losses() == {}


def test_bad_override_exits_with_config_error(tmp_path):
    run = torchrun(tmp_path / "x", "checkpoint.async_save=true", "checkpoint.ckpt_format=zarr")
    assert "checkpoint.ckpt_format: unsupported format 'zarr'" in run.output, tail(run)
    assert run.exit_code == 2
    assert not (tmp_path / "x").exists(), "a rejected config must not start anything"


def test_copying_reference_keeps_it_valid(reference_tp1, tmp_path):
    shutil.copytree(reference_tp1[1], tmp_path / "copy")
    from megatron.bridge.training.checkpoint.verify_cli import main as verify

    assert verify([str(tmp_path / "copy"), "--all"]) == 0
