"""The checks behind :meth:`ConfigContainer.validate` for the resiliency sections (``config_sections/resiliency.py``).

Fault tolerance, straggler detection, the re-run state machine, in-process restart, health checks and fault
injection: each failure is a ``ValueError`` naming the field and the fix (``utils.fields.fail``). Called by
``config_checks.container.validate_config``; imports nothing from ``config.py`` or ``config_sections/``. An optional
section that is ``None`` is off and has nothing to check; ``utils.fields.is_enabled`` says whether one is on. The
environment variables read here are the launcher's and the job script's listed in ``env_inputs.ENV_INPUTS`` (a unit
test checks it).
"""

from __future__ import annotations

import logging
import os

from megatron.bridge.training.config_checks.types import Container, Section
from megatron.bridge.training.faults import injection as fault_injection
from megatron.bridge.utils import launch_env
from megatron.bridge.utils.fields import fail as _fail
from megatron.bridge.utils.fields import is_enabled

logger = logging.getLogger(__name__)


def validate_resiliency(cfg: Container, world_size: int, store_port_offset: int) -> None:
    """Check every resiliency section of ``cfg``; an optional one that is ``None`` (off) has nothing to check."""
    _validate_fault_tolerance(cfg.ft, world_size)
    _validate_straggler(cfg)
    _validate_rerun(cfg)
    _validate_inprocess_restart(cfg, world_size, store_port_offset)
    _validate_health(cfg)
    _validate_fault_injection(cfg, world_size)


def _validate_fault_tolerance(ft: Section, world_size: int) -> None:
    if ft is None:
        return
    if is_enabled(ft) and not os.environ.get("FT_RANK_MONITOR_IPC_SOCKET"):
        _fail(
            "ft.enable_ft_package",
            "no rank monitor to report to ($FT_RANK_MONITOR_IPC_SOCKET is unset): this process was not started by "
            "ft_launcher, and under torchrun fault tolerance would silently do nothing",
            "launch with ft_launcher (same arguments as torchrun plus --ft-rank-section-timeouts=setup:600,"
            "step:180,checkpointing:420 --ft-rank-out-of-section-timeout=300), or set ft.enable_ft_package=false",
        )
    if ft.simulate_fault and not is_enabled(ft):
        _fail("ft.simulate_fault", "needs fault tolerance to detect the fault", "also set ft.enable_ft_package=true")
    if ft.simulated_fault_rank is not None and not 0 <= ft.simulated_fault_rank < world_size:
        _fail(
            "ft.simulated_fault_rank",
            f"{ft.simulated_fault_rank} is not a rank of a world of {world_size}",
            f"use 0..{world_size - 1} or null for a random rank",
        )
    if ft.simulated_fault_base_delay < 0:
        _fail(
            "ft.simulated_fault_base_delay",
            f"must be >= 0, got {ft.simulated_fault_base_delay}",
            "use a delay in seconds",
        )
    limit = ft.max_no_progress_restarts
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        _fail(
            "ft.max_no_progress_restarts",
            f"must be a whole number >= 0, got {limit!r}",
            "use the attempts without progress to allow before the job stops (e.g. 3), or 0 to turn the guard off",
        )


def _validate_straggler(cfg: Container) -> None:
    s = cfg.nvrx_straggler
    if is_enabled(cfg.straggler):
        if is_enabled(s):
            _fail(
                "straggler.log_straggler",
                "two straggler detectors are enabled (the legacy one and nvrx_straggler); they time the same steps "
                "and would report twice",
                "enable only one: set straggler.log_straggler=false and keep nvrx_straggler.enabled=true",
            )
        _fail(
            "straggler.log_straggler",
            "the legacy megatron-core straggler detector is not available in megatron.bridge",
            "set straggler.log_straggler=false and nvrx_straggler.enabled=true",
        )
    if s is None:
        return
    s.finalize()  # the section's own checks
    if not is_enabled(s):
        return
    if s.stop_if_detected and cfg.checkpoint.save is None:
        logger.warning(
            "nvrx_straggler.stop_if_detected is on but checkpoint.save is not set: a straggler stops the run "
            "without a checkpoint, and the steps since the last one are lost. Set checkpoint.save to keep them."
        )


