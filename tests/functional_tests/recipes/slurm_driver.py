"""Submit the tiny GPT through nemo_run's SlurmExecutor with PreemptionPlugin and FaultTolerancePlugin, and wait.

python slurm_driver.py <checkpoint dir> <train_iters> <time limit> [<preempt_time>]; ``$NEMORUN_HOME`` and
``$SLURM_CONF`` are set by the test. Prints ``RESULT {"status": ..., "log_dir": ...}`` at the end.
"""

import json
import os
import sys
from pathlib import Path

import nemo_run as run

from megatron.bridge.recipes.run_plugins import FaultTolerancePlugin, PreemptionPlugin

ENTRY = Path(__file__).resolve().parents[3] / "examples" / "pretrain_tiny_gpt.py"

if __name__ == "__main__":
    ckpt, iters, time_limit = sys.argv[1:4]
    preempt_time = int(sys.argv[4]) if len(sys.argv) > 4 else 60
    executor = run.SlurmExecutor(
        account="root",
        partition="debug",
        nodes=1,
        ntasks_per_node=2,
        time=time_limit,
        tunnel=run.LocalTunnel(job_dir=os.path.join(os.environ["NEMORUN_HOME"], "experiments")),
        packager=run.Packager(),
        env_vars={"MBRIDGE_FAULTS": os.environ.get("DRILL_FAULTS", ""), "PYTHONUNBUFFERED": "1"},
    )
    task = run.Script(
        path=str(ENTRY),
        entrypoint="python",
        args=[f"train.train_iters={iters}", f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}",
              "checkpoint.save_interval=1000", "logger.log_interval=10"],
    )  # fmt: skip
    plugins = [
        FaultTolerancePlugin(num_job_retries_on_failure=5, calc_ft_timeouts=False),
        PreemptionPlugin(preempt_time=preempt_time),
    ]
    run.run(task, executor=executor, plugins=plugins, name="preempt_drill", detach=False)
    info = run.Experiment.from_title("preempt_drill").status(return_dict=True)["preempt_drill"]
    print("RESULT", json.dumps({"status": str(info["status"]), "log_dir": info["local_dir"]}), flush=True)
