"""Tokens/s of the CPU Llama recipe trained by the framework with its resiliency features on vs a plain megatron-core
loop, and the share of step time spent waiting for data, measured in the same invocation.

1. A small real corpus is made offline (``megatron.bridge.data.offline_corpus`` + ``preprocess``, byte-level).
2. Framework: ``llama3_tiny_pretrain_config`` trained on 2 ranks by ``python -m megatron.bridge.launch`` (torchrun)
   through ``_recipe_run_timed.py`` (``megatron.bridge.recipes.run`` unchanged, but every ``next(data_iterator)`` of
   the forward step timed), with every resiliency feature on that works under plain torchrun: async global
   checkpoints, async local-tier checkpoints (``/dev/shm``), liveness ping + hang attribution, goodput, the re-run
   state machine (``validate_results``: NaN checks), NVRx straggler detection, the exit-signal handler. Not on:
   fault tolerance (needs ft_launcher) and in-process restart (refused with ``train.exit_signal_handler``).
3. Plain: ``_plain_mcore_loop.py`` under ``torch.distributed.run``: the same provider, hyperparameters, data files
   and loader, DP 2 with the distributed optimizer, in a bare ``get_forward_backward_func()`` + ``optimizer.step()``
   loop (no checkpoints, no resiliency code, no callbacks); on CPU each rank is pinned to its share of the cores,
   as the framework pins its ranks (``initialize.bind_cpu_cores``).
4. The two alternate for ``--rounds`` rounds (framework first in odd rounds, plain first in even ones). Both log
   ``iteration N/M | ... | step time X s`` on rank 0; the first ``--warmup`` steps of each run are skipped. Tokens/s
   = global batch x sequence length / mean step time over the kept steps of a run. The overhead is the median over
   the rounds of each round's 1 - framework/plain tokens/s. Also printed: the same from
   the wall time between consecutive log lines (everything between steps included: callbacks, logging, blocking
   parts of saves) and the framework's steps right after a save vs the others.

Data wait = time in ``next(data_iterator)`` (both runs time it the same way) / step time, over the kept steps,
the larger of the two ranks. Goals: overhead = 1 - framework/plain tokens/s <= 2 % from the logged step time and
<= 3 % from the wall time between log lines; framework data wait <= 2 %.
A whole run takes about 3-4 minutes on a 2-core machine; every subprocess has a timeout.

    python benchmarks/llama_throughput.py [--steps 200 --warmup 5 --rounds 3 --save-interval 30 --local-interval 10]
"""

import argparse
import datetime as dt
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _process import run_or_exit
from _result import emit_result

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RECIPE = "llama3_tiny_pretrain_config"
WAITS_ENV = "LLAMA_THROUGHPUT_WAITS"  # as in _plain_mcore_loop.py (not imported: the driver stays free of torch)
OVERHEAD_GOAL, WALL_OVERHEAD_GOAL, WAIT_GOAL = 0.02, 0.03, 0.02
_STEP = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank0\] INFO \S+: iteration (\d+)/\d+ \| consumed samples (\d+) \|"
    r".*\| step time ([\d.]+) s$",
    re.M,
)
_HEADER = re.compile(r"\[rank0\] INFO plain_mcore_loop: recipe \S+: (.*seq length (\d+).*)$", re.M)
_SAVE = re.compile(r"\[rank0\] .*Scheduling async (?:local )?checkpoint(?: save)? at iteration (\d+)")
_DEVICE = re.compile(r"\[rank0\] .*initialized (\w+) on (\w+)")


@dataclass
class Run:
    """One training run's rank-0 step lines and per-rank data waits."""

    name: str
    seconds: float
    steps: dict[int, float] = field(default_factory=dict)
    """Logged step time by iteration."""
    stamps: dict[int, dt.datetime] = field(default_factory=dict)
    """Time of each iteration's log line."""
    samples: dict[int, int] = field(default_factory=dict)
    waits: list[list[float]] = field(default_factory=list)
    """Per rank: the seconds of every ``next(data_iterator)``, in order."""
    saves: list[int] = field(default_factory=list)
    log: str = ""


