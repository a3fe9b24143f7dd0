"""Configuration dataclasses for pretraining; ``validate()`` checks them before anything starts.

A run is described by a :class:`ConfigContainer`. Recipes build one, entry scripts apply dotted overrides
(``train.train_iters=100 ft.enable_ft_package=true``) and :meth:`ConfigContainer.validate` rejects every
inconsistent combination with a :class:`ValueError` that names the field and the fix (the checks live in
``config_validation.py``).
"""

import dataclasses
import logging
import signal
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Optional

if TYPE_CHECKING:  # megatron-core classes: importing them here would import megatron-core with every config read
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron.bridge.models.gpt_provider import GPTModelProvider


def __getattr__(name: str) -> Any:
    """megatron-core's ``OptimizerConfig`` and ``DistributedDataParallelConfig``, loaded on first use.

    Megatron-Bridge users import both from this module.
    """
    if name == "OptimizerConfig":
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig
    if name == "DistributedDataParallelConfig":
        from megatron.core.distributed import DistributedDataParallelConfig

        return DistributedDataParallelConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _default_ddp() -> "DistributedDataParallelConfig":
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig()


@dataclass
class RNGConfig:
    """Random number generation."""

    seed: int = 1234
    """Seed for every generator (python, numpy, torch, and megatron-core's model-parallel RNG tracker)."""


@dataclass(kw_only=True)
class TrainingConfig:
    """Training loop length, batch sizes, and the ways a run may stop early."""

    train_iters: int = 100
    """Total number of optimizer steps."""
    micro_batch_size: int = 2
    """Samples per micro-batch on one data-parallel rank."""
    global_batch_size: int = 8
    """Samples per optimizer step over all data-parallel ranks (gradient accumulation fills the rest)."""
    exit_interval: Optional[int] = None
    """Save and exit when the iteration is a multiple of this (exit code 20)."""
    exit_duration_in_mins: Optional[float] = None
    """Save and exit after this many minutes of this process's wall time (exit code 19)."""
    exit_signal_handler: bool = False
    """Catch ``exit_signal``, save a checkpoint and exit (exit code 18)."""
    exit_signal: signal.Signals = signal.SIGTERM
    """Signal that triggers the save-and-exit path when ``exit_signal_handler`` is on."""
    exit_signal_handler_for_dataloader: bool = False
    """Make data-loader workers ignore ``exit_signal`` so they survive until the save (with ``num_workers > 0``)."""
    exit_signal_deadline: Optional[float] = 50.0
    """Seconds from the signal to the exit: a save still running then is abandoned (it is never loaded; the newest
    committed checkpoint stays the one to resume from) and the process exits 18. Keep it below the scheduler's
    grace time (``PreemptionPlugin.preempt_time``, Slurm ``KillWait``); ``None`` waits for the save however long."""


class TrainConfig(TrainingConfig):
    """Deprecated name of :class:`TrainingConfig` (Megatron-Bridge's); warns when used."""

    def __init__(self, **kwargs: Any) -> None:
        warnings.warn("TrainConfig is deprecated: use TrainingConfig", DeprecationWarning, stacklevel=2)
        super().__init__(**kwargs)


@dataclass(kw_only=True)
class ValidationConfig:
    """Evaluation on validation data during training."""

    eval_iters: int = 100
    """Steps (global batches) of each evaluation."""
    eval_interval: Optional[int] = None
    """Evaluate every this many training steps; ``None``: never during training."""
    skip_train: bool = False
    """Do not train: evaluate the loaded (or freshly initialized) model once and stop."""


@dataclass
class SchedulerConfig:
    """Learning-rate schedule (megatron-core ``OptimizerParamScheduler``)."""

    lr_decay_style: str = "cosine"
    """``"constant"``, ``"linear"`` or ``"cosine"``."""
    lr_warmup_iters: int = 2
    """Linear warmup length in iterations."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which the rate decays; ``None`` means ``train.train_iters``."""


