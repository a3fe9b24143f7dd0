"""What save retries cost a global save that never fails: retries on (``checkpoint.save_retries=3``) against off (0).

Trains the GPT example on 2 ranks with synchronous global saves, alternating runs with retries on and off (on, off,
on, off, ... so that drift in the machine's load falls on both alike). Nothing fails, so a retry never happens: what
is measured is the bookkeeping around each attempt. Each save's time is the loop's time in it, from rank 0's
``checkpoint_saved`` events (never the log); the first save of a run (its plan exchange, the writer's start) is left
out. The figure is the median over every steady save of every run of a mode.

Printed: one line per run and the ratio retries-on / retries-off (goal 1.0; target <= 1.05).

    python benchmarks/save_retry_overhead.py [--hidden-size 512 --num-layers 4 --saves 6 --interval 2 --rounds 2]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _result import emit_result
from save_blocking import saves_of

from megatron.bridge.training.events.reader import read_file
from megatron.bridge.training.events.stream import worker_file

REPO = Path(__file__).resolve().parents[1]
NAME = "save_retry_overhead"
TARGET = "<= 1.05"


def _train(tmp: Path, name: str, retries: int, args: argparse.Namespace) -> list[float]:
    """One run; the loop's seconds in each of its steady global saves."""
    ckpt, events = tmp / name, tmp / f"{name}-events"
    iters = args.saves * args.interval
    cmd = [
        sys.executable, "-m", "megatron.bridge.launch", "--standalone", "--nproc-per-node=2",
        str(REPO / "examples" / "pretrain_tiny_gpt.py"), f"checkpoint.save={ckpt}",
        f"checkpoint.save_interval={args.interval}", "checkpoint.most_recent_k=2", "checkpoint.async_save=false",
        f"checkpoint.save_retries={retries}", f"train.train_iters={iters}",
        f"model.hidden_size={args.hidden_size}", f"model.num_layers={args.num_layers}",
        f"model.num_attention_heads={args.hidden_size // 64}", "logger.log_interval=1000",
        f"health.event_dir={events}",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    if out.returncode != 0:
        sys.exit(f"training failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    found, problems = read_file(str(events / worker_file(0)))
    if problems:
        sys.exit(f"unreadable events of rank 0: {problems[:3]}")
    saves = [s for s in saves_of(found, "global", asynchronous=False) if s.steady]
    if len(saves) < args.saves - 1:
        sys.exit(f"{name}: {len(saves)} steady global saves in rank 0's events, expected {args.saves - 1}")
    return [s.blocking_s for s in saves]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating")
    args = parser.parse_args()
    times: dict[int, list[float]] = {3: [], 0: []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for retries in times:
                name = f"retries{retries}-{round_}"
                run = _train(Path(tmp), name, retries, args)
                times[retries] += run
                print(f"{name}: median save {statistics.median(run) * 1000:.1f} ms over {len(run)} saves", flush=True)
    on, off = statistics.median(times[3]), statistics.median(times[0])
    print(f"RATIO save with retries on / off = {on / off:.3f} (target {TARGET})")
    emit_result(
        NAME, "sync global save, save_retries=3 / save_retries=0 (no failure; median, steady state)", on / off,
        f"{on * 1000:.1f} ms ({len(times[3])} saves, retries on)", f"{off * 1000:.1f} ms ({len(times[0])} saves, off)",
        TARGET,
    )  # fmt: skip


if __name__ == "__main__":
    main()
