"""Fault tolerance drills under a real ft_launcher: hang, kill, exception, hung save, learned timeouts, budget."""

import json
import re

import pytest
from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.harness import assert_same_state, checkpoint_state, ft_launcher, tail

from megatron.bridge.training.events.stream import Event, EventKind, Mechanism, RestartLayer

FT = "ft.enable_ft_package=true"


SECTION_TIMEOUT = Mechanism.RANK_MONITOR_SECTION_TIMEOUT


def _first_detection(after: list[Event]) -> Event:
    return next(e for e in after if e.kind == EventKind.FAULT_DETECTED)


def _raised_by(after: list[Event]) -> set[int]:
    """The ranks whose own ``exit`` event names the injected exception (their peers name a broken collective)."""
    return {e.rank for e in after if e.kind == EventKind.EXIT and "fault injection: exception" in (e.detail or "")}


@pytest.mark.parametrize(
    "env,attributed",
    [
        (
            {"MBRIDGE_FAULTS": "hang@8:1"},
            lambda after: (e := _first_detection(after)).mechanism == SECTION_TIMEOUT and e.section == "step",
        ),
        (
            {"MBRIDGE_FAULTS": "kill@8:1"},
            lambda after: (e := _first_detection(after)).local_rank == 1 and e.signal == 9,
        ),
        # The launcher may see either rank's exit first (the peer's collective fails at once) and stops the group at
        # the first: the ranks' own exit events attribute the fault.
        ({"MBRIDGE_FAULTS": "exception@8:0"}, lambda after: _raised_by(after) == {0}),
        (
            {"MBRIDGE_FAULTS": "hang@6:1:save.during_write"},
            lambda after: (e := _first_detection(after)).mechanism == SECTION_TIMEOUT and e.section == "checkpointing",
        ),
    ],
    ids=["hang-in-step", "rank-killed", "python-exception", "hang-in-save"],
)
def test_fault_detected_restarted_resumed_identical(reference_tp1, tmp_path, env, attributed):
    reference, reference_ckpt = reference_tp1
    ckpt = tmp_path / "ckpt"
    run = ft_launcher(ckpt, FT, max_restarts=2, env=env)
    assert run.exit_code == 0, tail(run, 120)
    (struck,) = run.events(EventKind.FAULT_INJECTED)
    after = [e for e in run.events() if e.time >= struck.time]
    assert attributed(after), ([e for e in after if e.kind in (EventKind.FAULT_DETECTED, EventKind.EXIT)], tail(run))
    if env["MBRIDGE_FAULTS"] == "hang@8:1":  # the rank monitor's report of a hung step, as the docs quote it
        assert_doc_log_lines(run.output)
    detected = _first_detection(after)  # the launcher's view of an exit comes after a rank monitor's kill
    restarts = run.events(EventKind.RESTART_BEGUN)
    assert [e.layer for e in restarts] == [RestartLayer.IN_JOB] and restarts[0].time >= detected.time
    loads = [e.iteration for e in run.events(EventKind.CHECKPOINT_LOADED) if e.rank == 0]
    if "save.during_write" in env["MBRIDGE_FAULTS"]:
        # The rank monitor wakes the hung rank (SIGCONT) just before it kills it: in that moment the rank may pass the
        # commit's barrier and rank 0 commit 6 whole. Either way the restart loads a verified checkpoint.
        assert loads in ([3], [6]), loads
    else:
        assert loads == [6], loads
    ref_losses = reference.losses()
    assert all(run.losses()[i] == ref_losses[i] for i in range(9, 13))
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


