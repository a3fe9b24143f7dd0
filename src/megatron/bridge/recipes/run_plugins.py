"""NeMo-Run plugins that turn on megatron.bridge resiliency features for a launched task.

:class:`PreemptionPlugin` makes a task save and exit when its job is about to be stopped (time limit, preemption);
see its docstring.

:class:`FaultTolerancePlugin` launches the task with nvidia-resiliency-ext's ``ft_launcher`` (in-job restarts, rank
heartbeat and section timeouts), makes the scheduler retry a failed job, and enables fault tolerance in the
training config through dotted overrides::

    import nemo_run as run

    from megatron.bridge.recipes.run_plugins import FaultTolerancePlugin

    task = run.Script(path="examples/pretrain_tiny_gpt.py", entrypoint="python", args=["train.train_iters=100"])
    run.run(task, executor=run.LocalExecutor(ntasks_per_node=2), plugins=[FaultTolerancePlugin()])

Both plugins take a ``run.Script`` (the settings become dotted overrides appended to its arguments, spelled as
Megatron-Bridge's plugins spell them: ``ft.enable_ft_package=true``, ``train.exit_signal_handler=True``; a
``script_args_converter_fn`` may write them differently) or a ``run.Partial`` whose ``config`` is a
``ConfigContainer`` (the settings are set on it), on any executor.

How the settings reach ``ft_launcher`` (nemo_run 0.11): nemo_run's ``FaultTolerance`` launcher turns
``max_restarts``, the heartbeat timeouts and ``workload_check_interval`` into ``--max-restarts``/``--ft-*`` flags, but
it has no section-timeout fields and never passes its ``cfg_path`` to ``ft_launcher`` (on Slurm it only exports it as
``FAULT_TOL_CFG_PATH``, which ``ft_launcher`` does not read). ``ft_launcher`` does read its ``--ft-cfg-path`` from the
``PET_FT_CFG_PATH`` environment variable, so this plugin writes a YAML file with a ``fault_tolerance:`` section and
points ``PET_FT_CFG_PATH`` at it. Command-line flags override the file; both carry the same values.

- ``LocalExecutor``: the YAML is written when the plugin is applied, to
  ``$NEMORUN_HOME/fault_tolerance/ft_launcher_cfg_<hash>.yaml`` (named by its content).
- ``SlurmExecutor``: the sbatch script itself writes the YAML into the job directory on the cluster (a heredoc added
  to ``setup_lines``), so it also works through an SSH tunnel; the variable points at the path the job's processes
  see (inside the container, if there is one).
- Other executors: no YAML is delivered (a warning says so); ft_launcher then applies its own section defaults, and
  training falls back to heartbeats when the sections have no timeouts.
"""

import hashlib
import logging
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron.bridge.training.config import FaultToleranceConfig
from megatron.bridge.utils.fs import atomic_write
from megatron.bridge.utils.optional_imports import require

run = require("nemo_run")
_nemo_run_config = require("nemo_run.config")

logger = logging.getLogger(__name__)

#: ``ft_launcher`` reads ``--ft-cfg-path`` from this environment variable (torch's ``PET_<dest>`` convention).
FT_CFG_PATH_ENV = "PET_FT_CFG_PATH"
#: File name of the ft_launcher config inside a Slurm job directory.
SLURM_FT_CFG_NAME = "ft_launcher_cfg.yaml"
_HEREDOC_MARK = "MBRIDGE_FT_LAUNCHER_CFG_EOF"
_HEREDOC_COMMENT = "# ft_launcher config written by megatron.bridge FaultTolerancePlugin (section timeouts)"
_HEREDOC_BLOCK = re.compile(rf"^{re.escape(_HEREDOC_COMMENT)}\n.*?^{_HEREDOC_MARK}$\n?", re.S | re.M)
_FT_OVERRIDE_KEYS = ("ft.enable_ft_package", "ft.calc_ft_timeouts")