def _run(cmd: list[str], timeout: float, waits_dir: Path) -> tuple[str, float]:
    """Run ``cmd`` from the repository root; its output and wall time. Exits the benchmark when it fails."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", WAITS_ENV: str(waits_dir)}
    start = time.monotonic()
    out = run_or_exit(cmd, REPO, timeout, " ".join(cmd), env=env)
    return out, time.monotonic() - start


def _parse(name: str, log: str, seconds: float, waits_dir: Path) -> Run:
    run = Run(name, seconds, log=log)
    for m in _STEP.finditer(log):
        it = int(m.group(2))
        run.stamps[it] = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
        run.samples[it] = int(m.group(3))
        run.steps[it] = float(m.group(4))
    run.saves = sorted({int(m.group(1)) for m in _SAVE.finditer(log)})
    for rank in range(2):
        path = waits_dir / f"{name}_rank{rank}.json"
        run.waits.append(json.loads(path.read_text()) if path.is_file() else [])
    return run


def _make_corpus(tmp: Path) -> str:
    """A ~3 MB real corpus (the standard library's sources), byte-level tokens; returns the dataset prefix."""
    py = sys.executable
    jsonl, prefix = tmp / "corpus.jsonl", tmp / "corpus"
    _run([py, "-m", "megatron.bridge.data.offline_corpus", "--output", str(jsonl), "--max-bytes", "3000000"], 120, tmp)
    meta = json.dumps({"library": "byte-level"})
    cmd = [py, "-m", "megatron.bridge.data.preprocess", "--input", str(jsonl), "--output-prefix", str(prefix)]
    _run([*cmd, "--tokenizer-metadata", meta, "--append-eod"], 180, tmp)
    return str(prefix)


def _framework_overrides(prefix: str, run_dir: Path, local_dir: Path, args: argparse.Namespace) -> list[str]:
    return [
        f"dataset.blend=[['{prefix}'],None]", f"train.train_iters={args.steps}",
        f"checkpoint.save={run_dir / 'ckpt'}", f"checkpoint.load={run_dir / 'ckpt'}",
        f"checkpoint.save_interval={args.save_interval}", "checkpoint.async_save=true", "checkpoint.most_recent_k=2",
        "checkpoint.non_persistent_ckpt_type=local", f"checkpoint.non_persistent_save_interval={args.local_interval}",
        f"checkpoint.non_persistent_local_ckpt_dir={local_dir}",
        f"health.liveness_ping_interval={args.ping_interval}",  # also turns hang attribution on (default delays)
        "nvrx_straggler.enabled=true",
        "rerun_state_machine.rerun_mode=validate_results",  # NaN/Inf check of every loss, re-run on a bad one
        "train.exit_signal_handler=true", "train.exit_signal_handler_for_dataloader=true",
        f"logger.tensorboard_dir={run_dir / 'tb'}",  # the recipe's default is under the working directory
    ]  # fmt: skip


def _framework(prefix: str, tmp: Path, local_root: Path, index: int, args: argparse.Namespace) -> Run:
    run_dir, local_dir, waits = tmp / f"framework{index}", local_root / f"framework{index}", tmp / f"waits_f{index}"
    waits.mkdir(parents=True)  # fresh checkpoint directories: a run must not resume from the previous round's
    cmd = [
        sys.executable, "-m", "megatron.bridge.launch", "--standalone", "--nproc-per-node=2",
        str(BENCH / "_recipe_run_timed.py"), RECIPE, *_framework_overrides(prefix, run_dir, local_dir, args),
    ]  # fmt: skip
    return _parse("framework", *_run(cmd, args.timeout, waits), waits)


def _plain(prefix: str, tmp: Path, index: int, args: argparse.Namespace) -> Run:
    waits = tmp / f"waits_p{index}"
    waits.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(BENCH / "_plain_mcore_loop.py"), "--data-prefix", prefix, "--steps", str(args.steps),
    ]  # fmt: skip
    return _parse("plain", *_run(cmd, args.timeout, waits), waits)