def test_calculated_timeouts_are_saved_and_loaded(tmp_path):
    # Saves every 3 steps. Learned after each save: `checkpointing` from the first save on (saves are synchronous), and
    # `step` once 16 steps were seen (at the save at 18, after the last step: learned from a tiny model's steps, the
    # step timeout is short, and a load spike on a busy test machine may exceed it; here no step runs under it).
    ckpt = tmp_path / "ckpt"
    first = ft_launcher(ckpt, FT, "ft.calc_ft_timeouts=true", "train.train_iters=18")
    assert first.exit_code == 0, tail(first)
    assert "[FaultTolerance] section timeouts (from the launcher): setup=90.0s, step=6.0s" in first.output
    assert "[FaultTolerance] section timeouts (calculated)" in first.output
    state = json.loads((ckpt / "ft_state.json").read_text())["current_timeouts"]["section"]
    learned = state["section"]
    assert sorted(state["calculated_sections"]) == ["checkpointing", "step"]
    # A fresh start loaded no global checkpoint: its setup says nothing of a restart's, and without it the
    # out-of-section timeout is not learned either.
    assert learned["setup"] == 90 and state["out_of_section"] == 30, "setup and out-of-section keep launcher values"
    # Learned, not the launcher's (step:6, checkpointing:15). A section's first calculation is the safety factor (5,
    # the launcher's default) times the longest time seen on any rank, and nvrx averages each later one with the value
    # it had. So `checkpointing` is at least 5x the first save's blocking part (learned at 3), and `step` at least 5x
    # the longest step before it was learned (the first step is a warm-up, outside the section).
    first_save = max(float(b) for b in re.findall(r"at iteration 3 to \S+ \(blocking ([\d.]+) s\)", first.output))
    steps = max(e.seconds for e in first.events(EventKind.STEP_COMPLETED) if 2 <= e.iteration <= 16)
    assert learned["step"] != 6 and learned["step"] >= 5 * steps, (learned, steps)
    assert learned["checkpointing"] != 15 and learned["checkpointing"] >= 5 * first_save, (learned, first_save)

    # A restart of the finished run: it loads the learned timeouts at start-up, and having loaded a global checkpoint
    # (with nothing left to train) learns `setup` at its end.
    second = ft_launcher(ckpt, FT, "ft.calc_ft_timeouts=true", "train.train_iters=18")
    assert second.exit_code == 0, tail(second)
    expected = ", ".join(f"{name}={learned[name]:.1f}s" for name in ("setup", "step", "checkpointing"))
    assert f"[FaultTolerance] section timeouts (loaded from ft_state.json): {expected}" in second.output
    state = json.loads((ckpt / "ft_state.json").read_text())["current_timeouts"]["section"]
    assert sorted(state["calculated_sections"]) == ["checkpointing", "setup", "step"], state
    assert state["section"]["setup"] != 90 and state["out_of_section"] == 30, state


def test_restart_budget_is_bounded(tmp_path):
    run = ft_launcher(tmp_path / "ckpt", FT, max_restarts=2, env={"MBRIDGE_FAULTS": "kill@2:1:always"})
    assert run.exit_code == 128 + 9, tail(run)  # the killed worker's code, not ft_launcher's 1
    assert run.events(EventKind.EXIT)[-1].exit_code == 128 + 9  # the launcher's exit event says the same
    assert len(run.events(EventKind.FAULT_INJECTED)) == 3  # first attempt + 2 restarts, then stop
    assert len(run.events(EventKind.RESTART_BEGUN)) == 2
    assert "Some rank(s) exited with non-zero exit code" in run.output, tail(run, 80)
    assert_doc_log_lines(run.output)


def test_ft_under_torchrun_fails_fast_with_instructions(tmp_path):
    from tests.functional_tests.harness import torchrun

    run = torchrun(tmp_path / "ckpt", FT)
    assert run.exit_code == 2, tail(run)
    assert "ft.enable_ft_package: no rank monitor to report to" in run.output
    assert "launch with ft_launcher" in run.output


def test_a_config_error_under_ft_launcher_is_not_restarted(tmp_path):
    # The config is refused before the ranks reach the rank monitor, so they cannot ask ft_launcher not to restart
    # them: the launcher sees their exit code (2, CONFIG_ERROR, whose action is stop) and does not restart them.
    run = ft_launcher(tmp_path / "ckpt", FT, "health.liveness_ping_interval=-1", max_restarts=3)
    assert run.exit_code == 2, tail(run)
    assert "health.liveness_ping_interval: must be >= 0, got -1" in run.output, tail(run)
    assert "a worker exited with exit code 2 (CONFIG_ERROR), whose action is stop" in run.output, tail(run)
    assert "will restart worker group" not in run.output and not run.events(EventKind.RESTART_BEGUN)
    assert run.events(EventKind.EXIT)[-1].exit_code == 2  # the launcher's exit event says the same
    assert_doc_log_lines(run.output)
