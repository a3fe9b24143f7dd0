"""Worker of ``llama_throughput.py``: the tiny Llama recipe's model and data in a plain megatron-core training loop.

No checkpoints, no resiliency code, no callbacks: ``torch.distributed`` + ``parallel_state.initialize_model_parallel``,
the recipe's ``LlamaTinyModelProvider`` model in megatron-core DDP, ``get_megatron_optimizer`` (distributed
optimizer) and ``OptimizerParamScheduler``, then ``get_forward_backward_func()`` + ``optimizer.step()`` per step. The
hyperparameters (model, optimizer, DDP, dataset) are the ``llama3_tiny_pretrain_config`` recipe's, so both runs of the
benchmark train the same model the same way; the data are the same files, read by megatron-core's ``GPTDataset``
through ``megatron.bridge.data.loaders.build_train_valid_test_data_iterators`` (same loader workers).

Rank 0 logs one line per step in the framework's format (``iteration N/M | ... | step time X s``: optimizer zeroing,
forward/backward over the micro-batches, optimizer and scheduler step, as the framework's ``train_step`` times it),
so ``llama_throughput.py`` parses both runs alike. With ``LLAMA_THROUGHPUT_WAITS=<dir>`` each rank writes the
seconds every ``next(data_iterator)`` took to ``<dir>/plain_rank<N>.json`` at exit.

    torchrun --standalone --nproc-per-node=2 benchmarks/_plain_mcore_loop.py --data-prefix P [--steps 60]
        [--override model.hidden_size=1024 ...]

``--override`` takes the framework's dotted ``key=value`` form (``training/utils/overrides.py``), applied to the
recipe's config before anything is built, so a run of the framework with the same overrides trains the same model (the
GPU check, ``scripts/gpu_check.py``, scales the recipe up this way). The header line also gives the parameter count.
"""

import argparse
import json
import logging
import os
import time
from pathlib import Path

WAITS_ENV = "LLAMA_THROUGHPUT_WAITS"
"""Directory the per-rank data-wait files go to (unset: none written)."""


class TimedIterator:
    """An iterator that records how long each ``next()`` of the one it wraps took."""

    def __init__(self, inner, waits: list[float]) -> None:
        self.inner = inner
        self.waits = waits

    def __iter__(self) -> "TimedIterator":
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self.inner)
        finally:
            self.waits.append(time.perf_counter() - start)


