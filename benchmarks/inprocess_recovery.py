"""Recovery time after a crashed rank: in-process restart vs in-job restart (ft_launcher), in the same run.

Both runs train the tiny GPT on 2 ranks with a checkpoint at iteration 10; rank 1 raises at iteration 20
(``MBRIDGE_FAULTS=exception@20:1``) and the job resumes from 10. Recovery = the fault's log line -> the first
completed step after the restart (iteration 11 logged again). Repeated ``--repeats`` times; medians printed with
the ratio in-process / in-job (target <= 0.3).

The healthy rank is blocked in a collective with the crashed one when the fault strikes: with gloo it is freed by
the abort shutting the crashed rank's connections down (with NCCL, by aborting the communicators).

    python benchmarks/inprocess_recovery.py [--repeats 3] [--soft-timeout 8]
"""

import argparse
import datetime as dt
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _process import free_port
from _result import emit_result

REPO = Path(__file__).resolve().parents[1]
ENTRY = str(REPO / "examples" / "pretrain_tiny_gpt.py")
_TS = r"\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]?"
ENV = {"TORCH_CPP_LOG_LEVEL": "error", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0"}
COMMON = ["train.train_iters=30", "checkpoint.save_interval=10", "logger.log_interval=1"]


def _times(pattern: str, log: str) -> list[dt.datetime]:
    return [dt.datetime.strptime(m, "%Y-%m-%d %H:%M:%S,%f") for m in re.findall(_TS + pattern, log)]


def _recovery_seconds(cmd: list[str], overrides: list[str], ckpt: Path) -> float:
    """Run ``cmd`` on the entry script with ``overrides``; seconds from the fault to the first step after it."""
    shutil.rmtree(ckpt, ignore_errors=True)
    env = {**os.environ, **ENV, "PYTHONWARNINGS": "ignore", "MBRIDGE_FAULTS": "exception@20:1"}
    args = [*cmd, ENTRY, f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}", *COMMON, *overrides]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    fault = _times(r" \[rank1\] ERROR \S+: fault injection: exception at iteration 20", log)
    resumed = _times(r" \[rank0\] INFO \S+: iteration 11/30 ", log)
    if proc.returncode != 0 or not fault or len(resumed) < 2:
        kept = Path(tempfile.gettempdir()) / "inprocess_recovery_failed.log"
        kept.write_text(log)
        raise SystemExit(f"run failed (exit {proc.returncode}, log in {kept}): {' '.join(cmd)}\n{log[-3000:]}")
    return (resumed[1] - fault[0]).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--soft-timeout", type=float, default=8.0)
    args = parser.parse_args()
    ipr = [
        "inprocess_restart.enabled=true", f"inprocess_restart.soft_timeout={args.soft_timeout}",
        "inprocess_restart.hard_timeout=30", "inprocess_restart.heartbeat_interval=2",
        "inprocess_restart.heartbeat_timeout=10", "inprocess_restart.barrier_timeout=60",
        "inprocess_restart.completion_timeout=60",
    ]  # fmt: skip
    results: dict[str, list[float]] = {"in-process": [], "in-job": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            torchrun = [sys.executable, "-m", "megatron.bridge.launch", "--nproc-per-node=2"]
            in_process = [*torchrun, f"--master-port={free_port()}"]
            in_job = [
                sys.executable, "-m", "megatron.bridge.ft_launch", "--nproc-per-node=2", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=1",
            ]  # fmt: skip
            results["in-process"].append(_recovery_seconds(in_process, ipr, Path(tmp) / "ipr"))
            results["in-job"].append(_recovery_seconds(in_job, [], Path(tmp) / "injob"))
            print(
                f"repeat {i + 1}: in-process {results['in-process'][-1]:.2f} s, in-job {results['in-job'][-1]:.2f} s",
                flush=True,
            )
    ipr_s, job_s = statistics.median(results["in-process"]), statistics.median(results["in-job"])
    print(f"median recovery (fault -> first step after the restart): in-process {ipr_s:.2f} s, in-job {job_s:.2f} s")
    print(f"ratio in-process / in-job: {ipr_s / job_s:.2f} (target <= 0.30)")
    emit_result(
        "inprocess_recovery", f"in-process / in-job recovery time (median of {args.repeats})", ipr_s / job_s,
        f"{ipr_s:.2f} s (in-process restart)", f"{job_s:.2f} s (in-job restart, ft_launcher)", "<= 0.30",
    )  # fmt: skip


if __name__ == "__main__":
    main()
