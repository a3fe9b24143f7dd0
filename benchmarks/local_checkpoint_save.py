"""Blocking save time of the local checkpoint tier vs the global tier, measured in the same training run.

Trains the GPT recipe on 2 ranks with synchronous saves of both tiers: a global checkpoint every ``--interval``
iterations and a local one at every other iteration (a global save replaces the local one at its step). Reads rank
0's log and prints the median blocking time of each tier and the ratio global / local. The first save of each tier is
left out (one-time process and directory start-up).

A global save writes megatron-core ``torch_dist`` files into a temporary directory, hashes them, writes the manifest
and commits with renames and fsyncs. A local save writes one ``torch.save`` file per rank (plus replicas with
``--replication``) into node-local storage (``/dev/shm`` when present) after hashing its tensors in memory.

    python benchmarks/local_checkpoint_save.py [--hidden-size 512 --num-layers 4 --saves 6 --replication]

Target: local at least 5x faster (ratio >= 5).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _result import emit_result

REPO = Path(__file__).resolve().parents[1]
_GLOBAL = re.compile(r"\[rank0\].*saved checkpoint at iteration (\d+) .*\(blocking ([\d.]+) s\)")
_LOCAL = re.compile(r"\[rank0\].*saved local checkpoint at iteration (\d+) .*\(blocking ([\d.]+) s\)")


def _train(tmp: Path, local_root: Path, args: argparse.Namespace) -> str:
    cmd = [
        sys.executable, "-m", "megatron.bridge.launch", "--standalone", "--nproc-per-node=2",
        str(REPO / "examples" / "pretrain_tiny_gpt.py"),
        f"checkpoint.save={tmp / 'global'}", f"checkpoint.load={tmp / 'global'}",
        f"checkpoint.save_interval={args.interval}", "checkpoint.most_recent_k=2",
        "checkpoint.non_persistent_ckpt_type=local", "checkpoint.non_persistent_save_interval=1",
        f"checkpoint.non_persistent_local_ckpt_dir={local_root}", f"checkpoint.replication={args.replication}",
        *(["checkpoint.replication_jump=1"] if args.replication else []),
        f"train.train_iters={args.saves * args.interval}", f"model.hidden_size={args.hidden_size}",
        f"model.num_layers={args.num_layers}", f"model.num_attention_heads={args.hidden_size // 64}",
        "logger.log_interval=1000",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if out.returncode != 0:
        sys.exit(f"training failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return out.stdout + out.stderr


def _steady(pattern: re.Pattern, log: str) -> list[float]:
    times = {int(m.group(1)): float(m.group(2)) for m in pattern.finditer(log)}
    if len(times) < 2:
        sys.exit(f"too few saves matched {pattern.pattern!r}:\n{log[-3000:]}")
    first = min(times)
    return [t for it, t in times.items() if it != first]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--saves", type=int, default=6, help="global saves; local ones fill the steps between")
    parser.add_argument("--interval", type=int, default=3, help="checkpoint.save_interval")
    parser.add_argument("--replication", action="store_true", help="replicate local shards between the 2 ranks")
    args = parser.parse_args()
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as loc:
        log = _train(Path(tmp), Path(loc), args)
        size_mb = sum(f.stat().st_size for f in (Path(tmp) / "global").glob("iter_*/**/*") if f.is_file()) / 2**20
    glob_t, local_t = _steady(_GLOBAL, log), _steady(_LOCAL, log)
    g, loc_median = statistics.median(glob_t), statistics.median(local_t)
    where = "/dev/shm" if shm.is_dir() else "the temporary directory"
    print(f"model hidden={args.hidden_size} layers={args.num_layers}; {size_mb / 2:.1f} MiB per global checkpoint")
    print(f"global tier: median blocking {g:.3f} s over {len(glob_t)} saves (temporary directory on disk)")
    print(
        f"local tier : median blocking {loc_median:.3f} s over {len(local_t)} saves ({where}"
        f"{', replicated' if args.replication else ''})"
    )
    print(f"RATIO global/local blocking = {g / loc_median:.1f} (target >= 5)")
    emit_result(
        "local_checkpoint_save", "global / local save blocking (speed-up of the local tier)", g / loc_median,
        f"{loc_median:.3f} s (local save)", f"{g:.3f} s (global save)", ">= 5",
    )  # fmt: skip


if __name__ == "__main__":
    main()
