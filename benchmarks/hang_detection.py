"""Hang detection latency and recovery time: our fault tolerance vs plain ``torchrun --max-restarts``.

1. A short FT run with ``ft.calc_ft_timeouts=true`` learns the ``step`` timeout (written to ``ft_state.json``).
2. The same checkpoint directory is trained further under ft_launcher while rank 1 hangs (SIGSTOP) at a step.
3. The same hang under ``torchrun --max-restarts=1`` (no rank monitor), given up after ``--cap`` seconds.

Detection latency = hang -> the rank monitor reports the open section; recovery = hang -> first completed step
after the restart. Target (with learned timeouts): detection <= 5 x median step time + the monitor's check interval.

    python benchmarks/hang_detection.py [--cap 60]
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

from _process import free_port, kill_tree
from _result import emit_result

REPO = Path(__file__).resolve().parents[1]
ENTRY = str(REPO / "examples" / "pretrain_tiny_gpt.py")
CHECK_INTERVAL = 1.0
_TS = r"\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]?"


def _times(pattern: str, log: str) -> list[dt.datetime]:
    return [dt.datetime.strptime(m, "%Y-%m-%d %H:%M:%S,%f") for m in re.findall(_TS + pattern, log)]


def _run(cmd: list[str], env_faults: str | None, timeout: float) -> tuple[str, bool]:
    env = {"PYTHONWARNINGS": "ignore", **os.environ}
    if env_faults:
        env["MBRIDGE_FAULTS"] = env_faults
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out, True
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        return out, False


def _ft_cmd(ckpt: Path, port: int, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "megatron.bridge.ft_launch", "--nproc-per-node=2", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=1",
        "--ft-rank-section-timeouts=setup:120,step:60,checkpointing:60", "--ft-rank-out-of-section-timeout=60",
        f"--ft-workload-check-interval={CHECK_INTERVAL}", ENTRY, f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}",
        "checkpoint.save_interval=5", "ft.enable_ft_package=true", "ft.calc_ft_timeouts=true", *overrides,
    ]  # fmt: skip


def _measure(log: str, monitor_pattern: str | None) -> dict:
    hang = _times(r".*fault injection: hang at iteration", log)
    steps = [float(x) for x in re.findall(r"step time ([\d.]+) s", log)]
    result = {"median_step": statistics.median(steps) if steps else float("nan")}
    if not hang:
        return result
    t0 = hang[0]
    if monitor_pattern:
        seen = [t for t in _times(monitor_pattern, log) if t >= t0]
        result["detect"] = (seen[0] - t0).total_seconds() if seen else None
    loads = [t for t in _times(r".*successfully loaded verified checkpoint", log) if t >= t0]
    if loads:
        after = [t for t in _times(r".*\[rank0\].*metrics: iteration", log) if t >= loads[0]]
        result["recover"] = (after[0] - t0).total_seconds() if after else None
    return result


KEEP_SCHEDULE = "scheduler.use_checkpoint_opt_param_scheduler=True"
"""A run resumed with another ``train.train_iters`` keeps the checkpoint's learning-rate schedule (megatron-core refuses
a different one by default, as Megatron-Bridge does)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=60.0, help="give up on the baseline after this many seconds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        _run(_ft_cmd(ckpt, free_port(), "train.train_iters=20"), None, 300)  # learns the timeouts into ft_state.json
        longer = ("train.train_iters=60", KEEP_SCHEDULE)  # continues the first run's checkpoint: keep its schedule
        ft_log, _ = _run(_ft_cmd(ckpt, free_port(), *longer), "hang@30:1", 300)
        ft = _measure(ft_log, r".*Section 'step' has been open")
        base_ckpt = Path(tmp) / "base"
        shutil.copytree(ckpt, base_ckpt, dirs_exist_ok=True)
        base_cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
                    "--max-restarts=1", ENTRY, f"checkpoint.save={base_ckpt}", f"checkpoint.load={base_ckpt}",
                    "checkpoint.save_interval=5", "train.train_iters=100", KEEP_SCHEDULE]  # fmt: skip
        base_log, finished = _run(base_cmd, "hang@70:1", args.cap + 30)
        base = _measure(base_log, r".*(?:failed|restart)")
    step = ft["median_step"]
    target = 5 * step + CHECK_INTERVAL
    in_force = re.findall(r"Section 'step' has been open for [\d.]+ seconds. Timeout is ([\d.]+) seconds", ft_log)
    timeout = f"{float(in_force[0]):.2f} s" if in_force else "?"
    print(f"median step {step:.3f} s; learned step timeout in force {timeout}; check interval {CHECK_INTERVAL:.1f} s")
    print("| setup | detection latency | recovery (hang -> first step after restart) |")
    print("|---|---|---|")
    print(f"| ft_launcher + calc_ft_timeouts | {_secs(ft.get('detect'))} | {_secs(ft.get('recover'))} |")
    base_detect = _secs(base.get("detect"), f"not detected within {args.cap:.0f} s")
    print(f"| torchrun --max-restarts=1 | {base_detect} | {_secs(base.get('recover'), 'never')} |")
    detect = ft.get("detect")
    if detect is not None:
        print(f"RATIO detection / (5 x median step + check interval) = {detect / target:.2f} (target <= 1.0)")
    _emit(ft, base, target, args.cap)


def _emit(ft: dict, base: dict, target: float, cap: float) -> None:
    """The result lines: detection latency against its target, and recovery against the torchrun baseline."""
    detect = ft.get("detect")
    emit_result(
        "hang_detection", "detection latency / (5 x median step + check interval)",
        None if detect is None else detect / target, _secs(detect, "not detected") + " (ft_launcher, learned timeouts)",
        f"{target:.2f} s (5 x {ft['median_step']:.3f} s step + {CHECK_INTERVAL:.1f} s check interval)", "<= 1.0",
    )  # fmt: skip
    recover, base_recover = ft.get("recover"), base.get("recover")
    emit_result(
        "hang_detection", "recovery after a hang: ft_launcher / torchrun --max-restarts=1",
        None if recover is None or base_recover is None else recover / base_recover,
        _secs(recover, "never") + " (ft_launcher)",
        _secs(base_recover, f"never within {cap:.0f} s") + " (torchrun --max-restarts=1)",
    )  # fmt: skip


def _secs(value: float | None, missing: str = "n/a") -> str:
    return missing if value is None else f"{value:.2f} s"


if __name__ == "__main__":
    main()
