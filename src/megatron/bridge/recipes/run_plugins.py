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
"""

import hashlib
import logging
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

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


@dataclass(kw_only=True)
class FaultTolerancePlugin(run.Plugin):
    """Run a task under ``ft_launcher`` with in-job restarts, job retries and fault tolerance enabled.

    ``setup`` (called by nemo_run for each task the plugin is given to):

    - replaces the executor's launcher with ``nemo_run``'s ``FaultTolerance`` launcher (``ft_launcher``) carrying
      the heartbeat timeouts, ``max_restarts=num_in_job_restarts`` and the workload check interval, and delivers the
      section timeouts through a YAML config (see the module docstring);
    - sets ``executor.retries = num_job_retries_on_failure`` (Slurm: the job is requeued after a failure until that
      many attempts failed; nemo_run's local scheduler does not retry);
    - appends ``ft.enable_ft_package=<bool>`` and ``ft.calc_ft_timeouts=<bool>`` to the task's arguments, replacing
      earlier values of those keys.

    Supported tasks: ``run.Script`` that runs a Python file (``entrypoint="python"``, ``path=<script.py>``, dotted
    overrides as ``args``) or a module (``entrypoint="python"``, ``m=True``). Supported executors:
    ``run.LocalExecutor`` and ``run.SlurmExecutor``. Anything else is rejected before the task or executor changes.

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
        """Switch ``executor`` to ``ft_launcher`` and enable fault tolerance in ``task``'s arguments.

        Everything is checked before anything changes: a rejected task or executor is left as it was.

        Args:
            task: The task nemo_run is about to launch; must be a ``run.Script`` running Python.
            executor: The task's executor; ``run.LocalExecutor`` or ``run.SlurmExecutor``.

        Raises:
            TypeError: If the task or executor type is not supported.
            ValueError: If the script is inline or not run by Python, or a Slurm executor has no job directory yet.
        """
        _check_task(task)
        _reject_inprocess_restart(task, type(self).__name__)
        text = self.ft_launcher_config_yaml()
        if isinstance(executor, run.SlurmExecutor):
            if not executor.job_dir:
                raise ValueError(
                    "FaultTolerancePlugin needs a SlurmExecutor that is assigned to an experiment (job_dir is empty); "
                    "pass the plugin to run.run(...) or Experiment.add(...), which assign the executor first"
                )
            cfg_path, setup_lines = _slurm_cfg_lines(executor, text)
        elif isinstance(executor, run.LocalExecutor):
            cfg_path, setup_lines = _write_local_cfg(text), None
        else:
            raise TypeError(
                f"FaultTolerancePlugin does not support executor type {type(executor).__name__}; "
                "supported: nemo_run.LocalExecutor and nemo_run.SlurmExecutor"
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
        executor.env_vars = {**executor.env_vars, FT_CFG_PATH_ENV: cfg_path}
        if setup_lines:
            kept = _HEREDOC_BLOCK.sub("", executor.setup_lines or "").rstrip()  # drop a block from an earlier setup
            executor.setup_lines = f"{kept}\n{setup_lines}" if kept else setup_lines

        overrides = [
            f"ft.enable_ft_package={str(self.enable_ft_package).lower()}",
            f"ft.calc_ft_timeouts={str(self.calc_ft_timeouts).lower()}",
        ]
        prefixes = tuple(f"{key}=" for key in _FT_OVERRIDE_KEYS)
        task.args = [arg for arg in (task.args or []) if not arg.startswith(prefixes)] + overrides
        logger.info(
            "FaultTolerancePlugin: ft_launcher max_restarts=%d, job retries=%d, heartbeat timeouts %s/%s s, "
            "section timeouts %s, out-of-section %s s, %s=%s; task args += %s",
            self.num_in_job_restarts,
            self.num_job_retries_on_failure,
            self.initial_rank_heartbeat_timeout,
            self.rank_heartbeat_timeout,
            self.rank_section_timeouts,
            self.out_of_section_timeout,
            FT_CFG_PATH_ENV,
            cfg_path,
            overrides,
        )


_PREEMPTION_OVERRIDE_KEYS = (
    "train.exit_signal_handler",
    "train.exit_signal_handler_for_dataloader",
    "train.exit_signal_deadline",
)


@dataclass(kw_only=True)
class PreemptionPlugin(run.Plugin):
    """Save a checkpoint and exit (code 18) when the job's time is about to run out or it is preempted.

    ``setup`` appends to the task's arguments (replacing earlier values of these keys):

    - ``train.exit_signal_handler=<enable_exit_handler>``: every rank watches for SIGTERM; one rank receiving it
      stops all ranks after the same step;
    - ``train.exit_signal_handler_for_dataloader=<enable_exit_handler_for_data_loader>``;
    - ``train.exit_signal_deadline=<0.9 * preempt_time>``: the save and the exit must fit in the warning time.

    With ``run.SlurmExecutor`` it also sets ``executor.signal = "TERM@<preempt_time>"`` (``#SBATCH
    --signal=TERM@<preempt_time>``). Without ``B:``, Slurm signals the job step's processes: the launcher
    (torchrun or ft_launcher, which pass it on to the ranks and wait for them) and the training ranks themselves.
    A job preempted by a higher-priority partition gets SIGTERM from Slurm in the same way. Resuming needs a new
    start of the job: ``FaultTolerancePlugin`` requeues a job that did not finish, or submit with ``--requeue``
    where the cluster preempts by requeueing. With ``run.LocalExecutor`` only the training side is enabled: a
    SIGTERM sent to the ranks, or to ``megatron.bridge.launch`` or ft_launcher (both pass it on), saves and exits.

    Attributes:
        preempt_time: Seconds before the time limit at which Slurm sends SIGTERM.
        enable_exit_handler: Value of ``train.exit_signal_handler``.
        enable_exit_handler_for_data_loader: Value of ``train.exit_signal_handler_for_dataloader``.
    """

    preempt_time: int = 60
    enable_exit_handler: bool = True
    enable_exit_handler_for_data_loader: bool = False

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
        """Enable the exit handler in ``task``'s arguments and, on Slurm, the early signal.

        Raises:
            TypeError: If the task or executor type is not supported.
            ValueError: If the script is inline or not run by Python.
        """
        _check_task(task, type(self).__name__)
        _reject_inprocess_restart(task, type(self).__name__)
        if not isinstance(executor, (run.SlurmExecutor, run.LocalExecutor)):
            raise TypeError(
                f"PreemptionPlugin does not support executor type {type(executor).__name__}; "
                "supported: nemo_run.LocalExecutor and nemo_run.SlurmExecutor"
            )
        if isinstance(executor, run.SlurmExecutor) and self.enable_exit_handler:
            executor.signal = f"TERM@{self.preempt_time}"
        overrides = [
            f"train.exit_signal_handler={str(self.enable_exit_handler).lower()}",
            f"train.exit_signal_handler_for_dataloader={str(self.enable_exit_handler_for_data_loader).lower()}",
            f"train.exit_signal_deadline={self.exit_signal_deadline}",
        ]
        prefixes = tuple(f"{key}=" for key in _PREEMPTION_OVERRIDE_KEYS)
        task.args = [arg for arg in (task.args or []) if not arg.startswith(prefixes)] + overrides
        logger.info(
            "PreemptionPlugin: %s; task args += %s",
            f"SIGTERM {self.preempt_time} s before the limit" if isinstance(executor, run.SlurmExecutor) else "local",
            overrides,
        )


def _reject_inprocess_restart(task: Any, plugin: str) -> None:
    """Refuse a task that enables in-process restart (seed pitfall 3), before anything is changed.

    Raises:
        ValueError: ``inprocess_restart.enabled=true`` is among the task's arguments.
    """
    enabling = {f"inprocess_restart.enabled={v}" for v in ("true", "1", "yes", "on", "y")}  # OmegaConf's spellings
    if any(str(arg).strip().lower().lstrip("+") in enabling for arg in task.args or []):
        raise ValueError(
            f"{plugin} cannot be combined with inprocess_restart.enabled=true: in-process restart terminates hung "
            "ranks with SIGTERM and restarts inside the processes, which the plugin's launcher and signal handling "
            "would take for a failure or a preemption. Fix: drop the plugin and launch with "
            "`srun --kill-on-bad-exit=0 python -m megatron.bridge.launch ...` (or ft_launcher without the plugin), "
            "or set inprocess_restart.enabled=false"
        )


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


def _check_task(task: Any, plugin: str = "FaultTolerancePlugin") -> None:
    """Raise if ``task`` is not a ``run.Script`` that runs a Python file or module."""
    if isinstance(task, run.Partial):
        raise TypeError(
            f"{plugin} does not support {type(task).__name__} tasks ({task.__fn_or_cls__!r}); "
            "supported: nemo_run.Script(path=<entry script.py>, entrypoint='python', args=[dotted overrides])"
        )
    if not isinstance(task, run.Script):
        raise TypeError(
            f"{plugin} does not support task type {type(task).__name__}; "
            "supported: nemo_run.Script(path=<entry script.py>, entrypoint='python', args=[dotted overrides])"
        )
    if task.inline:
        raise ValueError(
            f"{plugin} does not support inline scripts (run.Script(inline=...)): the launcher must start "
            "a Python entry script; use run.Script(path=<entry script.py>, entrypoint='python', args=[...])"
        )
    if task.entrypoint != "python":
        raise ValueError(
            f"{plugin} needs run.Script(..., entrypoint='python'); got entrypoint={task.entrypoint!r} "
            f"for {task.path!r} (nemo_run's default 'bash' would make ft_launcher exec the file with --no-python)"
        )
