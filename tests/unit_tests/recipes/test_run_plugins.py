"""FaultTolerancePlugin with real nemo_run objects: setup, rejections, the sbatch script, a local launch."""

import copy
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

run = pytest.importorskip("nemo_run")
import nemo_run.config  # noqa: E402
from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig  # noqa: E402
from tests.unit_tests.configs import base_config  # noqa: E402

from megatron.bridge.recipes.run_plugins import (  # noqa: E402
    FT_CFG_PATH_ENV,
    FaultTolerancePlugin,
    FaultTolerancePluginScriptArgs,
)
from megatron.bridge.training.config import ConfigContainer, InProcessRestartConfig  # noqa: E402

SECTIONS = {"setup": 600.0, "step": 180.0, "checkpointing": 420.0}


@pytest.fixture
def nemorun_home(tmp_path, monkeypatch) -> Path:
    """A private NEMORUN_HOME; nemo_run reads the variable once at import, so its module global is patched too."""
    home = tmp_path / "nemorun_home"
    home.mkdir()
    monkeypatch.setenv("NEMORUN_HOME", str(home))
    monkeypatch.setattr(nemo_run.config, "_NEMORUN_HOME", str(home))
    return home


@pytest.fixture
def stdin_devnull(monkeypatch):
    """nemo_run's Slurm packaging runs shell commands through invoke, which reads stdin (pytest forbids that)."""
    with open(os.devnull) as devnull:
        monkeypatch.setattr(sys, "stdin", devnull)
        yield


def _script(*args: str) -> "run.Script":
    return run.Script(path="examples/pretrain_tiny_gpt.py", entrypoint="python", args=list(args))


def _read_ft_yaml(path: Path) -> FaultToleranceConfig:
    """Parse a config file exactly as ft_launcher does."""
    return FaultToleranceConfig.from_yaml_file(str(path))