@dataclass
class DatasetConfig:
    """Mock pretraining data: deterministic random token sequences, addressed by global sample index."""

    num_workers: int = 0
    """Data-loader worker processes per rank."""
    seed: Optional[int] = None
    """Seed of the token stream; ``None`` means ``rng.seed``."""


@dataclass
class CheckpointConfig:
    """Checkpoint save and load (global ``torch_dist`` tier; ``non_persistent_*`` is the local tier)."""

    save: Optional[str] = None
    """Directory to save checkpoints into; ``None`` disables saving."""
    load: Optional[str] = None
    """Directory to resume from (usually the same as ``save``); ``None`` starts from scratch."""
    save_interval: Optional[int] = None
    """Save every this many iterations (and at the end of training)."""
    most_recent_k: int = -1
    """Keep only the newest k committed checkpoints; -1 keeps all."""
    ckpt_format: str = "torch_dist"
    """On-disk format; only ``"torch_dist"`` (megatron-core distributed checkpointing) is supported."""
    async_save: bool = False
    """Write checkpoint files in a background process while training continues (needs ``torch_dist``)."""
    fully_parallel_save: bool = True
    """Spread the writing of replicated tensors over data-parallel ranks."""
    exit_on_missing_checkpoint: bool = False
    """Fail (exit code 3) when ``load`` holds no checkpoint at all, instead of starting from iteration 0."""
    non_persistent_save_interval: Optional[int] = None
    """Local-tier save interval in iterations."""
    non_persistent_ckpt_type: Optional[str] = None
    """Local-tier type: ``"local"`` (node-local storage through nvidia-resiliency-ext)."""
    non_persistent_local_ckpt_dir: Optional[str] = None
    """Node-local directory for the local tier."""
    non_persistent_local_ckpt_algo: str = "fully_parallel"
    """Local-tier save algorithm: ``"fully_parallel"`` or ``"atomic"``."""
    replication: bool = False
    """Replicate local-tier shards to other nodes."""
    replication_jump: Optional[int] = None
    """Rank distance between replicas; ``None`` means ranks per node."""
    replication_factor: int = 2
    """Number of copies of each local-tier shard."""


@dataclass
class LoggerConfig:
    """Logging."""

    log_interval: int = 1
    """Log loss and timings every this many iterations."""
    logging_level: int = logging.INFO
    """Level of the ``megatron.bridge`` loggers: ``logging.INFO`` (20), ``logging.DEBUG`` (10), ..."""
    tensorboard_dir: Optional[str] = None
    """Write scalars for TensorBoard here (rank 0 only); ``None`` disables it."""


@dataclass(kw_only=True)
class DistributedInitConfig:
    """torch.distributed setup."""

    distributed_backend: Literal["nccl", "gloo"] = "nccl"
    """Backend of the process groups. On a machine without CUDA, ``"nccl"`` runs on gloo (a CPU shim that logs
    it), so a GPU recipe runs unchanged on CPU."""
    distributed_timeout_minutes: int = 10
    """Timeout of collectives (the watchdog timeout with NCCL)."""


@dataclass
class FaultToleranceConfig:
    """Hang and crash detection through nvidia-resiliency-ext's rank monitor (needs ``ft_launcher``)."""

    enable_ft_package: bool = False
    """Enable fault tolerance (heartbeats and section timeouts to the ft_launcher rank monitor)."""
    calc_ft_timeouts: bool = False
    """Compute section timeouts from observed times and save them to ``ft_state.json``."""
    simulate_fault: bool = False
    """Inject a fault for testing: a timed fault of the fault-injection registry (``<kind>@<delay>s:<rank>``)."""
    simulated_fault_type: str = "random"
    """``"rank_hung"``, ``"rank_killed"`` or ``"random"``."""
    simulated_fault_rank: Optional[int] = None
    """Rank to fault; ``None`` picks one at random."""
    simulated_fault_base_delay: float = 0
    """Seconds after the rank starts training (its first iteration) before the simulated fault strikes."""


