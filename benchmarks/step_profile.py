"""Where a training step's time goes: each resiliency feature's cost per step, from a sampling profiler.

Runs the CPU Llama recipe with every resiliency feature on (the same run as ``llama_throughput.py``'s framework
loop: async global saves, local-tier saves, liveness ping and hang attribution, straggler detection, the re-run state
machine validating results, the exit-signal handler) on 2 ranks under ``py-spy record --idle --subprocesses``, and
attributes every sample of the ranks' training loop (``training/train.py:train``) to the feature whose code it is
in. Idle samples count: a rank waiting in a collective a feature added is time that feature costs.

A sample belongs to the innermost feature frame of its stack, unless the stack goes on into the model's work (the
forward and backward, the optimizer step), which is then what it is. Prints one row per feature: microseconds per
step (per rank, averaged over the run; a save's cost is spread over all steps) and the share of the loop, and a
``BENCHMARK_RESULT`` line for the framework's share outside the model's work (``target`` is issue 33's 2 %).

    python benchmarks/step_profile.py [--steps 60] [--rate 200]

Needs ``py-spy`` (in the dev extra) and ptrace permission over the ranks (a container may need ``CAP_SYS_PTRACE``);
without it the result says it was not tried.
"""

import argparse
import collections
import shutil
import sys
import tempfile
from pathlib import Path

from _process import run_or_exit
from _result import emit_result, format_not_tried

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
ANCHOR = "train (bridge/training/train.py"
"""The training loop's frame: only samples below it are counted."""

WORK = (
    ("forward_step (bridge/training/gpt_step.py", "model forward"),
    ("backward_step (core/pipeline_parallel/schedules.py", "model backward"),
    ("finalize_model_grads (core/distributed/finalize_model_grads.py", "gradient all-reduce"),
    ("step (core/optimizer/", "optimizer step"),
    ("decorate_context (torch/utils/_contextlib.py", "optimizer step"),
)
"""Frames that are the model's and optimizer's own work: everything below them is that work."""

FEATURES = (
    ("get_batch", "data: next batch (workers, collation)"),
    ("train_step (bridge/training/train.py", "loop: step bookkeeping (zero grads, learning rate, metrics)"),
    ("SavePath.finalize (bridge/training/checkpoint/saving.py", "async saves: commit when done"),
    ("agree_after_step (bridge/training/train.py", "the step's one agreement all-reduce (stop flags, saves in flight)"),
    (
        "RerunController.passes (bridge/training/health/rerun.py",
        "re-run state machine: per-step agreement, RNG snapshot",
    ),
    ("RerunController.end_step (bridge/training/health/rerun.py", "re-run state machine: step verdict"),
    ("check_losses", "loss checks (NaN/Inf/spike)"),
    ("wrap_forward_step.<locals>.timed_forward_step", "straggler detection: forward timing"),
    ("_StepHolder.__call__ (bridge/training/nvrx_straggler.py", "straggler detection: step timing"),
    ("StragglerCallback", "straggler detection: per-step check and reports"),
    ("StepFaults", "fault injection hooks"),
    ("FaultInjection", "fault injection hooks"),
    ("EventRecorder", "event stream"),
    ("FaultToleranceCallback", "fault tolerance sections (heartbeats)"),
    ("HangWatchCallback", "hang attribution watch"),
    ("LivenessCallback", "liveness ping"),
    ("GoodputCallback", "goodput: step and save accounting"),
    ("GoodputTracker.progress", "goodput: progress record (log interval)"),
    ("reduce_losses (bridge/training/losses.py", "loss reduction for logging (log interval)"),
    ("MetricsWriter", "metrics: log lines and TensorBoard (log interval)"),
    ("SavePath.save_local (bridge/training/checkpoint/saving.py", "local-tier saves: blocking part"),
    ("SavePath.save (bridge/training/checkpoint/saving.py", "global saves: blocking part"),
    ("GarbageCollectionCallback", "garbage collection: one collection and freeze at the start (once)"),
    ("_fire (bridge/training/train.py", "callbacks: dispatch"),
)
"""(frame substring, feature): the first match of a frame names its feature."""


