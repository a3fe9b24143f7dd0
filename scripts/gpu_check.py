"""Checks that the resiliency features work on one real GPU, and measures what they cost there, within minutes.

Five parts, each with its own time limit inside one budget (8 minutes on a GPU); a part that fails does not stop
the next. Every training run is the Llama recipe (``llama3_tiny_pretrain_config`` scaled by dotted overrides to about
300 M parameters: 24 layers of width 1024, bf16, sequences of 2048 tokens) on one rank with NCCL, under
``python -m megatron.bridge.ft_launch`` with every resiliency feature on: ft_launcher's rank monitor, async global
checkpoints and async local-tier checkpoints, the re-run state machine, straggler detection, the liveness ping,
preemption handling and in-process restart. The data are the drill's offline corpus (byte-level tokens).

a. the unit tier, with the GPU visible;
b. a SIGKILL at iteration 21 and the launcher's restart: the run resumes from the newest checkpoint committed before
   the kill, and its final model, optimizer, scheduler, data position and RNG state equal a fault-free run's bit for
   bit (``training/checkpoint/compare.py``, the drill's comparison);
c. an exception at iteration 21 restarted in the same process (in-process restart): the final state equals the
   fault-free run's, and the GPU memory allocated at the end of iteration 20, run again after the restart, exceeds
   its level before the fault by at most a quarter of the bf16 weights' bytes (a leaked copy of the aborted attempt's
   weights, gradients or optimizer state is at least 2 bytes per parameter: 4x the tolerance; what legitimately
   differs, scalars kept between steps, is kilobytes);
d. straggler detection on GPU timing: from iteration 30 the rank's steps do 3x the GPU work (extra matrix products,
   ``scripts/gpu_check_worker.py``); the detector's individual score, from CUDA kernel timing, stays at or above 0.5
   before and falls below it after;
e. tokens per second and model FLOPs utilisation (MFU) of the fault-free run against the plain megatron-core loop
   (``benchmarks/_plain_mcore_loop.py``, same model, data and batch), and the time the training thread spent on
   saves, async against sync (goodput's ``checkpoint_save``), and one save as the loop felt it (each run's first
   global save: the call, plus an async save's finalize, as ``benchmarks/save_blocking.py`` measures it).

``--dry-run``: the same steps on CPU (gloo, fp32, the recipe's tiny Llama, a fast subset of the unit tier), in about
a minute; the GPU memory check and MFU are then rows saying "not measured on CPU". Writes ``OUTDIR/gpu_check.md``,
``OUTDIR/gpu_check.json`` (each part: name, passed, seconds, figures, the tail of its log on failure; provenance)
and ``OUTDIR/gpu_check_logs.tar.gz``; exits 0 only when every part passed. ``scripts/gpu_check.sh`` installs the
carried wheels on the GPU machine and runs this.

    python scripts/gpu_check.py OUTDIR [--dry-run] [--budget SECONDS] [--scratch DIR]
"""

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from gpu_check_report import PEAKS, flops_per_token, peak_flops, write_reports  # noqa: E402

from megatron.bridge.drill import runner  # noqa: E402
from megatron.bridge.drill.cli import prepare_corpus  # noqa: E402
from megatron.bridge.training.config_checks.resiliency import INPROCESS_ENV  # noqa: E402
from megatron.bridge.training.events.reader import read_events  # noqa: E402
from megatron.bridge.training.events.stream import Event, EventKind, Mechanism, RestartLayer  # noqa: E402

WORKER = REPO / "scripts" / "gpu_check_worker.py"
PLAIN_LOOP = REPO / "benchmarks" / "_plain_mcore_loop.py"
RECIPE = "llama3_tiny_pretrain_config"
ITERS, SAVE_EVERY, LOCAL_EVERY, FAULT_AT = 24, 12, 8, 21
"""Fault-free run: local-tier saves at 8 and 16, global ones at 12 and 24; the faults strike when 21 starts."""
WARMUP = 3
"""First steps of a run left out of the throughput (CUDA and library set-up)."""
STRAGGLER_ITERS, SLOW_FROM, SCORE_THRESHOLD = 40, 29, 0.5
"""The straggler run: reports every few steps from iteration 17 (the detector measures steps for 16 first); slowed
from 29, so that at least two reports cover healthy steps only and two slowed ones only (with up to 8 steps between
reports; the report interval of each mode keeps it below that)."""
STRAGGLER_SAVE_EVERY, STRAGGLER_LOCAL_EVERY = 24, 16
"""The straggler run's saves are synchronous, two local and two global as in the fault-free run (16 and 32, 24 and
40): the sync side of part e's save blocking."""
FAILED_TAIL = 60
"""Log lines kept in the report for a failed part."""


