"""Configuration dataclasses for pretraining, in Megatron-Bridge's form; ``validate()`` checks them first.

A run is described by a :class:`ConfigContainer` of megatron-core configs (``GPTModelProvider``, ``OptimizerConfig``,
``DistributedDataParallelConfig``, ``GPTDatasetConfig``) and the sections below. Recipes build one, entry scripts
apply dotted overrides (``train.train_iters=100 ft.enable_ft_package=True``) and :meth:`ConfigContainer.validate`
rejects every inconsistent combination, and every field this framework cannot honour, with a :class:`ValueError`
that names the field and the fix (the checks live in ``config_checks/container.py``; the list of refused fields in
``config_checks/field_support.py``; ``docs/training/config-reference.md`` lists every field with its status).

The resiliency sections (``ft``, ``nvrx_straggler``, ``inprocess_restart``, ``rerun_state_machine``, ...) are
defined in ``config_sections/resiliency.py``, ``CheckpointConfig`` in ``config_sections/checkpoint.py``; all are
importable from here, as in Megatron-Bridge. An optional section is off when it is ``None`` or its own switch field
is false (``ft.enable_ft_package``, ``nvrx_straggler.enabled``, ``inprocess_restart.enabled``): ask
:func:`is_enabled` (``is_enabled(cfg.ft)``), never the section or its flag alone.

Layers: the checks (``config_checks/``) import nothing from this module or ``config_sections/`` (they read the
objects they are given); the sections call them from ``finalize()`` and :meth:`ConfigContainer.validate` from here.
"""

import logging
import signal
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from megatron.bridge.training.config_checks import sections as section_checks
from megatron.bridge.training.config_checks.cross import (
    validate_precision_consistency as _validate_mixed_precision_consistency,
)
from megatron.bridge.training.config_sections.checkpoint import CheckpointConfig
from megatron.bridge.training.config_sections.resiliency import (
    INPROCESS_STORE_PORT_OFFSET,
    FaultInjectionConfig,
    FaultToleranceConfig,
    HealthConfig,
    InProcessRestartConfig,
    NVRxStragglerDetectionConfig,
    RerunStateMachineConfig,
    StragglerDetectionConfig,
)
from megatron.bridge.training.tokenizers.config import TokenizerConfig
from megatron.bridge.utils import launch_env
from megatron.bridge.utils.common_utils import get_rank_safe, get_world_size_safe
from megatron.bridge.utils.fields import is_enabled, named_fields

if TYPE_CHECKING:  # megatron-core classes: importing them here would import megatron-core with every config read
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron.bridge.data.base import DataloaderConfig, DatasetBuildContext, DatasetProvider
    from megatron.bridge.data.config import GPTDatasetConfig, MockGPTDatasetConfig
    from megatron.bridge.models.gpt_provider import GPTModelProvider

__all__ = [
    "INPROCESS_STORE_PORT_OFFSET",
    "CheckpointConfig",
    "ConfigContainer",
    "DataloaderConfig",
    "DatasetBuildContext",
    "DatasetProvider",
    "DistributedDataParallelConfig",
    "DistributedInitConfig",
    "FaultInjectionConfig",
    "FaultToleranceConfig",
    "GPTDatasetConfig",
    "HealthConfig",
    "InProcessRestartConfig",
    "LoggerConfig",
    "MockGPTDatasetConfig",
    "NVRxStragglerDetectionConfig",
    "OptimizerConfig",
    "ProfilingConfig",
    "RNGConfig",
    "RerunStateMachineConfig",
    "SchedulerConfig",
    "StragglerDetectionConfig",
    "TokenizerConfig",
    "TrainConfig",
    "TrainingConfig",
    "ValidationConfig",
    "apply_environment_variables",
    "is_enabled",
    "runtime_config_update",
]