def attribute(lines: list[str]) -> tuple[collections.Counter, int]:
    """Samples per feature (or work) from py-spy's raw lines, and the samples of the loop in all."""
    counts: collections.Counter = collections.Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        start = next((i for i, frame in enumerate(frames) if frame.startswith(ANCHOR)), None)
        if start is None or not count.isdigit():
            continue
        owner = "loop: the rest (step counters, exit checks, save decisions)"
        for frame in frames[start + 1 :]:
            work = next((name for key, name in WORK if key in frame), None)
            if work is not None:
                owner = work
                continue
            owner = next((name for key, name in FEATURES if key in frame), owner)
        counts[owner] += int(count)
        total += int(count)
    return counts, total


def _profile(steps: int, rate: int, tmp: Path, extra: list[str]) -> list[str]:
    py = sys.executable
    jsonl, prefix = tmp / "corpus.jsonl", tmp / "corpus"
    run_or_exit([py, "-m", "megatron.bridge.data.offline_corpus", "--output", str(jsonl), "--max-bytes", "3000000"],
                REPO, 120, "offline corpus")  # fmt: skip
    tokenizer = ["--tokenizer-metadata", '{"library": "byte-level"}', "--append-eod"]
    preprocess = [py, "-m", "megatron.bridge.data.preprocess", "--input", str(jsonl), "--output-prefix", str(prefix)]
    run_or_exit([*preprocess, *tokenizer], REPO, 180, "preprocess")
    sys.path.insert(0, str(BENCH))
    from llama_throughput import RECIPE, _framework_overrides  # the same run as the throughput benchmark's

    args = argparse.Namespace(steps=steps, save_interval=30, local_interval=10, ping_interval=10)
    overrides = [*_framework_overrides(str(prefix), tmp / "run", tmp / "local", args), *extra]
    raw = tmp / "profile.txt"
    cmd = [
        "py-spy", "record", "--idle", "--subprocesses", "--format", "raw", "--rate", str(rate), "-o", str(raw), "--",
        py, "-m", "megatron.bridge.launch", "--standalone", "--nproc-per-node=2",
        str(BENCH / "_recipe_run_timed.py"), RECIPE, *overrides,
    ]  # fmt: skip
    run_or_exit(cmd, REPO, 900, "the profiled training run")
    return raw.read_text().splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps of the profiled run")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second per process")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="one more config override")
    args = parser.parse_args()
    if shutil.which("py-spy") is None:
        print(format_not_tried("step_profile", "framework share of the step", "py-spy is not installed"))
        return
    with tempfile.TemporaryDirectory() as tmp:
        counts, total = attribute(_profile(args.steps, args.rate, Path(tmp), args.override))
    if not total:
        print(format_not_tried("step_profile", "framework share of the step", "no sample of the training loop"))
        return
    per_step_us = 1e6 / (args.rate * 2 * args.steps)  # two ranks, each sampled at ``rate``
    work = {name for _, name in WORK}
    print(f"{'feature':<62} {'us/step':>9} {'share':>7}")
    for name, n in counts.most_common():
        print(f"{name:<62} {n * per_step_us:9.0f} {100 * n / total:6.1f}%")
    framework = sum(n for name, n in counts.items() if name not in work)
    model = total - framework
    print(f"{'loop in all':<62} {total * per_step_us:9.0f}")
    emit_result(
        "step_profile",
        "framework time outside the model's work / the model's work (sampled, idle waits included)",
        framework / model if model else None,
        f"{framework * per_step_us:.0f} us/step outside the model's work",
        f"{model * per_step_us:.0f} us/step of forward, backward, gradient all-reduce, optimizer step",
        "<= 0.02",
    )


if __name__ == "__main__":
    main()
