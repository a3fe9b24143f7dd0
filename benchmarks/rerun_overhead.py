"""Per-step cost of the loss checks around the re-run state machine, in 2-rank gloo processes.

What every training step pays, by mode, measured around an empty step (the cost does not depend on what the step
computes): the ``RerunController.passes`` loop and ``end_step`` (megatron-core's state machine bookkeeping, its
all-reduces in ``validate_results``, the all-rank NaN guard with its one all-reduce and the saved generator states).
The baseline is the same loop with every check off; a bare 4-byte all-reduce is timed for reference (the NaN guard
is one such all-reduce; in ``validate_results`` megatron-core's own all-reduced checks replace it after the first
step). Printed as microseconds per step and as a share of the CPU Llama recipe's step (``llama3_tiny_pretrain_config``
on 2 ranks), measured first in the same run (``_recipe_step.py``). On GPUs the guard's ``.item()`` also waits for
the step's kernels, which the optimizer's gradient-norm read does anyway.

    python benchmarks/rerun_overhead.py [--steps 3000] [--recipe-steps 30]
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

from megatron.bridge.training.config import RerunStateMachineConfig

MODES = {
    "checks off (baseline)": RerunStateMachineConfig(check_for_nan_in_loss=False),
    "disabled + NaN guard (default)": RerunStateMachineConfig(),
    "validate_results": RerunStateMachineConfig(rerun_mode="validate_results"),
    "validate_results + spiky loss": RerunStateMachineConfig(rerun_mode="validate_results", check_for_spiky_loss=True),
}


def _time_mode(cfg: RerunStateMachineConfig, steps: int) -> float:
    """Median seconds per step of the controller's work over ``steps`` empty steps (5 blocks)."""
    from megatron.core import rerun_state_machine as upstream

    from megatron.bridge.training.health.rerun import RerunController, build_rerun_state_machine, validate_loss
    from megatron.bridge.utils import upstream as compat

    upstream.destroy_rerun_state_machine()
    compat.set_rerun_state_machine(build_rerun_state_machine(cfg))
    controller = RerunController(cfg, save_dir=None)
    data = controller.wrap_data_iterator(iter(()))
    loss = torch.tensor(2.5)
    losses = [{"lm loss": loss}, {"lm loss": loss}]
    blocks = []
    iteration = 0
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps // 5):
            for _ in controller.passes(data, iteration):
                validate_loss(loss)  # two micro-batches, as the trainer's loss function calls it
                validate_loss(loss)
            verdict = controller.end_step(iteration, losses)
            assert verdict.apply and verdict.stop is None
            iteration += 1
        blocks.append((time.perf_counter() - start) / (steps // 5))
    return statistics.median(blocks)


_ALLREDUCE = "(reference: one 4-byte all-reduce + .item())"


def _time_allreduce(steps: int) -> float:
    """Median seconds of one small all-reduce, the floor of any cross-rank decision."""
    blocks = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps // 5):
            flag = torch.zeros(1, dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            flag.item()
        blocks.append((time.perf_counter() - start) / (steps // 5))
    return statistics.median(blocks)


def _worker(rank: int, port: int, steps: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if not torch.cuda.is_available():
        from megatron.bridge.utils.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    results = {name: _time_mode(cfg, steps) for name, cfg in MODES.items()}
    results[_ALLREDUCE] = _time_allreduce(steps) + results["checks off (baseline)"]
    if rank == 0:
        out.update(results)
    dist.destroy_process_group()


def main() -> None:
    """Run both ranks and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--recipe-steps", type=int, default=30, help="steps of the recipe run timing its step")
    args = parser.parse_args()
    recipe = measure_recipe_step(args.recipe_steps)
    print(f"the recipe's step: {recipe.describe()}; mean {recipe.mean_s * 1e3:.1f} ms", flush=True)
    step = recipe.median_s
    port = free_port()
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(port, args.steps, out), nprocs=2)
    base = out["checks off (baseline)"]
    print(f"| mode | us/step | added us/step | share of the recipe's {step * 1e3:.1f} ms step |")
    print("|---|---|---|---|")
    for name in [*MODES, _ALLREDUCE]:
        added = out[name] - base
        print(f"| {name} | {out[name] * 1e6:.1f} | {added * 1e6:.1f} | {100 * added / step:.3f} % |")
    for name in MODES:
        if name == "checks off (baseline)":
            continue
        added = out[name] - base
        emit_result(
            "rerun_overhead", f"added time per step / the recipe's step: {name}", added / step,
            f"{added * 1e6:.1f} us/step added ({out[name] * 1e6:.1f} us/step; checks off {base * 1e6:.1f} us/step)",
            recipe.describe(),
        )  # fmt: skip


if __name__ == "__main__":
    main()