_LAZY = {
    "OptimizerConfig": "megatron.core.optimizer",
    "DistributedDataParallelConfig": "megatron.core.distributed",
    "DataloaderConfig": "megatron.bridge.data.base",
    "DatasetBuildContext": "megatron.bridge.data.base",
    "DatasetProvider": "megatron.bridge.data.base",
    "GPTDatasetConfig": "megatron.bridge.data.config",
    "MockGPTDatasetConfig": "megatron.bridge.data.config",
}


def __getattr__(name: str) -> Any:
    """megatron-core's optimizer and DDP configs and the dataset configs, loaded on first use.

    Megatron-Bridge users import them from this module; importing them eagerly would load megatron-core with every
    config read.
    """
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def warn_rank_0(message: str) -> None:
    """``warnings.warn(message)`` on global rank 0 only (the config checks' warnings, once per job)."""
    if get_rank_safe() == 0:
        warnings.warn(message, stacklevel=2)


def _launcher_local_rank() -> int:
    """``$LOCAL_RANK`` or 0."""
    return launch_env.current().local_rank


def _default_ddp() -> "DistributedDataParallelConfig":
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig()


@named_fields
@dataclass(kw_only=True)
class RNGConfig:
    """Random number generation."""

    seed: int = 1234
    """Seed for every generator (python, numpy, torch, and megatron-core's model-parallel RNG tracker)."""
    te_rng_tracker: bool = False
    """Use Transformer Engine's RNG tracker (needs Transformer Engine)."""
    inference_rng_tracker: bool = False
    """Use the RNG tracker set up for inference."""
    data_parallel_random_init: bool = False
    """Initialize the weights differently on each data-parallel rank."""


@named_fields
@dataclass(kw_only=True)
class TrainingConfig:
    """Training loop length, batch sizes, and the ways a run may stop early."""

    micro_batch_size: Optional[int] = None
    """Samples per micro-batch on one data-parallel rank (required)."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all data-parallel ranks (gradient accumulation fills the rest); ``None``:
    ``micro_batch_size`` times the data-parallel size."""
    rampup_batch_size: Optional[list[int]] = None
    """Batch-size ramp-up ``[start, increment, samples]``."""
    decrease_batch_size_if_needed: bool = False
    """Shrink the global batch when the data-parallel size does not divide it."""
    empty_unused_memory_level: Literal[0, 1, 2] = 0
    """Empty the CUDA cache after each step (1) or also before the optimizer step (2)."""
    check_weight_hash_across_dp_replicas_interval: Optional[int] = None
    """Every this many steps, and before every save, check that data-parallel replicas hold identical weights; a
    mismatch rolls back to the newest checkpoint (exit 31) or, on a rank named before, stops (exit 30)."""
    train_sync_interval: Optional[int] = None
    """Synchronize the CPU with the GPU every this many steps."""
    train_iters: Optional[int] = None
    """Total number of optimizer steps (this or ``train_samples``)."""
    train_samples: Optional[int] = None
    """Total number of samples; ``train_iters`` becomes ``train_samples // global_batch_size``."""
    num_epochs: Optional[float] = None
    """Passes over a finite training dataset (fractions allowed); ``None``: the run's length is ``train_iters`` or
    ``train_samples``. Megatron-Bridge honours it only for its finite SFT datasets, which this framework does not
    have, so ``validate()`` refuses it, as Megatron-Bridge does for every other dataset."""
    _train_iters_from_num_epochs: bool = field(default=False, init=False, repr=False)
    """Whether ``train_iters`` was computed from ``num_epochs`` (Megatron-Bridge's marker; always False here)."""
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
    manual_gc: bool = False
    """Turn Python's automatic garbage collection off and collect on every rank at the same steps, every
    ``manual_gc_interval`` steps (``training/utils/garbage_collection.py``; set-up's objects are frozen either way,
    except
    under in-process restart)."""
    manual_gc_interval: int = 0
    """Steps between manual garbage collections (0: only around evaluation, with ``manual_gc_eval``)."""
    manual_gc_eval: bool = True
    """With ``manual_gc``: a full collection before each evaluation, a young-generation one after it."""
    iterations_to_skip: list[int] = field(default_factory=list)
    """Iterations whose batch is consumed without an update."""
    eval_iters: Optional[int] = None
    """Deprecated: ``validation.eval_iters`` (copied there by ``validate()``, with a warning)."""
    eval_interval: Optional[int] = None
    """Deprecated: ``validation.eval_interval`` (copied there by ``validate()``, with a warning)."""
    skip_train: Optional[bool] = None
    """Deprecated: ``validation.skip_train`` (copied there by ``validate()``, with a warning)."""
    derived: set[str] = field(default_factory=set, init=False, repr=False)
    """Fields ``validate()`` computed (``train_iters`` from ``train_samples``, ``global_batch_size``)."""

    def finalize(self) -> None:
        """Check that the run's length is given once; compute ``train_iters`` from ``train_samples``."""
        section_checks.finalize_training(self)


