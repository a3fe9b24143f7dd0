"""Configuration dataclasses for pretraining, and the one ``validate()`` that checks them before anything starts.

A run is described by a :class:`ConfigContainer`. Recipes build one, entry scripts apply dotted overrides
(``train.train_iters=100 ft.enable_ft_package=true``) and :meth:`ConfigContainer.validate` rejects every
inconsistent combination with a :class:`ValueError` that names the field and the fix.
"""

import os
import signal
from dataclasses import dataclass, field
from typing import Optional

import torch

_ENABLE_LATER = "is not supported by this version of megatron.bridge yet; leave it at its default"


def _fail(field_name: str, problem: str, fix: str) -> None:
    raise ValueError(f"{field_name}: {problem}. Fix: {fix}.")


@dataclass
class RNGConfig:
    """Random number generation."""

    seed: int = 1234
    """Seed for every generator (python, numpy, torch, and megatron-core's model-parallel RNG tracker)."""


@dataclass
class ModelConfig:
    """A GPT model built with megatron-core's ``GPTModel`` and its local (Transformer-Engine-free) layer spec."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Width of the residual stream."""
    ffn_hidden_size: Optional[int] = None
    """Width of the MLP; ``None`` means ``4 * hidden_size``."""
    num_attention_heads: int = 4
    """Number of attention heads; must divide ``hidden_size`` and be divisible by the tensor parallel size."""
    vocab_size: int = 128
    """Vocabulary size; must be divisible by ``tensor_model_parallel_size``."""
    seq_length: int = 32
    """Sequence length of every training sample (also the maximum position embedding)."""
    hidden_dropout: float = 0.1
    """Dropout probability after attention and MLP."""
    attention_dropout: float = 0.1
    """Dropout probability on attention scores."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    params_dtype: str = "float32"
    """Parameter dtype: ``"float32"`` or ``"bfloat16"`` (bf16 keeps fp32 master weights in the optimizer)."""
    tensor_model_parallel_size: int = 1
    """Tensor parallel size; must divide the world size."""
    pipeline_model_parallel_size: int = 1
    """Pipeline parallel size; only 1 is supported by this trunk."""
    share_embeddings_and_output_weights: bool = True
    """Tie the input embedding and the output projection."""


@dataclass
class TrainConfig:
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
    """Also install the handler in data-loader workers so they survive until the save."""


@dataclass
class OptimizerConfig:
    """Adam optimizer built by megatron-core's ``get_megatron_optimizer``."""

    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-5
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""


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
    log_level: str = "INFO"
    """Level of the ``megatron.bridge`` loggers."""
    tensorboard_dir: Optional[str] = None
    """Write scalars for TensorBoard here (rank 0 only); ``None`` disables it."""


@dataclass
class DistributedConfig:
    """torch.distributed setup."""

    backend: Optional[str] = None
    """``"nccl"`` or ``"gloo"``; ``None`` picks nccl when CUDA is present, else gloo."""
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
    """Inject a fault for testing."""
    simulated_fault_type: str = "random"
    """``"rank_hung"``, ``"rank_killed"`` or ``"random"``."""
    simulated_fault_rank: Optional[int] = None
    """Rank to fault; ``None`` picks one at random."""
    simulated_fault_base_delay: float = 0
    """Seconds after setup before the simulated fault strikes."""


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
    """Profile every this many steps."""


@dataclass
class InProcessRestartConfig:
    """In-process restart through nvidia-resiliency-ext's ``inprocess.Wrapper`` (experimental)."""

    enabled: bool = False
    """Enable in-process restart."""
    active_world_size: Optional[int] = None
    """Ranks executing the workload; the rest are warm reserves."""
    granularity: str = "node"
    """``"node"`` or ``"rank"`` restart granularity."""
    max_iterations: Optional[int] = None
    """Maximum restart attempts; ``None`` is unlimited."""
    soft_timeout: float = 60.0
    """Seconds without progress before a hang is declared (GIL released)."""
    hard_timeout: float = 90.0
    """Seconds without progress before hung ranks are force-terminated."""
    heartbeat_interval: float = 30.0
    """Seconds between monitor heartbeats."""
    heartbeat_timeout: float = 60.0
    """Seconds of missing heartbeats before a rank is declared dead."""
    barrier_timeout: float = 120.0
    """Timeout of the restart barrier."""
    completion_timeout: float = 120.0
    """Timeout of the completion barrier."""
    empty_cuda_cache: bool = True
    """Empty the CUDA cache during a restart."""
    max_rank_faults: Optional[int] = None
    """Maximum rank faults before terminating."""
    monitor_process_logdir: Optional[str] = None
    """Directory for monitor process logs."""


