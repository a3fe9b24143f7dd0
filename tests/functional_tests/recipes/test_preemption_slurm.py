"""Preemption on a real one-node Slurm cluster, submitted through nemo_run with PreemptionPlugin + FaultTolerancePlugin.

1. Time limit: Slurm signals the job ``PREEMPT_TIME`` seconds before its limit; every rank saves at the same step and
   exits, the job is requeued, resumes from that checkpoint and finishes.
2. Priority: a job in the higher-priority partition preempts ours; same outcome.

Both must end with the model, optimizer and RNG state of an uninterrupted run.

No drill races the machine's speed. In the first attempt both ranks pause (``hang`` fault: SIGSTOP) as they start
iteration ``PAUSE_AT``, and only then does the drill make Slurm signal the job: it cuts the job's time limit so that
the ``--signal=TERM@PREEMPT_TIME`` warning is due, or it submits the higher-priority job. Slurm continues the paused
ranks as it sends them SIGTERM (the drill continues any rank still stopped with SIGTERM pending), and they stop after
iteration ``PAUSE_AT``. The requeued attempt resumes past the fault, which strikes in a job's first attempt only, and
trains to ``ITERS``.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests import processes
from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.harness import assert_same_state, checkpoint_state, tail, torchrun

ITERS = 16
PAUSE_AT = 6
PREEMPT_TIME = 180
"""Seconds between Slurm's SIGTERM and the time limit (``--signal=TERM@180``): room for slurmctld, which checks
time limits every 30 s, and for the drill to give the time limit back before it is reached."""
TIME_LIMIT_MINUTES = 30
"""The job's time limit, until the time-limit drill cuts it; never reached."""
FAULTS = f"hang@{PAUSE_AT}:0,hang@{PAUSE_AT}:1"
DRIVER = Path(__file__).with_name("slurm_driver.py")
_SIGTERM_BIT = 1 << (signal.SIGTERM - 1)

pytestmark = pytest.mark.functional


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Callable[[], Path]:
    """The uninterrupted run's last checkpoint; trained while the cluster starts (call it to wait for it)."""
    ckpt = tmp_path_factory.mktemp("slurm_reference") / "ckpt"

    def train() -> Path:
        run = torchrun(ckpt, f"train.train_iters={ITERS}", "checkpoint.save_interval=1000")
        assert run.exit_code == 0, tail(run)
        return ckpt / f"iter_{ITERS:07d}"

    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(train).result


@dataclass
class Drill:
    """One job submitted through nemo_run, with its own experiment name, checkpoints and process tag."""

    env: dict
    root: Path
    name: str
    marker: str
    proc: subprocess.Popen
    job: str = ""

    @property
    def slurm_name(self) -> str:
        return f"root-root.{self.name}"  # nemo_run names the Slurm job <account>-<account>.<experiment>

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    def logs(self) -> str:
        """The job's output, every attempt."""
        return "".join(p.read_text(errors="replace") for p in sorted((self.root / "home").rglob("log-*.out")))

    def driver_output(self) -> str:
        return (self.root / "driver.log").read_text(errors="replace")