@dataclass(frozen=True)
class Mode:
    """What differs between the GPU check and its CPU dry run."""

    name: str
    dims: dict[str, int]
    """Model and batch: layers, hidden, ffn, heads, groups, seq, vocab, micro, global."""
    slow_factor: float
    report_interval: float
    """Straggler report interval (s): the detector turns it into about 4 steps."""
    budget: float
    unit_args: tuple[str, ...]
    run_timeout: float


GPU = Mode(
    "gpu", dict(layers=24, hidden=1024, ffn=3072, heads=16, groups=8, seq=2048, vocab=512, micro=2, batch=8),
    slow_factor=3.0, report_interval=0.5, budget=480.0, run_timeout=240.0,
    unit_args=("tests", "-m", "not functional", "-n", "8"),
)  # fmt: skip
DRY = Mode(
    "dry-run", dict(layers=4, hidden=64, ffn=192, heads=4, groups=2, seq=64, vocab=512, micro=2, batch=8),
    slow_factor=3.0, report_interval=0.15, budget=300.0, run_timeout=120.0,
    unit_args=tuple(f"tests/unit_tests/utils/test_{n}.py" for n in ("provenance", "fs", "fast_exit", "process_start")),
)  # fmt: skip


class Failed(Exception):
    """A part's check did not hold; the message says which."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`Failed` with ``message`` unless ``condition``."""
    if not condition:
        raise Failed(message)


@dataclass
class Part:
    """One part of the report."""

    key: str
    title: str
    passed: bool = False
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    log_tail: str = ""
    logs: list[Path] = field(default_factory=list)
    """Logs of the runs the part used (the last one's tail goes in the report on failure)."""

    def to_json(self) -> dict[str, Any]:
        """The part as the JSON report holds it (logs by file name: they are in the logs archive)."""
        return {**self.__dict__, "logs": [f"{p.parent.name}/{p.name}" for p in self.logs]}