def _validate_rerun(cfg: Container) -> None:
    r = cfg.rerun_state_machine
    if r.spiky_loss_factor <= 1.0:
        _fail(
            "rerun_state_machine.spiky_loss_factor",
            f"{r.spiky_loss_factor} would flag ordinary losses (a loss is spiky above factor x the largest seen)",
            "use a factor above 1, e.g. 10 (larger for large models)",
        )
    for name in ("max_consecutive_nan_skips", "error_injection_rate"):
        if getattr(r, name) < 0:
            _fail(f"rerun_state_machine.{name}", f"{getattr(r, name)} is negative", "use 0 or more")
    if r.max_rerun_restarts < 1:
        _fail(
            "rerun_state_machine.max_rerun_restarts",
            f"{r.max_rerun_restarts} would stop before the diagnostic checkpoint of a failing step is saved",
            "use 1 or more (the first exit 16 saves it)",
        )
    if r.max_consecutive_nan_skips > 0 and (r.rerun_mode != "disabled" or not r.check_for_nan_in_loss):
        _fail(
            "rerun_state_machine.max_consecutive_nan_skips",
            "skipping NaN steps needs rerun_mode=disabled and check_for_nan_in_loss=true (with the re-run state "
            "machine on, it decides what a NaN means)",
            "set rerun_state_machine.max_consecutive_nan_skips=0, or rerun_mode=disabled",
        )
    if r.rerun_mode == "validate_results":
        c = cfg.checkpoint
        if c.save is None or c.load is None or os.path.abspath(c.save) != os.path.abspath(c.load):
            _fail(
                "rerun_state_machine.rerun_mode",
                "validate_results saves a checkpoint at a step whose result reproducibly failed a check and re-runs "
                "that step from it after a restart, so checkpoint.save and checkpoint.load must name one directory "
                f"(save={c.save}, load={c.load})",
                "set checkpoint.save and checkpoint.load to the same directory, or use rerun_mode=disabled",
            )
        if not (r.check_for_nan_in_loss or r.check_for_spiky_loss):
            logger.warning(
                "rerun_state_machine.rerun_mode=validate_results with both loss checks off: nothing is validated; "
                "set check_for_nan_in_loss=true or check_for_spiky_loss=true"
            )
    if r.rerun_mode != "disabled":
        logger.warning(
            "rerun_state_machine.rerun_mode=%s: megatron-core's re-run state machine is experimental upstream%s",
            r.rerun_mode,
            "; every step runs twice" if r.rerun_mode == "report_determinism_stats" else "",
        )


