"""The processes a test started: find them, show where they are stuck, and make sure none outlives the test.

Every test runs with ``MBRIDGE_TEST_ID=<id>`` in its environment (set by ``tests/conftest.py``), and every launch
of the harness adds its own ``MBRIDGE_TEST_RUN=<marker>``; child processes inherit both, whatever starts them
(torchrun, ft_launcher, a data-loader worker, a checkpoint writer, an sbatch job). A process that must outlive the
test that happened to start it (a daemon of a session-wide Slurm cluster) is started with :func:`untracked_env`.

When a test fails or times out, :func:`stacks` shows the Python stack of each of its processes that is still alive
(``py-spy dump``, which needs no cooperation from the process and works on a stopped one), and :func:`kill_tagged`
removes them.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

TEST_ID = "MBRIDGE_TEST_ID"
"""Environment variable naming the test a process belongs to."""
RUN = "MBRIDGE_TEST_RUN"
"""Environment variable naming one launch inside a test."""


def tagged(key: str, value: str) -> list[int]:
    """PIDs of the live processes whose environment holds ``key=value`` (never this process)."""
    needle = f"{key}={value}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:  # gone, or not ours to read
            continue
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return f"pid {pid} (gone)"
    return f"pid {pid} [state {state}] {cmd[:300]}"


def _py_spy() -> str | None:
    return shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))


def stacks(pids: list[int], timeout: float = 20.0) -> str:
    """The Python stacks of ``pids`` (all threads), one block per process."""
    spy = _py_spy()
    blocks = []
    for pid in pids:
        head = f"---- {_describe(pid)}"
        if spy is None:
            blocks.append(f"{head}\n(py-spy is not installed: no stack)")
            continue
        try:
            out = subprocess.run(
                [spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout
            )
            body = (out.stdout or out.stderr).strip()
        except subprocess.TimeoutExpired:
            body = f"(py-spy did not answer within {timeout} s)"
        blocks.append(f"{head}\n{body}")
    return "\n".join(blocks)


def kill_tagged(key: str, value: str, rounds: int = 20) -> list[int]:
    """SIGKILL every live process tagged ``key=value`` (a stopped one too); return their PIDs.

    Looks again after each round: a launcher killed late in a round may have started a new worker meanwhile.
    """
    killed: list[int] = []
    for _ in range(rounds):
        pids = [pid for pid in tagged(key, value) if alive(pid)]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed += [pid for pid in pids if pid not in killed]
        time.sleep(0.05)
    return killed


def untracked_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) without the test tags, for processes meant to outlive the current test."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k not in (TEST_ID, RUN)}