@dataclass
class Job:
    """One launched run and what it left."""

    name: str
    directory: Path
    code: int
    seconds: float
    log: Path
    save_blocking_s: Optional[float] = None
    """The training thread's time on saves (rank 0's goodput ``checkpoint_save``), read before the checkpoints go."""

    def events(self) -> list[Event]:
        """Every event of the run (launcher and rank), in time order."""
        found, _ = read_events(str(self.directory / "events"))
        return found

    def of(self, kind: EventKind, rank: Optional[int] = 0) -> list[Event]:
        """The run's events of ``kind`` (about ``rank``; ``None``: any)."""
        return [e for e in self.events() if e.kind == kind and (rank is None or e.rank == rank)]

    def step_times(self) -> dict[int, float]:
        """Rank 0's step time by iteration (the last attempt's, where a restart ran an iteration again)."""
        return {e.iteration: e.seconds for e in self.of(EventKind.STEP_COMPLETED) if e.seconds is not None}

    def tail(self, lines: int = FAILED_TAIL) -> str:
        """The last ``lines`` lines of the run's log."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Check:
    """Runs the parts: the training runs, the comparisons and the figures."""

    def __init__(self, mode: Mode, scratch: Path, cuda: bool) -> None:
        self.mode, self.scratch, self.cuda = mode, scratch, cuda
        self.deadline = time.monotonic() + mode.budget
        self.corpus: Optional[str] = None
        self.reference: Optional[Job] = None
        self.sync_saves: Optional[Job] = None
        """The straggler run, whose saves are synchronous (part e compares them with the fault-free run's)."""
        self._reference_state: Optional[dict] = None
        self.tensorboard = _importable("tensorboard")
        self.jobs: list[Job] = []

    # ------------------------------------------------------------------------------------------------ runs

    def remaining(self) -> float:
        """Seconds left of the check's budget."""
        return self.deadline - time.monotonic()

    def timeout(self, cap: float) -> float:
        """The time limit of the next run: ``cap``, or what the budget leaves; fails the part when too little."""
        left = self.remaining() - 5
        require(left >= 20, f"not run: {self.mode.budget:.0f} s budget of the check used up")
        return min(cap, left)

    def data(self) -> str:
        """The corpus's dataset prefix (made on first use, with no network)."""
        if self.corpus is None:
            self.corpus = prepare_corpus(self.scratch / "data")
        return self.corpus

    def overrides(self, run: Path, iters: int = ITERS, async_save: bool = True) -> list[str]:
        """Every resiliency feature on, the model of this mode, checkpoints and events under ``run``."""
        d = self.mode.dims
        # At most 2 restarts in place: a fault that recurs in every attempt ends the run instead of looping.
        ipr = dict(max_iterations=2, soft_timeout=60, hard_timeout=90, heartbeat_interval=2, heartbeat_timeout=30,
                   barrier_timeout=120, completion_timeout=120, last_call_wait=0.3, monitor_thread_interval=0.2,
                   monitor_process_interval=0.5, progress_watchdog_interval=1)  # fmt: skip
        tensorboard = str(run / "tensorboard") if self.tensorboard else "null"
        return [
            f"dataset.blend=[[{self.data()!r}],None]", f"train.train_iters={iters}",
            f"model.num_layers={d['layers']}", f"model.hidden_size={d['hidden']}",
            f"model.ffn_hidden_size={d['ffn']}", f"model.num_attention_heads={d['heads']}",
            f"model.num_query_groups={d['groups']}", f"model.seq_length={d['seq']}",
            f"dataset.sequence_length={d['seq']}", f"train.micro_batch_size={d['micro']}",
            f"train.global_batch_size={d['batch']}", "model.hidden_dropout=0.1", "model.attention_dropout=0.1",
            f"checkpoint.save={run / 'checkpoints'}", f"checkpoint.load={run / 'checkpoints'}",
            f"checkpoint.save_interval={SAVE_EVERY}", f"checkpoint.async_save={str(async_save).lower()}",
            "checkpoint.most_recent_k=1", "checkpoint.non_persistent_ckpt_type=local",
            f"checkpoint.non_persistent_save_interval={LOCAL_EVERY}",
            f"checkpoint.non_persistent_local_ckpt_dir={run / 'local'}",
            "ft.enable_ft_package=true", "rerun_state_machine.rerun_mode=validate_results",
            "nvrx_straggler.enabled=true", "train.exit_signal_handler=true",
            "health.liveness_ping_interval=10", "health.liveness_ping_timeout=120",
            f"health.event_dir={run / 'events'}",
            "inprocess_restart.enabled=true", *[f"inprocess_restart.{k}={v}" for k, v in ipr.items()],
            f"inprocess_restart.monitor_process_logdir={run / 'inprocess'}",
            "logger.log_interval=1", f"logger.tensorboard_dir={tensorboard}",
        ]  # fmt: skip

    def launch(self, name: str, cmd: list[str], env: Optional[dict[str, str]] = None, cap: float = 0) -> Job:
        """Run ``cmd`` with its output in ``<scratch>/<name>/train.log`` and progress lines on stdout."""
        directory = self.scratch / name
        directory.mkdir(parents=True, exist_ok=True)
        full_env = {k: v for k, v in os.environ.items() if k != "MBRIDGE_FAULTS"}
        full_env.update(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", CUBLAS_WORKSPACE_CONFIG=":4096:8")
        full_env.update(INPROCESS_ENV)
        full_env.update(env or {})
        log = directory / "train.log"
        start = time.monotonic()
        code = runner.launch_and_watch(cmd, full_env, log, self.timeout(cap or self.mode.run_timeout), name)
        job = Job(name, directory, code, time.monotonic() - start, log)
        summary = directory / "checkpoints" / "goodput" / "summary.json"
        if summary.exists():
            job.save_blocking_s = float(json.loads(summary.read_text())["lost_s"]["checkpoint_save"])
        self.jobs.append(job)
        return job

    def release(self, keep_reference: bool) -> None:
        """Delete the checkpoints of the runs done with (GBs each on a GPU): all but the fault-free run's if kept."""
        for job in self.jobs:
            if not (keep_reference and job is self.reference):
                drop_checkpoints(job)

    def train(self, name: str, extra: tuple[str, ...] = (), iters: int = ITERS, async_save: bool = True,
              restarts: int = 0, env: Optional[dict[str, str]] = None) -> Job:  # fmt: skip
        """One training job of the recipe on one rank under ft_launcher, every feature on, ``extra`` overrides."""
        run = self.scratch / name
        cmd = [
            sys.executable, "-m", "megatron.bridge.ft_launch", "--nproc-per-node=1", "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0", f"--max-restarts={restarts}",
            "--ft-rank-section-timeouts=setup:600,step:180,checkpointing:600", "--ft-rank-out-of-section-timeout=600",
            "--ft-workload-check-interval=1", "--workers-stop-timeout=5", f"--event-dir={run / 'events'}",
            str(WORKER), RECIPE, *self.overrides(run, iters, async_save), *extra,
        ]  # fmt: skip
        return self.launch(name, cmd, env)

    def fault_free(self, part: Part) -> Job:
        """The fault-free run every comparison and the throughput use (run once)."""
        if self.reference is None:
            self.reference = self.train("reference")
        part.logs.append(self.reference.log)
        require(self.reference.code == 0, f"the fault-free run failed (exit {self.reference.code})")
        return self.reference

    def compare_with_reference(self, part: Part, job: Job) -> None:
        """Final state of ``job`` against the fault-free run's, bit for bit; figures ``equal`` and ``compared``."""
        from megatron.bridge.training.checkpoint import compare

        final = f"iter_{ITERS:07d}"
        reference = self.fault_free(part)
        if self._reference_state is None:
            self._reference_state = compare.checkpoint_state(reference.directory / "checkpoints" / final)
        state = compare.checkpoint_state(job.directory / "checkpoints" / final)
        result = compare.compare_states(self._reference_state, state, names=("fault-free run's", f"{job.name} run's"))
        part.figures["final_state_equal"] = result.equal
        part.figures["compared"] = "; ".join(p.describe() for p in result.parts)
        require(result.equal, "final state differs from the fault-free run's: " + "; ".join(result.differences[:5]))

    # ----------------------------------------------------------------------------------------------- parts

    def unit_tier(self, part: Part) -> None:
        """Part a: pytest on the mode's unit tests, with only the plugins the suite needs."""
        log = self.scratch / "unit" / "pytest.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        part.logs.append(log)
        cmd = [sys.executable, "-m", "pytest", *self.mode.unit_args, "-q", "-p", "no:cacheprovider",
               f"--basetemp={self.scratch / 'pytest'}"]  # fmt: skip
        part.figures["command"] = " ".join(["python", *cmd[1:-1]])
        # Only the plugins the suite uses, in this pytest and in those its tests start: a machine's image may hold
        # other pytest plugins, made for another pytest than the one carried.
        env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTEST_PLUGINS": "pytest_timeout,xdist.plugin"}
        with open(log, "w") as out:
            try:
                proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=self.timeout(240), start_new_session=True)  # fmt: skip
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = None
        summary = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?) in ([\d.]+)s", log.read_text(errors="replace"), re.M)
        found = re.findall(r"(\d+) (passed|failed|skipped|error)", summary[-1][0]) if summary else []
        counts = {kind: int(n) for n, kind in found}
        part.figures.update({kind: counts.get(kind, 0) for kind in ("passed", "failed", "skipped", "error")})
        require(code is not None, "the unit tier did not finish in time")
        require(code == 0, f"pytest exited {code}")

    def kill_and_resume(self, part: Part) -> None:
        """Part b: SIGKILL at :data:`FAULT_AT`, the launcher's restart, the resume, the final state."""
        reference = self.fault_free(part)
        part.figures["fault_free_run_s"] = round(reference.seconds, 1)
        job = self.train("killed", (f"fault_injection.faults=kill@{FAULT_AT}:0",), restarts=1)
        part.logs.append(job.log)
        part.figures["killed_run_s"] = round(job.seconds, 1)
        require(job.code == 0, f"the run with the kill failed (exit {job.code})")
        struck = job.of(EventKind.FAULT_INJECTED)
        require([(e.fault_kind, e.iteration) for e in struck] == [("kill", FAULT_AT)], f"faults struck: {struck}")
        kill = struck[0].time
        exits = [e for e in job.of(EventKind.WORKER_EXITED) if e.signal is not None]
        part.figures["worker_exit"] = f"signal {exits[0].signal}" if exits else "none seen"
        restarts = [e for e in job.of(EventKind.RESTART_ENDED, None) if e.layer == RestartLayer.IN_JOB]
        require(len(restarts) == 1, f"{len(restarts)} in-job restarts, expected 1")
        self._resume_figures(part, job, kill)
        self.compare_with_reference(part, job)

    def _resume_figures(self, part: Part, job: Job, fault_time: float) -> None:
        """Where the run resumed after the fault, against the newest checkpoint committed before it."""
        saved = [e for e in job.of(EventKind.CHECKPOINT_SAVED) if e.time < fault_time]
        loads = [e for e in job.of(EventKind.CHECKPOINT_LOADED) if e.time > fault_time]
        require(saved and loads, f"no checkpoint {'loaded' if saved else 'committed'} around the fault")
        newest = max(saved, key=lambda e: e.iteration)
        load = loads[0]
        part.figures["newest_committed_before_fault"] = f"{newest.tier} checkpoint of iteration {newest.iteration}"
        part.figures["resumed_from"] = f"{load.tier} checkpoint of iteration {load.iteration}"
        after = [e for e in job.of(EventKind.STEP_COMPLETED) if e.time > load.time]
        if after:
            part.figures["fault_to_next_step_s"] = round(after[0].time - fault_time, 2)
        require(load.iteration == newest.iteration, "did not resume from the newest committed checkpoint")

    def inprocess_restart(self, part: Part) -> None:
        """Part c: an exception at :data:`FAULT_AT`, in-process restart, memory, the final state."""
        memory = self.scratch / "inprocess_memory.jsonl"
        job = self.train("inprocess", (f"fault_injection.faults=exception@{FAULT_AT}:0",),
                         env={"GPU_CHECK_MEMORY": str(memory)})  # fmt: skip
        part.logs.append(job.log)
        part.figures["run_s"] = round(job.seconds, 1)
        require(job.code == 0, f"the run with the exception failed (exit {job.code})")
        struck = job.of(EventKind.FAULT_INJECTED)
        require([(e.fault_kind, e.iteration) for e in struck] == [("exception", FAULT_AT)], f"faults: {struck}")
        starts = [(e.inprocess_iteration, e.pid) for e in job.of(EventKind.ATTEMPT_STARTED)]
        part.figures["attempts"] = [f"in-process iteration {i} in pid {p}" for i, p in starts]
        require([i for i, _ in starts] == [0, 1], f"attempts {starts}: expected one in-process restart")
        require(len({p for _, p in starts}) == 1, "the restart ran in another process")
        detected = [e for e in job.of(EventKind.FAULT_DETECTED, None) if e.mechanism == Mechanism.INPROCESS_EXCEPTION]
        require(bool(detected), "no in-process detection of the exception")
        ended = [e for e in job.of(EventKind.RESTART_ENDED, None) if e.layer == RestartLayer.IN_PROCESS]
        require(bool(ended), "no in-process restart ended")
        part.figures["fault_to_restarted_s"] = round(ended[0].time - struck[0].time, 2)
        self._resume_figures(part, job, struck[0].time)
        self._memory(part, memory)
        self.compare_with_reference(part, job)

    def _memory(self, part: Part, path: Path) -> None:
        if not self.cuda:
            part.figures["gpu_memory"] = "not measured on CPU"
            return
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        at = {(r["attempt"], r["iteration"]): r for r in rows}
        before, after = at.get((0, FAULT_AT - 1)), at.get((1, FAULT_AT - 1))
        require(before is not None and after is not None, f"no memory record of iteration {FAULT_AT - 1} in both")
        tolerance = before["params"] * 2 // 4  # a quarter of the bf16 weights' bytes (see the module doc)
        diff = after["allocated"] - before["allocated"]
        mib = 2**20
        part.figures["gpu_memory"] = {
            "iteration": FAULT_AT - 1, "allocated_before_fault_mib": round(before["allocated"] / mib, 1),
            "allocated_after_restart_mib": round(after["allocated"] / mib, 1), "difference_mib": round(diff / mib, 2),
            "tolerance_mib": round(tolerance / mib, 1), "reserved_before_mib": round(before["reserved"] / mib, 1),
            "reserved_after_mib": round(after["reserved"] / mib, 1),
        }  # fmt: skip
        require(diff <= tolerance, f"GPU memory after the restart is {diff / mib:.1f} MiB above its level before")

    def straggler(self, part: Part) -> None:
        """Part d: steps slowed on the device from :data:`SLOW_FROM`; the individual score before and after."""
        extra = (
            f"nvrx_straggler.report_time_interval={self.mode.report_interval}",
            f"nvrx_straggler.gpu_individual_perf_threshold={SCORE_THRESHOLD}",
            f"nvrx_straggler.gpu_relative_perf_threshold={SCORE_THRESHOLD}",
            f"checkpoint.save_interval={STRAGGLER_SAVE_EVERY}",
            f"checkpoint.non_persistent_save_interval={STRAGGLER_LOCAL_EVERY}",
        )
        env = {"GPU_CHECK_SLOW": f"{SLOW_FROM}:{self.mode.slow_factor:g}"}
        job = self.sync_saves = self.train("straggler", extra, iters=STRAGGLER_ITERS, async_save=False, env=env)
        part.logs.append(job.log)
        part.figures.update(slowed_from=SLOW_FROM, factor=self.mode.slow_factor, threshold=SCORE_THRESHOLD)
        require(job.code == 0, f"the straggler run failed (exit {job.code})")
        reports = sorted(job.of(EventKind.STRAGGLER_REPORT), key=lambda e: e.iteration)
        iters = [e.iteration for e in reports]
        every = min((b - a for a, b in zip(iters, iters[1:])), default=0)
        text = job.log.read_text(errors="replace")
        sources = set(re.findall(r"Straggler report at iteration \d+ \(scores from ([^)]*)\)", text))
        score = {e.iteration: (e.individual_scores or {}).get(0, math.nan) for e in reports}
        healthy = [round(score[i], 3) for i in iters if i < SLOW_FROM]
        slowed = [round(score[i], 3) for i in iters if i - every >= SLOW_FROM - 1]
        detected = job.of(EventKind.FAULT_DETECTED, None)
        flagged = [e.iteration for e in detected if e.mechanism == Mechanism.STRAGGLER_SCORE]
        part.figures.update(score_source=", ".join(sorted(sources)) or "none", report_every_steps=every,
                            healthy_scores=healthy, slowed_scores=slowed, flagged_at=flagged)  # fmt: skip
        want = "CUDA kernel timing" if self.cuda else "wall time of the forward step"
        require(any(s.startswith(want) for s in sources), f"scores not from {want}")
        require(bool(healthy) and bool(slowed), "too few reports before and after the slowdown")
        require(all(s < SCORE_THRESHOLD for s in slowed), "the slowed steps were not flagged")
        # On a GPU kernel times are steady: no healthy report may flag. A shared CPU's load moves wall times, so
        # there the healthy reports only have to score above the threshold as a rule (their median).
        low = min(healthy) if self.cuda else statistics.median(healthy)
        require(low >= SCORE_THRESHOLD, f"healthy steps scored {low} < {SCORE_THRESHOLD}")

    def throughput(self, part: Part) -> None:
        """Part e: tokens/s and MFU against the plain loop; the training thread's time on async and sync saves."""
        d = self.mode.dims
        reference = self.fault_free(part)
        plain = self.plain_loop()
        part.logs.append(plain.log)
        require(plain.code == 0, f"the plain megatron-core loop failed (exit {plain.code})")
        tokens = d["batch"] * d["seq"]
        fw = _mean_kept(reference.step_times())
        pl = _mean_kept(_logged_step_times(plain.log))
        require(fw is not None and pl is not None, "too few steps logged to measure")
        params = re.search(r"parameters (\d+)", plain.log.read_text(errors="replace"))
        flops = flops_per_token(d)
        part.figures.update(
            tokens_per_step=tokens, parameters=int(params.group(1)) if params else None,
            flops_per_token=flops, framework_step_s=round(fw, 5), plain_step_s=round(pl, 5),
            framework_tokens_per_s=round(tokens / fw), plain_tokens_per_s=round(tokens / pl),
            framework_overhead=round(1 - pl / fw, 4),
        )  # fmt: skip
        if self.cuda:
            name, peak = peak_flops()
            part.figures["peak"] = f"{peak / 1e12:.0f} TFLOP/s dense bf16 ({name})" if peak else f"unknown ({name})"
            if peak:
                part.figures["framework_mfu"] = round(tokens / fw * flops / peak, 4)
                part.figures["plain_mfu"] = round(tokens / pl * flops / peak, 4)
        else:
            part.figures["framework_mfu"] = part.figures["plain_mfu"] = "not measured on CPU"
        sync = self.sync_saves
        require(sync is not None and sync.code == 0, "no sync saves to compare with: the straggler run failed")
        part.figures["sync_saves_from"] = "the straggler run (part d): same model, saves synchronous"
        blocking = {}
        for label, job in (("async", reference), ("sync", sync)):
            require(job.save_blocking_s is not None, f"no goodput summary of the {job.name} run")
            saves = job.of(EventKind.CHECKPOINT_SAVED)
            blocking[label] = job.save_blocking_s
            part.figures[f"{label}_save_blocking_s"] = round(blocking[label], 3)
            part.figures[f"{label}_saves"] = ", ".join(f"{e.tier} {e.iteration}" for e in saves)
            sizes = [e.bytes for e in saves if e.tier == "global" and e.bytes]
            if sizes:
                part.figures["global_checkpoint_mib"] = round(max(sizes) / 2**20, 1)
        part.figures["async_over_sync"] = round(blocking["async"] / blocking["sync"], 3) if blocking["sync"] else None
        # One save as the loop felt it (benchmarks/save_blocking.py's measure): the call, plus for an async save the
        # finalize that committed it; each run's first global save (the async one includes the writer's start-up).
        per_save = {}
        for label, job in (("async", reference), ("sync", sync)):
            found = [e for e in job.of(EventKind.CHECKPOINT_SAVED) if e.tier == "global" and e.seconds is not None]
            if found:
                first = min(found, key=lambda e: e.iteration)
                per_save[label] = first.seconds + (first.finalize_seconds or 0.0)
                part.figures[f"{label}_first_global_save_blocking_s"] = round(per_save[label], 3)
        if len(per_save) == 2 and per_save["sync"]:
            part.figures["first_global_save_async_over_sync"] = round(per_save["async"] / per_save["sync"], 3)

    def plain_loop(self) -> Job:
        """The plain megatron-core loop on the same model, batch and data (the model's overrides, nothing else)."""
        model = [o for o in self.overrides(self.scratch / "plain") if o.startswith(("model.", "train.", "dataset."))]
        model = [o for o in model if not o.startswith(("dataset.blend", "train.train_iters"))]
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(PLAIN_LOOP),
            "--data-prefix", self.data(), "--steps", str(ITERS), *[f"--override={o}" for o in model],
        ]  # fmt: skip
        return self.launch("plain", cmd)


