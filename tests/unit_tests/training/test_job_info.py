"""The job-info block and record: what the environment says about launcher, restarts and Slurm."""

import json
import logging

from megatron.bridge.training.events import job_info

SLURM_ENV = {
    "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
    "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "x", "FT_RANK_MONITOR_IPC_SOCKET": "/tmp/s",
}  # fmt: skip


def _info(env, resumed=None):
    return job_info.collect(
        env,
        device="cpu",
        inprocess_iteration=0,
        checkpoint={"save": "/ckpt", "load": None, "local": None},
        resumed=resumed or {"tier": None, "iteration": None, "directory": None, "why": "empty"},
    )


def test_launcher_detection():
    assert job_info.detect_launcher(SLURM_ENV) == "ft_launcher"
    assert job_info.detect_launcher({"TORCHELASTIC_RUN_ID": "x"}) == "torchrun"
    assert job_info.detect_launcher({"SLURM_PROCID": "3", "SLURM_STEP_ID": "0"}) == "srun"
    assert job_info.detect_launcher({}).startswith("none")


def test_slurm_fields_and_restart_counts():
    info = _info(SLURM_ENV)
    assert info["slurm"]["job_id"] == "42" and info["slurm"]["nodelist"] == "node[1-2]"
    assert info["restarts"] == {"in_job": 2, "in_process": 0, "requeue": 1}
    assert (info["world_size"], info["ranks_per_node"]) == (16, 8)
    block = job_info.format_block(info)
    assert "job_id=42" in block and "requeue 1" in block and "in-job 2" in block
    assert "slurm: not under Slurm" in job_info.format_block(_info({}))


def test_resumed_line_names_tier_and_reason():
    resumed = {"tier": "global", "iteration": 6, "directory": "/ckpt/iter_0000006", "why": "newest verified"}
    block = job_info.format_block(_info({}, resumed))
    assert "resumed from: global tier, iteration 6, /ckpt/iter_0000006 (newest verified)" in block


def test_report_appends_one_line_per_start(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="megatron.bridge"):
        job_info.report(_info(SLURM_ENV), str(tmp_path))
        job_info.report(_info({}), str(tmp_path))
    lines = (tmp_path / job_info.FILE_NAME).read_text().splitlines()
    assert [json.loads(line)["launcher"] for line in lines] == ["ft_launcher", "none (environment variables)"]
    assert caplog.text.count("job info:") == 2
