"""PreemptionPlugin with real nemo_run objects: overrides that validate, the sbatch signal line, rejections."""

import dataclasses

import pytest

run = pytest.importorskip("nemo_run")

from tests.unit_tests.configs import base_config  # noqa: E402
from tests.unit_tests.recipes.test_run_plugins import _sbatch_script, nemorun_home, stdin_devnull  # noqa: E402, F401

from megatron.bridge.recipes.run_plugins import (  # noqa: E402
    FaultTolerancePlugin,
    PreemptionPlugin,
    PreemptionPluginScriptArgs,
)
from megatron.bridge.training.config import ConfigContainer  # noqa: E402
from megatron.bridge.training.utils.overrides import apply_overrides  # noqa: E402


def test_is_a_nemo_run_plugin_with_the_documented_defaults():
    plugin = PreemptionPlugin()
    assert isinstance(plugin, run.Plugin)
    assert {f.name: getattr(plugin, f.name) for f in dataclasses.fields(plugin) if f.init} == {
        "preempt_time": 60,
        "enable_exit_handler": True,
        "enable_exit_handler_for_data_loader": False,
        "script_args_converter_fn": None,
    }


@pytest.mark.parametrize(
    "kwargs",
    [{"preempt_time": 0}, {"preempt_time": 1.5}, {"preempt_time": True},
     {"enable_exit_handler": False, "enable_exit_handler_for_data_loader": True}],
)  # fmt: skip
def test_invalid_values_are_rejected(kwargs):
    with pytest.raises(ValueError, match="PreemptionPlugin"):
        PreemptionPlugin(**kwargs)


def test_local_executor_gets_overrides_that_validate_and_replace_earlier_ones():
    task = run.Script(
        path="examples/pretrain_tiny_gpt.py", entrypoint="python",
        args=["train.train_iters=10", "train.exit_signal_handler=false", "train.exit_signal_deadline=1"],
    )  # fmt: skip
    executor = run.LocalExecutor(ntasks_per_node=2)
    PreemptionPlugin(preempt_time=120, enable_exit_handler_for_data_loader=True).setup(task, executor)
    assert task.args == [
        "train.train_iters=10",
        "train.exit_signal_handler=True",
        "train.exit_signal_handler_for_dataloader=True",
        "train.exit_signal_deadline=108.0",
    ]
    cfg = apply_overrides(base_config(), task.args)
    cfg.validate(world_size=2)
    assert cfg.train.exit_signal_handler and cfg.train.exit_signal_deadline == 108.0


def _pretrain_like(config: ConfigContainer) -> None:
    """A target taking the config the way megatron.bridge.training.pretrain.pretrain does."""


def test_a_partial_task_and_any_executor_get_the_handler_without_a_scheduler_signal():
    task = run.Partial(_pretrain_like, config=base_config())
    executor = run.DockerExecutor(container_image="i")
    PreemptionPlugin(preempt_time=30).setup(task, executor)
    train = task.config.train
    assert (train.exit_signal_handler, train.exit_signal_handler_for_dataloader, train.exit_signal_deadline) == (
        True,
        False,
        27.0,
    )
    assert not getattr(executor, "signal", None)  # only Slurm has one


def test_without_the_exit_handler_nothing_is_added_and_a_converter_writes_the_rest():
    task = run.Script(path="train.sh", args=["x=1"])  # any script: the launcher is not replaced
    PreemptionPlugin(enable_exit_handler=False).setup(task, run.LocalExecutor())
    assert task.args == ["x=1"]

    def converter(args: PreemptionPluginScriptArgs) -> list[str]:
        return ["--exit-handler" if args.enable_exit_handler else "--no-exit-handler"]

    PreemptionPlugin(script_args_converter_fn=converter).setup(task, run.LocalExecutor())
    assert task.args == ["x=1", "--exit-handler"]


def test_a_task_config_is_required():
    with pytest.raises(TypeError, match="PreemptionPlugin does not support task type"):
        PreemptionPlugin().setup(run.Config(_pretrain_like, config=None), run.LocalExecutor())


def test_sbatch_script_signals_the_job_step_before_the_limit(nemorun_home, tmp_path, stdin_devnull):  # noqa: F811
    script, _ = _sbatch_script(nemorun_home, PreemptionPlugin(preempt_time=90))
    assert "#SBATCH --signal=TERM@90\n" in script  # no B: the step's processes get it, not only the batch shell
    srun = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1, script
    assert srun[0].endswith(
        "train.train_iters=100 train.exit_signal_handler=True train.exit_signal_handler_for_dataloader=False "
        "train.exit_signal_deadline=81.0"
    ), srun[0]


def test_with_fault_tolerance_the_job_is_requeued_and_ft_launcher_passes_the_signal(
    nemorun_home,  # noqa: F811
    stdin_devnull,  # noqa: F811
):
    script, _ = _sbatch_script(nemorun_home, [FaultTolerancePlugin(), PreemptionPlugin()])
    assert "#SBATCH --signal=TERM@60\n" in script
    line = next(line for line in script.splitlines() if line.startswith("srun ") and " ft_launcher " in line)
    assert "ft.enable_ft_package=true" in line and "train.exit_signal_handler=True" in line
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script  # a stopped, unfinished job starts again and resumes