# The environment in-process restart needs (see docs/training/resiliency.md).
INPROCESS_ENV = {"TORCH_CPP_LOG_LEVEL": "error", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0"}


def _validate_inprocess_restart(cfg: Container, world_size: int, store_port_offset: int) -> None:
    ipr = cfg.inprocess_restart
    if not is_enabled(ipr):
        return
    p = "inprocess_restart"
    if ipr.active_world_size is not None and not 1 <= ipr.active_world_size <= world_size:
        _fail(
            f"{p}.active_world_size",
            f"{ipr.active_world_size} is not between 1 and the world size {world_size}",
            f"use a value in [1, {world_size}] (ranks above it wait as reserves) or leave it unset",
        )
    for name in ("max_iterations", "max_rank_faults"):
        if getattr(ipr, name) is not None and getattr(ipr, name) < 0:
            _fail(f"{p}.{name}", f"{getattr(ipr, name)} is negative", "use 0 or more, or None for no limit")
    intervals = ("monitor_thread_interval", "monitor_process_interval", "progress_watchdog_interval")
    timeouts = ("soft_timeout", "hard_timeout", "heartbeat_interval", "heartbeat_timeout", "barrier_timeout")
    for name in (*intervals, *timeouts, "completion_timeout", "last_call_wait", "termination_grace_time"):
        if getattr(ipr, name) <= 0:
            _fail(f"{p}.{name}", f"must be > 0 seconds, got {getattr(ipr, name)}", "use a positive number of seconds")
    ordered = [
        ("soft_timeout", "hard_timeout", "a hung rank is first aborted (soft), then terminated (hard)"),
        ("hard_timeout", "barrier_timeout", "ranks wait at the restart barrier for a hung rank to be terminated"),
        ("hard_timeout", "completion_timeout", "ranks wait at the completion barrier for a hung rank to be terminated"),
        ("heartbeat_interval", "heartbeat_timeout", "a missing rank is detected after several missed heartbeats"),
        ("heartbeat_timeout", "barrier_timeout", "a dead rank must be detected before the barrier gives up"),
    ]
    for lower, upper, why in ordered:
        if not getattr(ipr, lower) < getattr(ipr, upper):
            _fail(
                f"{p}.{lower}",
                f"{getattr(ipr, lower)} s must be < {p}.{upper}={getattr(ipr, upper)} s ({why})",
                f"lower {lower} or raise {upper}",
            )
    longest = max(intervals, key=lambda name: getattr(ipr, name))
    for name in ("soft_timeout", "heartbeat_timeout"):
        if getattr(ipr, name) <= getattr(ipr, longest):
            _fail(
                f"{p}.{name}",
                f"{getattr(ipr, name)} s is not above the wrapper's longest monitoring interval "
                f"({p}.{longest}={getattr(ipr, longest)} s)",
                "use a few seconds or more",
            )
    if cfg.dist.distributed_timeout_minutes * 60 <= ipr.hard_timeout:
        _fail(
            "dist.distributed_timeout_minutes",
            f"{cfg.dist.distributed_timeout_minutes} min is not above {p}.hard_timeout={ipr.hard_timeout} s: the "
            "collective watchdog would kill the process before in-process restart could recover it",
            f"raise it above {ipr.hard_timeout / 60:.1f} min or lower {p}.hard_timeout",
        )
    current = {k: os.environ.get(k) for k in INPROCESS_ENV}  # (each read is listed in env_inputs.ENV_INPUTS)
    missing = {k: v for k, v in INPROCESS_ENV.items() if current[k] != v}
    if missing:
        _fail(
            f"{p}.enabled",
            "in-process restart needs the environment "
            + ", ".join(f"{k}={v}" for k, v in INPROCESS_ENV.items())
            + " (quiet c10d logs on abort, NCCL errors that do not kill the process, NVLink SHARP off); not set: "
            + ", ".join(f"{k} (is {current[k]!r})" for k in missing),
            "export " + " ".join(f"{k}={v}" for k, v in missing.items()) + " in the job script before launching",
        )
    launch = launch_env.current()
    if launch.master_addr is None or launch.master_port is None:
        _fail(
            f"{p}.enabled",
            "needs MASTER_ADDR and MASTER_PORT (the rendezvous store; the wrapper's store listens on MASTER_PORT + "
            f"{store_port_offset})",
            "launch with torchrun, python -m megatron.bridge.launch or ft_launcher, or export both",
        )
    if launch.master_port + store_port_offset > launch_env.MAX_PORT:
        _fail(f"{p}.enabled", f"MASTER_PORT + {store_port_offset} is not a port", "use a lower MASTER_PORT")
    if ipr.granularity == "node" and launch.local_world_size is None:
        _fail(
            f"{p}.granularity",
            '"node" groups ranks by host and needs LOCAL_WORLD_SIZE (ranks per node), which is not set',
            'launch with torchrun/megatron.bridge.launch/ft_launcher (they set it), or use granularity "rank"',
        )


def _validate_health(cfg: Container) -> None:
    h = cfg.health
    if h.liveness_ping_interval < 0:
        _fail(
            "health.liveness_ping_interval",
            f"must be >= 0, got {h.liveness_ping_interval}",
            "use 0 (off) or a number of steps between pings",
        )
    if h.stack_dump_after is not None and h.stack_dump_after < 0:
        _fail(
            "health.stack_dump_after",
            f"must be >= 0 seconds, got {h.stack_dump_after}",
            "use a number of seconds, 0 (off) or null (half the shortest hang timeout)",
        )
    if h.liveness_ping_interval == 0:
        return
    if h.liveness_ping_timeout <= 0:
        _fail(
            "health.liveness_ping_timeout",
            f"must be > 0 seconds, got {h.liveness_ping_timeout}",
            "use a positive number of seconds",
        )
    if h.liveness_ping_timeout >= cfg.dist.distributed_timeout_minutes * 60:
        _fail(
            "health.liveness_ping_timeout",
            f"{h.liveness_ping_timeout} s is not below dist.distributed_timeout_minutes="
            f"{cfg.dist.distributed_timeout_minutes} min: a lost rank would hit the collectives' own timeout first",
            "lower health.liveness_ping_timeout (seconds to a minute is typical)",
        )


def _validate_fault_injection(cfg: Container, world_size: int) -> None:
    sources = {
        fault_injection.CONFIG_FIELD: cfg.fault_injection.faults or "",
        fault_injection.ENV: os.environ.get(fault_injection.ENV, ""),
    }
    for source, spec in sources.items():
        for fault in fault_injection.parse(spec, source):  # a bad item: a ValueError naming it, the form, the kinds
            if fault.rank >= world_size:
                _fail(
                    source,
                    f"{fault} names rank {fault.rank}, not a rank of a world of {world_size}",
                    f"use a rank in 0..{world_size - 1}",
                )
    ledger = cfg.fault_injection.ledger
    if ledger and not os.path.isdir(os.path.dirname(os.path.abspath(ledger))):
        _fail("fault_injection.ledger", f"the directory of {ledger} does not exist", "create it or use another path")