def write_waits(waits: list[float], name: str) -> None:
    """Write ``waits`` to ``$LLAMA_THROUGHPUT_WAITS/<name>_rank<RANK>.json`` (nothing when the variable is unset)."""
    out = os.environ.get(WAITS_ENV)
    if out:
        Path(out, f"{name}_rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(waits))


def _select_device():
    """This rank's device, chosen at run time: its local GPU, else the CPU (its share of the cores)."""
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    # As the framework does on CPU (initialize.bind_cpu_cores): a slice of the cores per local rank.
    cores = sorted(os.sched_getaffinity(0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = len(cores) // max(local_world, 1)
    if local_world > 1 and share >= 1:
        os.sched_setaffinity(0, cores[local_rank * share : (local_rank + 1) * share])
    return torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-prefix", required=True, help="indexed dataset prefix (<prefix>.bin/.idx)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE", help="a dotted config override (repeatable)"
    )
    args = parser.parse_args()

    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    logger = logging.getLogger("plain_mcore_loop")

    import torch
    import torch.distributed as dist

    device = _select_device()
    if device.type == "cpu":
        from megatron.bridge.utils.cpu_shims import apply_cpu_shims

        apply_cpu_shims()  # before megatron-core builds models on CPU
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.bridge.data.loaders import build_train_valid_test_data_iterators
    from megatron.bridge.data.utils import bind_provider_context, get_dataset_provider
    from megatron.bridge.recipes.llama.llama3 import llama3_tiny_pretrain_config
    from megatron.bridge.training.state import TrainState
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer
    from megatron.bridge.training.utils.overrides import apply_overrides

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    recipe = llama3_tiny_pretrain_config()
    recipe.dataset.blend = ([args.data_prefix], None)
    recipe.train.train_iters = args.steps
    cfg = apply_overrides(recipe, args.override)
    cfg.validate()  # finalizes the provider and the dataset config, derives the scheduler's lengths
    torch.manual_seed(cfg.rng.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.rng.seed)

    config = cfg.model.for_device(device)  # the recipe's LlamaTinyModelProvider, finalized for this device
    model = config.provide().to(device)
    if config.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    model = DistributedDataParallel(config=config, ddp_config=cfg.ddp, module=model)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads  # the data-parallel gradient reduction
    optimizer = get_megatron_optimizer(cfg.optimizer, [model])
    s = cfg.scheduler
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=s.lr_warmup_init, max_lr=cfg.optimizer.lr, min_lr=cfg.optimizer.min_lr,
        lr_warmup_steps=s.lr_warmup_steps, lr_decay_steps=s.lr_decay_steps, lr_decay_style=s.lr_decay_style,
        start_wd=cfg.optimizer.weight_decay, end_wd=cfg.optimizer.weight_decay, wd_incr_steps=s.wd_incr_steps,
        wd_incr_style=s.weight_decay_incr_style,
    )  # fmt: skip

    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    dp_size = parallel_state.get_data_parallel_world_size()
    cfg.validation.eval_iters = 0  # training batches only
    provider = bind_provider_context(
        get_dataset_provider(cfg.dataset), tokenizer=build_tokenizer(cfg.tokenizer), pg_collection=None
    )
    train_iter, _, _ = build_train_valid_test_data_iterators(
        cfg, TrainState(), provider, parallel_state.get_data_parallel_group()
    )
    if dist.get_rank() == 0:
        logger.info(
            "recipe llama3_tiny_pretrain_config: global batch %d, micro batch %d, seq length %d, data parallel %d, "
            "loader workers %d, distributed optimizer %s, device %s, parameters %d",
            gbs, mbs, cfg.model.seq_length, dp_size, cfg.dataset.num_workers, cfg.optimizer.use_distributed_optimizer,
            device, sum(p.numel() for p in model.parameters()),
        )  # fmt: skip
    waits: list[float] = []
    data_iterator = TimedIterator(train_iter, waits)
    seq = cfg.model.seq_length
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)

    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.float().view(-1)
        mask = loss_mask.reshape(-1).float()
        loss = torch.sum(losses * mask)
        num_tokens = mask.sum().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach().clone(), num_tokens.detach().float()])}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        tokens, labels, loss_mask, position_ids = (
            batch[key].to(device, non_blocking=True) for key in ("tokens", "labels", "loss_mask", "position_ids")
        )
        output = model(input_ids=tokens, position_ids=position_ids, attention_mask=causal, labels=labels)
        return output, lambda out: loss_func(loss_mask, out)

    forward_backward = get_forward_backward_func()
    num_microbatches = gbs // (mbs * dp_size)
    model.train()
    for iteration in range(1, args.steps + 1):
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=forward_step, data_iterator=data_iterator, model=[model],
            num_microbatches=num_microbatches, seq_length=seq, micro_batch_size=mbs, forward_only=False,
        )  # fmt: skip
        update_ok, grad_norm, _ = optimizer.step()
        if update_ok:
            scheduler.step(increment=gbs)
        step_time = time.perf_counter() - start
        total = torch.stack([x["lm loss"] for x in losses]).sum(dim=0)  # logged every step, as the recipe does
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        if dist.get_rank() == 0:
            logger.info(
                "iteration %d/%d | consumed samples %d | lm loss %r | grad norm %.6f | lr %.6e | step time %.4f s",
                iteration, args.steps, iteration * gbs, (total[0] / total[1]).item(), float(grad_norm),
                scheduler.get_lr(optimizer.param_groups[0]), step_time,
            )  # fmt: skip
    write_waits(waits, "plain")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # the guard matters: the loader's workers are spawned and import this module
    main()