@dataclass
class FaultInjectionConfig:
    """Real faults on demand, for tests and drills (``training/fault_injection.py`` documents the spec)."""

    faults: str = ""
    """Comma-separated faults ``<kind>@<when>:<rank>[:<phase>][:x<factor>][:always]``, e.g.
    ``"kill@8:1,stall@6:1:save.during_write,nan@8:0:local_save"``; ``$MBRIDGE_FAULTS`` (for launcher-driven runs)
    adds its faults to these. Empty: none."""
    ledger: Optional[str] = None
    """File shared by every attempt of the job: each fault strikes once per job, the first time any attempt reaches
    it, and is recorded there (a JSON line with its wall-clock time) just before. ``None``: faults strike in the
    first attempt only (unless ``:always``)."""


@dataclass
class NVRxStragglerDetectionConfig:
    """Straggler detection through nvidia-resiliency-ext's ``straggler.Detector``."""

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
    enable_logging: bool = True
    """Send score statistics to TensorBoard."""
    profiling_interval: int = 1
    """Time every n-th entry of each detection section (the step section once per step, the forward section once
    per micro-batch); 1 times all of them."""


@dataclass
class StragglerDetectionConfig:
    """megatron-core's older ``StragglerDetector`` (Megatron-LM's ``--log-straggler``).

    Not available in this framework: it is here so that a config carried over from Megatron-LM fails with a clear
    message instead of an unknown-field error. Use :class:`NVRxStragglerDetectionConfig`.
    """

    log_straggler: bool = False
    """Enable the legacy detector; only ``False`` is accepted (use ``nvrx_straggler.enabled``)."""


def is_enabled(section: Optional[object], flag: str = "enabled") -> bool:
    """Whether an optional section is set and switched on (``None`` is off).

    Example: ``is_enabled(cfg.ft, "enable_ft_package")``.
    """
    return section is not None and bool(getattr(section, flag))


INPROCESS_STORE_PORT_OFFSET = 2
"""In-process restart's store listens on ``MASTER_PORT + 2`` (the launcher's store is on ``MASTER_PORT``)."""


@dataclass
class InProcessRestartConfig:
    """In-process restart through nvidia-resiliency-ext's ``inprocess.Wrapper`` (experimental).

    Needs a launcher that sets ``MASTER_ADDR``/``MASTER_PORT`` (torchrun, ``megatron.bridge.launch``, ft_launcher or
    srun with ``--kill-on-bad-exit=0``), the environment ``TORCH_CPP_LOG_LEVEL=error``,
    ``TORCH_NCCL_RETHROW_CUDA_ERRORS=0``, ``NCCL_NVLS_ENABLE=0``, and a free port at ``MASTER_PORT + 2`` (the
    wrapper's store, hosted by rank 0).
    """

    enabled: bool = False
    """Enable in-process restart."""
    active_world_size: Optional[int] = None
    """Ranks executing the workload; the rest are warm reserves that replace faulty ranks. ``None``: all ranks."""
    granularity: str = "node"
    """``"node"``: a fault retires every rank of the faulty rank's node; ``"rank"``: only that rank."""
    max_iterations: Optional[int] = None
    """Maximum in-process restarts (the training function runs at most this + 1 times); then the processes exit
    with code 22 and an outer launcher may restart the job. ``None`` is unlimited."""
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
    empty_cuda_cache: bool = True
    """Empty the CUDA cache before a restart (no effect without CUDA)."""
    max_rank_faults: Optional[int] = None
    """Faults a rank may cause before its health check fails and it is retired. ``None`` is unlimited."""
    monitor_process_logdir: Optional[str] = None
    """Directory for one monitor-process log per rank (``monitor_process_<rank>.log``); ``None`` logs nowhere."""