@dataclass
class RerunStateMachineConfig:
    """megatron-core's re-run state machine (experimental upstream)."""

    rerun_mode: str = "disabled"
    """``"disabled"``, ``"validate_results"`` or ``"report_determinism_stats"``."""
    check_for_nan_in_loss: bool = True
    """Check the loss for NaN/Inf."""
    check_for_spiky_loss: bool = False
    """Check for a loss far above the largest seen."""
    spiky_loss_factor: float = 10.0
    """A loss above factor * max observed loss is flagged."""


@dataclass
class ConfigContainer:
    """Everything that describes one pretraining run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture and parallelism."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Loop length, batch sizes, early exits."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Data."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint save and load."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Logging."""
    dist: DistributedConfig = field(default_factory=DistributedConfig)
    """torch.distributed."""
    rng: RNGConfig = field(default_factory=RNGConfig)
    """Seeds."""
    ft: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    """Fault tolerance."""
    nvrx_straggler: NVRxStragglerDetectionConfig = field(default_factory=NVRxStragglerDetectionConfig)
    """Straggler detection."""
    inprocess_restart: InProcessRestartConfig = field(default_factory=InProcessRestartConfig)
    """In-process restart."""
    rerun_state_machine: RerunStateMachineConfig = field(default_factory=RerunStateMachineConfig)
    """Re-run state machine."""

    def validate(self, world_size: Optional[int] = None) -> None:
        """Check every field and every combination; raise ``ValueError`` naming the field and the fix.

        Args:
            world_size: number of ranks; defaults to ``$WORLD_SIZE`` (1 when unset).
        """
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        _validate_model(self.model, world_size)
        _validate_train(self.train, self.model, world_size)
        _validate_optimizer(self.optimizer, self.scheduler, self.train)
        _validate_checkpoint(self.checkpoint)
        _validate_runtime(self)
        _validate_fault_tolerance(self.ft, world_size)
        _validate_not_yet_supported(self)


def data_parallel_size(model: ModelConfig, world_size: int) -> int:
    """Number of data-parallel replicas for a world of ``world_size`` ranks."""
    return world_size // (model.tensor_model_parallel_size * model.pipeline_model_parallel_size)


def _validate_model(m: ModelConfig, world_size: int) -> None:
    tp = m.tensor_model_parallel_size
    if tp < 1:
        _fail("model.tensor_model_parallel_size", f"must be >= 1, got {tp}", "set a positive size")
    if m.pipeline_model_parallel_size != 1:
        _fail("model.pipeline_model_parallel_size", "pipeline parallelism is not supported", "set it to 1")
    if world_size % tp:
        _fail(
            "model.tensor_model_parallel_size",
            f"{tp} does not divide the world size {world_size}",
            "use a divisor of the number of ranks",
        )
    for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
        if getattr(m, name) < 1:
            _fail(f"model.{name}", f"must be >= 1, got {getattr(m, name)}", "set a positive value")
    if m.hidden_size % m.num_attention_heads:
        _fail(
            "model.num_attention_heads",
            f"{m.num_attention_heads} does not divide hidden_size {m.hidden_size}",
            "choose heads that divide the hidden size",
        )
    if m.num_attention_heads % tp:
        _fail(
            "model.num_attention_heads",
            f"{m.num_attention_heads} is not divisible by tensor parallel size {tp}",
            "use a multiple of model.tensor_model_parallel_size",
        )
    if m.vocab_size % tp:
        _fail(
            "model.vocab_size",
            f"{m.vocab_size} is not divisible by tensor parallel size {tp}",
            "pad the vocabulary to a multiple of model.tensor_model_parallel_size",
        )
    if m.ffn_hidden_size is not None and m.ffn_hidden_size < 1:
        _fail("model.ffn_hidden_size", f"must be >= 1 or None, got {m.ffn_hidden_size}", "use null for 4 * hidden_size")
    if m.ffn_hidden_size is not None and m.ffn_hidden_size % tp:
        _fail(
            "model.ffn_hidden_size",
            f"{m.ffn_hidden_size} is not divisible by tensor parallel size {tp}",
            "use a multiple of model.tensor_model_parallel_size",
        )
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(m, name) < 1.0:
            _fail(f"model.{name}", f"must be in [0, 1), got {getattr(m, name)}", "use a probability below 1")
    if m.params_dtype not in ("float32", "bfloat16"):
        _fail("model.params_dtype", f"unknown dtype {m.params_dtype!r}", 'use "float32" or "bfloat16"')