def _kept(run: Run, warmup: int) -> list[int]:
    """The iterations measured: every logged one after the warm-up."""
    kept = [it for it in sorted(run.steps) if it > warmup]
    if len(kept) < 5:
        sys.exit(f"{run.name} run: {len(run.steps)} steps logged, too few after {warmup} warm-up:\n{run.log[-3000:]}")
    return kept


def _intervals(run: Run, kept: list[int]) -> list[float]:
    """Wall time between the log line of each kept iteration and the one before it."""
    return [(run.stamps[it] - run.stamps[it - 1]).total_seconds() for it in kept if it - 1 in run.stamps]


def _wait_fraction(run: Run, kept: list[int]) -> tuple[float, float]:
    """(the larger over ranks of data wait / step time over the kept steps, that rank's mean wait per step)."""
    steps = max(run.steps)
    step_sum = sum(run.steps[it] for it in kept)
    worst = (0.0, 0.0)
    for waits in run.waits:
        per_step = len(waits) // steps if steps else 0
        if per_step == 0:
            sys.exit(f"{run.name} run: no data-wait record ({len(waits)} next() calls for {steps} steps)")
        wait = sum(sum(waits[(it - 1) * per_step : it * per_step]) for it in kept)
        worst = max(worst, (wait / step_sum, wait / len(kept)))
    return worst