def test_is_a_nemo_run_plugin_with_the_documented_defaults():
    plugin = FaultTolerancePlugin()
    assert isinstance(plugin, run.Plugin)
    defaults = {f.name: getattr(plugin, f.name) for f in dataclasses.fields(plugin) if f.init}
    assert defaults == {
        "enable_ft_package": True,
        "calc_ft_timeouts": True,
        "num_in_job_restarts": 3,
        "num_job_retries_on_failure": 2,
        "initial_rank_heartbeat_timeout": 1800,
        "rank_heartbeat_timeout": 300,
        "setup_timeout": 600,
        "step_timeout": 180,
        "checkpointing_timeout": 420,
        "out_of_section_timeout": 300,
        "workload_check_interval": 5.0,
        "script_args_converter_fn": None,
    }
    assert isinstance(plugin.workload_check_interval, float)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_in_job_restarts": -1},
        {"num_job_retries_on_failure": 1.5},
        {"rank_heartbeat_timeout": 0},
        {"initial_rank_heartbeat_timeout": None},
        {"step_timeout": -3},
        {"workload_check_interval": "5"},
    ],
)
def test_invalid_values_are_rejected(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        FaultTolerancePlugin(**kwargs)


def test_local_executor_gets_ft_launcher_retries_config_and_task_overrides(nemorun_home):
    task = _script("train.train_iters=100")
    executor = run.LocalExecutor(ntasks_per_node=2)
    plugin = FaultTolerancePlugin()

    plugin.setup(task, executor)

    launcher = executor.launcher
    assert isinstance(launcher, run.FaultTolerance)
    assert launcher.max_restarts == 3
    assert launcher.initial_rank_heartbeat_timeout == 1800
    assert launcher.rank_heartbeat_timeout == 300
    assert launcher.workload_check_interval == 5.0
    assert executor.retries == 2
    assert task.args == ["train.train_iters=100", "ft.enable_ft_package=true", "ft.calc_ft_timeouts=true"]

    # The section timeouts reach ft_launcher through the config file named by PET_FT_CFG_PATH.
    cfg_path = Path(executor.env_vars[FT_CFG_PATH_ENV])
    assert cfg_path.parent == nemorun_home / "fault_tolerance"
    cfg = _read_ft_yaml(cfg_path)
    assert dict(cfg.rank_section_timeouts) == SECTIONS
    assert cfg.rank_out_of_section_timeout == 300
    assert cfg.initial_rank_heartbeat_timeout == 1800
    assert cfg.rank_heartbeat_timeout == 300
    assert cfg.workload_check_interval == 5.0


def test_custom_values_and_none_section_timeouts(nemorun_home):
    task = _script()
    executor = run.LocalExecutor(ntasks_per_node=2, env_vars={"KEEP": "1"})
    plugin = FaultTolerancePlugin(
        calc_ft_timeouts=False,
        num_in_job_restarts=1,
        num_job_retries_on_failure=0,
        initial_rank_heartbeat_timeout=60,
        rank_heartbeat_timeout=30,
        setup_timeout=None,
        step_timeout=7.5,
        workload_check_interval=0.5,
    )
    plugin.setup(task, executor)

    assert executor.launcher.max_restarts == 1
    assert executor.launcher.workload_check_interval == 0.5
    assert executor.retries == 0
    assert executor.env_vars["KEEP"] == "1"
    assert task.args == ["ft.enable_ft_package=true", "ft.calc_ft_timeouts=false"]
    cfg = _read_ft_yaml(Path(executor.env_vars[FT_CFG_PATH_ENV]))
    assert dict(cfg.rank_section_timeouts) == {"setup": None, "step": 7.5, "checkpointing": 420.0}
    assert (cfg.initial_rank_heartbeat_timeout, cfg.rank_heartbeat_timeout) == (60, 30)


def test_existing_ft_overrides_are_replaced_not_duplicated(nemorun_home):
    task = _script(
        "ft.enable_ft_package=false",
        "train.train_iters=100",
        "ft.calc_ft_timeouts=true",
        "ft.simulate_fault=true",
        "ft.calc_ft_timeouts=true",
    )
    executor = run.LocalExecutor(ntasks_per_node=2)
    plugin = FaultTolerancePlugin(calc_ft_timeouts=False)

    plugin.setup(task, executor)
    plugin.setup(task, executor)  # applying twice changes nothing more

    assert task.args == [
        "train.train_iters=100",
        "ft.simulate_fault=true",
        "ft.enable_ft_package=true",
        "ft.calc_ft_timeouts=false",
    ]


def test_same_settings_share_one_config_file(nemorun_home):
    first, second = run.LocalExecutor(), run.LocalExecutor()
    FaultTolerancePlugin().setup(_script(), first)
    FaultTolerancePlugin().setup(_script(), second)
    other = run.LocalExecutor()
    FaultTolerancePlugin(step_timeout=60).setup(_script(), other)
    assert first.env_vars[FT_CFG_PATH_ENV] == second.env_vars[FT_CFG_PATH_ENV]
    assert other.env_vars[FT_CFG_PATH_ENV] != first.env_vars[FT_CFG_PATH_ENV]


def _noop(x: int) -> int:
    return x


def _with_inprocess_restart() -> ConfigContainer:
    cfg = base_config()
    cfg.inprocess_restart = InProcessRestartConfig(enabled=True)
    return cfg


def _pretrain_like(config: ConfigContainer) -> None:
    """A target taking the config the way megatron.bridge.training.pretrain.pretrain does."""


UNSUPPORTED_TASKS = [
    pytest.param(lambda: run.Partial(_noop, x=1), TypeError, r"run\.Partial whose target takes.*config", id="partial"),
    pytest.param(lambda: run.Config(_noop, x=1), TypeError, r"Config.*supported: nemo_run\.Script", id="config"),
    pytest.param(
        lambda: run.Script(path="examples/pretrain_tiny_gpt.py"), ValueError, r"entrypoint='python'", id="bash-entry"
    ),
]


@pytest.mark.parametrize(("make_task", "error", "message"), UNSUPPORTED_TASKS)
def test_unsupported_tasks_are_rejected_before_anything_changes(nemorun_home, make_task, error, message):
    task = make_task()
    executor = run.LocalExecutor(ntasks_per_node=2, launcher="torchrun", retries=5)
    task_before, executor_before = copy.deepcopy(task), copy.deepcopy(executor)

    with pytest.raises(error, match=message):
        FaultTolerancePlugin().setup(task, executor)

    assert task == task_before
    assert executor == executor_before
    assert not (nemorun_home / "fault_tolerance").exists()


def test_a_partial_task_gets_the_settings_in_its_config(nemorun_home):
    config = base_config()
    config.ft = None  # Megatron-Bridge's default: no ft section
    task = run.Partial(_pretrain_like, config=config)
    executor = run.LocalExecutor(ntasks_per_node=2)
    FaultTolerancePlugin(calc_ft_timeouts=False).setup(task, executor)
    assert (task.config.ft.enable_ft_package, task.config.ft.calc_ft_timeouts) == (True, False)
    assert isinstance(executor.launcher, run.FaultTolerance) and executor.retries == 2


def test_other_executors_get_ft_launcher_without_the_section_file(nemorun_home, caplog):
    task = _script("train.train_iters=1")
    executor = run.DockerExecutor(container_image="some/image")
    with caplog.at_level("WARNING"):
        FaultTolerancePlugin().setup(task, executor)
    assert isinstance(executor.launcher, run.FaultTolerance) and executor.retries == 2
    assert FT_CFG_PATH_ENV not in executor.env_vars
    assert "reach ft_launcher only through LocalExecutor and SlurmExecutor" in caplog.text
    assert task.args[-2:] == ["ft.enable_ft_package=true", "ft.calc_ft_timeouts=true"]


def test_a_converter_writes_the_script_arguments(nemorun_home):
    def converter(args: FaultTolerancePluginScriptArgs) -> list[str]:
        return [f"--ft={int(args.enable_ft_package)}{int(args.calc_ft_timeouts)}"]

    task = _script("train.train_iters=3")
    FaultTolerancePlugin(script_args_converter_fn=converter).setup(task, run.LocalExecutor())
    assert task.args == ["train.train_iters=3", "--ft=11"]


def test_unassigned_slurm_executor_is_rejected_before_anything_changes(tmp_path):
    task = _script()
    executor = run.SlurmExecutor(account="acct", tunnel=run.LocalTunnel(job_dir=str(tmp_path)))
    task_before, executor_before = copy.deepcopy(task), copy.deepcopy(executor)

    with pytest.raises(ValueError, match="assigned to an experiment"):
        FaultTolerancePlugin().setup(task, executor)

    assert task == task_before
    assert executor == executor_before


def _sbatch_script(nemorun_home: Path, plugin: Any, **executor_kwargs) -> tuple[str, "run.Experiment"]:
    """The sbatch script nemo_run would submit with ``plugin`` (or a list of plugins); a dry run submits nothing."""
    job_root = nemorun_home / "experiments"
    executor = run.SlurmExecutor(
        account="acct",
        partition="debug",
        nodes=1,
        ntasks_per_node=2,
        tunnel=run.LocalTunnel(job_dir=str(job_root)),
        packager=run.Packager(),
        **executor_kwargs,
    )
    task = run.Script(path="/abs/examples/pretrain_tiny_gpt.py", entrypoint="python", args=["train.train_iters=100"])
    with run.Experiment("ft_sbatch", executor=executor, log_level="WARN") as exp:
        exp.add(task, name="train", plugins=plugin if isinstance(plugin, list) else [plugin])
        exp.dryrun(log=False, delete_exp_dir=False)
        job_executor = exp.jobs[0].executor
        script_path = Path(job_executor.experiment_dir) / f"{job_executor.job_name}_sbatch.sh"
        return script_path.read_text(), exp


def _ft_launcher_line(script: str) -> str:
    lines = [line for line in script.splitlines() if line.startswith("srun ") and " ft_launcher " in line]
    assert len(lines) == 1, script
    return lines[0]


def _heredoc_config(script: str, tmp_path: Path) -> tuple[str, FaultToleranceConfig]:
    match = re.search(r"cat > (\S+) <<'(\w+)'\n(.*?)\n\2\n", script, re.S)
    assert match, script
    written = tmp_path / "from_heredoc.yaml"
    written.write_text(match.group(3))
    return match.group(1), _read_ft_yaml(written)


def test_sbatch_script_runs_ft_launcher_with_restarts_timeouts_and_requeue(nemorun_home, tmp_path, stdin_devnull):
    plugin = FaultTolerancePlugin(num_in_job_restarts=4, num_job_retries_on_failure=3, rank_heartbeat_timeout=250)
    script, exp = _sbatch_script(nemorun_home, plugin)

    cmd = _ft_launcher_line(script)
    assert "--max-restarts 4" in cmd
    assert "--ft-initial_rank_heartbeat_timeout 1800" in cmd
    assert "--ft-rank_heartbeat_timeout 250" in cmd
    assert "--ft-workload_check_interval 5.0" in cmd
    assert "--nproc-per-node 2" in cmd
    assert cmd.endswith(
        "/abs/examples/pretrain_tiny_gpt.py train.train_iters=100 ft.enable_ft_package=true ft.calc_ft_timeouts=true"
    )
    assert "--no-python" not in cmd
    assert "#SBATCH --ntasks-per-node=1" in script  # one ft_launcher per node, it starts the 2 ranks

    # Job retries: nemo_run requeues a failed job until num_job_retries_on_failure attempts failed.
    assert "export TORCHX_MAX_RETRIES=3" in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert "Run with: sbatch --requeue" in script

    # Section timeouts: the script writes the YAML into the job dir and points ft_launcher at it.
    job_dir = Path(exp.jobs[0].executor.tunnel.job_dir) / "train"
    target, cfg = _heredoc_config(script, tmp_path)
    assert target == str(job_dir / "ft_launcher_cfg.yaml")
    assert f"export {FT_CFG_PATH_ENV}={target}\n" in script  # /nemo_run replaced by the job dir (no container)
    assert script.index(f"cat > {target}") < script.index(cmd)
    assert dict(cfg.rank_section_timeouts) == SECTIONS
    assert cfg.rank_out_of_section_timeout == 300
    assert cfg.rank_heartbeat_timeout == 250


def test_sbatch_script_in_a_container_points_at_the_mounted_job_dir(nemorun_home, tmp_path, stdin_devnull):
    script, exp = _sbatch_script(
        nemorun_home, FaultTolerancePlugin(), container_image="nvcr.io/some/image", setup_lines="echo user setup"
    )
    job_dir = Path(exp.jobs[0].executor.tunnel.job_dir) / "train"
    target, _ = _heredoc_config(script, tmp_path)
    assert target == str(job_dir / "ft_launcher_cfg.yaml")  # written by the batch shell, outside the container
    assert f"export {FT_CFG_PATH_ENV}=/nemo_run/ft_launcher_cfg.yaml\n" in script
    assert f"{job_dir}:/nemo_run" in _ft_launcher_line(script)  # ... which the container sees at /nemo_run
    assert "echo user setup\n# ft_launcher config" in script  # user setup lines kept


def test_reapplying_to_a_slurm_executor_keeps_one_config_block(tmp_path):
    executor = run.SlurmExecutor(account="acct", tunnel=run.LocalTunnel(job_dir=str(tmp_path)), setup_lines="echo a")
    executor.assign("exp_1", str(tmp_path / "exp_1"), task_id="train", task_dir="train")
    FaultTolerancePlugin(step_timeout=50).setup(_script(), executor)
    FaultTolerancePlugin(step_timeout=60).setup(_script(), executor)
    assert executor.setup_lines.startswith("echo a\n# ft_launcher config")
    assert executor.setup_lines.count("cat > ") == 1
    assert "step: 60" in executor.setup_lines and "step: 50" not in executor.setup_lines
    assert executor.env_vars[FT_CFG_PATH_ENV] == "/nemo_run/ft_launcher_cfg.yaml"


WORKER = """
import json, os, sys
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

client = RankMonitorClient()
client.init_workload_monitoring()
out = {
    "argv": sys.argv[1:],
    "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
    "sections": dict(client.section_timeouts.section),
    "out_of_section": client.section_timeouts.out_of_section,
    "heartbeat": [client.hb_timeouts.initial, client.hb_timeouts.subsequent],
}
client.shutdown_workload_monitoring()
with open(os.path.join(os.environ["OUT_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(out, f)
"""


@pytest.mark.functional
def test_local_launch_starts_two_ranks_under_ft_launcher_with_the_config(nemorun_home, tmp_path, monkeypatch):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    monkeypatch.chdir(tmp_path)
    task = run.Script(
        path=str(worker), entrypoint="python", args=["train.train_iters=3"], env={"OUT_DIR": str(out_dir)}
    )
    plugin = FaultTolerancePlugin(initial_rank_heartbeat_timeout=120, rank_heartbeat_timeout=60, step_timeout=90)
    executor = run.LocalExecutor(ntasks_per_node=2)

    run.run(task, executor=executor, plugins=[plugin], name="ft_local", tail_logs=False, log_level="WARN")

    exp = run.Experiment.from_title("ft_local")
    info = exp.status(return_dict=True)["ft_local"]
    status_file = Path(info["local_dir"]) / "nemo_run" / info["handle"].rsplit("/", 1)[-1] / "SUCCESS"
    result = json.loads(status_file.read_text())  # torchx's status file, whatever the outcome
    logs = "\n".join(p.read_text() for p in Path(info["local_dir"]).rglob("*.log"))
    assert result["final_state"] == "SUCCEEDED", logs[-4000:]
    assert result["roles"]["ft_local"][0]["exitcode"] == 0
    # ft_launcher's own log lines: 0.4 names its logger ft_launcher<pid>, 0.6 and later print launcher.py:<line>.
    assert re.search(r"\[ft_launcher\d+@|\] launcher\.py:\d+ ", logs), logs[-4000:]

    ranks = sorted(out_dir.glob("rank*.json"))
    assert [p.name for p in ranks] == ["rank0.json", "rank1.json"], logs[-4000:]
    for path in ranks:
        seen = json.loads(path.read_text())
        assert seen["argv"] == ["train.train_iters=3", "ft.enable_ft_package=true", "ft.calc_ft_timeouts=true"]
        assert seen["restart"] == "0"
        assert seen["sections"] == {"setup": 600.0, "step": 90.0, "checkpointing": 420.0}
        assert seen["out_of_section"] == 300.0
        assert seen["heartbeat"] == [120.0, 60.0]


def test_the_performance_scripts_path_offers_the_same_plugins():
    import importlib.util

    from megatron.bridge.recipes import run_plugins

    path = Path(__file__).resolve().parents[3] / "scripts" / "performance" / "resiliency_plugins.py"
    spec = importlib.util.spec_from_file_location("resiliency_plugins", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.FaultTolerancePlugin is run_plugins.FaultTolerancePlugin
    assert module.FaultTolerancePluginScriptArgs is run_plugins.FaultTolerancePluginScriptArgs
    assert module.PreemptionPlugin is run_plugins.PreemptionPlugin


def test_a_recipe_run_by_name_keeps_its_name_first_under_the_plugins(nemorun_home):
    from megatron.bridge.recipes.run_plugins import PreemptionPlugin

    args = ["llama3_tiny_pretrain_config", "train.train_iters=9"]
    task = run.Script(path="examples/pretrain_recipe.py", entrypoint="python", args=args)
    executor = run.LocalExecutor(ntasks_per_node=2)
    FaultTolerancePlugin().setup(task, executor)
    PreemptionPlugin().setup(task, executor)
    assert task.args[:2] == ["llama3_tiny_pretrain_config", "train.train_iters=9"]
    assert "ft.enable_ft_package=true" in task.args and "train.exit_signal_handler=True" in task.args
    assert Path(task.path).exists()


def test_a_task_with_inprocess_restart_gets_fault_tolerance_as_its_outer_layer(nemorun_home):
    task = run.Partial(_pretrain_like, config=_with_inprocess_restart())
    executor = run.LocalExecutor(ntasks_per_node=2)
    FaultTolerancePlugin().setup(task, executor)
    assert task.config.inprocess_restart.enabled and task.config.ft.enable_ft_package
    assert isinstance(executor.launcher, run.FaultTolerance)  # restarts what in-process restart cannot recover
