"""Straggler detection demo: train the tiny GPT on 2 ranks and watch the per-rank performance reports.

    python -m torch.distributed.run --nproc_per_node=2 straggler_detection_example.py
        reports every second with both score kinds; no rank is flagged

    python -m torch.distributed.run --nproc_per_node=2 straggler_detection_example.py --slow-rank 1
        rank 1's forward steps take twice as long: it scores ~0.5 and is flagged as a straggler

    ... --slow-rank 1 nvrx_straggler.stop_if_detected=true checkpoint.save=/tmp/ckpt
        the run saves a checkpoint at the first report that flags rank 1 and exits with code 21 on every rank

Any other argument is a dotted config override (``nvrx_straggler.report_time_interval=5``). ``--slow-rank`` is a
CPU demonstration: the rank sleeps inside its forward step. On GPUs the scores come from CUDA kernel timings, which
a sleep does not change, so there it is not flagged (a GPU whose kernels really run slower is).
"""

import argparse
import sys

import torch

from megatron.bridge.recipes.tiny_gpt import tiny_gpt_config
from megatron.bridge.training.config import ConfigContainer, NVRxStragglerDetectionConfig
from megatron.bridge.training.gpt_step import forward_step
from megatron.bridge.training.pretrain import main


def straggler_config() -> ConfigContainer:
    """The tiny GPT recipe with straggler detection reporting every second for 200 steps (~12 s on 2 CPU cores).

    On CPU the scores come from the forward step's wall time, so the model is made wide enough for a ~20 ms forward
    step: at the recipe's ~4 ms one, a single OS scheduling hiccup moves a rank's median by 30%.
    """
    cfg = tiny_gpt_config()
    cfg.model.hidden_size = 128
    cfg.model.seq_length = 128
    cfg.dataset.seq_length = 128  # Megatron-Bridge checks that the data and the model agree
    cfg.train.train_iters = 200
    cfg.logger.log_interval = 20
    cfg.nvrx_straggler = NVRxStragglerDetectionConfig(
        enabled=True,
        report_time_interval=1.0,
        calc_relative_gpu_perf=True,
        calc_individual_gpu_perf=True,
        num_gpu_perf_scores_to_print=5,
        gpu_relative_perf_threshold=0.7,
        gpu_individual_perf_threshold=0.7,
        stop_if_detected=False,
        enable_logging=True,
    )
    return cfg


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The demo's own options; everything else is passed on as config overrides."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slow-rank", type=int, default=None, help="rank whose forward steps are slowed down")
    parser.add_argument("--slow-factor", type=float, default=2.0, help="how many times slower (> 1, default 2)")
    return parser.parse_known_args(argv)


if __name__ == "__main__":  # the guard matters: checkpoint writers spawn helper processes
    args, overrides = parse_args(sys.argv[1:])
    if args.slow_rank is not None:
        overrides = [f"fault_injection.faults=slow@1:{args.slow_rank}:x{args.slow_factor:g}", *overrides]
        if torch.cuda.is_available():
            print("--slow-rank sleeps on the CPU; GPU (kernel) scores will not flag it", file=sys.stderr)
    main(straggler_config, forward_step, overrides)
