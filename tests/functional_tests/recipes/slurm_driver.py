"""Submit the tiny GPT through nemo_run's SlurmExecutor with PreemptionPlugin and FaultTolerancePlugin, and wait.

python slurm_driver.py --name <experiment> --ckpt <dir> --iters <n> --time <limit> --preempt-time <seconds>
[--faults <spec>] [--marker <tag>]; ``$NEMORUN_HOME`` and ``$SLURM_CONF`` are set by the test. The job's processes
get ``MBRIDGE_FAULTS=<spec>`` and ``MBRIDGE_TEST_RUN=<tag>`` (how the test finds them). Prints
``RESULT {"status": ..., "log_dir": ...}`` at the end.
"""

import argparse
import json
import os
from pathlib import Path

import nemo_run as run

from megatron.bridge.recipes.run_plugins import FaultTolerancePlugin, PreemptionPlugin

ENTRY = Path(__file__).resolve().parents[3] / "examples" / "pretrain_tiny_gpt.py"

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag in ("--name", "--ckpt", "--iters", "--time", "--preempt-time"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--faults", default="")
    parser.add_argument("--marker", default="")
    args = parser.parse_args()
    executor = run.SlurmExecutor(
        account="root",
        partition="debug",
        nodes=1,
        ntasks_per_node=2,
        time=args.time,
        tunnel=run.LocalTunnel(job_dir=os.path.join(os.environ["NEMORUN_HOME"], "experiments")),
        packager=run.Packager(),
        env_vars={"MBRIDGE_FAULTS": args.faults, "MBRIDGE_TEST_RUN": args.marker, "PYTHONUNBUFFERED": "1"},
    )
    task = run.Script(
        path=str(ENTRY),
        entrypoint="python",
        args=[f"train.train_iters={args.iters}", f"checkpoint.save={args.ckpt}", f"checkpoint.load={args.ckpt}",
              "checkpoint.save_interval=1000", "logger.log_interval=1"],
    )  # fmt: skip
    plugins = [
        FaultTolerancePlugin(num_job_retries_on_failure=5, calc_ft_timeouts=False),
        PreemptionPlugin(preempt_time=int(args.preempt_time)),
    ]
    run.run(task, executor=executor, plugins=plugins, name=args.name, detach=False)
    info = run.Experiment.from_title(args.name).status(return_dict=True)[args.name]
    print("RESULT", json.dumps({"status": str(info["status"]), "log_dir": info["local_dir"]}), flush=True)