def drop_checkpoints(job: Job) -> None:
    """Free the disk a run's checkpoints take (GBs each on a GPU), once nothing reads them any more."""
    for name in ("checkpoints", "local"):
        shutil.rmtree(job.directory / name, ignore_errors=True)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _logged_step_times(log: Path) -> dict[int, float]:
    found = re.findall(r"\[rank0\].* iteration (\d+)/\d+ \|.*\| step time ([\d.]+) s", log.read_text(errors="replace"))
    return {int(i): float(t) for i, t in found}


def _mean_kept(times: dict[int, float]) -> Optional[float]:
    kept = [t for i, t in times.items() if i > WARMUP]
    return statistics.mean(kept) if len(kept) >= 5 else None


def run_part(part: Part, fn: Callable[[Part], None]) -> Part:
    """Run one part, recording its outcome; a failure is recorded, never raised."""
    print(f"\n[gpu_check] part {part.key}: {part.title}", flush=True)
    part.problems.clear()  # "not run" until now
    start = time.monotonic()
    try:
        fn(part)
        part.passed = True
    except Failed as err:
        part.problems.append(str(err))
    except Exception as err:  # noqa: BLE001 - an unexpected error fails this part only
        part.problems.append(f"{type(err).__name__}: {err}")
        part.log_tail = traceback.format_exc()[-4000:]
    part.seconds = round(time.monotonic() - start, 1)
    if not part.passed and part.logs and not part.log_tail:
        part.log_tail = Job("", part.logs[-1].parent, 0, 0, part.logs[-1]).tail()
    verdict = "passed" if part.passed else f"FAILED: {'; '.join(part.problems)}"
    print(f"[gpu_check] part {part.key} {verdict} ({part.seconds} s)", flush=True)
    return part


