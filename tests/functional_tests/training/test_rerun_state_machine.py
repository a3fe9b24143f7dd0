"""Re-run state machine drills: real NaN and spiky losses in a 2-rank run, judged the same way on every rank.

Faults come from ``MBRIDGE_FAULTS``: ``nan@5:1`` makes rank 1's forward output NaN in the first pass of step 5
only (a re-run computes the true value: transient); ``:always`` corrupts every pass in every attempt (reproducible).
"""

import json
import re

import torch
from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.harness import (
    assert_same_state,
    checkpoint_state,
    ft_launcher,
    tail,
    torchrun,
)

from megatron.bridge.training.checkpoint.compare import flatten as _flatten
from megatron.bridge.training.checkpoint.rng import rng_state_from_tensor
from megatron.bridge.training.events.stream import Mechanism

VALIDATE = "rerun_state_machine.rerun_mode=validate_results"


def _stops(run) -> list[tuple[int, int]]:
    """(iteration, exit code) of every attempt rank 0 ended, in order."""
    pattern = r"\[rank0\] INFO megatron\.bridge\.training\.pretrain: training stopped at iteration (\d+): "
    pattern += r".*\(exit code (\d+)\)"
    return [(int(i), int(c)) for i, c in re.findall(pattern, run.output)]


def _assert_same_pre_step_state(diagnostic, reference) -> None:
    """Model, optimizer, progress and every generator equal; the diagnostic checkpoint adds the machine's state."""
    a, b = checkpoint_state(diagnostic), checkpoint_state(reference)
    rng_a, rng_b = a.pop("sharded.rng_state"), b.pop("sharded.rng_state")
    a.pop("common.rng_bytes"), b.pop("common.rng_bytes")
    assert_same_state(a, b)
    for row_a, row_b in zip(rng_a, rng_b, strict=True):
        state_a, state_b = rng_state_from_tensor(row_a), rng_state_from_tensor(row_b)
        assert state_a.pop("rank_extra") is not None and state_b.pop("rank_extra") is None
        flat_a, flat_b = _flatten(state_a), _flatten(state_b)
        assert flat_a.keys() == flat_b.keys()
        for key, value in flat_a.items():
            same = torch.equal(value, flat_b[key]) if isinstance(value, torch.Tensor) else value == flat_b[key]
            assert same, f"generator state {key} differs"


