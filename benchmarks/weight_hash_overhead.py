"""Cost of the weight-hash check (``train.check_weight_hash_across_dp_replicas_interval``) per training step.

The check hashes every parameter of the rank (SHA-1 of its bytes), all-gathers the digests over the data-parallel
group and all-reduces the verdict: ``health/weight_hash.check_replicas``, timed here in 2-rank gloo processes on the
CPU Llama recipe's own model (``llama3_tiny_pretrain_config``, built as the recipe builds it), in interleaved blocks.
The baseline is the recipe's step without the check, measured first in the same run (``_recipe_step.py``: 2 ranks,
the loop's own step timing). Reported: step time with the check every ``--interval`` steps (its cost divided by the
interval, added to the step) over the step without it; the goal is at most 0.5 % more. The check before each save
is a save's cost, not a step's: printed for reference.

    python benchmarks/weight_hash_overhead.py [--calls 200] [--interval 100] [--recipe-steps 30]
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _process import free_port
from _recipe_step import measure_recipe_step
from _result import emit_result


def _worker(rank: int, port: int, calls: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    from megatron.bridge.utils.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state, tensor_parallel

    from megatron.bridge.recipes.llama.llama3 import llama3_tiny_pretrain_config
    from megatron.bridge.training.health.weight_hash import check_replicas

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    cfg = llama3_tiny_pretrain_config()
    cfg.validate(world_size=2)
    torch.manual_seed(cfg.rng.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.rng.seed)
    model = [cfg.model.for_device(torch.device("cpu")).provide()]
    groups = {False: parallel_state.get_data_parallel_group(), True: parallel_state.get_expert_data_parallel_group}
    assert check_replicas(model, groups) == ([], [])  # same seed on both ranks: identical replicas
    blocks = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(max(calls // 5, 1)):
            check_replicas(model, groups)
        blocks.append((time.perf_counter() - start) / max(calls // 5, 1))
    if rank == 0:
        out["check"] = statistics.median(blocks)
        out["parameters"] = sum(p.numel() for p in model[0].parameters())
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    """Measure the recipe's step, then the check, and print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--interval", type=int, default=100, help="steps between checks (the documented example)")
    parser.add_argument("--recipe-steps", type=int, default=30, help="steps of the recipe run timing its step")
    args = parser.parse_args()
    recipe = measure_recipe_step(args.recipe_steps)
    step = recipe.median_s
    print(f"the recipe's step: {recipe.describe()}; mean {recipe.mean_s * 1e3:.1f} ms", flush=True)
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), args.calls, out), nprocs=2)
    check = out["check"]
    with_check = step + check / args.interval
    print(f"one check ({out['parameters']:,} parameters): {check * 1e3:.2f} ms ({100 * check / step:.1f} % of a step)")
    print(f"every {args.interval} steps: {with_check * 1e3:.3f} ms per step vs {step * 1e3:.3f} ms without")
    print(f"before every save: {check * 1e3:.2f} ms added to the save")
    emit_result(
        "weight_hash_overhead", f"step time with the check every {args.interval} steps / without", with_check / step,
        f"{with_check * 1e3:.3f} ms (one check {check * 1e3:.2f} ms / {args.interval})", recipe.describe(), "<= 1.005",
    )  # fmt: skip


if __name__ == "__main__":
    main()
