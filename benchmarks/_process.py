"""Process helpers shared by the benchmark scripts (a private module: ``report.py`` does not run it)."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/resources.py
# Ports reserved like the tests': a benchmark beside a test run never takes one of its ports.
from tests.resources import free_port  # noqa: E402

__all__ = ["free_port", "kill_tree"]


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
