"""FaultTolerancePlugin through a real nemo_run LocalExecutor: ft_launcher starts 2 ranks and training finishes.

The task is the generic recipe entry (``examples/pretrain_recipe.py``) running the CPU Llama recipe by name.
"""

import json
import os
import subprocess
import sys
import textwrap

from tests.functional_tests.harness import REPO, kill_processes_with_marker

_DRIVER = textwrap.dedent(
    """
    import json, os, sys
    import nemo_run as run
    from megatron.bridge.recipes.run_plugins import FaultTolerancePlugin

    if __name__ == "__main__":
        ckpt = sys.argv[1]
        task = run.Script(path="examples/pretrain_recipe.py", entrypoint="python",
                          args=["llama3_tiny_pretrain_config", "train.train_iters=4", "dataset.num_workers=0",
                                f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}",
                                f"logger.tensorboard_dir={ckpt}-tensorboard"])
        run.run(task, executor=run.LocalExecutor(ntasks_per_node=2),
                plugins=[FaultTolerancePlugin(num_in_job_restarts=1)], name="tiny_gpt_ft")
        info = run.Experiment.from_title("tiny_gpt_ft").status(return_dict=True)["tiny_gpt_ft"]
        print("RESULT", json.dumps({"status": str(info["status"]), "local_dir": info["local_dir"]}))
    """
)


def test_plugin_launches_ft_launcher_and_trains(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    marker = os.urandom(8).hex()
    env = {**os.environ, "NEMORUN_HOME": str(tmp_path / "home"), "MBRIDGE_TEST_RUN": marker}
    try:
        proc = subprocess.run(
            [sys.executable, str(driver), str(tmp_path / "ckpt")], cwd=REPO, env=env, capture_output=True,
            text=True, timeout=300, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        kill_processes_with_marker(marker)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result["status"] == "SUCCEEDED", out[-4000:]
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "home").rglob("*.log"))
    assert "ft_launcher" in out or "ft_launcher" in logs
    assert "[FaultTolerance] section timeouts (from the launcher): setup=600.0s, step=180.0s" in logs + out
    assert "training stopped at iteration 4" in logs + out
    assert "iteration 4/4 | consumed samples 32 |" in logs + out  # the Llama recipe's global batch of 8
    assert (tmp_path / "ckpt" / "iter_0000004" / "manifest.json").exists()
