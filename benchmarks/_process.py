"""Process helpers shared by the benchmark scripts (a private module: ``report.py`` does not run it)."""

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/resources.py
# Ports reserved like the tests': a benchmark beside a test run never takes one of its ports.
from tests.resources import free_port  # noqa: E402

__all__ = ["free_port", "kill_tree", "run_or_exit"]


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (launchers start their workers in sessions of their own)."""
    try:
        import psutil

        procs = [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]
    except Exception:  # psutil missing or the process gone: fall back to the process group of the script
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        return
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def run_or_exit(cmd: list[str], cwd: Path, timeout: float, what: str, env: Optional[dict[str, str]] = None) -> str:
    """Run ``cmd`` with its output collected; its output. Exits the benchmark, naming ``what``, on failure or timeout.

    The command runs in a session of its own; on timeout it is killed with its descendants.
    """
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        sys.exit(f"{what} timed out after {timeout:.0f} s:\n{out[-3000:]}")
    if proc.returncode != 0:
        sys.exit(f"{what} failed (exit {proc.returncode}):\n{out[-3000:]}")
    return out
