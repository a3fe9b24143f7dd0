"""Preemption on a real one-node Slurm cluster, submitted through nemo_run with PreemptionPlugin + FaultTolerancePlugin.

1. Time limit: Slurm signals the job ``preempt_time`` seconds before its limit; every rank saves at the same step and
   exits, the job is requeued, resumes from that checkpoint and finishes.
2. Priority: a job in the higher-priority partition preempts ours; same outcome.

Both must end with the model, optimizer and RNG state of an uninterrupted run. Steps are slowed down (``slow``
fault on both ranks, which does not change the math) so that training outlives the signal.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.functional_tests import slurm_cluster
from tests.functional_tests.harness import (
    assert_same_state,
    checkpoint_state,
    tail,
    torchrun,
)

ITERS = 320
DRIVER = Path(__file__).with_name("slurm_driver.py")
SLOW = "slow@1:0:x10:always,slow@1:1:x10:always"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm_cluster.missing()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Slurm drill: {reason} (scripts/setup_slurm.sh installs it)")
        pytest.skip(reason)
    with slurm_cluster.slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("slurm_reference") / "ckpt"
    run = torchrun(ckpt, f"train.train_iters={ITERS}", "checkpoint.save_interval=1000")
    assert run.exit_code == 0, tail(run)
    return ckpt / f"iter_{ITERS:07d}"


def _start_driver(env: dict, tmp_path: Path, time_limit: str) -> subprocess.Popen:
    """Submit through nemo_run; the job's processes belong to slurmd (the cluster's teardown cancels leftovers)."""
    env = {**env, "NEMORUN_HOME": str(tmp_path / "home"), "DRILL_FAULTS": SLOW}
    proc = subprocess.Popen(
        [sys.executable, str(DRIVER), str(tmp_path / "ckpt"), str(ITERS), time_limit],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return proc


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    return out


def _job_logs(tmp_path: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((tmp_path / "home").rglob("log-*.out")))


def _wait_for_slurm(env: dict, timeout: float = 600) -> list[str]:
    """Wait until the newest drill job left the queue for good; return its states, one per attempt, oldest first."""
    deadline = time.monotonic() + timeout
    query = ["squeue", "-h", "-n", "root-root.preempt_drill"]
    while subprocess.run(query, env=env, capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(2)
    sacct = ["sacct", "-n", "-X", "-D", "--name=root-root.preempt_drill", "-o", "JobID,State"]
    rows = [line.split() for line in subprocess.run(sacct, env=env, capture_output=True, text=True).stdout.splitlines()]
    newest = max(int(job) for job, _ in rows)  # the cluster is shared by this module's drills
    return [state for job, state in rows if int(job) == newest]


def _assert_preempted_resumed_identical(tmp_path: Path, reference: Path, env: dict) -> None:
    states = _wait_for_slurm(env)
    logs = _job_logs(tmp_path)
    assert states[-1] == "COMPLETED" and len(states) >= 2, (states, logs[-3000:])
    assert set(states[:-1]) <= {"REQUEUED", "PREEMPTED"}, states
    assert "Received signal 15, initiating graceful stop" in logs
    assert "Preemption detected, saving checkpoint and exiting" in logs
    stops = [
        int(i) for i in re.findall(r"\[rank0\] INFO \S+: training stopped at iteration (\d+): a rank received", logs)
    ]
    assert stops, logs[-3000:]
    ckpt = tmp_path / "ckpt"
    for k in stops:  # every preemption left a checkpoint at its own step, and the next attempt resumed there
        assert f"successfully loaded verified checkpoint {ckpt}/iter_{k:07d} at iteration {k}" in logs, logs[-3000:]
    assert f"training stopped at iteration {ITERS}: reached train.train_iters={ITERS}" in logs
    assert_same_state(checkpoint_state(ckpt / f"iter_{ITERS:07d}"), checkpoint_state(reference))
    _assert_job_info(ckpt, logs, attempts=len(states))


def _assert_job_info(ckpt: Path, logs: str, attempts: int) -> None:
    """Every start recorded the Slurm job and its requeue count; the log block shows them."""
    records = [json.loads(line) for line in (ckpt / "job_info.jsonl").read_text().splitlines()]
    assert len(records) == attempts, records
    job_ids = {r["slurm"]["job_id"] for r in records}
    assert len(job_ids) == 1, "a requeued job keeps its id"
    assert all(r["slurm"]["nodelist"] and r["launcher"] == "ft_launcher" for r in records), records
    requeues = [r["restarts"]["requeue"] for r in records]
    assert requeues == list(range(attempts)), requeues
    assert [r["resumed"]["tier"] for r in records][1:] == ["global"] * (attempts - 1), records
    assert f"slurm: job_id={job_ids.pop()}" in logs
    assert f"restarts: in-job 0, in-process 0, requeue {attempts - 1}" in logs


def test_time_limit_signal_saves_requeues_and_resumes(cluster, reference, tmp_path):
    proc = _start_driver(cluster, tmp_path, "00:02:00")
    out = _finish(proc, timeout=900)
    # nemo_run followed the job through its requeues (it polls sacct) until it finished.
    assert json.loads(out.split("RESULT ", 1)[1].splitlines()[0])["status"] == "SUCCEEDED", out[-3000:]
    _assert_preempted_resumed_identical(tmp_path, reference, cluster)


def test_higher_priority_job_preempts_and_training_resumes(cluster, reference, tmp_path):
    proc = _start_driver(cluster, tmp_path, "00:15:00")
    deadline = time.monotonic() + 300
    while "iteration 40/" not in _job_logs(tmp_path):
        assert proc.poll() is None and time.monotonic() < deadline, _job_logs(tmp_path)[-3000:]
        time.sleep(1)
    high = subprocess.run(
        ["sbatch", "--parsable", "-p", "high", "--exclusive", "-o", str(tmp_path / "high.out"), "--wrap", "sleep 2"],
        env=cluster, capture_output=True, text=True, check=True,
    )  # fmt: skip
    _finish(proc, timeout=900)  # nemo_run 0.11 takes PREEMPTED for the end of the job: Slurm has the truth
    _assert_preempted_resumed_identical(tmp_path, reference, cluster)
    high_state = subprocess.run(
        ["sacct", "-n", "-X", "-j", high.stdout.strip(), "-o", "State"], env=cluster, capture_output=True, text=True
    ).stdout.split()
    assert high_state == ["COMPLETED"], high_state
