"""The documented fault tolerance example runs on CPU and survives its simulated fault."""

import os
import re
import subprocess

from tests.functional_tests.harness import REPO, kill_processes_with_marker

SCRIPT = REPO / "examples" / "training_features" / "resiliency" / "fault_tolerance" / "run_fault_tolerance.sh"


def test_simulated_hang_is_detected_restarted_and_training_completes(tmp_path):
    marker = os.urandom(8).hex()
    env = {**os.environ, "RUN_DIR": str(tmp_path / "run"), "MBRIDGE_TEST_RUN": marker}
    try:
        proc = subprocess.run(
            ["bash", str(SCRIPT), "--simulate-fault"], env=env, capture_output=True, text=True, timeout=400,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        kill_processes_with_marker(marker)
    out = proc.stdout + proc.stderr
    log = (tmp_path / "run" / "train.log").read_text()
    assert proc.returncode == 0, out[-3000:]
    assert "[FaultTolerance] section timeouts (from the launcher): setup=180.0s, step=10.0s" in log
    assert "simulating rank_hung on rank 1 now" in log
    # Mostly rank 1 stops inside a step; when the timer strikes during a save, the `checkpointing` section times out.
    assert re.search(r"Section '(step|checkpointing)' has been open for", log), out[-3000:]
    assert "will restart worker group" in log
    assert "successfully loaded verified checkpoint" in log
    # The fault struck while training ran: before the final checkpoint, not in the shutdown after it.
    assert log.index("simulating rank_hung on rank 1 now") < log.index("saved checkpoint at iteration 600"), out[-3000:]
    assert "training stopped at iteration 600: reached train.train_iters=600 (exit code 0)" in log
