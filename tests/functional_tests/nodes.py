"""Nodes on one machine for the node-loss drills: each an ft_launcher agent with its own node-local directory.

Several agents (``--nnodes=N`` or ``MIN:MAX``, one rank each) share one c10d rendezvous, each with its own
node-local checkpoint directory (``NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE=1``: nvidia-resiliency-ext 0.6 and later
refuse two agents on one host otherwise). A node is lost by SIGKILLing its agent and every process it started.
"""

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.functional_tests.harness import BASE, ENTRY, REPO, kill_processes_with_marker

LOCAL = ["checkpoint.non_persistent_ckpt_type=local", "checkpoint.non_persistent_save_interval=2"]
"""Local saves every 2 iterations (global ones every 3: the harness's ``BASE``)."""


class Job:
    """Training launched in the background by ``launcher``, its output in a file; killed as a whole."""

    def __init__(self, launcher: list[str], ckpt: Path, overrides: list[str], out: Path, faults: str = "") -> None:
        self.marker = uuid.uuid4().hex
        self.out = out
        cmd = [*launcher, str(ENTRY), f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}", *BASE, *LOCAL, *overrides]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MBRIDGE_TEST_RUN": self.marker}
        # Two "nodes" on one host on purpose: from nvidia-resiliency-ext 0.6 the rendezvous closes the job when two
        # launchers join from one host (a misconfiguration on a cluster), unless this says it is meant.
        env["NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE"] = "1"
        env.pop("MBRIDGE_FAULTS", None)
        if faults:
            env["MBRIDGE_FAULTS"] = faults
        self._file = open(out, "w")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(cmd, stdout=self._file, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def output(self) -> str:
        return self.out.read_text()

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            assert self.proc.poll() is None, (
                f"job exited ({self.proc.returncode}) before {text!r}:\n{self.output()[-3000:]}"
            )
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{self.output()[-3000:]}"
            time.sleep(0.5)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return -999
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the launcher and every process it started (for an agent: the node is gone)."""
        kill_processes_with_marker(self.marker)
        self.proc.wait()
        self._file.close()


def agent(
    endpoint: str,
    run_id: str,
    ckpt: Path,
    local_dir: Path,
    out: Path,
    faults: str = "",
    extra: tuple = (),
    nnodes: str = "2",
    launcher_args: tuple = (),
) -> Job:
    """One "node": an ft_launcher agent with one training rank and its own node-local directory.

    ``nnodes`` is the launcher's ``--nnodes`` (``N`` or ``MIN:MAX``); ``launcher_args`` go to the launcher too.
    """
    launcher = [
        sys.executable, "-m", "megatron.bridge.ft_launch", f"--nnodes={nnodes}", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", "--max-restarts=3",
        *launcher_args,
    ]  # fmt: skip
    overrides = [f"checkpoint.non_persistent_local_ckpt_dir={local_dir}", "checkpoint.replication=true", *extra]
    return Job(launcher, ckpt, overrides, out, faults)


def wait_until_hosting(agent: Job, endpoint: str, timeout: float = 120) -> None:
    """Wait until ``agent`` listens on the rendezvous ``endpoint`` (it hosts the store), not for a fixed time."""
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        assert agent.proc.poll() is None, f"agent exited ({agent.proc.returncode}):\n{agent.output()[-3000:]}"
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"no rendezvous store on {endpoint} within {timeout} s"
            time.sleep(0.2)


def wait_for_files(pattern: str, roots: list[Path], count: int, timeout: float = 60) -> None:
    """Wait until each of ``roots`` holds ``count`` files matching ``pattern`` (background writers finishing)."""
    deadline = time.monotonic() + timeout
    while any(len(list(root.glob(pattern))) < count for root in roots):
        assert time.monotonic() < deadline, [sorted(root.rglob("*")) for root in roots]
        time.sleep(0.2)