@pytest.fixture
def submit(slurm, tmp_path):
    """Start the nemo_run driver for a drill; at the end, cancel its job if it is still there (a failed drill)."""
    drills: list[Drill] = []

    def start(name: str) -> Drill:
        marker = uuid.uuid4().hex
        with open(tmp_path / "driver.log", "w") as out:
            proc = subprocess.Popen(
                [sys.executable, str(DRIVER), f"--name={name}", f"--ckpt={tmp_path / 'ckpt'}", f"--iters={ITERS}",
                 f"--time={TIME_LIMIT_MINUTES}", f"--preempt-time={PREEMPT_TIME}", f"--faults={FAULTS}",
                 f"--marker={marker}"],
                env={**slurm, "NEMORUN_HOME": str(tmp_path / "home")}, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        drill = Drill(slurm, tmp_path, name, marker, proc)
        drills.append(drill)
        drill.job = _job_id(drill)
        return drill

    yield start
    for drill in drills:
        drill.proc.kill()
        drill.proc.wait()
        subprocess.run(["scancel", "--full", "-n", drill.slurm_name], env=slurm, capture_output=True)
        _wait_until(lambda d=drill: not _squeue(d), 120, "the drill's job to leave the queue")


def _wait_until(predicate, timeout: float, what: str, context=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}\n{context()}"
        time.sleep(0.2)


def _squeue(drill: Drill) -> str:
    return subprocess.run(
        ["squeue", "-h", "-n", drill.slurm_name, "-o", "%i"], env=drill.env, capture_output=True, text=True
    ).stdout.strip()


def _job_id(drill: Drill) -> str:
    """The Slurm id of the drill's job, once nemo_run submitted it."""
    _wait_until(lambda: _squeue(drill) or drill.proc.poll() is not None, 120, "the job's submission")
    assert _squeue(drill), drill.driver_output()[-3000:]
    return _squeue(drill)


def _proc_status(pid: int) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
    except OSError:
        return None


def _stopped(pids: list[int]) -> list[int]:
    return [pid for pid in pids if (_proc_status(pid) or {}).get("State", "").startswith("T")]


def _paused_ranks(drill: Drill, timeout: float = 300) -> list[int]:
    """Wait until both ranks of the job paused at ``PAUSE_AT`` (state T); return their PIDs."""
    _wait_until(
        lambda: len(_stopped(processes.tagged(processes.RUN, drill.marker))) == 2 or drill.proc.poll() is not None,
        timeout, f"both ranks to pause at iteration {PAUSE_AT}", lambda: drill.logs()[-3000:],
    )  # fmt: skip
    paused = _stopped(processes.tagged(processes.RUN, drill.marker))
    assert len(paused) == 2, drill.logs()[-3000:]
    return paused


def _continue_when_signalled(drill: Drill, pids: list[int], timeout: float) -> None:
    """Wait until Slurm signalled each paused rank, and make sure it goes on.

    Slurm continues stopped processes itself when it sends them SIGTERM (SIGCONT first): such a rank is no longer
    stopped. A rank that is still stopped with SIGTERM pending (sent by its launcher, say) is continued here.
    """
    waiting = set(pids)

    def step() -> bool:
        for pid in list(waiting):
            status = _proc_status(pid)
            if status is None or not status["State"].startswith("T"):
                waiting.discard(pid)
            elif (int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)) & _SIGTERM_BIT:
                os.kill(pid, signal.SIGCONT)
                waiting.discard(pid)
        return not waiting

    _wait_until(step, timeout, "Slurm's SIGTERM to reach the paused ranks", lambda: drill.logs()[-3000:])


def _scontrol_job(drill: Drill) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", drill.job], env=drill.env, capture_output=True, text=True, check=True
    ).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def _seconds(slurm_time: str) -> int:
    """``[days-]hours:minutes:seconds`` (or ``minutes:seconds``) in seconds."""
    days, _, clock = slurm_time.rpartition("-")
    seconds = 0
    for part in clock.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds + int(days or 0) * 86400


def _set_time_limit(drill: Drill, minutes: int) -> None:
    subprocess.run(
        ["scontrol", "update", f"JobId={drill.job}", f"TimeLimit={minutes}"],
        env=drill.env, capture_output=True, text=True, check=True,
    )  # fmt: skip


def _finish(drill: Drill, timeout: float) -> str:
    """Wait for the nemo_run driver to return; its output."""
    try:
        drill.proc.wait(timeout=timeout)
    finally:
        drill.proc.kill()
    assert drill.proc.returncode == 0, drill.driver_output()[-4000:]
    return drill.driver_output()


def _sacct_states(drill: Drill) -> list[str]:
    sacct = ["sacct", "-n", "-X", "-D", "-j", drill.job, "-o", "JobID,State"]
    rows = subprocess.run(sacct, env=drill.env, capture_output=True, text=True, check=True).stdout.splitlines()
    return [row.split()[1] for row in rows if row.strip()]


