"""Process helpers shared by the benchmark scripts (a private module: ``report.py`` does not run it)."""

import os
import signal


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
