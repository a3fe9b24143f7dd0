"""Time the training loop is blocked by one checkpoint save, sync vs async, per tier, measured in the same run.

Trains the GPT example on 2 ranks five times with the same model and save schedule: global saves synchronous,
asynchronous, and asynchronous with megatron-core's save plan cached (``checkpoint.ckpt_assume_constant_structure``);
then local-tier saves (``checkpoint.non_persistent_ckpt_type=local``) synchronous and asynchronous. Each run's numbers
come from rank 0's event stream, never from its log:

- a save's *call* is the loop's time in the save (``checkpoint_saved``'s ``seconds``): the whole save when it is
  synchronous; the state dict, the plan and the writer's start when it is asynchronous;
- an asynchronous save is also *committed* by the loop, a few steps later, after the step where every rank finished
  writing: the loop's time in that finalize (``finalize_seconds``);
- blocking per save = call + commit. Steady state: the first save (the writer's start-up, the plan's first
  exchange) and a save still in flight when training ends (the loop then waits for all of it) are left out. The
  figure is the median over the remaining saves. On a machine without spare cores (2 cores, 2 ranks) the background
  writer also slows the steps it overlaps (its serialization and hashing run on the rank's cores; a writer forked per
  save also makes the first step after the fork pay copy-on-write faults on every page it writes, which the
  persistent CPU writer avoids): that is not blocking; each run's median step time
  and how much longer the step right after a save ran are printed beside.

Printed: a table of every save, and one ratio per asynchronous mode against the synchronous save of the same tier.

    python benchmarks/save_blocking.py [--hidden-size 512 --num-layers 4 --saves 8 --interval 3]

Targets (issue 33): async global save blocking <= 5 % of a synchronous one (the cached plan); the local tier is
reported the same way.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from _result import emit_result

from megatron.bridge.training.events.reader import read_file
from megatron.bridge.training.events.stream import Event, EventKind, worker_file

REPO = Path(__file__).resolve().parents[1]
NAME = "save_blocking"
TARGET = "<= 0.05"


@dataclass(frozen=True)
class Save:
    """One save of a run, as the loop felt it (seconds)."""

    iteration: int
    call_s: float
    commit_s: Optional[float]
    """The loop's time in the finalize that committed it (``finalize_seconds``; ``None``: synchronous, the commit is
    in the call)."""
    steady: bool
    """Neither the run's first save nor one committed after the last step."""

    @property
    def blocking_s(self) -> float:
        return self.call_s + (self.commit_s or 0.0)


def saves_of(events: list[Event], tier: str, asynchronous: bool) -> list[Save]:
    """The saves of ``tier`` in rank 0's ``events``."""
    events = sorted(events, key=lambda e: (e.time, e.mono or 0.0))
    last_step = max((e.time for e in events if e.kind == EventKind.STEP_COMPLETED), default=float("inf"))
    saved = [e for e in events if e.kind == EventKind.CHECKPOINT_SAVED and e.tier == tier and e.seconds is not None]
    first = min((e.iteration for e in saved), default=None)
    found = []
    for e in saved:
        at_close = asynchronous and e.time > last_step  # committed by the wait when training ends
        commit = e.finalize_seconds if asynchronous else None
        found.append(Save(e.iteration, e.seconds, commit, steady=e.iteration != first and not at_close))
    return found


