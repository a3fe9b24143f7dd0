"""The resiliency sections of ``ConfigContainer``: each names the failure it handles and the knobs of its handling.

Megatron-Bridge's classes and fields (``FaultToleranceConfig``, ``NVRxStragglerDetectionConfig``,
``InProcessRestartConfig``, ``RerunStateMachineConfig``, ``StragglerDetectionConfig``) plus this framework's own
(``HealthConfig``, ``FaultInjectionConfig``, and the bounded re-run fields of ``RerunStateMachineConfig``). Import
them from ``megatron.bridge.training.config``, as in Megatron-Bridge; they live here to keep that module short.

A section that is ``None`` is off, and so is one whose own switch field is false (the field its class names in
``SWITCH``): ask ``megatron.bridge.utils.fields.is_enabled(section)``, which reads both.
"""

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from megatron.bridge.utils.fields import fail, named_fields


@named_fields
@dataclass
class FaultToleranceConfig:
    """Hang and crash detection through nvidia-resiliency-ext's rank monitor (needs ``ft_launcher``)."""

    SWITCH: ClassVar[str] = "enable_ft_package"
    """The field that turns the section on (``utils.fields.is_enabled``)."""
    enable_ft_package: bool = False
    """Enable fault tolerance (heartbeats and section timeouts to the ft_launcher rank monitor)."""
    calc_ft_timeouts: bool = False
    """Compute section timeouts from observed times and save them to ``ft_state.json``."""
    simulate_fault: bool = False
    """Inject a fault for testing: a timed fault of the fault-injection registry (``<kind>@<delay>s:<rank>``)."""
    simulated_fault_type: Literal["rank_hung", "rank_killed", "random"] = "random"
    """``"rank_hung"``, ``"rank_killed"`` or ``"random"``."""
    simulated_fault_rank: Optional[int] = None
    """Rank to fault; ``None`` picks one at random."""
    simulated_fault_base_delay: float = 0
    """Seconds after the rank starts training (its first iteration) before the simulated fault strikes."""
    max_no_progress_restarts: int = 3
    """Stop the job with exit code 29 (``NO_PROGRESS``, no restart, no requeue) when this many attempts in a row
    (in-job restarts, Slurm requeues and in-process restart iterations of the same job id) each failed without
    committing a newer checkpoint or completing a step beyond the furthest reached before: a crash that every restart
    meets again. Checked at each restart's set-up from the event stream (``health.event_dir``); the log and a
    ``fault_detected`` event (``no_progress``) name the repeated failure's rank, cause and iteration. 0: off."""


@named_fields
@dataclass
class FaultInjectionConfig:
    """Real faults on demand, for tests and drills (``training/faults/spec.py`` documents the one fault grammar)."""

    faults: str = ""
    """Comma-separated faults ``<kind>@<when>:<rank>[:<phase>][:x<factor>][:always]``, e.g.
    ``"kill@8:1,preempt@20:0,stall@6:1:save.during_write,nan@8:0:local_save"``, in the grammar that
    ``$MBRIDGE_FAULTS`` (for launcher-driven runs; its faults are added to these) and the drill's ``--faults`` use
    too. Kinds: ``hang``, ``kill``, ``preempt``, ``preempt-tree``, ``exception``, ``stall``, ``slow``, ``spike``,
    ``nan``, ``corrupt-local``, ``fill``, ``oom``, ``clock-jump``, ``no-rng-restore``, ``no-optimizer-restore``,
    ``no-data-restore``. Empty: none."""
    ledger: Optional[str] = None
    """File shared by every attempt of the job: each fault strikes once per job, the first time any attempt reaches
    it, and is recorded there (a JSON line with its wall-clock time) just before. ``None``: faults strike in the
    first attempt only (unless ``:always``)."""