class TrainConfig(TrainingConfig):
    """Deprecated name of :class:`TrainingConfig` (Megatron-Bridge's); warns when used."""

    def __init__(self, **kwargs: Any) -> None:
        warnings.warn("TrainConfig is deprecated: use TrainingConfig", DeprecationWarning, stacklevel=2)
        super().__init__(**kwargs)


@named_fields
@dataclass(kw_only=True)
class ValidationConfig:
    """Evaluation on validation data during training."""

    eval_iters: Optional[int] = 100
    """Steps (global batches) of each evaluation."""
    eval_interval: Optional[int] = None
    """Evaluate every this many training steps; ``None``: never during training."""
    skip_train: bool = False
    """Do not train: evaluate the loaded (or freshly initialized) model once and stop."""
    eval_global_batch_size: Optional[int] = None
    """Samples per evaluation step over all data-parallel ranks; ``None``: ``train.global_batch_size`` (filled in by
    ``validate()``). A multiple of ``eval_micro_batch_size`` times the data-parallel size."""
    eval_micro_batch_size: Optional[int] = None
    """Samples per evaluation micro-batch on one rank; ``None``: ``train.micro_batch_size`` (filled in by
    ``validate()``)."""
    derived: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    """Fields ``validate()`` filled in from the training section, with the value it gave them (a field changed since
    is the user's)."""


@named_fields
@dataclass(kw_only=True)
class SchedulerConfig:
    """Learning-rate and weight-decay schedules (megatron-core's ``OptimizerParamScheduler``).

    The rates themselves (``lr``, ``min_lr``, ``weight_decay``) are fields of the optimizer config.
    """

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    """Shape of the learning-rate decay after warmup."""
    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    """Shape of the final anneal of a ``WSD`` (warmup-stable-decay) schedule."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which the rate decays; ``None``: ``train.train_iters``."""
    lr_decay_samples: Optional[int] = None
    """Samples over which the rate decays (instead of ``lr_decay_iters``)."""
    lr_wsd_decay_iters: Optional[int] = None
    """Iterations of a ``WSD`` schedule's final anneal."""
    lr_wsd_decay_samples: Optional[int] = None
    """Samples of a ``WSD`` schedule's final anneal."""
    lr_warmup_fraction: Optional[float] = None
    """Warmup as a fraction of the decay length (instead of ``lr_warmup_iters``/``lr_warmup_samples``)."""
    lr_warmup_iters: int = 0
    """Linear warmup length in iterations."""
    lr_warmup_samples: int = 0
    """Linear warmup length in samples."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of the warmup."""
    override_opt_param_scheduler: bool = False
    """On resume, use this config's schedule instead of the checkpoint's."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, use the checkpoint's schedule instead of this config's."""
    start_weight_decay: Optional[float] = None
    """Weight decay at the start; ``None``: the optimizer's ``weight_decay``."""
    end_weight_decay: Optional[float] = None
    """Weight decay at the end; ``None``: the optimizer's ``weight_decay``."""
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    """How the weight decay moves from start to end."""
    max_steps: Optional[int] = None
    """Length in iterations of the full run whose schedules a shorter run follows (at least ``train.train_iters``):
    the run takes the first ``train_iters`` steps of the longer run's learning-rate and weight-decay schedules
    (``lr_decay_iters`` becomes ``max_steps``). Iteration-based runs only; ``None``: the schedules span
    ``train_iters``."""
    lr_warmup_steps: Optional[int] = field(default=None, init=False)
    """Warmup length in samples, computed by ``validate()``."""
    lr_decay_steps: Optional[int] = field(default=None, init=False)
    """Decay length in samples, computed by ``validate()``."""
    wd_incr_steps: Optional[int] = field(default=None, init=False)
    """Weight-decay schedule length in samples, computed by ``validate()``."""
    wsd_decay_steps: Optional[int] = field(default=None, init=False)
    """Length of a ``WSD`` schedule's final anneal in samples, computed by ``validate()``."""
    derived: set[str] = field(default_factory=set, init=False, repr=False)
    """Fields ``validate()`` filled in from others (``lr_decay_iters``/``lr_decay_samples``, ``lr_wsd_decay_iters``)."""

    def finalize(self) -> None:
        """Check the schedule's own fields (units not mixed, one warmup, weight decay not decreasing)."""
        section_checks.finalize_scheduler(self)


