"""Run the real training entry point under torchrun (2 ranks, gloo on CPU) and read what it left behind."""

import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from tests import processes
from tests.resources import free_port

from megatron.bridge.training.checkpoint import compare
from megatron.bridge.training.events.reader import read_events
from megatron.bridge.training.events.stream import Event, EventKind, Mechanism

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / "examples" / "pretrain_tiny_gpt.py"
_LOSS_RE = re.compile(r"\[rank0\].* iteration (\d+)/\d+ \| consumed samples \d+ \| lm loss (\S+) \|")

# 12 iterations, a checkpoint every 3: small enough for CI, long enough to interrupt and resume.
BASE = ["train.train_iters=12", "checkpoint.save_interval=3", "checkpoint.most_recent_k=-1"]

# A resumed run with another train.train_iters has another learning-rate schedule, which megatron-core refuses to
# load over the checkpoint's (as in Megatron-Bridge) unless told which one wins: keep the checkpoint's.
KEEP_SCHEDULE = "scheduler.use_checkpoint_opt_param_scheduler=True"


@dataclass
class Run:
    """Outcome of one training launch."""

    exit_code: int
    """Exit code of the launcher, which is that of the first training process that failed."""
    output: str
    event_dir: Optional[Path] = None
    """Where the launcher and the ranks wrote their events (``<checkpoint.save>/events``, the default)."""
    started: float = 0.0
    """Unix time of the launch: events before it belong to earlier runs on the same checkpoint directory."""
    finished: float = 0.0
    """Unix time the launcher ended."""

    def losses(self) -> dict[int, float]:
        """The loss rank 0 logged at each iteration."""
        return {int(m.group(1)): float(m.group(2)) for m in _LOSS_RE.finditer(self.output)}

    def events(self, kind: Optional[EventKind] = None) -> list[Event]:
        """The run's events in time order (of ``kind`` only, if given); a line the reader skipped fails the test."""
        found, problems = read_events(str(self.event_dir))
        assert not problems, problems
        return [e for e in found if e.time >= self.started and (kind is None or e.kind == kind)]

    def loaded(self, rank: int = 0) -> list[int]:
        """The iterations of the checkpoints ``rank`` loaded, in order (one per start that resumed)."""
        return [e.iteration for e in self.events(EventKind.CHECKPOINT_LOADED) if e.rank == rank]

    def loads(self, rank: int = 0) -> list[tuple[str, int]]:
        """The (tier, iteration) of each checkpoint ``rank`` loaded, in order (``"local"`` or ``"global"``)."""
        return [(e.tier, e.iteration) for e in self.events(EventKind.CHECKPOINT_LOADED) if e.rank == rank]

    def detected(self, mechanism: Mechanism) -> list[Event]:
        """The ``fault_detected`` events of ``mechanism``."""
        return [e for e in self.events(EventKind.FAULT_DETECTED) if e.mechanism == mechanism]


def kill_processes_with_marker(marker: str) -> list[int]:
    """SIGKILL every process of the launch tagged ``MBRIDGE_TEST_RUN=<marker>``; return their PIDs.

    A SIGKILLed rank can leave helper processes behind (writers, managers); a test run must not leak them.
    """
    return processes.kill_tagged(processes.RUN, marker)


def torchrun(
    ckpt_dir: Path,
    *overrides: str,
    env: dict | None = None,
    timeout: float = 300,
    nproc: int = 2,
    entry: list[str] | None = None,
) -> Run:
    """Train the tiny GPT on 2 ranks with checkpoints in ``ckpt_dir`` and the given dotted overrides.

    ``entry``: another entry script and its own arguments (the tiny GPT example by default).

    Launched through ``megatron.bridge.launch`` (torchrun that passes the training processes' exit code through).
    """
    launcher = [
        sys.executable, "-m", "megatron.bridge.launch", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
    ]  # fmt: skip
    return launch(launcher, ckpt_dir, *overrides, env=env, timeout=timeout, entry=entry)


# Section timeouts for drills on a 2-core machine: steps take ~0.05 s, saves ~2 s, start-up ~15 s.
FT_FLAGS = [
    "--ft-rank-section-timeouts=setup:90,step:6,checkpointing:15", "--ft-rank-out-of-section-timeout=30",
    "--ft-workload-check-interval=1",
]  # fmt: skip


def ft_launcher(
    ckpt_dir: Path,
    *overrides: str,
    max_restarts: int = 0,
    env: dict | None = None,
    ft_flags: list[str] | None = None,
    timeout: float = 300,
) -> Run:
    """Like :func:`torchrun`, launched by nvidia-resiliency-ext's ``ft_launcher`` with in-job restarts."""
    launcher = [
        sys.executable, "-m", "megatron.bridge.ft_launch", f"--event-dir={ckpt_dir / 'events'}",
        "--nproc-per-node=2", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--max-restarts={max_restarts}",
        *(FT_FLAGS if ft_flags is None else ft_flags),
    ]  # fmt: skip
    return launch(launcher, ckpt_dir, *overrides, env=env, timeout=timeout)


