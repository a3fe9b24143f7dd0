"""The trunk under nvidia-resiliency-ext's ft_launcher: a crashed save is recovered by an in-job restart."""

from tests.functional_tests.harness import assert_same_state, checkpoint_state, ft_launcher, tail

from megatron.bridge.training.events.stream import EventKind


def test_in_job_restart_after_crash_during_save(reference_tp1, tmp_path):
    reference, reference_ckpt = reference_tp1
    ckpt = tmp_path / "ckpt"
    run = ft_launcher(ckpt, max_restarts=1, env={"MBRIDGE_FAULTS": "kill@6:1:save.during_write"})
    assert run.exit_code == 0, tail(run)
    assert [e.fault_kind for e in run.events(EventKind.FAULT_INJECTED)] == ["kill"]
    # The restarted workers resumed from the last committed checkpoint and finished like the uninterrupted run.
    assert run.loaded() == [3]
    ref_losses = reference.losses()
    assert {i: ref_losses[i] for i in range(7, 13)}.items() <= run.losses().items()
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


def test_restart_budget_spent_exits_non_zero(tmp_path):
    run = ft_launcher(tmp_path / "ckpt", max_restarts=0, env={"MBRIDGE_FAULTS": "kill@3:1:save.during_write"})
    assert run.exit_code != 0, tail(run)
    assert "fault injection: SIGKILL" in run.output
    assert not (tmp_path / "ckpt" / "iter_0000003").exists()