@named_fields
@dataclass(kw_only=True)
class LoggerConfig:
    """Logging and TensorBoard."""

    log_interval: int = 100
    """Log loss and timings every this many iterations."""
    log_params_norm: bool = False
    """Log the norm of the parameters."""
    log_throughput: bool = False
    """Log throughput per GPU."""
    log_progress: bool = False
    """Write ``progress.txt`` (tokens, floating-point operations) into the checkpoint directory."""
    timing_log_level: Literal[-1, 0, 1, 2] = 0
    """Detail of the timers logged (0: the step only)."""
    timing_log_option: Literal["max", "minmax", "all"] = "minmax"
    """How timers are reduced across ranks."""
    tensorboard_dir: Optional[str] = None
    """Write scalars for TensorBoard here (rank 0 only); ``None`` disables it."""
    tensorboard_log_interval: int = 1
    """Write training scalars to TensorBoard every this many iterations."""
    tensorboard_queue_size: int = 1000
    """Events TensorBoard's writer queues before it flushes."""
    log_timers_to_tensorboard: bool = False
    """Write the timers to TensorBoard."""
    log_validation_ppl_to_tensorboard: bool = False
    """Write validation perplexity to TensorBoard."""
    log_memory_to_tensorboard: bool = False
    """Write CUDA memory statistics to TensorBoard."""
    wandb_project: Optional[str] = None
    """Weights & Biases project; ``None`` disables it."""
    wandb_exp_name: Optional[str] = None
    """Weights & Biases run name."""
    wandb_save_dir: Optional[str] = None
    """Weights & Biases local directory."""
    wandb_entity: Optional[str] = None
    """Weights & Biases team or user."""
    logging_level: int = logging.INFO
    """Level of the ``megatron.bridge`` loggers: ``logging.INFO`` (20), ``logging.DEBUG`` (10), ..."""

    def finalize(self) -> None:
        """Nothing to check alone (Megatron-Bridge's MLflow/Comet fields do not exist here)."""


