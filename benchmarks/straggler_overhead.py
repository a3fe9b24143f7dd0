"""Step time with NVRx straggler detection on vs off, interleaved in the same 2-rank processes.

Whole training runs on this 2-core machine vary by tens of percent from one run to the next, far more than the
overhead to measure. So both modes run in the same processes, in alternating blocks of ``--steps-per-block`` steps
(about a second each), and the ratio is taken between the median block times of the two modes.

A step is ``--step-ms`` of matrix multiplications (the "forward step", wrapped the way the trainer wraps it) plus a
gradient-sized all-reduce over gloo, as in data-parallel training; by default as many milliseconds as the CPU Llama
recipe's step (``llama3_tiny_pretrain_config`` on 2 ranks), measured first in the same run (``_recipe_step.py``).
With detection on, each step also goes through everything the trainer adds: the ``train_step`` and ``forward_step``
detection sections, the per-step ``check`` and, every ``--report-interval`` seconds, a full report (collectives,
formatting, logging). Detection costs the same whatever the step computes, so this measures its overhead at a given
step time. Target: <= 1 % of the recipe's step.

Two numbers are printed: the A/B ratio (median over pairs of on/off block time; noisy, its spread is shown) and the
directly accounted cost: time spent inside ``check`` (reports included) plus the cost of the two sections around
an empty step, per step, over the recipe's measured step time. It is an upper bound: a report's collectives also
absorb the ranks' skew, which the next gradient all-reduce would otherwise wait for.

    python benchmarks/straggler_overhead.py [--step-ms MS] [--pairs 15] [--report-interval 2]
"""

import argparse
import logging
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _process import free_port
from _recipe_step import measure_recipe_step
from _result import emit_result

from megatron.bridge.training.config import NVRxStragglerDetectionConfig
from megatron.bridge.training.nvrx_straggler import NVRxStragglerDetectionManager


def _calibrate(step_s: float) -> tuple[torch.Tensor, int]:
    """A matrix and the number of its products that take ``step_s`` (rank 0's count is used by both ranks)."""
    a = torch.randn(256, 256)
    for _ in range(20):  # warm up: the first products are slower
        a @ a
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.5:
        a @ a
        done += 1
    per_product = (time.perf_counter() - start) / done
    count = torch.tensor([max(1, round(step_s / per_product))])
    dist.broadcast(count, src=0)
    return a, int(count.item())


def _section_cost(manager: NVRxStragglerDetectionManager, n: int = 2000) -> float:
    """Seconds the two detection sections add to one (empty) step."""
    empty = manager.wrap_forward_step(lambda: None)
    start = time.perf_counter()
    for _ in range(n):
        with manager.step_section():
            empty()
    return (time.perf_counter() - start) / n


def _worker(rank: int, port: int, args: argparse.Namespace, results: "mp.Queue") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)  # reports are built and formatted; printing them is not measured
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if not torch.cuda.is_available():
        from megatron.bridge.utils.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
    cfg = NVRxStragglerDetectionConfig(enabled=True, report_time_interval=args.report_interval)
    manager = NVRxStragglerDetectionManager(cfg)
    manager.initialize()
    a, products = _calibrate(args.step_ms / 1000)
    grads = torch.zeros(2_000_000)  # 8 MB of fp32 gradients

    def forward_step() -> None:
        for _ in range(products):
            a @ a

    timed_forward = manager.wrap_forward_step(forward_step)
    section_cost = _section_cost(manager)
    blocks: dict[bool, list[float]] = {False: [], True: []}
    reports = iteration = 0
    in_check = 0.0
    for pair in range(args.pairs):
        for on in (False, True) if pair % 2 == 0 else (True, False):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps_per_block):
                if on:
                    iteration += 1
                    with manager.step_section():
                        timed_forward()
                        dist.all_reduce(grads)
                    check_start = time.perf_counter()
                    reports += manager.check(iteration) is not None
                    in_check += time.perf_counter() - check_start
                else:
                    forward_step()
                    dist.all_reduce(grads)
            blocks[on].append((time.perf_counter() - start) / args.steps_per_block)
    manager.shutdown()
    if rank == 0:
        results.put((blocks, reports, in_check / iteration + section_cost))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, help="compute per step in ms (default: the recipe's, measured)")
    parser.add_argument("--pairs", type=int, default=15, help="number of (off, on) block pairs")
    parser.add_argument("--steps-per-block", type=int, default=10)
    parser.add_argument("--report-interval", type=float, default=2.0, help="nvrx_straggler.report_time_interval")
    args = parser.parse_args()
    recipe = measure_recipe_step()
    print(f"the recipe's step: {recipe.describe()}; mean {recipe.mean_s * 1e3:.1f} ms", flush=True)
    if args.step_ms is None:
        args.step_ms = recipe.median_s * 1e3

    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(rank, port, args, results)) for rank in range(2)]
    for p in procs:
        p.start()
    blocks, reports, accounted = results.get()
    for p in procs:
        p.join()
    off, on = statistics.median(blocks[False]), statistics.median(blocks[True])
    ratios = [b / a for a, b in zip(blocks[False], blocks[True])]
    q1, ratio, q3 = statistics.quantiles(ratios, n=4)
    steps = args.pairs * args.steps_per_block
    print(f"{args.pairs} pairs of {args.steps_per_block}-step blocks; {reports} reports in {steps} detected steps")
    print(f"median time per step: off {off * 1000:.2f} ms, on {on * 1000:.2f} ms")
    print(f"A/B ratio on/off (median of pairs): {ratio:.4f}, interquartile range {q1:.4f}-{q3:.4f}")
    print(
        f"accounted detection cost: {accounted * 1000:.3f} ms/step = {100 * accounted / recipe.median_s:.3f} % of the "
        f"recipe's step (target <= 1 %)"
    )
    step = f"{off * 1000:.2f} ms/step (detection off, {args.step_ms:.1f} ms of compute)"
    emit_result(
        "straggler_overhead", "step time, detection on / off (A/B, median of pairs)", ratio,
        f"{on * 1000:.2f} ms/step (detection on; IQR of ratio {q1:.4f}-{q3:.4f})", step,
    )  # fmt: skip
    emit_result(
        "straggler_overhead", "accounted detection cost / the recipe's step", accounted / recipe.median_s,
        f"{accounted * 1000:.3f} ms/step (check + reports + sections)", recipe.describe(), "<= 0.01",
    )  # fmt: skip


if __name__ == "__main__":
    main()
