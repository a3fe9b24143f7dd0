"""PreemptionPlugin with real nemo_run objects: overrides that validate, the sbatch signal line, rejections."""

import copy
import dataclasses

import pytest

run = pytest.importorskip("nemo_run")

from tests.unit_tests.recipes.test_run_plugins import _sbatch_script, nemorun_home, stdin_devnull  # noqa: E402, F401

from megatron.bridge.recipes.run_plugins import FaultTolerancePlugin, PreemptionPlugin  # noqa: E402
from megatron.bridge.training.config import ConfigContainer  # noqa: E402
from megatron.bridge.training.utils.overrides import apply_overrides  # noqa: E402


def test_is_a_nemo_run_plugin_with_the_documented_defaults():
    plugin = PreemptionPlugin()
    assert isinstance(plugin, run.Plugin)
    assert {f.name: getattr(plugin, f.name) for f in dataclasses.fields(plugin) if f.init} == {
        "preempt_time": 60,
        "enable_exit_handler": True,
        "enable_exit_handler_for_data_loader": False,
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
        "train.exit_signal_handler=true",
        "train.exit_signal_handler_for_dataloader=true",
        "train.exit_signal_deadline=108.0",
    ]
    cfg = apply_overrides(ConfigContainer(), task.args)
    cfg.validate(world_size=2)
    assert cfg.train.exit_signal_handler and cfg.train.exit_signal_deadline == 108.0


def test_unsupported_tasks_and_executors_are_rejected_before_anything_changes():
    task = run.Script(path="train.sh")  # bash entrypoint
    executor = run.LocalExecutor()
    before = copy.deepcopy(task), copy.deepcopy(executor)
    with pytest.raises(ValueError, match="PreemptionPlugin needs run.Script"):
        PreemptionPlugin().setup(task, executor)
    assert (task, executor) == before
    with pytest.raises(TypeError, match="PreemptionPlugin does not support executor type"):
        PreemptionPlugin().setup(run.Script(path="x.py", entrypoint="python"), run.DockerExecutor(container_image="i"))


def test_sbatch_script_signals_the_job_step_before_the_limit(nemorun_home, tmp_path, stdin_devnull):  # noqa: F811
    script, _ = _sbatch_script(nemorun_home, PreemptionPlugin(preempt_time=90))
    assert "#SBATCH --signal=TERM@90\n" in script  # no B: the step's processes get it, not only the batch shell
    srun = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1, script
    assert srun[0].endswith(
        "train.train_iters=100 train.exit_signal_handler=true train.exit_signal_handler_for_dataloader=false "
        "train.exit_signal_deadline=81.0"
    ), srun[0]


def test_with_fault_tolerance_the_job_is_requeued_and_ft_launcher_passes_the_signal(
    nemorun_home,  # noqa: F811
    stdin_devnull,  # noqa: F811
):
    script, _ = _sbatch_script(nemorun_home, [FaultTolerancePlugin(), PreemptionPlugin()])
    assert "#SBATCH --signal=TERM@60\n" in script
    line = next(line for line in script.splitlines() if line.startswith("srun ") and " ft_launcher " in line)
    assert "ft.enable_ft_package=true" in line and "train.exit_signal_handler=true" in line
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script  # a stopped, unfinished job starts again and resumes
