"""What a run is and where it came from, said once at start: launcher, restarts, Slurm job, layout, resume source.

Rank 0 logs one ``job info`` block after the checkpoint is loaded and appends the same facts as one JSON line to
``<checkpoint.save>/job_info.jsonl`` (one line per start: a requeued or restarted job adds a line), so that a person
looking at a run directory sees every attempt, how it was launched and what it resumed from.
"""

import json
import logging
import os
import socket
import time
from typing import Any, Optional

from megatron.bridge.training.components import Component, Run
from megatron.bridge.utils import launch_env

logger = logging.getLogger(__name__)

FILE_NAME = "job_info.jsonl"

_SLURM = {
    "job_id": "SLURM_JOB_ID",
    "array_job_id": "SLURM_ARRAY_JOB_ID",
    "array_task_id": "SLURM_ARRAY_TASK_ID",
    "restart_count": "SLURM_RESTART_COUNT",
    "nodelist": "SLURM_JOB_NODELIST",
    "num_nodes": "SLURM_JOB_NUM_NODES",
    "partition": "SLURM_JOB_PARTITION",
}


def detect_launcher(env: Optional[dict[str, str]] = None) -> str:
    """The launcher that started this process, from the environment it set."""
    env = os.environ if env is None else env
    if "FT_RANK_MONITOR_IPC_SOCKET" in env:
        return "ft_launcher"
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return "srun"
    return "none (environment variables)"


def collect(
    env: Optional[dict[str, str]] = None,
    *,
    device: str,
    inprocess_iteration: int,
    checkpoint: dict[str, Optional[str]],
    resumed: dict[str, Any],
) -> dict[str, Any]:
    """The job-info record of this start.

    Args:
        env: the environment to read (default ``os.environ``).
        device: this rank's device, e.g. ``"cpu"`` or ``"cuda:0"``.
        inprocess_iteration: the in-process restart iteration (0 without in-process restart).
        checkpoint: the checkpoint directories (save, load, local).
        resumed: what the run resumed from (tier, iteration, directory, why).
    """
    env = os.environ if env is None else env
    launch = launch_env.current(env)
    slurm = {key: env[var] for key, var in _SLURM.items() if var in env}
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "launcher": detect_launcher(env),
        "world_size": launch.world_size,
        "ranks_per_node": launch.ranks_per_node,
        "device": device,
        "restarts": {
            "in_job": launch.restart_count,
            "in_process": inprocess_iteration,
            "requeue": launch.requeue_count,
        },
        "slurm": slurm or None,
        "checkpoint": checkpoint,
        "resumed": resumed,
    }


def format_block(info: dict[str, Any]) -> str:
    """The record as the indented block the log shows."""
    restarts = info["restarts"]
    resumed = info["resumed"]
    if resumed.get("tier") is None:
        resumed_line = f"nothing, iteration 0 ({resumed.get('why')})"
    else:
        resumed_line = (
            f"{resumed['tier']} tier, iteration {resumed['iteration']}, {resumed['directory']} ({resumed['why']})"
        )
    slurm = info["slurm"]
    slurm_line = ", ".join(f"{k}={v}" for k, v in slurm.items()) if slurm else "not under Slurm"
    ckpt = ", ".join(f"{k}={v}" for k, v in info["checkpoint"].items() if v is not None) or "no checkpoints"
    lines = [
        f"launcher: {info['launcher']} on {info['host']}",
        f"world size {info['world_size']}, {info['ranks_per_node']} rank(s) per node, device {info['device']}",
        f"restarts: in-job {restarts['in_job']}, in-process {restarts['in_process']}, requeue {restarts['requeue']}",
        f"slurm: {slurm_line}",
        f"checkpoints: {ckpt}",
        f"resumed from: {resumed_line}",
    ]
    return "job info:\n" + "\n".join("    " + line for line in lines)


def report(info: dict[str, Any], save_dir: Optional[str]) -> None:
    """Log the block and append the record to ``<save_dir>/job_info.jsonl`` (call on rank 0 only)."""
    logger.info("%s", format_block(info))
    if save_dir is None:
        return
    os.makedirs(save_dir, exist_ok=True)
    with open(os.path.join(save_dir, FILE_NAME), "a") as f:
        f.write(json.dumps(info, sort_keys=True) + "\n")


class JobInfo(Component):
    """The job-info block as a run's component: rank 0 reports it once the run knows what it resumed from."""

    def ready(self, run: Run) -> None:
        """Rank 0 logs the block and appends it to ``<checkpoint.save>/job_info.jsonl``."""
        if run.rank != 0:
            return
        ckpt = run.cfg.checkpoint
        info = collect(
            device=str(run.device),
            inprocess_iteration=run.inprocess_iteration,
            checkpoint={"save": ckpt.save, "load": ckpt.load, "local": ckpt.non_persistent_local_ckpt_dir},
            resumed=run.checkpoints.resumed,
        )
        report(info, ckpt.save)
