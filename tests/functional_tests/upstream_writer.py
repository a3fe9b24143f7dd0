"""Train the tiny GPT and, at one step, also write a checkpoint the way Megatron-Bridge writes it (no manifest).

Entry of ``test_upstream_checkpoint.py``: ``upstream_writer.py --dir DIR --at N [dotted overrides]``. When the loop
is about to save at step ``N``, a callback writes ``DIR/iter_000000N`` with megatron-core's ``dist_checkpointing``
in Megatron-Bridge's content and file names, as its ``save_checkpoint`` does: the common part holds
``checkpoint_version`` 3.0, ``iteration`` and ``opt_param_scheduler``; the sharded part the model, the optimizer and
``rng_state`` (one ``ShardedObject`` per (pipeline, tensor) rank, data-parallel rank as replica id); next to them
``train_state.pt`` (0-d tensors), ``run_config.yaml``, and at the top ``latest_train_state.pt`` and
``latest_checkpointed_iteration.txt``. Nothing of this package's own format (manifest, per-rank RNG blob, marker) is
written there, and this writer uses none of this package's checkpoint code.
"""

import argparse
import os
import random
import shutil
import sys

import numpy as np
import torch
import yaml

from megatron.bridge.training.callbacks import Callback


def _generator_states() -> dict:
    from megatron.core import tensor_parallel

    from megatron.bridge.utils.cpu_shims import training_on_cpu

    states = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if not training_on_cpu():
        states["cuda_rng_state"] = torch.cuda.get_rng_state()
    return states


def _train_state_tensors(train_state) -> dict:
    return {
        "step": torch.tensor(train_state.step, dtype=torch.int64),
        "consumed_train_samples": torch.tensor(train_state.consumed_train_samples, dtype=torch.int64),
        "skipped_train_samples": torch.tensor(train_state.skipped_train_samples, dtype=torch.int64),
        "consumed_valid_samples": torch.tensor(train_state.consumed_valid_samples, dtype=torch.int64),
        "floating_point_operations_so_far": torch.tensor(
            train_state.floating_point_operations_so_far, dtype=torch.float64
        ),
        "do_train": torch.tensor(train_state.do_train, dtype=torch.bool),
        "do_valid": torch.tensor(train_state.do_valid, dtype=torch.bool),
        "do_test": torch.tensor(train_state.do_test, dtype=torch.bool),
    }


def write_upstream_checkpoint(root: str, context) -> None:
    """Write the checkpoint of the current step into ``root`` in Megatron-Bridge's layout (every rank calls it)."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    cfg = context.state.cfg
    train_state = context.state.train_state
    step = train_state.step
    ckpt_dir = os.path.join(root, f"iter_{step:07d}")
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if cfg.optimizer.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    chunks = [chunk.module if hasattr(chunk, "module") else chunk for chunk in context.model]
    while any(hasattr(chunk, "module") for chunk in chunks):
        chunks = [chunk.module if hasattr(chunk, "module") else chunk for chunk in chunks]
    state_dict = {"checkpoint_version": 3.0, "iteration": step}
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks):
        state_dict[key] = chunk.sharded_state_dict(metadata=metadata)
    state_dict["optimizer"] = context.optimizer.sharded_state_dict(state_dict, metadata=metadata)
    state_dict["opt_param_scheduler"] = context.scheduler.state_dict()
    ps = parallel_state
    state_dict["rng_state"] = ShardedObject(
        "rng_state",
        [_generator_states()],
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )
    rank = torch.distributed.get_rank()
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state_dict, ckpt_dir, content_metadata=metadata)
    torch.distributed.barrier()
    if rank == 0:
        torch.save(_train_state_tensors(train_state), os.path.join(ckpt_dir, "train_state.pt"))
        shutil.copy(os.path.join(ckpt_dir, "train_state.pt"), os.path.join(root, "latest_train_state.pt"))
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(step))
        run_config = {
            "checkpoint": {"save_optim": True, "save_rng": True, "ckpt_format": "torch_dist"},
            "model": {
                "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
                "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
                "num_layers": cfg.model.num_layers,
                "hidden_size": cfg.model.hidden_size,
            },
            "optimizer": {"use_distributed_optimizer": bool(cfg.optimizer.use_distributed_optimizer)},
        }
        with open(os.path.join(ckpt_dir, "run_config.yaml"), "w") as f:
            yaml.safe_dump(run_config, f)
    torch.distributed.barrier()


class WriteUpstreamCheckpoint(Callback):
    """At the save of step ``at``, first write Megatron-Bridge's checkpoint of that step into ``root``."""

    def __init__(self, root: str, at: int) -> None:
        self.root, self.at = root, at

    def on_checkpoint_save_start(self, context) -> None:
        if context.state.train_state.step == self.at:
            write_upstream_checkpoint(self.root, context)


def main() -> None:
    from megatron.bridge.recipes.tiny_gpt import tiny_gpt_config
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import main as pretrain_main

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--at", type=int, required=True)
    args, overrides = parser.parse_known_args(sys.argv[1:])
    pretrain_main(tiny_gpt_config, forward_step, overrides, callbacks=[WriteUpstreamCheckpoint(args.dir, args.at)])


if __name__ == "__main__":  # the guard matters: checkpoint writers spawn helper processes
    main()