def main(argv: Optional[list[str]] = None) -> int:
    """Run the check; return its exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="on CPU with the tiny model (see the module doc)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all parts (default: the mode's)")
    parser.add_argument("--scratch", type=Path, default=None, help="checkpoints and logs (default: a temp dir)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.dry_run:  # on CPU even where a GPU is: every run of the check inherits this
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    cuda = torch.cuda.is_available()
    mode = DRY if args.dry_run else GPU
    if args.budget:
        mode = Mode(**{**mode.__dict__, "budget": args.budget})
    args.outdir.mkdir(parents=True, exist_ok=True)
    if args.scratch is not None:
        args.scratch.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="mbridge-gpu-check-", dir=args.scratch))
    tempfile.tempdir = str(scratch)  # the comparison's flattened checkpoints go there, not to a small /tmp
    check = Check(mode, scratch, cuda)
    titles = {
        "a": "unit tier with the device visible", "b": "SIGKILL under ft_launcher, resume, final state bit-equal",
        "c": "in-process restart, memory released, final state bit-equal",
        "d": "straggler detection on device timing",
        "e": "throughput and MFU vs plain megatron-core; async vs sync save",
    }  # fmt: skip
    parts = {key: Part(key, title, problems=["not run: the check ended before it"]) for key, title in titles.items()}
    from megatron.bridge.utils import provenance

    def report() -> dict[str, Any]:
        return {
            "mode": mode.name, "passed": all(p.passed for p in parts.values()),
            "seconds": round(time.monotonic() - started, 1), "provenance": provenance.collect(REPO).to_json(),
            "cuda": torch.version.cuda, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "model": {**mode.dims, "recipe": RECIPE, "iterations": ITERS, "fault_at": FAULT_AT,
                      "dtype": "bf16" if cuda else "fp32", "backend": "nccl" if cuda else "gloo"},
            "peaks_tflops": {name: peak / 1e12 for name, peak in PEAKS},
            "parts": [parts[k].to_json() for k in sorted(parts)],
        }  # fmt: skip

    order = "bcdea"  # the parts that need the device first: the unit tier gets what is left of the budget
    if not args.dry_run and not cuda:
        for part in parts.values():
            part.problems = ["no CUDA device visible (use --dry-run on a CPU machine)"]
    else:
        fns = {"a": check.unit_tier, "b": check.kill_and_resume, "c": check.inprocess_restart,
               "d": check.straggler, "e": check.throughput}  # fmt: skip
        for key in order:
            run_part(parts[key], fns[key])
            check.release(keep_reference=key == "b")  # part c compares with the fault-free run too
            write_reports(report(), args.outdir, scratch)  # after every part: a check killed later leaves these
    final = report()
    write_reports(final, args.outdir, scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"[gpu_check] {'PASSED' if final['passed'] else 'FAILED'} in {final['seconds']} s; report in {args.outdir}")
    return 0 if final["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