def test_transient_nan_is_rerun_found_not_reproducible_and_training_continues(reference_tp1, tmp_path):
    reference, reference_ckpt = reference_tp1
    # Async saves and the exit-signal handler: the step's flags ride on the state machine's all-reduce, re-run too.
    features = ["checkpoint.async_save=true", "train.exit_signal_handler=true"]
    run = torchrun(tmp_path / "ckpt", VALIDATE, *features, env={"MBRIDGE_FAULTS": "nan@5:1"})
    assert run.exit_code == 0, tail(run)
    assert [(e.rank, e.iteration) for e in run.detected(Mechanism.RERUN_NAN)] == [(1, 5)], tail(run)
    assert "First rerun: unexpected result is not reproducible within the tolerance" in run.output
    assert "iteration 5: the failed check (found NaN in local forward loss calculation) was not reproduced" in (
        run.output
    )
    assert "re-run state machine: 1 transient fault(s) detected; each step was re-run and training went on" in (
        run.output
    )
    assert run.losses() == reference.losses()
    assert_same_state(
        checkpoint_state(tmp_path / "ckpt" / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012")
    )


def test_persistent_nan_under_ft_launcher_stops_after_bounded_restarts(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = ft_launcher(
        ckpt, VALIDATE, "ft.enable_ft_package=true", "rerun_state_machine.max_rerun_restarts=2",
        max_restarts=20, env={"MBRIDGE_FAULTS": "nan@5:1:always"},
    )  # fmt: skip
    assert run.exit_code == 17, tail(run)  # ft_launch passes the code on (ft_launcher alone exits 1)
    # Attempt 1 re-runs in place (reproducible), saves at 4, exits 16; attempt 2 re-runs from that checkpoint on the
    # same device, exits 16; attempt 3 is past max_rerun_restarts=2: exit 17 and ft_launcher is told to stop.
    assert _stops(run) == [(4, 16), (4, 16), (4, 17)], tail(run, 120)
    assert "First rerun: unexpected result is reproducible within the tolerance" in run.output
    assert run.output.count("Got rescheduled on the same GPU") >= 2
    assert_doc_log_lines(run.output)
    assert "asked ft_launcher not to restart the workers" in run.output
    assert "could not re-run it on other hardware" in run.output
    assert json.loads((ckpt / "rerun_attempts.json").read_text()) == {"step": 5, "restarts": 3, "fallbacks": 0}
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"  # the diagnostic checkpoint
    # It holds exactly the state after 4 fault-free steps (dropout generators included), ready to re-run step 5.
    reference = torchrun(tmp_path / "reference", "train.exit_interval=4")  # same schedule, stops after step 4
    assert reference.exit_code == 20, tail(reference)
    _assert_same_pre_step_state(ckpt / "iter_0000004", tmp_path / "reference" / "iter_0000004")


def test_persistent_nan_with_fallback_sets_the_checkpoint_aside_then_stops(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = ft_launcher(
        ckpt, VALIDATE, "ft.enable_ft_package=true", "rerun_state_machine.max_rerun_restarts=1",
        "rerun_state_machine.on_rerun_limit=fallback", max_restarts=20, env={"MBRIDGE_FAULTS": "nan@5:1:always"},
    )  # fmt: skip
    assert run.exit_code != 0, tail(run)
    # 16 (re-run elsewhere), limit reached: fall back to 3 (16), train 4, step 5 fails again: 16, then 17.
    assert _stops(run) == [(4, 16), (4, 16), (4, 16), (4, 17)], tail(run, 120)
    assert "that checkpoint was set aside and the next start resumes from iteration 3" in run.output
    assert "one fallback to an older checkpoint" in run.output
    assert (ckpt / "iter_0000004.rerun_failed").is_dir()  # set aside, never deleted
    assert run.loaded() == [4, 3, 4]


def test_nan_stops_every_rank_before_the_step_and_the_resumed_run_loses_nothing(reference_tp1, tmp_path):
    reference, reference_ckpt = reference_tp1
    ckpt = tmp_path / "ckpt"
    stopped = torchrun(ckpt, env={"MBRIDGE_FAULTS": "nan@5:1"})  # rerun_mode=disabled, the default
    assert stopped.exit_code == 17, tail(stopped)
    for rank in (0, 1):
        stop = f"[rank{rank}] INFO megatron.bridge.training.pretrain: training stopped at iteration 4: NaN/Inf loss "
        assert stop in stopped.output, tail(stopped)
    assert "(seen on this rank)" in stopped.output and "(seen on another rank)" in stopped.output
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"

    resumed = torchrun(ckpt)
    assert resumed.exit_code == 0, tail(resumed)
    ref_losses = reference.losses()
    assert resumed.losses() == {i: ref_losses[i] for i in resumed.losses()}
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


def test_nan_steps_are_skipped_up_to_the_limit_then_the_run_stops(tmp_path):
    skip = "rerun_state_machine.max_consecutive_nan_skips=2"
    once = torchrun(tmp_path / "once", skip, env={"MBRIDGE_FAULTS": "nan@5:1"})
    assert once.exit_code == 0, tail(once)
    assert "iteration 5: NaN/Inf loss (seen on this rank): optimizer step skipped" in once.output
    assert "training stopped at iteration 12: reached train.train_iters=12" in once.output

    faults = "nan@5:1:always,nan@6:0:always,nan@7:1:always"
    limit = torchrun(tmp_path / "limit", skip, env={"MBRIDGE_FAULTS": faults})
    assert limit.exit_code == 17, tail(limit)
    assert "(2 of rerun_state_machine.max_consecutive_nan_skips=2 in a row)" in limit.output
    assert "training stopped at iteration 6: NaN/Inf loss at iteration 7 for 3 steps in a row" in limit.output


def test_spiky_loss_is_flagged_only_when_checked(tmp_path):
    # The largest of the first 100 micro-batch losses (50 steps, 2 per rank per step) sets the bar; step 60 is x100.
    common = ["train.train_iters=62", "checkpoint.save_interval=100"]
    env = {"MBRIDGE_FAULTS": "spike@60:1:x100"}
    on = torchrun(tmp_path / "on", *common, "rerun_state_machine.check_for_spiky_loss=true", env=env)
    assert on.exit_code == 0, tail(on)
    flagged = r"Rank 1, node \S+, device \S+, iteration 60: Unexpected result .* \(message='Spiky loss'\)"
    assert re.search(flagged, on.output), tail(on)
    assert_doc_log_lines(on.output)

    off = torchrun(tmp_path / "off", *common, env=env)
    assert off.exit_code == 0, tail(off)
    assert "fault injection: spike forward output" in off.output
    assert "Spiky loss" not in off.output

    rerun = torchrun(tmp_path / "rerun", *common, VALIDATE, "rerun_state_machine.check_for_spiky_loss=true", env=env)
    assert rerun.exit_code == 0, tail(rerun)
    assert "(message='Spiky loss')" in rerun.output
    assert "First rerun: unexpected result is not reproducible within the tolerance" in rerun.output
    assert "Continuing normal execution because failed validation was not fatal" in rerun.output
    clean = torchrun(tmp_path / "clean", *common)
    assert clean.exit_code == 0, tail(clean)
    assert rerun.losses() == clean.losses()  # the re-run's clean result is the one applied
    assert off.losses()[60] != clean.losses()[60]


def test_report_determinism_stats_reruns_every_step_and_reports(reference_tp1, tmp_path):
    reference, reference_ckpt = reference_tp1
    run = torchrun(tmp_path / "ckpt", "rerun_state_machine.rerun_mode=report_determinism_stats")
    assert run.exit_code == 0, tail(run)
    reports = re.findall(
        r"determinism stats at iteration (\d+), 'found NaN in local forward loss calculation' \(all ranks, since "
        r"start\): (.*)",
        run.output,
    )
    assert [int(i) for i, _ in reports] == [2, 4, 6, 8, 10, 12], tail(run)
    assert all(re.fullmatch(r"[\d,]+ samples, all identical", text) for _, text in reports), reports  # CPU: bitwise
    assert_doc_log_lines(run.output)
    assert run.losses() == reference.losses()
    assert_same_state(
        checkpoint_state(tmp_path / "ckpt" / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012")
    )