def _validate_train(t: TrainConfig, m: ModelConfig, world_size: int) -> None:
    if t.train_iters < 1:
        _fail("train.train_iters", f"must be >= 1, got {t.train_iters}", "set the number of optimizer steps")
    if t.micro_batch_size < 1:
        _fail("train.micro_batch_size", f"must be >= 1, got {t.micro_batch_size}", "set a positive size")
    dp = data_parallel_size(m, world_size)
    if t.global_batch_size < 1:
        _fail("train.global_batch_size", f"must be >= 1, got {t.global_batch_size}", "set a positive size")
    if t.global_batch_size % (t.micro_batch_size * dp):
        _fail(
            "train.global_batch_size",
            f"{t.global_batch_size} is not a multiple of micro_batch_size * data_parallel_size "
            f"= {t.micro_batch_size} * {dp}",
            f"use a multiple of {t.micro_batch_size * dp}",
        )
    if t.exit_interval is not None and t.exit_interval < 1:
        _fail("train.exit_interval", f"must be >= 1 or None, got {t.exit_interval}", "use a positive interval")
    if t.exit_duration_in_mins is not None and t.exit_duration_in_mins <= 0:
        _fail(
            "train.exit_duration_in_mins",
            f"must be > 0 or None, got {t.exit_duration_in_mins}",
            "use a positive duration",
        )
    try:
        exit_signal = signal.Signals(t.exit_signal)
    except ValueError:
        _fail("train.exit_signal", f"{t.exit_signal!r} is not a signal", "use a name such as SIGTERM or SIGUSR1")
    if exit_signal in (signal.SIGKILL, signal.SIGSTOP):
        _fail(
            "train.exit_signal",
            f"{signal.Signals(t.exit_signal).name} cannot be caught",
            "use SIGTERM, SIGUSR1 or SIGUSR2",
        )
    if t.exit_signal_handler_for_dataloader and not t.exit_signal_handler:
        _fail(
            "train.exit_signal_handler_for_dataloader",
            "needs the main handler",
            "also set train.exit_signal_handler=true",
        )


def _validate_optimizer(o: OptimizerConfig, s: SchedulerConfig, t: TrainConfig) -> None:
    if o.lr <= 0:
        _fail("optimizer.lr", f"must be > 0, got {o.lr}", "set a positive learning rate")
    if not 0 <= o.min_lr <= o.lr:
        _fail("optimizer.min_lr", f"must be in [0, lr={o.lr}], got {o.min_lr}", "lower optimizer.min_lr")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(o, name) < 1.0:
            _fail(f"optimizer.{name}", f"must be in [0, 1), got {getattr(o, name)}", "use e.g. 0.9 / 0.95")
    if o.clip_grad < 0:
        _fail("optimizer.clip_grad", f"must be >= 0, got {o.clip_grad}", "use 0 to disable clipping")
    if o.weight_decay < 0:
        _fail("optimizer.weight_decay", f"must be >= 0, got {o.weight_decay}", "use a non-negative value")
    if s.lr_decay_style not in ("constant", "linear", "cosine"):
        _fail("scheduler.lr_decay_style", f"unknown style {s.lr_decay_style!r}", 'use "constant", "linear" or "cosine"')
    if s.lr_decay_iters is not None and s.lr_decay_iters < 1:
        _fail(
            "scheduler.lr_decay_iters",
            f"must be >= 1 or None, got {s.lr_decay_iters}",
            "use null to decay over train.train_iters",
        )
    decay = s.lr_decay_iters if s.lr_decay_iters is not None else t.train_iters
    if s.lr_warmup_iters < 0 or s.lr_warmup_iters >= decay:
        _fail(
            "scheduler.lr_warmup_iters",
            f"must be in [0, {decay}), got {s.lr_warmup_iters}",
            "make warmup shorter than scheduler.lr_decay_iters (default train.train_iters)",
        )


