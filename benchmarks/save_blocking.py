"""Time the training thread spends on sync vs async checkpoint saves, measured in the same run, printed as a ratio.

Trains the GPT recipe three times on 2 ranks (same model, same save schedule): with ``checkpoint.async_save=false``,
with ``true``, and with ``true`` and megatron-core's save plan cached (``checkpoint.ckpt_assume_constant_structure``).
What each run's training thread spent on saves is read from rank 0's own accounting, not from its log: goodput's
``checkpoint_save`` time (``<checkpoint.save>/goodput/summary.json``), which counts every moment the loop is blocked
on a save: the save calls (for an async save: the wait for the previous one to finish and
commit, then the scheduling), the commit after the step where every rank finished writing (whether they did travels
in the step's one agreement all-reduce), and the wait for the last save when training closes. The event stream's
``checkpoint_saved`` events (``seconds``: the loop's time in one save call) split it into the save calls and the
rest (commits and the wait at close). Every save of the run counts, the first one (async: the writer's
start-up) included.

    python benchmarks/save_blocking.py [--hidden-size 512 --num-layers 4 --saves 6 --interval 3]

Targets: the async run's time on saves <= 10% of the sync run's; with the plan cached <= 5%.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from _result import emit_result

from megatron.bridge.training.event_stream import EventKind, read_file, worker_file

REPO = Path(__file__).resolve().parents[1]
NAME = "save_blocking"


@dataclass(frozen=True)
class SaveTime:
    """What one run's training thread (rank 0) spent on checkpoint saves.

    Attributes:
        total_s: all of it (goodput's ``checkpoint_save``).
        calls_s: the save calls (``checkpoint_saved`` events' ``seconds``), by iteration.
    """

    total_s: float
    calls_s: dict[int, float]

    @property
    def saves(self) -> int:
        return len(self.calls_s)

    @property
    def rest_s(self) -> float:
        """Commits and the wait at close: what the save calls leave of the total."""
        return self.total_s - sum(self.calls_s.values())


def _train(ckpt: Path, async_save: bool, args: argparse.Namespace, cached_plan: bool = False) -> SaveTime:
    iters = args.saves * args.interval
    events = ckpt.parent / f"{ckpt.name}-events"
    cmd = [
        sys.executable, "-m", "megatron.bridge.launch", "--standalone", "--nproc-per-node=2",
        str(REPO / "examples" / "pretrain_tiny_gpt.py"),
        f"checkpoint.save={ckpt}", f"checkpoint.save_interval={args.interval}", "checkpoint.most_recent_k=2",
        f"checkpoint.async_save={str(async_save).lower()}", f"train.train_iters={iters}",
        f"model.hidden_size={args.hidden_size}", f"model.num_layers={args.num_layers}",
        f"model.num_attention_heads={args.hidden_size // 64}", "logger.log_interval=1000",
        f"health.event_dir={events}", f"checkpoint.ckpt_assume_constant_structure={str(cached_plan).lower()}",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    if out.returncode != 0:
        sys.exit(f"training failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    summary = json.loads((ckpt / "goodput" / "summary.json").read_text())
    found, problems = read_file(str(events / worker_file(0)))
    if problems:
        sys.exit(f"unreadable events of rank 0: {problems[:3]}")
    calls = {
        e.iteration: e.seconds
        for e in found
        if e.kind == EventKind.CHECKPOINT_SAVED and e.tier == "global" and e.seconds is not None
    }
    if len(calls) != args.saves:
        sys.exit(f"{len(calls)} global saves in rank 0's events, expected {args.saves}: {sorted(calls)}")
    return SaveTime(float(summary["lost_s"]["checkpoint_save"]), calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--interval", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sync = _train(Path(tmp) / "sync", False, args)
        async_ = _train(Path(tmp) / "async", True, args)
        cached = _train(Path(tmp) / "cached", True, args, cached_plan=True)
        size_mb = sum(f.stat().st_size for f in (Path(tmp) / "sync").glob("iter_*/**/*") if f.is_file()) / 2**20
    print(f"model hidden={args.hidden_size} layers={args.num_layers}; {size_mb / 2:.1f} MiB per checkpoint")
    print(f"time rank 0's training thread spent on saves, {args.saves} saves every {args.interval} steps:")
    print("| run | total | save calls | commits + wait at close | first save call | other save calls |")
    print("|---|---|---|---|---|---|")
    for name, run in (("sync", sync), ("async", async_), ("async, cached plan", cached)):
        first = min(run.calls_s)
        others = sum(t for it, t in run.calls_s.items() if it != first)
        print(
            f"| {name} | {run.total_s:.3f} s | {sum(run.calls_s.values()):.3f} s | {run.rest_s:.3f} s | "
            f"{run.calls_s[first]:.3f} s | {others:.3f} s |"
        )
    print(
        "(the save calls as the event stream times them also hold the bookkeeping after a save, goodput's own progress "
        "record among it, which goodput's count leaves out: a few ms per save, hence a sync run's small negative rest)"
    )
    ratio = async_.total_s / sync.total_s
    print(f"RATIO async/sync time on saves = {ratio:.3f} (target <= 0.10)")
    emit_result(
        NAME, "async / sync: training thread's time on saves (all of the run's saves)", ratio,
        f"{async_.total_s:.3f} s (async: save calls {sum(async_.calls_s.values()):.3f} s + commits and wait at close "
        f"{async_.rest_s:.3f} s; {async_.saves} saves)",
        f"{sync.total_s:.3f} s (sync, {sync.saves} saves)", "<= 0.10",
    )  # fmt: skip
    emit_result(
        NAME, "async with the save plan cached / sync: training thread's time on saves", cached.total_s / sync.total_s,
        f"{cached.total_s:.3f} s (checkpoint.ckpt_assume_constant_structure: save calls "
        f"{sum(cached.calls_s.values()):.3f} s + commits and wait at close {cached.rest_s:.3f} s)",
        f"{sync.total_s:.3f} s (sync, {sync.saves} saves)", "<= 0.05",
    )  # fmt: skip


if __name__ == "__main__":
    main()