@named_fields
@dataclass(kw_only=True)
class DistributedInitConfig:
    """torch.distributed setup."""

    distributed_backend: Literal["nccl", "gloo"] = "nccl"
    """Backend of the process groups. When the run trains on CPU (``device``), ``"nccl"`` runs on gloo (a CPU shim
    that logs it), so a GPU recipe runs unchanged on CPU."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """The device every rank trains on: ``"auto"`` (this rank's GPU when the node has one, the CPU when it has
    none; a GPU that is visible but unusable stops the run with exit 25, never a silent fall-back to CPU),
    ``"cuda"`` (a usable GPU is required: exit 25 without one, to requeue on GPU nodes) or ``"cpu"`` (gloo and the
    CPU shims even on a GPU node; bfloat16 is refused). Not a Megatron-Bridge field."""
    distributed_timeout_minutes: int = 10
    """Timeout of collectives (the watchdog timeout with NCCL)."""
    align_grad_reduce: bool = True
    """With pipeline parallelism, each stage reduces its gradients on its own."""
    local_rank: int = field(default_factory=_launcher_local_rank)
    """This process's rank on its node (from the launcher's ``LOCAL_RANK``); picks the GPU."""
    lazy_mpu_init: bool = False
    """Defer model-parallel initialization to an external manager (it also forces ``model.use_cpu_initialization``,
    as in Megatron-Bridge)."""
    use_megatron_fsdp: bool = False
    """Shard parameters with Megatron FSDP."""
    use_torch_fsdp2: bool = False
    """Shard parameters with PyTorch FSDP2."""
    nccl_communicator_config_path: Optional[str] = None
    """YAML file of per-communicator NCCL settings."""
    use_tp_pp_dp_mapping: bool = False
    """Order ranks tensor-pipeline-data instead of tensor-data-pipeline."""
    use_gloo_process_groups: bool = True
    """Also create gloo process groups next to the NCCL ones."""
    use_sharp: bool = False
    """Use InfiniBand SHARP for data-parallel collectives."""
    external_gpu_device_mapping: bool = False
    """GPU visibility is set outside (``CUDA_VISIBLE_DEVICES``): always use ``cuda:0``."""
    enable_megatron_core_experimental: bool = False
    """Enable megatron-core's experimental features."""
    distributed_timeout_seconds_after_init: Optional[int] = None
    """A shorter collective timeout from the first iteration on."""
    disable_jit_fuser: bool = False
    """Turn megatron-core's jit fuser off (it is always off on CPU)."""

    @property
    def lazy_init(self) -> bool:
        """Megatron-Bridge's other name of :attr:`lazy_mpu_init`."""
        return self.lazy_mpu_init

    @lazy_init.setter
    def lazy_init(self, value: bool) -> None:
        self.lazy_mpu_init = value


