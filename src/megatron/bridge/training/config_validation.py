"""The checks behind :meth:`ConfigContainer.validate`: one function per config section, all run at start.

Every failure is a ``ValueError`` of the form ``"<field>: <problem>. Fix: <fix>."`` so that a user reading
the log knows which dotted override to change and how.

``config.py`` calls these checks; they receive the config's objects and values and import nothing from
``config.py`` at run time (its classes only for type checking), so the dependency goes one way.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
from typing import TYPE_CHECKING, Optional

import torch

from megatron.bridge.training import fault_injection
from megatron.bridge.training.checkpoint.validation import validate_checkpoint

if TYPE_CHECKING:
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.config import (
        ConfigContainer,
        FaultToleranceConfig,
        TrainingConfig,
    )

logger = logging.getLogger(__name__)


def _fail(field_name: str, problem: str, fix: str) -> None:
    raise ValueError(f"{field_name}: {problem}. Fix: {fix}.")


def validate_config(cfg: ConfigContainer, world_size: Optional[int], store_port_offset: int) -> None:
    """Check every field and every combination of ``cfg``; raise ``ValueError`` naming the field and the fix.

    Args:
        cfg: the configuration to check.
        world_size: number of ranks; ``None``: ``$WORLD_SIZE`` (1 when unset).
        store_port_offset: in-process restart's store listens on ``MASTER_PORT`` + this.
    """
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    training_ranks = world_size  # with in-process restart's warm reserves, only the active ranks train
    if cfg.inprocess_restart.enabled and 1 <= (cfg.inprocess_restart.active_world_size or 0) <= world_size:
        training_ranks = cfg.inprocess_restart.active_world_size
    _validate_model(cfg.model, training_ranks)
    _validate_train(cfg.train, cfg.model, training_ranks)
    _validate_optimizer(cfg)
    _validate_validation(cfg)
    validate_checkpoint(cfg.checkpoint, world_size)
    _validate_runtime(cfg)
    _validate_fault_tolerance(cfg.ft, world_size)
    _validate_straggler(cfg)
    _validate_rerun(cfg)
    _validate_inprocess_restart(cfg, world_size, store_port_offset)
    _validate_health(cfg)
    _validate_fault_injection(cfg, world_size)


def data_parallel_size(model: GPTModelProvider, world_size: int) -> int:
    """Number of data-parallel replicas for a world of ``world_size`` ranks."""
    return world_size // (model.tensor_model_parallel_size * model.pipeline_model_parallel_size)


def _validate_model(m: GPTModelProvider, world_size: int) -> None:
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
    if m.vocab_size is None:
        _fail("model.vocab_size", "is not set", "set model.vocab_size (the tokenizer's vocabulary size)")
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
    if m.padded_vocab_size % tp:
        _fail(
            "model.vocab_size",
            f"{m.vocab_size} is not divisible by tensor parallel size {tp}",
            "pad the vocabulary to a multiple of model.tensor_model_parallel_size (model.should_pad_vocab=True)",
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
    if m.params_dtype not in (torch.float32, torch.bfloat16) or m.fp16:
        _fail(
            "model.params_dtype",
            f"{m.params_dtype} (fp16={m.fp16}) is not supported",
            "use torch.float32, or torch.bfloat16 with model.bf16=True",
        )
    if (m.params_dtype == torch.bfloat16 or m.bf16) and not torch.cuda.is_available():
        _fail(
            "model.params_dtype",
            "bfloat16 needs CUDA (megatron-core's mixed-precision optimizer accepts only CUDA tensors)",
            'use "float32" on a machine without a GPU',
        )
    try:
        copy.copy(m).finalize()  # megatron-core's own checks of the TransformerConfig, on a copy
    except (ValueError, AssertionError, TypeError, ZeroDivisionError) as err:
        _fail("model", f"megatron-core rejects the model config: {err}", "fix the field it names")


def _validate_train(t: TrainingConfig, m: GPTModelProvider, world_size: int) -> None:
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
    if t.exit_signal_deadline is not None and t.exit_signal_deadline <= 0:
        _fail(
            "train.exit_signal_deadline",
            f"must be > 0 seconds or None, got {t.exit_signal_deadline}",
            "use a few seconds less than the scheduler waits between its signal and SIGKILL, e.g. 50",
        )
    if t.exit_signal_handler_for_dataloader and not t.exit_signal_handler:
        _fail(
            "train.exit_signal_handler_for_dataloader",
            "needs the main handler",
            "also set train.exit_signal_handler=true",
        )


def _validate_optimizer(cfg: ConfigContainer) -> None:
    o, s, t, m = cfg.optimizer, cfg.scheduler, cfg.train, cfg.model
    if o.optimizer not in ("adam", "sgd"):
        _fail("optimizer.optimizer", f"unknown optimizer {o.optimizer!r}", 'use "adam" or "sgd"')
    if o.lr is None or o.lr <= 0:
        _fail("optimizer.lr", f"must be > 0, got {o.lr}", "set a positive learning rate")
    min_lr = o.min_lr if o.min_lr is not None else 0.0
    if not 0 <= min_lr <= o.lr:
        _fail("optimizer.min_lr", f"must be in [0, lr={o.lr}], got {o.min_lr}", "lower optimizer.min_lr")
    model_bf16 = m.bf16 or m.params_dtype == torch.bfloat16
    if (o.bf16, o.fp16) != (model_bf16, m.fp16) or o.params_dtype != m.params_dtype:
        _fail(
            "optimizer.bf16",
            f"the optimizer's precision (bf16={o.bf16}, fp16={o.fp16}, params_dtype={o.params_dtype}) differs from the "
            f"model's (bf16={m.bf16}, fp16={m.fp16}, params_dtype={m.params_dtype})",
            "set optimizer.bf16, optimizer.fp16 and optimizer.params_dtype as the model has them",
        )
    for section, value in (("optimizer", o.use_distributed_optimizer), ("ddp", cfg.ddp.use_distributed_optimizer)):
        if value:
            _fail(
                f"{section}.use_distributed_optimizer",
                "the distributed optimizer is not supported by this package yet",
                f"set {section}.use_distributed_optimizer=False",
            )
    try:
        copy.deepcopy(o).__post_init__()  # megatron-core's own checks, on a copy
    except (ValueError, AssertionError, RuntimeError) as err:
        _fail("optimizer", f"megatron-core rejects the optimizer config: {err}", "fix the field it names")
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


def _validate_validation(cfg: ConfigContainer) -> None:
    v = cfg.validation
    if v.eval_iters < 1 and (v.eval_interval is not None or v.skip_train):
        _fail(
            "validation.eval_iters", f"must be >= 1 to evaluate, got {v.eval_iters}", "set a positive number of steps"
        )
    if v.eval_interval is not None and v.eval_interval < 1:
        _fail("validation.eval_interval", f"must be >= 1 or None, got {v.eval_interval}", "use null to never evaluate")


def _validate_runtime(cfg: ConfigContainer) -> None:
    backend = cfg.dist.distributed_backend
    if backend not in ("gloo", "nccl"):
        _fail("dist.distributed_backend", f"unknown backend {backend!r}", 'use "nccl" (GPUs) or "gloo"')
    if cfg.dist.distributed_timeout_minutes < 1:
        _fail(
            "dist.distributed_timeout_minutes",
            f"must be >= 1, got {cfg.dist.distributed_timeout_minutes}",
            "use a positive number of minutes",
        )
    if cfg.rng.seed < 0 or cfg.rng.seed >= 2**32:
        _fail("rng.seed", f"must be in [0, 2**32), got {cfg.rng.seed}", "use a non-negative 32-bit seed")
    if cfg.logger.logging_level not in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL):
        _fail(
            "logger.logging_level",
            f"unknown level {cfg.logger.logging_level!r}",
            "use 10 (DEBUG), 20 (INFO), 30 (WARNING), 40 (ERROR) or 50 (CRITICAL)",
        )
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


def _validate_straggler(cfg: ConfigContainer) -> None:
    s = cfg.nvrx_straggler
    if cfg.straggler.log_straggler:
        if s.enabled:
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
    if not s.enabled:
        return
    if not (s.calc_relative_gpu_perf or s.calc_individual_gpu_perf):
        _fail(
            "nvrx_straggler.calc_relative_gpu_perf",
            "both score kinds are off (and nvrx_straggler.calc_individual_gpu_perf), so nothing would be detected",
            "set nvrx_straggler.calc_relative_gpu_perf=true or nvrx_straggler.calc_individual_gpu_perf=true",
        )
    for name in ("gpu_relative_perf_threshold", "gpu_individual_perf_threshold"):
        value = getattr(s, name)
        if not 0.0 < value <= 1.0:
            _fail(
                f"nvrx_straggler.{name}",
                f"must be in (0, 1], got {value} (a score is this rank's speed over the reference speed)",
                "use e.g. 0.7 to flag ranks more than ~1.4x slower",
            )
    if s.report_time_interval <= 0:
        _fail(
            "nvrx_straggler.report_time_interval",
            f"must be > 0 seconds, got {s.report_time_interval}",
            "use e.g. 300",
        )
    if s.profiling_interval < 1:
        _fail(
            "nvrx_straggler.profiling_interval", f"must be >= 1, got {s.profiling_interval}", "use 1 to time every step"
        )
    if s.num_gpu_perf_scores_to_print < 0:
        _fail(
            "nvrx_straggler.num_gpu_perf_scores_to_print",
            f"must be >= 0, got {s.num_gpu_perf_scores_to_print}",
            "use e.g. 5",
        )
    if s.stop_if_detected and cfg.checkpoint.save is None:
        logger.warning(
            "nvrx_straggler.stop_if_detected is on but checkpoint.save is not set: a straggler stops the run "
            "without a checkpoint, and the steps since the last one are lost. Set checkpoint.save to keep them."
        )


_RERUN_MODES = ("disabled", "validate_results", "report_determinism_stats")
_INJECTION_TYPES = ("transient_error", "persistent_error", "correct_result")


def _validate_rerun(cfg: ConfigContainer) -> None:
    r = cfg.rerun_state_machine
    if r.rerun_mode not in _RERUN_MODES:
        _fail("rerun_state_machine.rerun_mode", f"unknown mode {r.rerun_mode!r}", f"use one of {_RERUN_MODES}")
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
    if r.on_rerun_limit not in ("stop", "fallback"):
        _fail("rerun_state_machine.on_rerun_limit", f"unknown action {r.on_rerun_limit!r}", "use stop or fallback")
    if r.error_injection_type not in _INJECTION_TYPES:
        _fail(
            "rerun_state_machine.error_injection_type",
            f"unknown type {r.error_injection_type!r}",
            f"use one of {_INJECTION_TYPES}",
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
_INPROCESS_ENV = {"TORCH_CPP_LOG_LEVEL": "error", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0"}
_INPROCESS_MONITOR_INTERVAL_S = 2.0  # the longest of the wrapper's monitoring intervals (the progress watchdog's)


def _validate_inprocess_restart(cfg: ConfigContainer, world_size: int, store_port_offset: int) -> None:
    ipr = cfg.inprocess_restart
    if not ipr.enabled:
        return
    p = "inprocess_restart"
    if ipr.granularity not in ("node", "rank"):
        _fail(f"{p}.granularity", f"unknown granularity {ipr.granularity!r}", 'use "node" or "rank"')
    if ipr.active_world_size is not None and not 1 <= ipr.active_world_size <= world_size:
        _fail(
            f"{p}.active_world_size",
            f"{ipr.active_world_size} is not between 1 and the world size {world_size}",
            f"use a value in [1, {world_size}] (ranks above it wait as reserves) or leave it unset",
        )
    for name in ("max_iterations", "max_rank_faults"):
        if getattr(ipr, name) is not None and getattr(ipr, name) < 0:
            _fail(f"{p}.{name}", f"{getattr(ipr, name)} is negative", "use 0 or more, or None for no limit")
    timeouts = ("soft_timeout", "hard_timeout", "heartbeat_interval", "heartbeat_timeout", "barrier_timeout")
    for name in (*timeouts, "completion_timeout"):
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
    for name in ("soft_timeout", "heartbeat_timeout"):
        if getattr(ipr, name) <= _INPROCESS_MONITOR_INTERVAL_S:
            _fail(
                f"{p}.{name}",
                f"{getattr(ipr, name)} s is not above the wrapper's monitoring interval "
                f"({_INPROCESS_MONITOR_INTERVAL_S} s)",
                "use a few seconds or more",
            )
    if cfg.dist.distributed_timeout_minutes * 60 <= ipr.hard_timeout:
        _fail(
            "dist.distributed_timeout_minutes",
            f"{cfg.dist.distributed_timeout_minutes} min is not above {p}.hard_timeout={ipr.hard_timeout} s: the "
            "collective watchdog would kill the process before in-process restart could recover it",
            f"raise it above {ipr.hard_timeout / 60:.1f} min or lower {p}.hard_timeout",
        )
    missing = {k: v for k, v in _INPROCESS_ENV.items() if os.environ.get(k) != v}
    if missing:
        _fail(
            f"{p}.enabled",
            "in-process restart needs the environment "
            + ", ".join(f"{k}={v}" for k, v in _INPROCESS_ENV.items())
            + " (quiet c10d logs on abort, NCCL errors that do not kill the process, NVLink SHARP off); not set: "
            + ", ".join(f"{k} (is {os.environ.get(k)!r})" for k in missing),
            "export " + " ".join(f"{k}={v}" for k, v in missing.items()) + " in the job script before launching",
        )
    if "MASTER_ADDR" not in os.environ or not os.environ.get("MASTER_PORT", "").isdigit():
        _fail(
            f"{p}.enabled",
            "needs MASTER_ADDR and MASTER_PORT (the rendezvous store; the wrapper's store listens on MASTER_PORT + "
            f"{store_port_offset})",
            "launch with torchrun, python -m megatron.bridge.launch or ft_launcher, or export both",
        )
    if int(os.environ["MASTER_PORT"]) + store_port_offset > 65535:
        _fail(f"{p}.enabled", f"MASTER_PORT + {store_port_offset} is not a port", "use a lower MASTER_PORT")
    if ipr.granularity == "node" and not os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        _fail(
            f"{p}.granularity",
            '"node" groups ranks by host and needs LOCAL_WORLD_SIZE (ranks per node), which is not set',
            'launch with torchrun/megatron.bridge.launch/ft_launcher (they set it), or use granularity "rank"',
        )
    if cfg.train.exit_signal_handler:
        _fail(
            "train.exit_signal_handler",
            "cannot be combined with in-process restart (the preemption path, e.g. NeMo-Run's PreemptionPlugin): the "
            "wrapper terminates hung ranks with SIGTERM, which the handler would take for a preemption and save on",
            "set train.exit_signal_handler=false, or inprocess_restart.enabled=false to use preemption handling",
        )
    if cfg.ft.enable_ft_package:
        _fail(
            "ft.enable_ft_package",
            "cannot be combined with in-process restart in this version: FT's section timers would see the "
            "in-process restart as a hang and restart the job under it",
            "set ft.enable_ft_package=false and launch under ft_launcher (--max-restarts) to keep in-job restart as "
            "the fallback when in-process restart gives up",
        )


def _validate_health(cfg: ConfigContainer) -> None:
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
    if cfg.inprocess_restart.enabled:
        _fail(
            "health.liveness_ping_interval",
            "cannot be combined with in-process restart, which already watches every rank (heartbeats, "
            "inprocess_restart.soft_timeout) and restarts in place; the ping would turn that restart into an exit 24",
            "set health.liveness_ping_interval=0 with inprocess_restart.enabled=true",
        )


def _validate_fault_injection(cfg: ConfigContainer, world_size: int) -> None:
    sources = {
        "fault_injection.faults": cfg.fault_injection.faults or "",
        fault_injection.ENV: os.environ.get(fault_injection.ENV, ""),
    }
    for source, spec in sources.items():
        for fault in fault_injection.parse(spec, source):  # a malformed item: a ValueError naming it and the form
            if fault.rank >= world_size:
                _fail(
                    source,
                    f"{fault} names rank {fault.rank}, not a rank of a world of {world_size}",
                    f"use a rank in 0..{world_size - 1}",
                )
    ledger = cfg.fault_injection.ledger
    if ledger and not os.path.isdir(os.path.dirname(os.path.abspath(ledger))):
        _fail("fault_injection.ledger", f"the directory of {ledger} does not exist", "create it or use another path")