@named_fields
@dataclass
class NVRxStragglerDetectionConfig:
    """Straggler detection through nvidia-resiliency-ext's ``straggler.Detector``."""

    SWITCH: ClassVar[str] = "enabled"
    """The field that turns the section on (``utils.fields.is_enabled``)."""
    enabled: bool = False
    """Enable straggler detection."""
    report_time_interval: float = 300.0
    """Seconds between straggler reports."""
    calc_relative_gpu_perf: bool = True
    """Score ranks against each other."""
    calc_individual_gpu_perf: bool = True
    """Score each rank against its own history."""
    num_gpu_perf_scores_to_print: int = 5
    """Number of best and worst scores printed in each report."""
    gpu_relative_perf_threshold: float = 0.7
    """A relative score below this flags a straggler (0 < x <= 1)."""
    gpu_individual_perf_threshold: float = 0.7
    """An individual score below this flags a straggler (0 < x <= 1)."""
    stop_if_detected: bool = False
    """Save and stop all ranks when a straggler is flagged."""
    stop_after_consecutive_reports: int = 1
    """With ``stop_if_detected``: stop only once the same rank is flagged in this many reports in a row (1: at the
    first). Raise it where one report can catch a healthy rank in a passing slowdown (a shared host, a
    checkpoint write beside the step): a rank that stays slow is still stopped, one report interval later."""
    enable_logging: bool = True
    """Send score statistics to TensorBoard."""
    logger_name: str = "megatron.bridge.NVRxStragglerDetection"
    """Logger the reports are written to."""
    profiling_interval: int = 1
    """Time every n-th entry of each detection section (the step section once per step, the forward section once
    per micro-batch); 1 times all of them."""

    def finalize(self) -> None:
        """Check this section's settings when detection is enabled; changes nothing, so calling it again is harmless.

        ``ConfigContainer.validate`` calls it (Megatron-Bridge's ``finalize`` of a config section); the checks that
        involve other sections stay there.

        Raises:
            ConfigError: a ``ValueError`` naming the field and the fix.
        """
        if not self.enabled:
            return
        if not (self.calc_relative_gpu_perf or self.calc_individual_gpu_perf):
            fail(
                "nvrx_straggler.calc_relative_gpu_perf",
                "both score kinds are off (and nvrx_straggler.calc_individual_gpu_perf), so nothing would be detected",
                "set nvrx_straggler.calc_relative_gpu_perf=true or nvrx_straggler.calc_individual_gpu_perf=true",
            )
        for name in ("gpu_relative_perf_threshold", "gpu_individual_perf_threshold"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                fail(
                    f"nvrx_straggler.{name}",
                    f"must be in (0, 1], got {value} (a score is this rank's speed over the reference speed)",
                    "use e.g. 0.7 to flag ranks more than ~1.4x slower",
                )
        if self.report_time_interval <= 0:
            fail(
                "nvrx_straggler.report_time_interval",
                f"the report_time_interval must be positive (seconds between reports), got {self.report_time_interval}",
                "use e.g. 300",
            )
        if self.profiling_interval < 1:
            fail(
                "nvrx_straggler.profiling_interval",
                f"must be >= 1, got {self.profiling_interval}",
                "use 1 to time every step",
            )
        if self.stop_after_consecutive_reports < 1:
            fail(
                "nvrx_straggler.stop_after_consecutive_reports",
                f"must be >= 1, got {self.stop_after_consecutive_reports}",
                "use 1 to stop at the first report that flags a rank",
            )
        if self.num_gpu_perf_scores_to_print < 0:
            fail(
                "nvrx_straggler.num_gpu_perf_scores_to_print",
                f"must be >= 0, got {self.num_gpu_perf_scores_to_print}",
                "use e.g. 5",
            )


@named_fields
@dataclass
class StragglerDetectionConfig:
    """megatron-core's older ``StragglerDetector`` (Megatron-LM's ``--log-straggler``).

    Not available in this framework: it is here so that a config carried over from Megatron-LM fails with a clear
    message instead of an unknown-field error. Use :class:`NVRxStragglerDetectionConfig`.
    """

    SWITCH: ClassVar[str] = "log_straggler"
    """The field that turns the section on (``utils.fields.is_enabled``)."""
    log_straggler: bool = False
    """Enable the legacy detector; only ``False`` is accepted (use ``nvrx_straggler.enabled``)."""
    enable_straggler_on_startup: bool = True
    """Start the legacy detector on start-up (no effect: it never runs here)."""
    straggler_ctrlr_port: int = 65535
    """Port of the legacy detector's on/off switch (no effect: it never runs here)."""
    straggler_minmax_count: int = 1
    """Number of fastest and slowest ranks the legacy detector reports (no effect: it never runs here)."""
    disable_straggler_on_startup: bool = False
    """Start the legacy detector switched off (no effect: it never runs here)."""


INPROCESS_STORE_PORT_OFFSET = 2
"""In-process restart's store listens on ``MASTER_PORT + 2`` (the launcher's store is on ``MASTER_PORT``)."""

INPROCESS_COORDINATION_PORT_OFFSET = 1
"""In-process restart's coordination store (the one every iteration builds its process groups on) listens on
``MASTER_PORT + 1``; rank 0 hosts it."""


@named_fields
@dataclass
class InProcessRestartConfig:
    """In-process restart through nvidia-resiliency-ext's ``inprocess.Wrapper`` (experimental).

    Needs a launcher that sets ``MASTER_ADDR``/``MASTER_PORT`` (torchrun, ``megatron.bridge.launch``, ft_launcher or
    srun with ``--kill-on-bad-exit=0``), the environment ``TORCH_CPP_LOG_LEVEL=error``,
    ``TORCH_NCCL_RETHROW_CUDA_ERRORS=0``, ``NCCL_NVLS_ENABLE=0``, and a free port at ``MASTER_PORT + 2`` (the
    wrapper's store, hosted by rank 0).
    """

    SWITCH: ClassVar[str] = "enabled"
    """The field that turns the section on (``utils.fields.is_enabled``)."""
    enabled: bool = False
    """Enable in-process restart."""
    active_world_size: Optional[int] = None
    """Ranks executing the workload; the rest are warm reserves that replace faulty ranks. ``None``: all ranks."""
    granularity: Literal["node", "rank"] = "node"
    """``"node"``: a fault retires every rank of the faulty rank's node; ``"rank"``: only that rank."""
    max_iterations: Optional[int] = None
    """Maximum in-process restarts (the training function runs at most this + 1 times); then the processes exit
    with code 22 and an outer launcher may restart the job. ``None`` is unlimited."""
    monitor_thread_interval: float = 1.0
    """Seconds between checks of the wrapper's monitor thread (in the training process). A finished run waits up to
    this long for the thread to stop before the process can exit: each exit that ends in an in-job restart pays it."""
    monitor_process_interval: float = 1.0
    """Seconds between checks of the wrapper's monitor process."""
    progress_watchdog_interval: float = 2.0
    """Seconds between the automatic progress reports of the watchdog thread. Megatron-Bridge's default is 1.0; here
    it is twice ``monitor_process_interval`` because with both at 1 s the monitor process was seen to check the
    timeouts only every ~30 s (it checks after an interval without a message from its rank)."""
    soft_timeout: float = 60.0
    """Seconds without progress (a completed step or save) before a rank is declared hung and every rank restarts
    in-process; catches hangs with the GIL released."""
    hard_timeout: float = 90.0
    """Seconds without progress before a hung rank is terminated (SIGTERM, then SIGKILL)."""
    heartbeat_interval: float = 30.0
    """Seconds between the monitor processes' heartbeats."""
    heartbeat_timeout: float = 60.0
    """Seconds of missing heartbeats before a rank is declared dead."""
    barrier_timeout: float = 120.0
    """Timeout of the barrier every rank passes before a restart."""
    completion_timeout: float = 120.0
    """Timeout of the barrier every rank passes when the training function returns."""
    last_call_wait: float = 1.0
    """Seconds to gather faults from other ranks before a restart starts."""
    termination_grace_time: float = 1.0
    """Seconds between SIGTERM and SIGKILL when a hung rank is terminated."""
    empty_cuda_cache: bool = True
    """Empty the CUDA cache before a restart (no effect without CUDA)."""
    max_rank_faults: Optional[int] = None
    """Faults a rank may cause before its health check fails and it is retired. ``None`` is unlimited."""
    monitor_process_logdir: Optional[str] = None
    """Directory for monitor-process logs: one per rank (``monitor_process_<rank>.log``); under Slurm only the job's
    rank 0 logs (``monitor_<job>_<host>_<rank>_<local rank>.log``). ``None`` logs nowhere."""


@named_fields
@dataclass
class RerunStateMachineConfig:
    """megatron-core's re-run state machine (experimental upstream) and the loss checks around it."""

    rerun_mode: Literal["disabled", "validate_results", "report_determinism_stats"] = "disabled"
    """``"disabled"`` (check the loss, never re-run), ``"validate_results"`` (re-run a step whose loss failed a
    check to tell a transient fault from a reproducible one) or ``"report_determinism_stats"`` (re-run every step
    once and report how much results differ)."""
    check_for_nan_in_loss: bool = True
    """Check every micro-batch loss for NaN/Inf. The decision is reduced across all ranks: every rank stops (or
    skips the step) together."""
    check_for_spiky_loss: bool = False
    """Check for a loss far above the largest of the first 100 micro-batch losses (a warning; re-run when
    ``validate_results``)."""
    spiky_loss_factor: float = 10.0
    """A loss above factor * max observed loss is flagged."""
    max_consecutive_nan_skips: int = 0
    """With ``rerun_mode="disabled"``: skip the optimizer step of a step whose loss is NaN/Inf (gradients dropped,
    data consumed) up to this many steps in a row, then stop with exit 17. 0 stops at the first one."""
    max_rerun_restarts: int = 3
    """How many times a job may exit with 16 to re-run the same suspicious step from its checkpoint (each restart
    that lands on the same device is one more). Past it, ``on_rerun_limit`` applies: never an endless loop."""
    on_rerun_limit: Literal["stop", "fallback"] = "stop"
    """``"stop"``: exit 17 and ask ft_launcher not to restart. ``"fallback"``: set the failing checkpoint aside
    (renamed, never deleted), resume from the newest verified older one, once per failing step; then stop."""
    error_injection_rate: int = 0
    """Tests and drills: make megatron-core's error injector fail about one validated result in this many (0 =
    off). Affects the python random stream, so runs with it are not bit-comparable to runs without."""
    error_injection_type: Literal["correct_result", "transient_error", "persistent_error"] = "transient_error"
    """What the injected failure turns out to be: ``"transient_error"``, ``"persistent_error"`` or
    ``"correct_result"``."""
    result_rejected_tracker_filename: Optional[str] = None
    """File that megatron-core appends one line to for every rejected result (None = no file)."""


@named_fields
@dataclass
class HealthConfig:
    """Liveness ping, device health checks, hang attribution (a stuck rank's stacks) and the event stream."""

    liveness_ping_interval: int = 0
    """Every this many steps, all ranks join a one-element all-reduce on a side group with a real timeout, so that a
    dead or stuck peer is reported by rank (after at most ``liveness_ping_timeout`` seconds, exit 24) instead of the
    next large collective waiting for ``dist.distributed_timeout_minutes``. 0 turns it off."""
    liveness_ping_timeout: float = 60.0
    """Seconds the liveness ping waits for every rank; keep it above the longest step-to-step skew between ranks
    (a save on one rank delays its next ping)."""
    stack_dump_after: Optional[float] = None
    """Seconds a step or a save may stay open before this rank writes every thread's Python stack to its attribution
    file (``<checkpoint.save>/attribution/<attempt>/rank<N>.stacks``), so a hang leaves a record of where each rank
    was before a timeout kills it. ``None``: the earliest of half the ft section timeout, half of
    ``inprocess_restart.soft_timeout`` and, for a step, half of ``liveness_ping_timeout`` past the last step's length;
    off when none applies. 0: off."""
    event_dir: Optional[str] = None
    """Directory of the structured event stream (``docs/training/events.md``): every rank appends typed JSON lines
    (attempts, steps, checkpoint saves and loads, faults injected and detected, exits) to
    ``events-rank<R>.jsonl``; give the launcher the same directory (``--event-dir``) for its restarts and worker
    exits. ``None``: ``<checkpoint.save>/events`` when ``checkpoint.save`` is set, else off. ``""``: off."""