def _validate_checkpoint(c: CheckpointConfig) -> None:
    if c.ckpt_format != "torch_dist":
        _fail("checkpoint.ckpt_format", f"unsupported format {c.ckpt_format!r}", 'use "torch_dist"')
    if c.save_interval is not None and c.save_interval < 1:
        _fail("checkpoint.save_interval", f"must be >= 1 or None, got {c.save_interval}", "use a positive interval")
    if c.save_interval is not None and c.save is None:
        _fail("checkpoint.save_interval", "is set but checkpoint.save is not", "set checkpoint.save to a directory")
    if c.async_save and c.save is None:
        _fail("checkpoint.async_save", "is on but checkpoint.save is not set", "set checkpoint.save to a directory")
    if c.most_recent_k == 0 or c.most_recent_k < -1:
        _fail(
            "checkpoint.most_recent_k",
            f"must be -1 (keep all) or >= 1, got {c.most_recent_k}",
            "use -1 or a positive count",
        )
    if c.exit_on_missing_checkpoint and c.load is None:
        _fail(
            "checkpoint.exit_on_missing_checkpoint",
            "is set but checkpoint.load is not",
            "set checkpoint.load to the directory to resume from",
        )
    local_fields = ("non_persistent_save_interval", "non_persistent_local_ckpt_dir")
    for name in local_fields:
        if getattr(c, name) is not None and c.non_persistent_ckpt_type is None:
            _fail(
                f"checkpoint.{name}",
                "is set but checkpoint.non_persistent_ckpt_type is not",
                "set checkpoint.non_persistent_ckpt_type or remove this field",
            )
    if c.save is not None and os.path.exists(c.save) and not os.path.isdir(c.save):
        _fail("checkpoint.save", f"{c.save!r} exists and is not a directory", "point it at a directory")
    if c.load is not None and os.path.exists(c.load) and not os.path.isdir(c.load):
        _fail("checkpoint.load", f"{c.load!r} exists and is not a directory", "point it at a checkpoint directory")


def _validate_runtime(cfg: ConfigContainer) -> None:
    backend = cfg.dist.backend
    if backend not in (None, "gloo", "nccl"):
        _fail("dist.backend", f"unknown backend {backend!r}", 'use "gloo", "nccl" or leave it unset')
    if backend == "nccl" and not torch.cuda.is_available():
        _fail("dist.backend", "nccl needs CUDA, which is not available here", "leave dist.backend unset (gloo)")
    if cfg.model.params_dtype == "bfloat16" and not torch.cuda.is_available():
        _fail(
            "model.params_dtype",
            "bfloat16 needs CUDA (megatron-core's mixed-precision optimizer accepts only CUDA tensors)",
            'use "float32" on a machine without a GPU',
        )
    if cfg.dist.distributed_timeout_minutes < 1:
        _fail(
            "dist.distributed_timeout_minutes",
            f"must be >= 1, got {cfg.dist.distributed_timeout_minutes}",
            "use a positive number of minutes",
        )
    if cfg.rng.seed < 0 or cfg.rng.seed >= 2**32:
        _fail("rng.seed", f"must be in [0, 2**32), got {cfg.rng.seed}", "use a non-negative 32-bit seed")
    if cfg.logger.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        _fail("logger.log_level", f"unknown level {cfg.logger.log_level!r}", "use DEBUG, INFO, WARNING or ERROR")
    if cfg.logger.log_interval < 1:
        _fail("logger.log_interval", f"must be >= 1, got {cfg.logger.log_interval}", "use a positive interval")
    if cfg.dataset.num_workers < 0:
        _fail("dataset.num_workers", f"must be >= 0, got {cfg.dataset.num_workers}", "use 0 or more workers")


def _validate_fault_tolerance(ft: FaultToleranceConfig, world_size: int) -> None:
    if ft.enable_ft_package and not os.environ.get("FT_RANK_MONITOR_IPC_SOCKET"):
        _fail(
            "ft.enable_ft_package",
            "no rank monitor to report to ($FT_RANK_MONITOR_IPC_SOCKET is unset): this process was not started by "
            "ft_launcher, and under torchrun fault tolerance would silently do nothing",
            "launch with ft_launcher (same arguments as torchrun plus --ft-rank-section-timeouts=setup:600,"
            "step:180,checkpointing:420 --ft-rank-out-of-section-timeout=300), or set ft.enable_ft_package=false",
        )
    if ft.simulate_fault and not ft.enable_ft_package:
        _fail("ft.simulate_fault", "needs fault tolerance to detect the fault", "also set ft.enable_ft_package=true")
    if ft.simulated_fault_type not in ("rank_hung", "rank_killed", "random"):
        _fail(
            "ft.simulated_fault_type",
            f"unknown type {ft.simulated_fault_type!r}",
            'use "rank_hung", "rank_killed" or "random"',
        )
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


def _validate_not_yet_supported(cfg: ConfigContainer) -> None:
    """Reject features whose configuration exists but whose runtime this version does not have."""
    enabled = {
        "nvrx_straggler.enabled": cfg.nvrx_straggler.enabled,
        "inprocess_restart.enabled": cfg.inprocess_restart.enabled,
        "rerun_state_machine.rerun_mode": cfg.rerun_state_machine.rerun_mode != "disabled",
        "train.exit_signal_handler": cfg.train.exit_signal_handler,
        "checkpoint.non_persistent_ckpt_type": cfg.checkpoint.non_persistent_ckpt_type is not None,
    }
    for name, on in enabled.items():
        if on:
            _fail(name, _ENABLE_LATER, f"unset {name}")