def _states(drill: Drill, timeout: float = 300) -> list[str]:
    """Wait until the drill's job left the queue for good and the accounting has its end (it lags behind the
    controller); return its states, one per attempt, oldest first."""

    def ended() -> bool:
        states = [] if _squeue(drill) else _sacct_states(drill)
        return bool(states) and states[-1] not in ("PENDING", "RUNNING", "REQUEUED")

    _wait_until(ended, timeout, "the job to finish", lambda: f"{_sacct_states(drill)}\n{drill.logs()[-3000:]}")
    return _sacct_states(drill)


def _assert_preempted_resumed_identical(drill: Drill, reference: Callable[[], Path]) -> None:
    states = _states(drill)
    logs = drill.logs()
    assert len(states) == 2 and states[0] in {"REQUEUED", "PREEMPTED"} and states[1] == "COMPLETED", (
        states,
        logs[-3000:],
    )
    assert "Received signal 15, initiating graceful stop" in logs
    assert "Preemption detected, saving checkpoint and exiting" in logs
    stops = [
        int(i) for i in re.findall(r"\[rank0\] INFO \S+: training stopped at iteration (\d+): a rank received", logs)
    ]
    # One stop, inside training: the ranks were paused at PAUSE_AT when the signal came (Slurm continues them and
    # signals them at once; a rank that ran a step in between stops after PAUSE_AT + 1).
    assert len(stops) == 1 and PAUSE_AT <= stops[0] <= PAUSE_AT + 1, logs[-3000:]
    ckpt, stop = drill.ckpt, stops[0]
    resumed = f"successfully loaded verified checkpoint {ckpt}/iter_{stop:07d} at iteration {stop}"
    assert resumed in logs, logs[-3000:]
    assert f"training stopped at iteration {ITERS}: reached train.train_iters={ITERS}" in logs
    assert_same_state(checkpoint_state(ckpt / f"iter_{ITERS:07d}"), checkpoint_state(reference()))
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
    assert_doc_log_lines(logs)  # the block the docs quote: the second start's


@pytest.mark.timeout(600)
def test_time_limit_signal_saves_requeues_and_resumes(reference, submit):
    drill = submit("drill_time_limit")
    paused = _paused_ranks(drill)
    # Cut the limit to 2-3 minutes past now: the TERM@PREEMPT_TIME warning is due at slurmctld's next check.
    elapsed = _seconds(_scontrol_job(drill)["RunTime"])
    _set_time_limit(drill, elapsed // 60 + PREEMPT_TIME // 60)
    _continue_when_signalled(drill, paused, timeout=PREEMPT_TIME - 60)
    _set_time_limit(drill, TIME_LIMIT_MINUTES)  # give the time back: the job ends by its own save and exit
    out = _finish(drill, timeout=600)
    # nemo_run followed the job through its requeue (it polls sacct) until it finished.
    assert json.loads(out.split("RESULT ", 1)[1].splitlines()[0])["status"] == "SUCCEEDED", out[-3000:]
    _assert_preempted_resumed_identical(drill, reference)


@pytest.mark.timeout(600)
def test_higher_priority_job_preempts_and_training_resumes(reference, submit, tmp_path):
    drill = submit("drill_priority")
    paused = _paused_ranks(drill)
    high = subprocess.run(
        ["sbatch", "--parsable", "-p", "high", "--exclusive", "-o", str(tmp_path / "high.out"), "--wrap", "sleep 2"],
        env=drill.env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    _continue_when_signalled(drill, paused, timeout=120)
    _finish(drill, timeout=600)  # nemo_run 0.11 takes PREEMPTED for the end of the job: Slurm has the truth
    _assert_preempted_resumed_identical(drill, reference)
    high_state = subprocess.run(
        ["sacct", "-n", "-X", "-j", high.stdout.strip(), "-o", "State"], env=drill.env, capture_output=True, text=True
    ).stdout.split()
    assert high_state == ["COMPLETED"], high_state
