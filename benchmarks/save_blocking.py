"""Blocking time of sync vs async checkpoint saves, measured in the same run, printed as a ratio.

Trains the GPT recipe twice on 2 ranks (same model, same save schedule), once with ``checkpoint.async_save=false``
and once with ``true``, and reads rank 0's log. A sync save blocks training for its whole duration; an async save
blocks while it is scheduled and again while it is committed (hashing + manifest + rename) after the background
write finished. The first save of a run is reported separately (one-time process start-up).

    python benchmarks/save_blocking.py [--hidden-size 512 --num-layers 4 --saves 6]

Target: async blocking <= 10% of sync blocking.
"""

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _result import emit_result

REPO = Path(__file__).resolve().parents[1]
_SYNC = re.compile(r"\[rank0\].*saved checkpoint at iteration (\d+) .*\(blocking ([\d.]+) s\)")
_SCHED = re.compile(r"\[rank0\].*Scheduling async checkpoint save at iteration (\d+) .*\(blocking ([\d.]+) s\)")
_FINAL = re.compile(r"\[rank0\].*finalized async checkpoint save at iteration (\d+) \(commit ([\d.]+) s\)")


def _train(ckpt: Path, async_save: bool, args: argparse.Namespace) -> str:
    iters = args.saves * args.interval
    cmd = [
        sys.executable, "-m", "megatron.bridge.launch", "--standalone", "--nproc-per-node=2",
        str(REPO / "examples" / "pretrain_tiny_gpt.py"),
        f"checkpoint.save={ckpt}", f"checkpoint.save_interval={args.interval}", "checkpoint.most_recent_k=2",
        f"checkpoint.async_save={str(async_save).lower()}", f"train.train_iters={iters}",
        f"model.hidden_size={args.hidden_size}", f"model.num_layers={args.num_layers}",
        f"model.num_attention_heads={args.hidden_size // 64}", "logger.log_interval=1000",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        sys.exit(f"training failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return out.stdout + out.stderr


def _per_save(pattern: re.Pattern, log: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in pattern.finditer(log)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--interval", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sync_log = _train(Path(tmp) / "sync", False, args)
        async_log = _train(Path(tmp) / "async", True, args)
        size_mb = sum(f.stat().st_size for f in (Path(tmp) / "sync").glob("iter_*/**/*") if f.is_file()) / 2**20
    sync = _per_save(_SYNC, sync_log)
    sched, final = _per_save(_SCHED, async_log), _per_save(_FINAL, async_log)
    first = min(sync)
    sync_steady = [t for it, t in sync.items() if it != first]
    async_steady = [sched[it] + final.get(it, 0.0) for it in sched if it != first]
    s, a = statistics.median(sync_steady), statistics.median(async_steady)
    print(f"model hidden={args.hidden_size} layers={args.num_layers}; {size_mb / 2:.1f} MiB per checkpoint")
    first_async = sched[first] + final[first]
    print(f"first save (process start-up included): sync {sync[first]:.3f} s, async {first_async:.3f} s")
    print(f"steady-state blocking, median of {len(sync_steady)} saves:")
    print(f"  sync : {s:.3f} s")
    print(
        f"  async: {a:.3f} s (schedule {statistics.median(sched[i] for i in sched if i != first):.3f} s"
        f" + commit {statistics.median(final[i] for i in final if i != first):.3f} s)"
    )
    print(f"RATIO async/sync blocking = {a / s:.3f} (target <= 0.10)")
    emit_result(
        "save_blocking", "async / sync save blocking (steady state, median)", a / s,
        f"{a:.3f} s (async save)", f"{s:.3f} s (sync save)", "<= 0.10",
    )  # fmt: skip


if __name__ == "__main__":
    main()