def _check_timeout(name: str, value: Any, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        none = " or None (no timeout)" if allow_none else ""
        raise ValueError(f"FaultTolerancePlugin.{name} must be a number of seconds > 0{none}, got {value!r}")


@dataclass
class FaultTolerancePluginScriptArgs:
    """What :class:`FaultTolerancePlugin` tells a ``run.Script`` task; a converter makes it command-line arguments."""

    enable_ft_package: bool
    """Value for ``ft.enable_ft_package``."""
    calc_ft_timeouts: bool
    """Value for ``ft.calc_ft_timeouts``."""


def _default_fault_tolerance_converter(args: FaultTolerancePluginScriptArgs) -> list[str]:
    # Lower-case booleans, as Megatron-Bridge writes them (its Hydra-style overrides); the override parser takes both.
    return [
        f"ft.enable_ft_package={str(args.enable_ft_package).lower()}",
        f"ft.calc_ft_timeouts={str(args.calc_ft_timeouts).lower()}",
    ]


@dataclass
class PreemptionPluginScriptArgs:
    """What :class:`PreemptionPlugin` tells a ``run.Script`` task; a converter makes it command-line arguments."""

    enable_exit_handler: bool
    """Value for ``train.exit_signal_handler``."""
    enable_exit_handler_for_data_loader: bool
    """Value for ``train.exit_signal_handler_for_dataloader``."""
    exit_signal_deadline: Optional[float] = None
    """Value for ``train.exit_signal_deadline`` (this package's addition; ``None``: not set)."""


def _default_preemption_converter(args: PreemptionPluginScriptArgs) -> list[str]:
    overrides = [
        f"train.exit_signal_handler={args.enable_exit_handler!r}",
        f"train.exit_signal_handler_for_dataloader={args.enable_exit_handler_for_data_loader!r}",
    ]
    if args.exit_signal_deadline is not None:
        overrides.append(f"train.exit_signal_deadline={args.exit_signal_deadline!r}")
    return overrides


@dataclass(kw_only=True)
class FaultTolerancePlugin(run.Plugin):
    """Run a task under ``ft_launcher`` with in-job restarts, job retries and fault tolerance enabled.

    ``setup`` (called by nemo_run for each task the plugin is given to):

    - replaces the executor's launcher with ``nemo_run``'s ``FaultTolerance`` launcher (``ft_launcher``) carrying
      the heartbeat timeouts, ``max_restarts=num_in_job_restarts`` and the workload check interval, and delivers the
      section timeouts through a YAML config (see the module docstring);
    - sets ``executor.retries = num_job_retries_on_failure`` (Slurm: the job is requeued after a failure until that
      many attempts failed; nemo_run's local scheduler does not retry);
    - ``run.Script``: appends ``ft.enable_ft_package=<bool>`` and ``ft.calc_ft_timeouts=<bool>`` (or what
      ``script_args_converter_fn`` makes of :class:`FaultTolerancePluginScriptArgs`) to the task's arguments,
      replacing earlier values of those keys; ``run.Partial``: sets both on its ``config.ft`` (made when ``None``).

    Any executor; the section timeouts reach ft_launcher through ``run.LocalExecutor`` and ``run.SlurmExecutor``
    (see the module docstring). A Python file must be run by ``entrypoint="python"`` (ft_launcher would exec it).
    Anything refused is refused before the task or executor changes.

    Attributes:
        enable_ft_package: Value of the ``ft.enable_ft_package`` override (heartbeats and sections from training).
        calc_ft_timeouts: Value of the ``ft.calc_ft_timeouts`` override (training computes section timeouts from
            observed times and saves them for the next run).
        num_in_job_restarts: ``ft_launcher --max-restarts``: worker-group restarts within one job.
        num_job_retries_on_failure: ``executor.retries``: new job launches after a failed job.
        initial_rank_heartbeat_timeout: Seconds allowed until a rank's first heartbeat.
        rank_heartbeat_timeout: Seconds allowed between later heartbeats.
        setup_timeout: Timeout (seconds) of the ``setup`` section; ``None`` disables it.
        step_timeout: Timeout (seconds) of the ``step`` section; ``None`` disables it.
        checkpointing_timeout: Timeout (seconds) of the ``checkpointing`` section; ``None`` disables it.
        out_of_section_timeout: Timeout (seconds) for time spent outside every section; ``None`` disables it.
        workload_check_interval: Seconds between the rank monitors' checks.
        script_args_converter_fn: Makes the arguments of a ``run.Script`` task from
            :class:`FaultTolerancePluginScriptArgs`; ``None``: ``ft.<field>=<Python literal>``.
    """

    enable_ft_package: bool = True
    calc_ft_timeouts: bool = True
    num_in_job_restarts: int = 3
    num_job_retries_on_failure: int = 2
    initial_rank_heartbeat_timeout: int = 1800
    rank_heartbeat_timeout: int = 300
    setup_timeout: Optional[float] = 600
    step_timeout: Optional[float] = 180
    checkpointing_timeout: Optional[float] = 420
    out_of_section_timeout: Optional[float] = 300
    workload_check_interval: float = 5.0
    script_args_converter_fn: Optional[Callable[[FaultTolerancePluginScriptArgs], list[str]]] = None

    def __post_init__(self) -> None:
        for name in ("num_in_job_restarts", "num_job_retries_on_failure"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"FaultTolerancePlugin.{name} must be an integer >= 0, got {value!r}")
        for name in ("initial_rank_heartbeat_timeout", "rank_heartbeat_timeout", "workload_check_interval"):
            _check_timeout(name, getattr(self, name), allow_none=False)
        for name in ("setup_timeout", "step_timeout", "checkpointing_timeout", "out_of_section_timeout"):
            _check_timeout(name, getattr(self, name), allow_none=True)

    @property
    def rank_section_timeouts(self) -> dict[str, Optional[float]]:
        """Section timeouts as ``ft_launcher`` expects them (``--ft-rank-section-timeouts``)."""
        return {"setup": self.setup_timeout, "step": self.step_timeout, "checkpointing": self.checkpointing_timeout}

    def ft_launcher_config(self) -> dict[str, Any]:
        """The ``fault_tolerance`` section of the ``ft_launcher`` YAML config.

        Returns:
            A dict with a single ``fault_tolerance`` key, as ``FaultToleranceConfig.from_yaml_file`` reads it.
        """
        return {
            "fault_tolerance": {
                "workload_check_interval": self.workload_check_interval,
                "initial_rank_heartbeat_timeout": self.initial_rank_heartbeat_timeout,
                "rank_heartbeat_timeout": self.rank_heartbeat_timeout,
                "rank_section_timeouts": self.rank_section_timeouts,
                "rank_out_of_section_timeout": self.out_of_section_timeout,
            }
        }

    def ft_launcher_config_yaml(self) -> str:
        """The ``ft_launcher`` config (see :meth:`ft_launcher_config`) as YAML text."""
        return yaml.safe_dump(self.ft_launcher_config(), sort_keys=False)

    def setup(self, task: Any, executor: Any) -> None:
        """Switch ``executor`` to ``ft_launcher`` and enable fault tolerance in ``task``.

        Everything is checked before anything changes: a refused task or executor is left as it was.

        Args:
            task: The task nemo_run is about to launch: a ``run.Script`` or a ``run.Partial`` with a ``config``.
            executor: The task's executor.

        Raises:
            TypeError: If the task is neither a ``run.Script`` nor a ``run.Partial`` with a ``config``.
            ValueError: If a Python file is not run by Python or a Slurm executor has no job directory yet.
        """
        name = type(self).__name__
        config = _check_task(task, name, launcher_replaced=True)
        text = self.ft_launcher_config_yaml()
        cfg_path, setup_lines = None, None
        if isinstance(executor, run.SlurmExecutor):
            if not executor.job_dir:
                raise ValueError(
                    "FaultTolerancePlugin needs a SlurmExecutor that is assigned to an experiment (job_dir is empty); "
                    "pass the plugin to run.run(...) or Experiment.add(...), which assign the executor first"
                )
            cfg_path, setup_lines = _slurm_cfg_lines(executor, text)
        elif isinstance(executor, run.LocalExecutor):
            cfg_path = _write_local_cfg(text)
        else:
            logger.warning(
                "FaultTolerancePlugin: section timeouts %s reach ft_launcher only through LocalExecutor and "
                "SlurmExecutor; with %s it applies its own defaults",
                self.rank_section_timeouts,
                type(executor).__name__,
            )

        if executor.launcher is not None:
            logger.info("FaultTolerancePlugin replaces launcher %r with ft_launcher", executor.launcher)
        executor.launcher = run.FaultTolerance(
            max_restarts=self.num_in_job_restarts,
            initial_rank_heartbeat_timeout=self.initial_rank_heartbeat_timeout,
            rank_heartbeat_timeout=self.rank_heartbeat_timeout,
            workload_check_interval=self.workload_check_interval,
        )
        executor.retries = self.num_job_retries_on_failure
        if cfg_path is not None:
            executor.env_vars = {**executor.env_vars, FT_CFG_PATH_ENV: cfg_path}
        if setup_lines:
            kept = _HEREDOC_BLOCK.sub("", executor.setup_lines or "").rstrip()  # drop a block from an earlier setup
            executor.setup_lines = f"{kept}\n{setup_lines}" if kept else setup_lines

        if config is None:
            args = FaultTolerancePluginScriptArgs(self.enable_ft_package, self.calc_ft_timeouts)
            changes = _set_script_args(
                task, (self.script_args_converter_fn or _default_fault_tolerance_converter)(args)
            )
        else:
            if getattr(config, "ft", None) is None:
                config.ft = FaultToleranceConfig()
            config.ft.enable_ft_package = self.enable_ft_package
            config.ft.calc_ft_timeouts = self.calc_ft_timeouts
            changes = [f"ft.enable_ft_package={self.enable_ft_package}", f"ft.calc_ft_timeouts={self.calc_ft_timeouts}"]
        logger.info(
            "FaultTolerancePlugin: ft_launcher max_restarts=%d, job retries=%d, heartbeat timeouts %s/%s s, "
            "section timeouts %s, out-of-section %s s, %s=%s; task: %s",
            self.num_in_job_restarts,
            self.num_job_retries_on_failure,
            self.initial_rank_heartbeat_timeout,
            self.rank_heartbeat_timeout,
            self.rank_section_timeouts,
            self.out_of_section_timeout,
            FT_CFG_PATH_ENV,
            cfg_path,
            changes,
        )


@dataclass(kw_only=True)
class PreemptionPlugin(run.Plugin):
    """Save a checkpoint and exit (code 18) when the job's time is about to run out or it is preempted.

    With ``enable_exit_handler``, ``setup`` appends to a ``run.Script`` task's arguments (replacing earlier values of
    these keys; ``script_args_converter_fn`` may write :class:`PreemptionPluginScriptArgs` differently), or sets the
    same fields on a ``run.Partial`` task's ``config.train``:

    - ``train.exit_signal_handler=True``: every rank watches for SIGTERM; one rank receiving it stops all ranks after
      the same step;
    - ``train.exit_signal_handler_for_dataloader=<enable_exit_handler_for_data_loader>``;
    - ``train.exit_signal_deadline=<0.9 * preempt_time>``: the save and the exit must fit in the warning time.

    With ``run.SlurmExecutor`` it also sets ``executor.signal = "TERM@<preempt_time>"`` (``#SBATCH
    --signal=TERM@<preempt_time>``). Without ``B:``, Slurm signals the job step's processes: the launcher
    (torchrun or ft_launcher, which pass it on to the ranks and wait for them) and the training ranks themselves.
    A job preempted by a higher-priority partition gets SIGTERM from Slurm in the same way. Resuming needs a new
    start of the job: ``FaultTolerancePlugin`` requeues a job that did not finish, or submit with ``--requeue``
    where the cluster preempts by requeueing. With other executors only the training side is enabled: a SIGTERM
    sent to the ranks, or to ``megatron.bridge.launch`` or ft_launcher (both pass it on), saves and exits.

    Attributes:
        preempt_time: Seconds before the time limit at which Slurm sends SIGTERM.
        enable_exit_handler: Value of ``train.exit_signal_handler``.
        enable_exit_handler_for_data_loader: Value of ``train.exit_signal_handler_for_dataloader``.
        script_args_converter_fn: Makes the arguments of a ``run.Script`` task from
            :class:`PreemptionPluginScriptArgs`; ``None``: ``train.<field>=<Python literal>``.
    """

    preempt_time: int = 60
    enable_exit_handler: bool = True
    enable_exit_handler_for_data_loader: bool = False
    script_args_converter_fn: Optional[Callable[[PreemptionPluginScriptArgs], list[str]]] = None

    def __post_init__(self) -> None:
        if isinstance(self.preempt_time, bool) or not isinstance(self.preempt_time, int) or self.preempt_time < 1:
            raise ValueError(
                f"PreemptionPlugin.preempt_time must be an integer >= 1 (seconds), got {self.preempt_time!r}"
            )
        if self.enable_exit_handler_for_data_loader and not self.enable_exit_handler:
            raise ValueError(
                "PreemptionPlugin.enable_exit_handler_for_data_loader needs enable_exit_handler=True "
                "(the workers only need to survive while the training process saves)"
            )

    @property
    def exit_signal_deadline(self) -> float:
        """Seconds the training gets from the signal to its exit: 90 % of ``preempt_time``."""
        return round(0.9 * self.preempt_time, 1)

    def setup(self, task: Any, executor: Any) -> None:
        """Enable the exit handler in ``task`` and, on Slurm, the early signal.

        Raises:
            TypeError: If the task is neither a ``run.Script`` nor a ``run.Partial`` with a ``config``.
        """
        config = _check_task(task, type(self).__name__, launcher_replaced=False)
        slurm = isinstance(executor, run.SlurmExecutor)
        changes: list[str] = []
        if self.enable_exit_handler:
            if slurm:
                executor.signal = f"TERM@{self.preempt_time}"
            args = PreemptionPluginScriptArgs(
                self.enable_exit_handler, self.enable_exit_handler_for_data_loader, self.exit_signal_deadline
            )
            if config is None:
                changes = _set_script_args(task, (self.script_args_converter_fn or _default_preemption_converter)(args))
            else:
                config.train.exit_signal_handler = True
                config.train.exit_signal_handler_for_dataloader = self.enable_exit_handler_for_data_loader
                config.train.exit_signal_deadline = self.exit_signal_deadline
                changes = _default_preemption_converter(args)
        logger.info(
            "PreemptionPlugin: %s; task: %s",
            f"SIGTERM {self.preempt_time} s before the limit" if slurm else "no scheduler signal",
            changes,
        )


def _set_script_args(task: Any, overrides: list[str]) -> list[str]:
    """Append ``overrides`` to ``task.args``, dropping earlier arguments that set the same keys; return them."""
    keys = tuple(f"{arg.split('=', 1)[0].lstrip('+')}=" for arg in overrides if "=" in arg)
    task.args = [arg for arg in (task.args or []) if not str(arg).lstrip("+").startswith(keys)] + list(overrides)
    return list(overrides)


def _write_local_cfg(text: str) -> str:
    """Write the ft_launcher YAML under ``$NEMORUN_HOME/fault_tolerance`` (named by its content); return its path."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = os.path.join(_nemo_run_config.get_nemorun_home(), "fault_tolerance", f"ft_launcher_cfg_{digest}.yaml")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, text)  # concurrent writers of the same content: each replaces it whole
    return path


def _slurm_cfg_lines(executor: Any, text: str) -> tuple[str, str]:
    """Sbatch lines that write the ft_launcher YAML into the job directory, and the path the job's processes see.

    The job directory on the cluster is what nemo_run mounts at ``/nemo_run`` inside a container, and what it
    substitutes for ``/nemo_run`` in the script when there is no container; the lines run in the batch shell
    (outside any container), so they write to the cluster path.
    """
    host_dir = os.path.join(executor.tunnel.job_dir, Path(executor.job_dir).name)
    host_path = os.path.join(host_dir, SLURM_FT_CFG_NAME)
    lines = "\n".join(
        [
            _HEREDOC_COMMENT,
            f"mkdir -p {shlex.quote(host_dir)}",
            f"cat > {shlex.quote(host_path)} <<'{_HEREDOC_MARK}'",
            text.rstrip("\n"),
            _HEREDOC_MARK,
        ]
    )
    return f"/{_nemo_run_config.RUNDIR_NAME}/{SLURM_FT_CFG_NAME}", lines


def _check_task(task: Any, plugin: str, launcher_replaced: bool) -> Any:
    """The ``config`` of a ``run.Partial`` task, or ``None`` for a ``run.Script``; raise for anything else.

    With ``launcher_replaced`` (ft_launcher), a Python file must be run by ``entrypoint="python"``: nemo_run's
    default ``bash`` makes ft_launcher exec the file itself with ``--no-python``.
    """
    if isinstance(task, run.Partial):
        config = getattr(task, "config", None)
        if config is None:
            raise TypeError(
                f"{plugin} needs a run.Partial whose target takes the ConfigContainer as `config` (as "
                f"megatron.bridge.training.pretrain.pretrain does); {task.__fn_or_cls__!r} got none"
            )
        return config
    if not isinstance(task, run.Script):
        raise TypeError(
            f"{plugin} does not support task type {type(task).__name__}; supported: nemo_run.Script "
            "(settings become dotted overrides) and nemo_run.Partial with a `config` (settings are set on it)"
        )
    if launcher_replaced and not task.inline and str(task.path).endswith(".py") and task.entrypoint != "python":
        raise ValueError(
            f"{plugin} needs run.Script(..., entrypoint='python') for the Python file {task.path!r}; got "
            f"entrypoint={task.entrypoint!r} (nemo_run's default 'bash' would make ft_launcher exec the file with "
            "--no-python)"
        )
    return None
