"""Local checkpoint tier drills: a lost node's shards come back from a replica; a bad local tier falls back to global.

"Two nodes" on one machine: two ft_launcher agents (``--nnodes=2``, one rank each) sharing a c10d rendezvous, each
with its own node-local directory (``NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE=1``: nvidia-resiliency-ext 0.6 and later
refuse two agents on one host otherwise). A node is lost by SIGKILLing its agent and worker and deleting its
directory; a replacement agent joins the job, as a spare node would.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

import pytest
from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.harness import (
    BASE,
    ENTRY,
    KEEP_SCHEDULE,
    REPO,
    Run,
    assert_same_state,
    checkpoint_state,
    free_port,
    kill_processes_with_marker,
    tail,
    torchrun,
)

from megatron.bridge.training.events.stream import Mechanism

# Global saves at 3, 6, 9 (harness BASE); local saves every 2 iterations, so the local tier holds iteration 8 when the
# drill strikes at the start of iteration 9, newer than the global checkpoint at 6.
LOCAL = ["checkpoint.non_persistent_ckpt_type=local", "checkpoint.non_persistent_save_interval=2"]
STRIKE = 9


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


def _agent(
    endpoint: str, run_id: str, ckpt: Path, local_dir: Path, out: Path, faults: str = "", extra: tuple = ()
) -> Job:
    """One "node": an ft_launcher agent with one training rank and its own node-local directory."""
    launcher = [
        sys.executable, "-m", "megatron.bridge.ft_launch", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", "--max-restarts=3",
    ]  # fmt: skip
    overrides = [f"checkpoint.non_persistent_local_ckpt_dir={local_dir}", "checkpoint.replication=true", *extra]
    return Job(launcher, ckpt, overrides, out, faults)


@pytest.fixture(scope="module")
def two_node_reference(tmp_path_factory) -> tuple[Run, Path]:
    """The uninterrupted run on the same two-node layout (gloo reduces across "nodes" in another order than
    within one, so a one-node run is not a bit-exact reference)."""
    root = tmp_path_factory.mktemp("two_node_reference")
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    a = _agent(endpoint, run_id, root / "ckpt", root / "node_a", root / "a.log")
    _wait_until_hosting(a, endpoint)
    b = _agent(endpoint, run_id, root / "ckpt", root / "node_b", root / "b.log")
    codes = [a.wait(timeout=300), b.wait(timeout=60)]
    output = a.output() + b.output()
    assert codes == [0, 0], output[-6000:]
    return Run(0, output, root / "ckpt" / "events"), root / "ckpt"


def _wait_until_hosting(agent: Job, endpoint: str, timeout: float = 120) -> None:
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


def _wait_for_files(pattern: str, roots: list[Path], count: int, timeout: float = 60) -> None:
    """Wait until each of ``roots`` holds ``count`` files matching ``pattern`` (background writers finishing)."""
    deadline = time.monotonic() + timeout
    while any(len(list(root.glob(pattern))) < count for root in roots):
        assert time.monotonic() < deadline, [sorted(root.rglob("*")) for root in roots]
        time.sleep(0.2)


def _lose_a_node(tmp_path: Path, damage_replica: bool, extra: tuple = ()) -> tuple[Run, Path]:
    """Run on two nodes, lose node B after the local save at 8, optionally damage its replica, replace node B."""
    ckpt, node_a, node_b = tmp_path / "ckpt", tmp_path / "node_a", tmp_path / "node_b"
    endpoint, run_id, started = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8], time.time()
    a = _agent(endpoint, run_id, ckpt, node_a, tmp_path / "a.log", extra=extra)
    agents = [a]
    try:
        _wait_until_hosting(a, endpoint)  # node A hosts the rendezvous store: it must outlive node B
        stall = f"stall@{STRIKE}:0,stall@{STRIKE}:1"
        b = _agent(endpoint, run_id, ckpt, node_b, tmp_path / "b.log", faults=stall, extra=extra)
        agents.append(b)
        b.wait_for("fault injection: stall", timeout=240)
        # Each node holds its own shard of 8 and its peer's replica (async: once the background writers finish).
        _wait_for_files("local_ckpt/*/*/*/iter_0000008_*_local.pt", [node_a, node_b], count=2)
        # The global tier is older than 8. Its save at 6 is committed; an async one only if a step's non-blocking
        # finalization saw its write done before the stall at 9.
        committed = sorted(int(p.name[len("iter_") :]) for p in ckpt.glob("iter_*"))
        assert committed and committed[-1] < 8, committed
        assert 6 in committed or "checkpoint.async_save=true" in extra, committed
        b.kill()
        shutil.rmtree(node_b)
        assert not any(node_b.parent.glob("node_b/**/*.pt"))
        if damage_replica:
            _flip_a_byte_in_the_replica_of_node_b(node_a, b.output())
        replacement = _agent(endpoint, run_id, ckpt, node_b, tmp_path / "b2.log", extra=extra)
        agents.append(replacement)
        codes = [a.wait(timeout=300), replacement.wait(timeout=60)]
    finally:
        for agent in agents:
            agent.kill()
    output = "".join(agent.output() for agent in agents)
    assert codes == [0, 0], output[-6000:]
    return Run(0, output, ckpt / "events", started), ckpt


def _rank_of(output: str) -> int:
    return 0 if "[rank0]" in output else 1


def _flip_a_byte_in_the_replica_of_node_b(node_a: Path, node_b_output: str) -> Path:
    """Flip one byte inside the largest tensor of node A's copy of node B's shard at iteration 8."""
    lost_rank = _rank_of(node_b_output)
    (replica,) = node_a.glob(f"local_ckpt/*/*/*/iter_0000008_{lost_rank}_local.pt")
    with zipfile.ZipFile(replica) as zf:
        member = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(replica, "r+b") as f:
        f.seek(member.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        where = member.header_offset + 30 + name_len + extra_len + member.file_size // 2
        f.seek(where)
        byte = f.read(1)[0]
        f.seek(where)
        f.write(bytes([byte ^ 0x10]))
    return replica


@pytest.mark.parametrize("saves", ["sync", "async"])
def test_lost_node_is_recovered_from_its_replica_bit_identically(two_node_reference, tmp_path, saves):
    reference, reference_ckpt = two_node_reference
    run, ckpt = _lose_a_node(tmp_path, damage_replica=False, extra=("checkpoint.async_save=true",) * (saves == "async"))
    if saves == "async":
        assert "Scheduling async local checkpoint at iteration 8" in run.output, tail(run)
    assert run.loads(0)[-1] == run.loads(1)[-1] == ("local", 8), run.loads(0)
    assert "(1 of 2 ranks' shards fetched from replicas)" in run.output  # the line an operator reads
    assert_doc_log_lines(run.output)
    assert not run.detected(Mechanism.LOCAL_CHECKPOINT_HASH)
    resumed = {i: loss for i, loss in run.losses().items() if i > 8}
    assert resumed == {i: reference.losses()[i] for i in range(9, 13)}
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


def test_damaged_replica_is_detected_and_the_global_checkpoint_is_loaded(two_node_reference, tmp_path):
    reference, reference_ckpt = two_node_reference
    run, ckpt = _lose_a_node(tmp_path, damage_replica=True)
    failed = run.detected(Mechanism.LOCAL_CHECKPOINT_HASH)
    assert failed and failed[0].iteration == 8, tail(run)
    assert "_local.pt" in failed[0].detail and "content differs" in failed[0].detail, failed[0]
    assert run.loads(0) == run.loads(1) == [("global", 6)]  # node B's replacement: its first start
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


def test_async_local_saves_resume_and_without_local_files_the_global_tier_is_used(reference_tp1, tmp_path):
    reference, reference_ckpt = reference_tp1
    ckpt, local_dir = tmp_path / "ckpt", tmp_path / "local"
    tier = [f"checkpoint.non_persistent_local_ckpt_dir={local_dir}", "checkpoint.async_save=true"]
    launcher = [sys.executable, "-m", "megatron.bridge.launch", "--nproc-per-node=2", f"--master-port={free_port()}"]
    job = Job(launcher, ckpt, tier, tmp_path / "first.log", faults=f"stall@{STRIKE}:0,stall@{STRIKE}:1")
    try:
        job.wait_for("fault injection: stall", timeout=240)
        deadline = time.monotonic() + 60  # the background writers finish the local save of iteration 8
        while len(list(local_dir.glob("local_ckpt/*/*/*/iter_0000008_*_local.pt"))) < 2:
            assert time.monotonic() < deadline, sorted(local_dir.rglob("*"))
            time.sleep(0.2)
    finally:
        job.kill()
    assert "Scheduling async local checkpoint at iteration 8" in job.output()
    shutil.copytree(ckpt, tmp_path / "ckpt_backup")
    shutil.copytree(local_dir, tmp_path / "local_backup")

    shutil.rmtree(local_dir)  # every local shard gone: the job resumes from the global tier
    from_global = torchrun(ckpt, *LOCAL, *tier)
    assert from_global.exit_code == 0, tail(from_global)
    resumed = from_global.losses()  # from 3 or 6: whether the async commit of 6 finished before the stall
    assert from_global.loads() == [("global", min(resumed) - 1)]
    assert min(resumed) in (4, 7) and resumed == {i: reference.losses()[i] for i in range(min(resumed), 13)}
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))

    shutil.rmtree(ckpt)  # back to the interrupted job, its local tier intact
    shutil.rmtree(local_dir)
    shutil.copytree(tmp_path / "ckpt_backup", ckpt)
    shutil.copytree(tmp_path / "local_backup", local_dir)
    from_local = torchrun(ckpt, *LOCAL, *tier)
    assert from_local.exit_code == 0, tail(from_local)
    assert from_local.loads() == [("local", 8)]
    assert from_local.losses() == {i: reference.losses()[i] for i in range(9, 13)}
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


def test_nan_right_after_a_local_load_discards_it_and_the_restart_loads_the_global_one(reference_tp1, tmp_path):
    reference, reference_ckpt = reference_tp1
    ckpt, local_dir = tmp_path / "ckpt", tmp_path / "local"
    tier = [*LOCAL, f"checkpoint.non_persistent_local_ckpt_dir={local_dir}"]
    # The local checkpoint of 8 is intact byte for byte (its hashes match) but its weights are NaN.
    first = torchrun(ckpt, *tier, env={"MBRIDGE_FAULTS": f"nan@8:0:local_save,nan@8:1:local_save,kill@{STRIKE}:1"})
    assert first.exit_code != 0 and "saved with NaN" in first.output, tail(first)
    second = torchrun(ckpt, *tier)
    assert second.exit_code == 23, tail(second)
    assert second.loads() == [("local", 8)]
    assert {e.iteration for e in second.detected(Mechanism.NAN_GUARD)} == {9}, tail(second)
    assert "1 step(s) after loading the local checkpoint of iteration 8" in second.output  # why the exit is 23
    assert not list(local_dir.rglob("iter_0000008_*_local.pt"))
    third = torchrun(ckpt, *tier)
    assert third.exit_code == 0, tail(third)
    assert third.loads() == [("global", 6)]
    assert third.losses() == {i: reference.losses()[i] for i in range(7, 13)}
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


def test_atomic_algorithm_saves_and_loads_and_an_older_local_checkpoint_yields_to_the_global_one(
    reference_tp1, tmp_path
):
    reference, reference_ckpt = reference_tp1
    ckpt, local_dir = tmp_path / "ckpt", tmp_path / "local"
    tier = [*LOCAL, f"checkpoint.non_persistent_local_ckpt_dir={local_dir}"]
    tier.append("checkpoint.non_persistent_local_ckpt_algo=atomic")
    first = torchrun(ckpt, *tier, env={"MBRIDGE_FAULTS": f"kill@{STRIKE}:1"})
    assert first.exit_code != 0 and "saved local checkpoint at iteration 8" in first.output, tail(first)
    assert_doc_log_lines(first.output)
    resumed = torchrun(ckpt, *tier)
    assert resumed.exit_code == 0, tail(resumed)
    assert "loaded verified local checkpoint at iteration 8" in resumed.output, tail(resumed)
    assert resumed.losses() == {i: reference.losses()[i] for i in range(9, 13)}
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))
    # The local tier now holds 10 (at 12 the global save was due, and a local save never replaces it): older.
    again = torchrun(ckpt, *tier, "train.train_iters=13", KEEP_SCHEDULE)
    assert again.exit_code == 0, tail(again)
    assert "local checkpoint at iteration 10 is not newer than the global one at 12" in again.output, tail(again)
    assert re.search(r"successfully loaded verified checkpoint \S+iter_0000012 at iteration 12", again.output)