def launch(
    launcher: list[str],
    ckpt_dir: Path,
    *overrides: str,
    env: dict | None = None,
    timeout: float = 300,
    entry: list[str] | None = None,
) -> Run:
    """Run ``launcher`` on the tiny GPT entry script (or ``entry``) with checkpoints in ``ckpt_dir``."""
    script = entry or [str(ENTRY)]
    cmd = [*launcher, *script, f"checkpoint.save={ckpt_dir}", f"checkpoint.load={ckpt_dir}", *BASE, *overrides]
    marker, started = uuid.uuid4().hex, time.time()
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "MBRIDGE_TEST_RUN": marker, **(env or {})}
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=REPO)
        stuck = ""
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode, stuck = -999, processes.stacks(processes.tagged(processes.RUN, marker))
        except BaseException:  # the test's time limit, or an interrupt: show where the launch was
            print(processes.stacks(processes.tagged(processes.RUN, marker)))
            raise
        finally:
            kill_processes_with_marker(marker)
            proc.wait()
        out.seek(0)
        output = out.read()
    if returncode == -999:
        raise AssertionError(f"training did not finish within {timeout} s:\n{output[-4000:]}\n{stuck}")
    return Run(returncode, output, ckpt_dir / "events", started, time.time())


@dataclass
class RankRuns:
    """Outcome of ranks started without a launcher: each rank's exit code and output."""

    exit_codes: list[int]
    outputs: list[str]
    event_dir: Optional[Path] = None
    """Where the ranks wrote their events (``<checkpoint.save>/events``)."""
    started: float = 0.0
    """Unix time of the start (events before it belong to earlier runs)."""

    def events(self, kind: Optional[EventKind] = None) -> list[Event]:
        """The ranks' events in time order (of ``kind`` only, if given), as :meth:`Run.events`."""
        return Run(0, "", self.event_dir, self.started).events(kind)


def without_launcher(
    ckpt_dir: Path, *overrides: str, env: dict | None = None, timeout: float = 300, nproc: int = 2
) -> RankRuns:
    """Start ``nproc`` ranks as separate processes with the torch.distributed environment, no agent watching them.

    This is how ``srun --kill-on-bad-exit=0`` runs a job step: a rank that dies takes no other rank with it, so a
    survivor's own handling of the loss can be observed. Rank 0 hosts the rendezvous store.
    """
    import time

    port = free_port()
    marker = uuid.uuid4().hex
    cmd = [sys.executable, str(ENTRY), f"checkpoint.save={ckpt_dir}", f"checkpoint.load={ckpt_dir}", *BASE, *overrides]
    procs, files = [], []
    start, started = time.monotonic(), time.time()
    for rank in range(nproc):
        rank_env = {
            **os.environ, "PYTHONUNBUFFERED": "1", "MBRIDGE_TEST_RUN": marker, "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), **(env or {}),
        }  # fmt: skip
        out = tempfile.TemporaryFile(mode="w+")
        files.append(out)
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=rank_env, cwd=REPO))
    codes, stuck = [], ""
    try:
        for proc in procs:
            remaining = max(1.0, timeout - (time.monotonic() - start))
            try:
                codes.append(proc.wait(timeout=remaining))
            except subprocess.TimeoutExpired:
                codes.append(-999)
        if -999 in codes:
            stuck = processes.stacks(processes.tagged(processes.RUN, marker))
    except BaseException:  # the test's time limit, or an interrupt: show where the ranks were
        print(processes.stacks(processes.tagged(processes.RUN, marker)))
        raise
    finally:
        kill_processes_with_marker(marker)
        for proc in procs:
            proc.wait()
    outputs = []
    for out in files:
        out.seek(0)
        outputs.append(out.read())
        out.close()
    if -999 in codes:
        ranks = "\n".join(o[-3000:] for o in outputs)
        raise AssertionError(f"a rank did not finish within {timeout} s:\n{ranks}\n{stuck}")
    return RankRuns(codes, outputs, ckpt_dir / "events", started)


def checkpoint_state(ckpt_dir: Path) -> dict[str, Any]:
    """Every tensor and value of a committed checkpoint (model, optimizer, RNG, scheduler, progress), flat."""
    return compare.checkpoint_state(ckpt_dir)


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bit-for-bit equality of two :func:`checkpoint_state` results."""
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    assert any(k.startswith("sharded.optimizer") for k in a), "optimizer state must be compared too"
    for key in a:
        va, vb = a[key], b[key]
        if isinstance(va, torch.Tensor):
            assert va.dtype == vb.dtype and va.shape == vb.shape, key
            assert torch.equal(va, vb), f"{key} differs"
        else:
            assert va == vb, f"{key}: {va!r} != {vb!r}"


def tail(run: Run, lines: int = 60) -> str:
    """The end of a run's output, for assertion messages."""
    return "\n".join(run.output.splitlines()[-lines:])
