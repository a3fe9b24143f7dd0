"""Stop and resume: every logged loss and the final model, optimizer and RNG states equal an uninterrupted run."""

import shutil

from tests.functional_tests.harness import assert_same_state, checkpoint_state, tail, torchrun

from megatron.bridge.training.events.stream import EventKind


def _assert_resumed_like_reference(first, second, reference, ckpt, reference_ckpt, stop_at=6):
    ref_losses = reference.losses()
    assert first.losses() == {i: ref_losses[i] for i in range(1, stop_at + 1)}
    assert second.losses() == {i: ref_losses[i] for i in range(stop_at + 1, 13)}, tail(second)
    assert f"at iteration {stop_at}" in second.output
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


def test_resume_is_bit_identical(reference_tp1, interrupted_tp1, interrupted_copy):
    reference, reference_ckpt = reference_tp1
    first, _ = interrupted_tp1
    assert "training stopped at iteration 6: reached train.exit_interval=6" in first.output
    second = torchrun(interrupted_copy)
    assert second.exit_code == 0, tail(second)
    _assert_resumed_like_reference(first, second, reference, interrupted_copy, reference_ckpt)


def test_async_save_resume_matches_sync_reference(reference_tp1, tmp_path):
    reference, reference_ckpt = reference_tp1
    first = torchrun(tmp_path / "ckpt", "checkpoint.async_save=true", "train.exit_interval=6")
    assert first.exit_code == 20, tail(first)
    scheduled = [
        line for line in first.output.splitlines() if "[rank0]" in line and "Scheduling async checkpoint save" in line
    ]
    assert len(scheduled) == 2, scheduled  # iterations 3 and 6
    assert "finalized async checkpoint save at iteration 6" in first.output
    # Three saves in the resumed run (8, 10, 12), the last one from megatron-core's cached save plan.
    cached = ("checkpoint.ckpt_assume_constant_structure=true", "checkpoint.save_interval=2")
    second = torchrun(tmp_path / "ckpt", "checkpoint.async_save=true", *cached)
    assert second.exit_code == 0, tail(second)
    assert "finalized async checkpoint save at iteration 12" in second.output
    # Each save's event says what it blocked the loop: the call, then the finalize that committed it.
    saved = [e for e in second.events(EventKind.CHECKPOINT_SAVED) if e.rank == 0 and e.tier == "global"]
    assert [e.iteration for e in saved] == [8, 10, 12]
    assert all(0 <= e.finalize_seconds <= e.commit_seconds and e.seconds < e.commit_seconds for e in saved), saved
    _assert_resumed_like_reference(first, second, reference, tmp_path / "ckpt", reference_ckpt)


def test_restart_after_completion_does_not_train_again(reference_tp1, tmp_path):
    shutil.copytree(reference_tp1[1], tmp_path / "ckpt")
    again = torchrun(tmp_path / "ckpt")
    assert again.exit_code == 0, tail(again)
    assert again.losses() == {}
    assert "already at train.train_iters=12" in again.output


def test_duration_limit_saves_and_exits_for_requeue(tmp_path):
    run = torchrun(tmp_path / "ckpt", "train.exit_duration_in_mins=0.0001")
    assert run.exit_code == 19, tail(run)
    assert "ran train.exit_duration_in_mins=0.0001" in run.output
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert run.losses().keys() == {1}


def test_resume_on_a_different_world_size(interrupted_copy):
    run = torchrun(interrupted_copy, nproc=1)
    assert run.exit_code == 0, tail(run)
    assert run.loaded() == [6]
    assert "random generators are re-seeded, not restored" in run.output
    assert sorted(run.losses()) == list(range(7, 13))


def test_ckpt_step_resumes_from_exactly_that_checkpoint(reference_tp1, tmp_path):
    reference, reference_ckpt = reference_tp1
    shutil.copytree(reference_ckpt, tmp_path / "ckpt")  # iterations 3, 6, 9 and 12
    missing = torchrun(tmp_path / "ckpt", "checkpoint.ckpt_step=5")
    assert missing.exit_code == 3, tail(missing)
    assert "checkpoint.ckpt_step=5: checkpoint.load=" in missing.output and "[3, 6, 9, 12]" in missing.output
    again = torchrun(tmp_path / "ckpt", "checkpoint.ckpt_step=6")  # not the newest (12): exactly 6
    assert again.exit_code == 0, tail(again)
    assert again.loaded() == [6]
    assert again.losses() == {i: reference.losses()[i] for i in range(7, 13)}
    assert_same_state(
        checkpoint_state(tmp_path / "ckpt" / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012")
    )