@dataclass
class RerunStateMachineConfig:
    """megatron-core's re-run state machine (experimental upstream) and the loss checks around it."""

    rerun_mode: str = "disabled"
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
    on_rerun_limit: str = "stop"
    """``"stop"``: exit 17 and ask ft_launcher not to restart. ``"fallback"``: set the failing checkpoint aside
    (renamed, never deleted), resume from the newest verified older one, once per failing step; then stop."""
    error_injection_rate: int = 0
    """Tests and drills: make megatron-core's error injector fail about one validated result in this many (0 =
    off). Affects the python random stream, so runs with it are not bit-comparable to runs without."""
    error_injection_type: str = "transient_error"
    """What the injected failure turns out to be: ``"transient_error"``, ``"persistent_error"`` or
    ``"correct_result"``."""
    result_rejected_tracker_filename: Optional[str] = None
    """File that megatron-core appends one line to for every rejected result (None = no file)."""


@dataclass
class HealthConfig:
    """Liveness ping, device health checks and hang attribution (stacks of a stuck rank written before it is killed)."""

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


@dataclass(kw_only=True)
class ConfigContainer:
    """Everything that describes one pretraining run (keyword arguments only)."""

    model: "GPTModelProvider"
    """The model and its parallelism: a ``GPTModelProvider`` (``megatron.bridge.models``), i.e. a megatron-core
    ``TransformerConfig`` that builds the model."""
    train: TrainingConfig = field(default_factory=TrainingConfig)
    """Loop length, batch sizes, early exits."""
    optimizer: "OptimizerConfig"
    """The optimizer: megatron-core's ``OptimizerConfig`` (``optimizer``, ``lr``, ``min_lr``, ``weight_decay``,
    ``adam_*``, ``clip_grad``, ...), built by ``get_megatron_optimizer``."""
    ddp: "DistributedDataParallelConfig" = field(default_factory=_default_ddp)
    """Data-parallel gradient reduction: megatron-core's ``DistributedDataParallelConfig``."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """Evaluation on validation data."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Data."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint save and load."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Logging."""
    dist: DistributedInitConfig = field(default_factory=DistributedInitConfig)
    """torch.distributed."""
    rng: RNGConfig = field(default_factory=RNGConfig)
    """Seeds."""
    ft: Optional[FaultToleranceConfig] = None
    """Fault tolerance; ``None`` is off (a dotted override of one of its fields creates it)."""
    nvrx_straggler: Optional[NVRxStragglerDetectionConfig] = None
    """Straggler detection; ``None`` is off."""
    straggler: Optional[StragglerDetectionConfig] = None
    """The legacy straggler detector (rejected when enabled); ``None`` is off."""
    inprocess_restart: Optional[InProcessRestartConfig] = None
    """In-process restart; ``None`` is off."""
    rerun_state_machine: RerunStateMachineConfig = field(default_factory=RerunStateMachineConfig)
    """Re-run state machine."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """Liveness ping, device health checks, hang attribution."""
    fault_injection: FaultInjectionConfig = field(default_factory=FaultInjectionConfig)
    """Faults injected for tests and drills."""

    def validate(self, world_size: Optional[int] = None) -> None:
        """Check every field and every combination; raise ``ValueError`` naming the field and the fix.

        Args:
            world_size: number of ranks; defaults to ``$WORLD_SIZE`` (1 when unset).
        """
        from megatron.bridge.training.config_validation import validate_config  # one way: it never imports this

        validate_config(_with_sections(self), world_size, INPROCESS_STORE_PORT_OFFSET)


def _with_sections(cfg: ConfigContainer) -> ConfigContainer:
    """A shallow copy of ``cfg`` whose optional resiliency sections that are ``None`` hold their (off) defaults."""
    return dataclasses.replace(
        cfg,
        ft=cfg.ft or FaultToleranceConfig(),
        nvrx_straggler=cfg.nvrx_straggler or NVRxStragglerDetectionConfig(),
        straggler=cfg.straggler or StragglerDetectionConfig(),
        inprocess_restart=cfg.inprocess_restart or InProcessRestartConfig(),
    )
