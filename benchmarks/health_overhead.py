"""Cost of the health features per training step, in 2-rank gloo processes.

Timed in the same processes, in interleaved blocks:

- the liveness ping (one store write plus a 4-byte all-reduce on its gloo side group), paid once every
  ``health.liveness_ping_interval`` steps;
- hang attribution's per-step work (``HangWatch.open`` and ``close``: set and clear a deadline), paid every step
  when a hang timeout is in force;
- baseline: a bare 4-byte all-reduce on the default group (what any cross-rank decision costs).

Printed as microseconds per call and as a share of the CPU Llama recipe's step (``llama3_tiny_pretrain_config`` on 2
ranks, measured first in the same run: ``_recipe_step.py``; the ping divided by ``--interval``).

    python benchmarks/health_overhead.py [--calls 2000] [--interval 10] [--recipe-steps 30]
"""

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _process import free_port
from _recipe_step import measure_recipe_step
from _result import emit_result

from megatron.bridge.training.config import HealthConfig
from megatron.bridge.training.health.hang_attribution import HangWatch
from megatron.bridge.training.health.liveness import LivenessPing


def _blocks(fn, calls: int, blocks: int = 5) -> float:
    """Median seconds per call over ``blocks`` blocks of ``calls // blocks`` calls."""
    times = []
    for _ in range(blocks):
        dist.barrier()
        start = time.perf_counter()
        for i in range(calls // blocks):
            fn(i)
        times.append((time.perf_counter() - start) / (calls // blocks))
    return statistics.median(times)


def _worker(rank: int, port: int, calls: int, tmp: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ping = LivenessPing(HealthConfig(liveness_ping_interval=1, liveness_ping_timeout=30), "bench", {}.get)
    ping.setup()
    watch = HangWatch(tmp, "bench", rank, lambda section: 30.0)

    def bare(_: int) -> None:
        dist.all_reduce(torch.ones(1))

    def hang_watch(_: int) -> None:
        watch.open("step")
        watch.close()

    results: dict[str, list[float]] = {"bare": [], "ping": [], "watch": []}
    for _ in range(3):  # interleaved rounds: drifts of a noisy machine hit every variant alike
        results["bare"].append(_blocks(bare, calls))
        results["ping"].append(_blocks(lambda i: ping.maybe_ping(i + 1), calls))
        results["watch"].append(_blocks(hang_watch, calls * 10))
    watch.shutdown()
    if rank == 0:
        out.update({name: statistics.median(values) for name, values in results.items()})
    dist.destroy_process_group()


def main() -> None:
    """Run both ranks and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--interval", type=int, default=10, help="steps between pings")
    parser.add_argument("--recipe-steps", type=int, default=30, help="steps of the recipe run timing its step")
    args = parser.parse_args()
    recipe = measure_recipe_step(args.recipe_steps)
    print(f"the recipe's step: {recipe.describe()}; mean {recipe.mean_s * 1e3:.1f} ms", flush=True)
    step = recipe.median_s
    port = free_port()
    out = mp.Manager().dict()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(port, args.calls, tmp, out), nprocs=2)
    print(f"| what | us per call | ratio to a bare all-reduce | share of the recipe's {step * 1e3:.1f} ms step |")
    print("|---|---|---|---|")
    rows = [
        ("bare 4-byte all-reduce (baseline)", out["bare"], 1),
        (f"liveness ping (every {args.interval} steps)", out["ping"], args.interval),
        ("hang attribution open+close (every step)", out["watch"], 1),
    ]
    for name, seconds, every in rows:
        share = 100 * seconds / every / step
        print(f"| {name} | {seconds * 1e6:.1f} | {seconds / out['bare']:.2f} | {share:.4f} % |")
    for name, seconds, every in rows[1:]:
        emit_result(
            "health_overhead", f"cost per step / the recipe's step: {name}", seconds / every / step,
            f"{seconds * 1e6:.1f} us per call ({seconds / out['bare']:.2f} x a bare all-reduce of "
            f"{out['bare'] * 1e6:.1f} us)", recipe.describe(),
        )  # fmt: skip


if __name__ == "__main__":
    main()
