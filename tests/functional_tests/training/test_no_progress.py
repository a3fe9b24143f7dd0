"""The no-progress guard under a real ft_launcher: a crash at the same iteration on every attempt stops the job."""

import pytest
from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.harness import ft_launcher, tail

from megatron.bridge.training.events.stream import EventKind, Mechanism

FT = "ft.enable_ft_package=true"


@pytest.mark.timeout(240)
def test_no_progress_stops_a_crash_loop_after_the_guard_not_the_budget(tmp_path):
    # Checkpoints every 3 steps: the first attempt commits 3 and dies at 5; every restart resumes from 3, completes
    # 4 again and dies at 5 again. With the default ft.max_no_progress_restarts=3, the restart after the third such
    # attempt stops at set-up with exit 29, although the launcher had 8 restarts. (A SIGKILL: the rank writes no exit
    # event, so the launcher's view of the signal names it, and its peer's broken collective is not blamed.)
    run = ft_launcher(tmp_path / "ckpt", FT, max_restarts=8, env={"MBRIDGE_FAULTS": "kill@5:1:always"})
    assert run.exit_code == 29, tail(run, 120)
    assert len(run.events(EventKind.FAULT_INJECTED)) == 4, tail(run)  # the first attempt and 3 restarts struck
    assert len(run.events(EventKind.RESTART_BEGUN)) == 4  # the 4th restart is the one the guard stopped
    starts = [e for e in run.events(EventKind.ATTEMPT_STARTED) if e.rank == 0]
    assert [e.restart_count for e in starts] == [0, 1, 2, 3, 4]
    assert run.loaded() == [3, 3, 3]  # the stopped attempt loaded nothing
    assert not [e for e in run.events(EventKind.STEP_COMPLETED) if e.restart_count == 4]

    (verdict,) = run.detected(Mechanism.NO_PROGRESS)
    assert (verdict.rank, verdict.iteration, verdict.restart_count) == (1, 5, 4)
    assert verdict.signal == 9
    cause = "rank 1 at iteration 5: killed by signal 9 (SIGKILL)"
    for text in ("no progress in the last 3 attempts", f"the same failure each time: {cause}"):
        assert text in verdict.detail, verdict.detail
    line = next(line for line in run.output.splitlines() if "no-progress guard:" in line)
    assert cause in line, line
    assert_doc_log_lines(run.output)
    # Every rank stopped with the guard's code, and the launcher's exit event says the same.
    stopped = [e for e in run.events(EventKind.EXIT) if e.restart_count == 4 and e.process == "worker"]
    assert sorted(e.rank for e in stopped) == [0, 1] and {e.exit_code for e in stopped} == {29}
    assert run.events(EventKind.EXIT)[-1].exit_code == 29