def _train(tmp: Path, name: str, args: argparse.Namespace, *, asynchronous: bool, tier: str, cached: bool = False):
    ckpt, events = tmp / name, tmp / f"{name}-events"
    iters = args.saves * args.interval + 2  # two steps after the last save: its commit happens in the loop
    schedule = [f"checkpoint.save_interval={args.interval}"]
    if tier == "local":
        schedule = [
            f"checkpoint.save_interval={10 * iters}", f"checkpoint.load={ckpt}",
            "checkpoint.non_persistent_ckpt_type=local",
            f"checkpoint.non_persistent_save_interval={args.interval}",
            f"checkpoint.non_persistent_local_ckpt_dir={tmp / f'{name}-local'}",
        ]  # fmt: skip
    cmd = [
        sys.executable, "-m", "megatron.bridge.launch", "--standalone", "--nproc-per-node=2",
        str(REPO / "examples" / "pretrain_tiny_gpt.py"), f"checkpoint.save={ckpt}", *schedule,
        "checkpoint.most_recent_k=2", f"checkpoint.async_save={str(asynchronous).lower()}",
        f"train.train_iters={iters}",
        f"model.hidden_size={args.hidden_size}", f"model.num_layers={args.num_layers}",
        f"model.num_attention_heads={args.hidden_size // 64}", "logger.log_interval=1000",
        f"health.event_dir={events}", f"checkpoint.ckpt_assume_constant_structure={str(cached).lower()}",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    if out.returncode != 0:
        sys.exit(f"training failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    found, problems = read_file(str(events / worker_file(0)))
    if problems:
        sys.exit(f"unreadable events of rank 0: {problems[:3]}")
    saves = saves_of(found, tier, asynchronous)
    if len([s for s in saves if s.iteration % args.interval == 0]) < args.saves:
        sys.exit(f"{name}: {len(saves)} {tier} saves in rank 0's events, expected {args.saves}")
    return saves, next_step_cost(found, {s.iteration for s in saves})


def next_step_cost(events: list[Event], saved: set[int]) -> tuple[float, float]:
    """The median step time (the loop's own, ``step_completed``'s ``seconds``) of the steps not right after a save,
    and the median of how much longer the step right after a save ran (the writer's CPU work on the rank's cores, and
    copy-on-write after a writer's fork: not blocking, but the loop pays it)."""
    times = {e.iteration: e.seconds for e in events if e.kind == EventKind.STEP_COMPLETED and e.seconds is not None}
    base = statistics.median(t for it, t in times.items() if it > 2 and it - 1 not in saved)
    after = [times[it + 1] - base for it in saved if it + 1 in times]
    return base, statistics.median(after) if after else 0.0


def _median_blocking(saves: list[Save]) -> float:
    return statistics.median(s.blocking_s for s in saves if s.steady)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--saves", type=int, default=8)
    parser.add_argument("--interval", type=int, default=3)
    args = parser.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        modes = (
            ("global sync", False, "global", False), ("global async", True, "global", False),
            ("global async, cached plan", True, "global", True),
            ("local sync", False, "local", False), ("local async", True, "local", False),
        )  # fmt: skip
        for i, (name, asynchronous, tier, cached) in enumerate(modes, 1):
            print(f"[{i}/{len(modes)}] {name} ...", flush=True)
            runs[name] = _train(Path(tmp), f"run{i}", args, asynchronous=asynchronous, tier=tier, cached=cached)
        size_mb = sum(f.stat().st_size for f in (Path(tmp) / "run1").glob("iter_*/**/*") if f.is_file()) / 2**20
    print(f"model hidden={args.hidden_size} layers={args.num_layers}; {size_mb / 2:.1f} MiB per checkpoint")
    print(f"rank 0's loop blocked per save (s), {args.saves} saves every {args.interval} steps; * = steady state")
    print(
        "| run | step | next step + | "
        + " | ".join(f"it {s.iteration}" for s in runs["global sync"][0])
        + " | median |"
    )
    for name, (saves, (base, after)) in runs.items():
        cells = [
            f"{s.call_s:.3f}" + (f"+{s.commit_s:.3f}" if s.commit_s is not None else "") + ("*" if s.steady else "")
            for s in saves
        ]
        print(f"| {name} | {base:.3f} | {after:.3f} | " + " | ".join(cells) + f" | {_median_blocking(saves):.3f} |")
    for tier in ("global", "local"):
        sync = _median_blocking(runs[f"{tier} sync"][0])
        for mode in [m for m in runs if m.startswith(f"{tier} async")]:
            saves = runs[mode][0]
            steady = [s for s in saves if s.steady]
            value = _median_blocking(saves)
            call = statistics.median(s.call_s for s in steady)
            commit = statistics.median(s.commit_s or 0.0 for s in steady)
            print(f"RATIO {mode} / sync = {value / sync:.3f} (target {TARGET})")
            emit_result(
                NAME, f"{mode} / sync: loop blocked per save (median, steady state)", value / sync,
                f"{value * 1000:.1f} ms (call {call * 1000:.1f} ms + commit {commit * 1000:.1f} ms; "
                f"{len(steady)} saves)",
                f"{sync * 1000:.1f} ms ({tier} sync save)", TARGET,
            )  # fmt: skip
            base, after = runs[mode][1]
            emit_result(
                NAME, f"{mode}: the step right after a save, extra time / median step", after / base,
                f"{after * 1000:.1f} ms more (the writer's CPU work)", f"{base * 1000:.1f} ms step",
            )  # fmt: skip


if __name__ == "__main__":
    main()