@named_fields
@dataclass(kw_only=True)
class ProfilingConfig:
    """Profilers (none can run in this framework yet: ``validate()`` refuses turning one on)."""

    use_nsys_profiler: bool = False
    """Drive Nsight Systems through the CUDA profiler API."""
    profile_step_start: int = 10
    """First profiled step."""
    profile_step_end: int = 12
    """Last profiled step."""
    use_pytorch_profiler: bool = False
    """Use the PyTorch profiler."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """Ranks that profile."""
    record_memory_history: bool = False
    """Record the CUDA memory history."""
    memory_snapshot_path: str = "snapshot.pickle"
    """Where the memory snapshot is written."""
    record_shapes: bool = False
    """Record tensor shapes while profiling."""
    nvtx_ranges: bool = False
    """Annotate NVTX ranges."""

    def finalize(self) -> None:
        """One profiler at a time, over a step range that exists."""
        section_checks.finalize_profiling(self)


@dataclass(kw_only=True)
class ConfigContainer:
    """Everything that describes one pretraining run (keyword arguments only; Megatron-Bridge's sections)."""

    env_vars: dict[str, Union[str, int, float, bool]] = field(default_factory=dict)
    """Environment variables the recipe wants set (``runtime_config_update`` sets each one the process does not
    already have: the launcher's and the job script's values win)."""
    rng: RNGConfig = field(default_factory=RNGConfig)
    """Seeds."""
    rerun_state_machine: RerunStateMachineConfig = field(default_factory=RerunStateMachineConfig)
    """Re-run state machine and loss checks."""
    train: TrainingConfig
    """Loop length, batch sizes, early exits."""
    model: "GPTModelProvider"
    """The model and its parallelism: a ``GPTModelProvider`` (``megatron.bridge.models``), i.e. a megatron-core
    ``TransformerConfig`` that builds the model."""
    optimizer: "OptimizerConfig"
    """The optimizer: megatron-core's ``OptimizerConfig`` (``optimizer``, ``lr``, ``min_lr``, ``weight_decay``,
    ``adam_*``, ``clip_grad``, ...), built by ``get_megatron_optimizer``."""
    ddp: "DistributedDataParallelConfig" = field(default_factory=_default_ddp)
    """Data-parallel gradient reduction: megatron-core's ``DistributedDataParallelConfig``."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """Evaluation on validation data."""
    scheduler: SchedulerConfig
    """Learning-rate schedule."""
    dataset: "GPTDatasetConfig"
    """Data: a ``MockGPTDatasetConfig`` (synthetic tokens) or ``GPTDatasetConfig`` (megatron-core's)."""
    logger: LoggerConfig
    """Logging."""
    tokenizer: TokenizerConfig
    """The tokenizer (``NullTokenizer`` with ``vocab_size`` for mock data)."""
    checkpoint: CheckpointConfig
    """Checkpoint save and load."""
    dist: DistributedInitConfig = field(default_factory=DistributedInitConfig)
    """torch.distributed."""
    ft: Optional[FaultToleranceConfig] = None
    """Fault tolerance; ``None`` is off (a dotted override of one of its fields creates it)."""
    straggler: Optional[StragglerDetectionConfig] = None
    """The legacy straggler detector (rejected when enabled); ``None`` is off."""
    nvrx_straggler: Optional[NVRxStragglerDetectionConfig] = None
    """Straggler detection; ``None`` is off."""
    profiling: Optional[ProfilingConfig] = field(default_factory=ProfilingConfig)
    """Profilers; ``None`` is off."""
    peft: Optional[Any] = None
    """Parameter-efficient finetuning (not available here: must be ``None``)."""
    comm_overlap: Optional[Any] = None
    """Communication overlap settings (not available here: must be ``None``)."""
    mixed_precision: Optional[Union[str, Any]] = None
    """A mixed-precision recipe (not available here: must be ``None``; set ``model.bf16``/``params_dtype``)."""
    tensor_inspect: Optional[Any] = None
    """Tensor inspection (not available here: must be ``None``)."""
    inprocess_restart: Optional[InProcessRestartConfig] = None
    """In-process restart; ``None`` is off."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """Liveness ping, device health checks, hang attribution (this framework's)."""
    fault_injection: FaultInjectionConfig = field(default_factory=FaultInjectionConfig)
    """Faults injected for tests and drills (this framework's)."""
    data_parallel_size: Optional[int] = field(default=None, init=False)
    """Data-parallel replicas for the world size validated against (filled in by ``validate()``)."""

    def to_dict(self) -> dict[str, Any]:
        """The config as plain values: each section a mapping naming its class in ``_target_``."""
        from megatron.bridge.training.utils.config_utils import to_plain

        return to_plain(self)

    def to_yaml(self, yaml_path: Optional[str] = None) -> None:
        """Write :meth:`to_dict` as YAML to ``yaml_path`` (atomically), or print it when ``None``."""
        from megatron.bridge.training.utils.config_utils import write_yaml

        write_yaml(self.to_dict(), yaml_path)

    def print_yaml(self) -> None:
        """Print the config as YAML."""
        self.to_yaml()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any]) -> "ConfigContainer":
        """The config :meth:`to_dict` wrote, built again (``utils.config_utils.from_plain``)."""
        from megatron.bridge.training.utils.config_utils import from_plain

        return from_plain({**config_dict, "_target_": f"{cls.__module__}.{cls.__qualname__}"})

    @classmethod
    def from_yaml(cls, yaml_path: str) -> "ConfigContainer":
        """The config a :meth:`to_yaml` file (or a checkpoint's ``run_config.yaml``) holds, built again."""
        from megatron.bridge.training.utils.config_utils import read_yaml

        return cls.from_dict(read_yaml(yaml_path))

    def get_data_parallel_size(self, world_size: int) -> int:
        """Data-parallel replicas among ``world_size`` ranks (the active ones with in-process restart's reserves)."""
        from megatron.bridge.training.config_checks.container import active_ranks, check_world_divisible

        return check_world_divisible(self.model, active_ranks(self, world_size))

    def set_data_parallel_size(self) -> None:
        """Fill :attr:`data_parallel_size` for this process's world size, without validating the rest."""
        self.data_parallel_size = self.get_data_parallel_size(get_world_size_safe())

    def validate(self, world_size: Optional[int] = None) -> None:
        """Check every field and every combination; raise ``ValueError`` naming the field and the fix.

        As in Megatron-Bridge, it runs every section's ``finalize()``, finalizes the model and dataset configs and
        fills the fields derived from others (``train.global_batch_size`` when ``None``, ``train.train_iters`` from
        ``train.train_samples``, the scheduler's lengths, the evaluation batch sizes, :attr:`data_parallel_size`).
        Where Megatron-Bridge reconciles two fields (the distributed optimizer's flags), it does the same, with a
        warning.

        Args:
            world_size: number of ranks; defaults to this process's (``get_world_size_safe()``: the process
                group's, else ``$WORLD_SIZE``, else 1).
        """
        from megatron.bridge.training.config_checks.container import (
            validate_config,
            validate_fields,
        )  # never imports this

        if world_size is None:
            world_size = get_world_size_safe()
        validate_fields(self)  # types and spelling first: the reconciliations below read the fields
        _validate_and_sync_distributed_optimizer_settings(self)
        _validate_mixed_precision_consistency(self)
        validate_config(self, world_size, INPROCESS_STORE_PORT_OFFSET)
        self.data_parallel_size = self.get_data_parallel_size(world_size)


def apply_environment_variables(cfg: ConfigContainer) -> None:
    """Set each of ``cfg.env_vars`` that this process does not have yet (the launcher's values win).

    Raises:
        ValueError: a name that is not a non-empty string.
        TypeError: a value that is not a string, number or bool.
    """
    from megatron.bridge.training.utils.env_defaults import apply_env_defaults

    apply_env_defaults(cfg.env_vars)


def runtime_config_update(cfg: ConfigContainer) -> None:
    """Make ``cfg`` ready to train, as Megatron-Bridge's entry points do: apply ``env_vars``, then validate.

    Megatron-Bridge also applies a mixed-precision recipe and communication-overlap settings here; neither exists in
    this framework (``validate()`` refuses both). Calling it twice changes nothing the second time. Like
    ``validate()``, it accepts a config that names no tokenizer; ``pretrain()`` then refuses it before anything
    starts (``config_checks/container.py``: ``require_tokenizer``).
    """
    apply_environment_variables(cfg)
    cfg.set_data_parallel_size()
    cfg.validate()


def _validate_and_sync_distributed_optimizer_settings(config: ConfigContainer) -> None:
    """Turn the distributed optimizer (and parameter-gather overlap) on in both DDP and the optimizer.

    As Megatron-Bridge does when either asks for it, with a warning when the two disagreed: both must agree for the
    optimizer to shard its state over the buffers DDP lays out.
    """
    for name, what in (("use_distributed_optimizer", "distributed optimizer"), ("overlap_param_gather", None)):
        in_ddp, in_optimizer = getattr(config.ddp, name), getattr(config.optimizer, name)
        if in_ddp or in_optimizer:
            if in_ddp != in_optimizer:
                title = what.capitalize() if what else name
                warn_rank_0(
                    f"{title} settings were not in sync: ddp.{name}={in_ddp}, optimizer.{name}={in_optimizer}. "
                    f"Automatically enabling {what or name} for both settings."
                )
            setattr(config.ddp, name, True)
            setattr(config.optimizer, name, True)