def _tokens_per_step(runs: list[Run], seq_length: int) -> int:
    batches = {run.samples[it] // it for run in runs for it in run.samples}
    if len(batches) != 1:
        sys.exit(f"the runs consumed different global batch sizes: {sorted(batches)}")
    return batches.pop() * seq_length


def _spread(values: list[float]) -> float:
    """(max - min) / mean: the run-to-run spread of one mode."""
    return (max(values) - min(values)) / statistics.mean(values) if len(values) > 1 else 0.0


def _join(values: list[float]) -> str:
    return ", ".join(f"{x:.0f}" for x in values)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each run left out")
    parser.add_argument("--rounds", type=int, default=3, help="framework + plain runs, alternating")
    parser.add_argument("--save-interval", type=int, default=30, help="checkpoint.save_interval (async, global)")
    parser.add_argument("--local-interval", type=int, default=10, help="local-tier checkpoint interval (async)")
    parser.add_argument("--ping-interval", type=int, default=10, help="health.liveness_ping_interval")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before a training run is killed")
    args = parser.parse_args()
    start = time.monotonic()
    shm = Path("/dev/shm")
    runs: dict[str, list[Run]] = {"framework": [], "plain": []}
    with tempfile.TemporaryDirectory() as t, tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as loc:
        tmp = Path(t)
        prefix = _make_corpus(tmp)
        print(f"corpus ready in {time.monotonic() - start:.0f} s", flush=True)
        for i in range(args.rounds):
            order = ("framework", "plain") if i % 2 == 0 else ("plain", "framework")
            for name in order:
                if name == "framework":
                    run = _framework(prefix, tmp, Path(loc), i, args)
                else:
                    run = _plain(prefix, tmp, i, args)
                runs[name].append(run)
                kept = _kept(run, args.warmup)
                mean = statistics.mean(run.steps[it] for it in kept)
                print(f"round {i + 1}: {name:9s} mean step {mean:.4f} s over {len(kept)} steps ({run.seconds:.0f} s)")
    header = _HEADER.search(runs["plain"][0].log)
    if header is None:
        sys.exit(f"the plain run printed no recipe line:\n{runs['plain'][0].log[-3000:]}")
    tokens = _tokens_per_step(runs["framework"] + runs["plain"], int(header.group(2)))
    device = _DEVICE.search(runs["framework"][0].log)
    _report(runs, tokens, header.group(1), device.groups() if device else ("?", "?"), args)
    print(f"benchmark wall time {time.monotonic() - start:.0f} s")


def _report(runs: dict[str, list[Run]], tokens: int, recipe: str, device: tuple[str, str], args) -> None:
    kept = {name: [_kept(run, args.warmup) for run in rs] for name, rs in runs.items()}
    step, median, wall, per_run = {}, {}, {}, {}
    for name, rs in runs.items():
        step[name] = statistics.mean(r.steps[it] for r, k in zip(rs, kept[name]) for it in k)
        median[name] = statistics.median(r.steps[it] for r, k in zip(rs, kept[name]) for it in k)
        wall[name] = statistics.mean(x for r, k in zip(rs, kept[name]) for x in _intervals(r, k))
        per_run[name] = [tokens / statistics.mean(r.steps[it] for it in k) for r, k in zip(rs, kept[name])]
    fw, plain = tokens / step["framework"], tokens / step["plain"]
    fw_wall, plain_wall = tokens / wall["framework"], tokens / wall["plain"]
    rounds = list(zip(runs["framework"], kept["framework"], runs["plain"], kept["plain"]))
    by_round = [
        1 - statistics.mean(p.steps[i] for i in pk) / statistics.mean(f.steps[i] for i in fk) for f, fk, p, pk in rounds
    ]
    by_round_wall = [
        1 - statistics.mean(_intervals(p, pk)) / statistics.mean(_intervals(f, fk)) for f, fk, p, pk in rounds
    ]
    overhead, overhead_wall = statistics.median(by_round), statistics.median(by_round_wall)
    waits = {name: [_wait_fraction(r, k) for r, k in zip(rs, kept[name])] for name, rs in runs.items()}
    wait = {name: max(w[0] for w in ws) for name, ws in waits.items()}
    wait_ms = {name: 1000 * max(w[1] for w in ws) for name, ws in waits.items()}

    print(f"\nrecipe {RECIPE}: {recipe}; {tokens} tokens per step; {device[0]} on {device[1]}")
    print(
        f"framework features: async global checkpoint every {args.save_interval} steps, async local-tier checkpoint "
        f"every {args.local_interval} steps (node-local /dev/shm), liveness ping every {args.ping_interval} steps + "
        "hang attribution (default stack-dump delay), goodput, re-run state machine (validate_results: NaN/Inf check "
        "of every loss), NVRx straggler detection (default 300 s report interval), exit-signal handler (loader "
        "workers ignore the signal), TensorBoard; not on: ft (needs ft_launcher), in-process restart (refused with "
        "the exit-signal handler)"
    )
    print(
        f"{args.rounds} round(s) of {args.steps} steps per run, first {args.warmup} skipped; both runs pin each rank "
        "to its share of the cores on CPU (initialize.bind_cpu_cores; the plain loop does the same)\n"
    )
    print("| measure | framework | plain megatron-core |")
    print("|---|---|---|")
    print(f"| tokens/s from logged step time (mean) | {fw:.0f} | {plain:.0f} |")
    print(f"| mean step time | {step['framework']:.4f} s | {step['plain']:.4f} s |")
    print(f"| median step time | {median['framework']:.4f} s | {median['plain']:.4f} s |")
    fw_runs, plain_runs = per_run["framework"], per_run["plain"]
    print(f"| tokens/s per run | {_join(fw_runs)} | {_join(plain_runs)} |")
    print(f"| tokens/s from wall time between log lines | {fw_wall:.0f} | {plain_wall:.0f} |")
    print(f"| data wait / step time | {100 * wait['framework']:.2f} % | {100 * wait['plain']:.2f} % |")
    print(f"| data wait per step | {wait_ms['framework']:.2f} ms | {wait_ms['plain']:.2f} ms |\n")
    _save_breakdown(runs["framework"], kept["framework"], step["plain"])
    print(f"overhead per round (logged step time): {', '.join(f'{100 * x:.2f} %' for x in by_round)}")
    print(f"overhead per round (wall time): {', '.join(f'{100 * x:.2f} %' for x in by_round_wall)}")
    print(f"framework tokens/s: {fw:.0f}")
    print(f"plain tokens/s    : {plain:.0f}")
    verdict = _verdict(overhead <= OVERHEAD_GOAL)
    print(f"overhead = 1 - framework/plain, median of rounds = {100 * overhead:.2f} % (goal <= 2 %): {verdict}")
    print(
        f"overhead from wall time between log lines, median of rounds = {100 * overhead_wall:.2f} % (goal <= 3 %): "
        f"{_verdict(overhead_wall <= WALL_OVERHEAD_GOAL)}"
    )
    print(
        f"data wait fraction (framework) = {100 * wait['framework']:.2f} % of step time (goal <= 2 %): "
        f"{_verdict(wait['framework'] <= WAIT_GOAL)}"
    )
    spread = max(_spread(fw_runs), _spread(plain_runs))
    if args.rounds < 2:
        print("NOISY?: one round only, so the run-to-run spread is unknown; use --rounds 2 or more")
    elif spread > abs(overhead):
        print(
            f"NOISY: the run-to-run spread of tokens/s within one mode ({100 * spread:.1f} %) is larger than the "
            f"measured difference ({100 * abs(overhead):.1f} %): this machine's noise, not the framework, may decide "
            "the verdict; rerun or raise --rounds/--steps"
        )
    base = f"{plain:.0f} tokens/s (plain megatron-core loop, {step['plain'] * 1000:.1f} ms/step)"
    emit_result(
        "llama_throughput", "framework overhead: 1 - framework/plain tokens/s (logged step time, median of rounds)",
        overhead,
        f"{fw:.0f} tokens/s (framework, resiliency on, {step['framework'] * 1000:.1f} ms/step; run spread "
        f"{100 * spread:.1f} %)", base, f"<= {OVERHEAD_GOAL}", spread=spread if args.rounds >= 2 else None,
    )  # fmt: skip
    emit_result(
        "llama_throughput",
        "framework overhead: 1 - framework/plain tokens/s (wall time between log lines, median of rounds)",
        overhead_wall, f"{fw_wall:.0f} tokens/s (framework)", f"{plain_wall:.0f} tokens/s (plain)",
        f"<= {WALL_OVERHEAD_GOAL}", spread=spread if args.rounds >= 2 else None,
    )  # fmt: skip
    emit_result(
        "llama_throughput", "data wait / step time (framework run)", wait["framework"],
        f"{wait_ms['framework']:.2f} ms/step in next(data_iterator)",
        f"{step['framework'] * 1000:.1f} ms/step (plain loop: {100 * wait['plain']:.2f} %)", f"<= {WAIT_GOAL}",
    )  # fmt: skip


def _save_breakdown(runs: list[Run], kept: list[list[int]], plain_step: float) -> None:
    """The framework's steps right after a save (the async write runs beside them) vs the other steps."""
    after, other = [], []
    for run, k in zip(runs, kept):
        saved = set(run.saves)
        for it in k:
            (after if it - 1 in saved else other).append(run.steps[it])
    if not after or not other:
        return
    a, o = statistics.mean(after), statistics.mean(other)
    print(
        f"framework steps right after a save: mean {a:.4f} s over {len(after)} steps; other steps {o:.4f} s over "
        f"{len(other)} ({100 * (1 - plain_step / o):+.1f} % vs plain); the saves account for "
        f"{100 * (a - o) * len(after) / (a * len(after) + o * len(other)):.1f} % of the framework's step time\n"
    )


if __name__ == "__main__":
    main()
