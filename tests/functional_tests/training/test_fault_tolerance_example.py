"""The documented fault tolerance example runs on CPU, learns its timeouts, and survives its simulated fault.

The commands are the Verification commands of docs/training/resiliency.md and skills/resiliency/SKILL.md, run as
written from the repository root; the environment moves the run directory to a temporary one and shortens training.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.harness import REPO, kill_processes_with_marker

DOC_COMMANDS = (
    "./examples/training_features/resiliency/fault_tolerance/run_fault_tolerance.sh",
    "./examples/training_features/resiliency/fault_tolerance/run_fault_tolerance.sh --simulate-fault",
)
PLAIN, SIMULATE_FAULT = DOC_COMMANDS


def _run(command: str, run_dir: Path, train_iters: int) -> tuple[subprocess.CompletedProcess, str]:
    """Run a doc command from the repository root; return the process and the full log (``$RUN_DIR/train.log``)."""
    marker = os.urandom(8).hex()
    env = {
        **os.environ, "RUN_DIR": str(run_dir), "TRAIN_ITERS": str(train_iters), "MBRIDGE_TEST_RUN": marker,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }  # fmt: skip
    try:
        proc = subprocess.run(
            shlex.split(command), cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        kill_processes_with_marker(marker)
    return proc, (run_dir / "train.log").read_text()


def test_timeouts_come_from_the_launcher_then_are_learned(tmp_path):
    # 40 iterations: two checkpoints (every 20), enough to learn the step and checkpointing timeouts.
    proc, log = _run(PLAIN, tmp_path / "run", train_iters=40)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    # The script shows these lines (it filters the log) ...
    launcher = "[FaultTolerance] section timeouts (from the launcher): setup=180.0s, step=10.0s, checkpointing=120.0s"
    assert launcher in proc.stdout, out[-3000:]
    learned = re.search(r"\[FaultTolerance\] section timeouts \(calculated\): setup=180\.0s, step=\S+s", proc.stdout)
    assert learned and proc.stdout.index(launcher) < learned.start(), out[-3000:]
    assert "training stopped at iteration 40: reached train.train_iters=40 (exit code 0)" in proc.stdout
    assert "Agent exits with exit code = 0." in proc.stdout
    assert_doc_log_lines(proc.stdout)  # the lines the docs quote, in the script's filtered view
    # ... and keeps the whole log; the learned timeouts are saved for the next start.
    assert "will restart worker group" not in log
    assert (tmp_path / "run" / "checkpoints" / "ft_state.json").is_file()


def test_simulated_hang_is_detected_restarted_and_training_completes(tmp_path):
    # 300 iterations instead of the script's 600: on 2 CPU cores the hang (4 s into training) strikes near iteration
    # 30, and even at 15 ms a step the 300 iterations with their 15 saves take longer than 4 s.
    proc, log = _run(SIMULATE_FAULT, tmp_path / "run", train_iters=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "[FaultTolerance] section timeouts (from the launcher): setup=180.0s, step=10.0s" in log
    assert "fault injection: hang at 4 s into training on rank 1" in proc.stdout
    assert_doc_log_lines(proc.stdout)
    # Mostly rank 1 stops inside a step; when the timer strikes during a save, the `checkpointing` section times out.
    assert re.search(r"\[RankMonServer\S*\] Section '(step|checkpointing)' has been open for", proc.stdout), out[-3000:]
    assert "will restart worker group" in proc.stdout
    restart = log.index("will restart worker group")
    before, after = log[:restart], log[restart:]
    saved = [int(it) for it in re.findall(r"\[rank0\] .*saved checkpoint at iteration (\d+)", before)]
    if saved:
        # The usual case: the restarted workers resume from the newest verified checkpoint (or a newer one whose
        # commit the hang cut off before its log line) and, once a save had learned them, its timeouts.
        loaded = re.search(r"successfully loaded verified checkpoint \S+ at iteration (\d+)", after)
        assert loaded and int(loaded.group(1)) >= max(saved), out[-3000:]
        if "[FaultTolerance] section timeouts (calculated)" in before:
            assert "[FaultTolerance] section timeouts (loaded from ft_state.json)" in after, out[-3000:]
    else:
        # On a busy machine the hang can strike before the first checkpoint is committed (in a step before
        # iteration 20, or inside the first save): nothing to resume from, training restarts from iteration 0.
        assert "training starts at iteration 0" in after, out[-3000:]
    # The fault struck while training ran: before the final checkpoint, not in the shutdown after it.
    assert log.index("fault injection: hang at 4 s into training on rank 1") < log.index(
        "saved checkpoint at iteration 300"
    ), out[-3000:]
    assert "training stopped at iteration 300: reached train.train_iters=300 (exit code 0)" in proc.stdout
