"""The checks behind :meth:`ConfigContainer.validate`: one function per config section, all run at start.

Every failure is a ``ValueError`` of the form ``"<field>: <problem>. Fix: <fix>."`` so that a user reading
the log knows which dotted override to change and how. First the fields themselves (types, misspelt attributes,
fields this framework refuses: ``config_checks/field_support.py``), then each section and the combinations; the
resiliency
sections are checked in ``config_checks/resiliency.py``. As in Megatron-Bridge, validation also fills the fields
derived from others (``train.global_batch_size``, ``train.train_iters`` from ``train.train_samples``, the
scheduler's step counts, ``model.vocab_size`` from the tokenizer) and finalizes the model and dataset configs.

``config.py`` calls these checks; they receive the config's objects and values and import nothing from
``config.py`` or ``config_sections/``, not even for annotations (``config_checks/types.py``), so the dependency goes
one way. An optional section may be ``None`` (off); the checks ask ``utils.fields.is_enabled`` whether one is on.
Besides the config they read only the environment variables listed in ``env_inputs.ENV_INPUTS``, and never ask CUDA
anything: a check that depends on the device uses ``dist.device`` (with ``auto``, it runs at initialization
instead).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import signal
import warnings
from typing import Optional

import torch

from megatron.bridge.training.config_checks.checkpoint import validate_checkpoint
from megatron.bridge.training.config_checks.cross import validate_evaluation_batches, validate_schedule
from megatron.bridge.training.config_checks.elastic import shrink_note, validate_elastic
from megatron.bridge.training.config_checks.field_support import REFUSED, refused_fields
from megatron.bridge.training.config_checks.resiliency import validate_resiliency
from megatron.bridge.training.config_checks.types import Container, ModelConfig
from megatron.bridge.training.events.stream import directory_problem, resolve_directory
from megatron.bridge.utils import launch_env
from megatron.bridge.utils.fields import ConfigError, field_problems, is_enabled
from megatron.bridge.utils.fields import fail as _fail

logger = logging.getLogger(__name__)

MEGATRON_CORE_SECTIONS = ("model", "optimizer", "ddp")
"""Sections that are megatron-core's own configs: megatron-core checks their fields (``_validate_model``, ...)."""


def validate_config(cfg: Container, world_size: Optional[int], store_port_offset: int) -> None:
    """Check every field and every combination of ``cfg``; raise ``ValueError`` naming the field and the fix.

    Args:
        cfg: the configuration to check (an optional section that is ``None`` is off and not checked).
        world_size: number of ranks; ``None``: ``$WORLD_SIZE`` (1 when unset).
        store_port_offset: in-process restart's store listens on ``MASTER_PORT`` + this.
    """
    if world_size is None:
        world_size = launch_env.current().world_size
    validate_fields(cfg)
    _finalize_sections(cfg)
    _refuse_unsupported(cfg)  # after the sections' own checks: a combination no one accepts is named as such first
    training_ranks = active_ranks(cfg, world_size)
    _validate_tokenizer(cfg)
    _validate_device(cfg)
    _validate_model(cfg.model, training_ranks)
    _validate_deterministic_mode(cfg.model)
    _validate_train(cfg, training_ranks)
    validate_elastic(cfg)  # after train: it reads the global batch the user set (not derived)
    _validate_optimizer(cfg)
    validate_schedule(cfg)
    if cfg.train.train_iters < 1:  # after the schedule, whose length check names the default decay's cause first
        _fail("train.train_iters", f"must be >= 1, got {cfg.train.train_iters}", "set the number of optimizer steps")
    validate_evaluation_batches(cfg, data_parallel_size(cfg.model, training_ranks))
    _validate_dataset(cfg)
    validate_checkpoint(cfg.checkpoint, world_size)
    _validate_runtime(cfg)
    _validate_event_dir(cfg)
    validate_resiliency(cfg, world_size, store_port_offset)


def active_ranks(cfg: Container, world_size: int) -> int:
    """The ranks that train: all of them, or with in-process restart's warm reserves only the active ones."""
    restart = cfg.inprocess_restart
    if is_enabled(restart) and 1 <= (restart.active_world_size or 0) <= world_size:
        return restart.active_world_size
    return world_size


def _finalize_sections(cfg: Container) -> None:
    """Each section's own checks (its ``finalize()``, as Megatron-Bridge's ``validate()`` calls them).

    The training section's runs later, once the global batch size is known (``_validate_train``), and the model's and
    the dataset's with their own checks; an optional section that is ``None`` has none to run.
    """
    for name in ("logger", "scheduler", "checkpoint", "profiling", "nvrx_straggler", "tensor_inspect"):
        section = getattr(cfg, name)
        if section is not None and hasattr(section, "finalize"):
            section.finalize()


def validate_fields(cfg: Container) -> None:
    """Sections of the right class, values of the right type, no misspelt attribute.

    Every field of every section is checked against its annotation, read from the section's class, so a field added
    to a section is checked with no list to extend; megatron-core's sections (:data:`MEGATRON_CORE_SECTIONS`) check
    themselves, and a section refused whole (``field_support.REFUSED``) is named by that check instead.
    """
    for problem in field_problems(cfg, ""):
        raise ConfigError(problem)
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if f.name in MEGATRON_CORE_SECTIONS or f.name in REFUSED or not dataclasses.is_dataclass(section):
            continue
        for problem in field_problems(section, f.name):
            raise ConfigError(problem)


def _refuse_unsupported(cfg: Container) -> None:
    """No field this framework cannot honour is set away from its default (``field_support.REFUSED``)."""
    for dotted, value, default, why in refused_fields(cfg):
        _fail(dotted, f"{value!r} is not supported here ({why})", f"leave it at its default {default!r}")


def tokenizer_unset(cfg: Container) -> bool:
    """Whether the config names no tokenizer at all (neither ``tokenizer_type`` nor ``metadata_path``)."""
    return cfg.tokenizer.tokenizer_type is None and cfg.tokenizer.metadata_path is None


def require_tokenizer(cfg: Container) -> None:
    """A run needs a tokenizer: fail naming the choices when the config has none.

    ``validate()`` and ``runtime_config_update`` accept a config without one, as Megatron-Bridge's do (its
    vocabulary is then unknown); ``pretrain()`` calls this right after them, so such a run stops before anything
    starts.
    """
    if tokenizer_unset(cfg):
        _validate_tokenizer(cfg, required=True)


def _validate_tokenizer(cfg: Container, required: bool = False) -> None:
    """The tokenizer builds from local files; the model's vocabulary holds every id it makes (or takes its size).

    A config naming no tokenizer is checked only when ``required`` (see :func:`require_tokenizer`).
    """
    from megatron.bridge.data.tokenization import build_tokenizer

    if tokenizer_unset(cfg) and not required:
        return
    m = cfg.model
    vocab_size = build_tokenizer(cfg.tokenizer).vocab_size
    if m.vocab_size is None:
        m.vocab_size = vocab_size  # as in Megatron-Bridge: the model's vocabulary is the tokenizer's
    elif m.vocab_size >= 1 and vocab_size > m.vocab_size:  # (a size below 1 is the model check's to name)
        field = "tokenizer.vocab_size" if cfg.tokenizer.vocab_size is not None else "model.vocab_size"
        _fail(
            field,
            f"the tokenizer's vocabulary ({vocab_size} ids) is larger than model.vocab_size={m.vocab_size}: token ids "
            "past the embedding",
            "raise model.vocab_size, or leave it None to take the tokenizer's",
        )


def _validate_dataset(cfg: Container) -> None:
    from megatron.bridge.data.base import DatasetProvider
    from megatron.bridge.data.checks import check_dataset_files, is_mock
    from megatron.bridge.data.config import GPTDatasetConfig

    d = cfg.dataset
    example = "MockGPTDatasetConfig(seq_length=..., random_seed=..., reset_position_ids=False, ...)"
    if isinstance(d, DatasetProvider):  # builds its own datasets: only the loader fields are ours to check
        d.finalize()
        _validate_loader(d)
        return
    if not isinstance(d, GPTDatasetConfig):
        _fail("dataset", f"is a {type(d).__name__}, not a GPTDatasetConfig or DatasetProvider", f"use {example}")
    try:
        d.finalize()
    except ConfigError:
        raise  # already names the field
    except (TypeError, AssertionError, ValueError) as err:
        _fail("dataset", f"megatron-core rejects the dataset config: {err}", "fix the field it names")
    if not is_mock(d):
        check_dataset_files(d)  # prefixes, .bin/.idx agreement, blend weights, split sizes, the index cache
    if d.sequence_length != cfg.model.seq_length:
        _fail(
            "dataset.sequence_length",
            f"{d.sequence_length} differs from model.seq_length={cfg.model.seq_length}. Please ensure sequence length "
            "configuration in model config and dataset config match",
            "give both the same sequence length",
        )
    for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):  # set: d.finalize() checks it
        if getattr(d, name) and is_mock(d):
            _fail(f"dataset.{name}", "the mock stream has no document boundaries", "set it to False")
    if d.hybrid_context_parallel:
        _fail("dataset.hybrid_context_parallel", "context parallelism is not supported", "set it to False")
    _validate_loader(d)


def _validate_loader(d: object) -> None:
    """The data-loader fields every dataset config has (``DataloaderConfig``)."""
    from megatron.bridge.data.base import DatasetProvider
    from megatron.bridge.data.checks import is_mock

    if d.dataloader_type == "cyclic":
        _fail(
            "dataset.dataloader_type",
            "'cyclic' (shuffled epochs) serves Megatron-Bridge's fine-tuning datasets, which this package does not "
            "provide",
            'use "single" (or None), or "batch" for whole global batches',
        )
    if d.dataloader_type == "external" and not isinstance(d, DatasetProvider):
        _fail(
            "dataset.dataloader_type",
            "'external' takes the datasets as ready-made loaders, which only a DatasetProvider returns (a GPT "
            "dataset config gives samples, which would be read one at a time as batches)",
            'use "single" (or None)',
        )
    if d.dataloader_type == "batch" and not isinstance(d, DatasetProvider) and is_mock(d):
        _fail(
            "dataset.dataloader_type",
            "'batch' shuffles whole epochs, and the mock stream is endless",
            'use "single" (or None) with mock data',
        )
    if d.num_workers < 0:
        _fail("dataset.num_workers", f"must be >= 0, got {d.num_workers}", "use 0 or more workers")


def data_parallel_size(model: ModelConfig, world_size: int) -> int:
    """Number of data-parallel replicas for a world of ``world_size`` ranks."""
    return world_size // (model.tensor_model_parallel_size * model.pipeline_model_parallel_size)


def _validate_pipeline(m: ModelConfig) -> None:
    """Stages (and virtual stages) must each get the same whole number of layers."""
    pp, vp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size
    if vp is not None and (vp < 1 or pp < 2):
        _fail(
            "model.virtual_pipeline_model_parallel_size",
            f"{vp} needs a positive value and model.pipeline_model_parallel_size >= 2 (it is {pp})",
            "set it to None, or use pipeline parallelism",
        )
    chunks = pp * (vp or 1)
    if m.num_layers % chunks:
        what = f"{pp} pipeline stages" + (f" x {vp} virtual stages" if vp else "")
        _fail(
            "model.num_layers",
            f"{m.num_layers} layers cannot be split evenly over {what}",
            f"use a multiple of {chunks} layers, or change model.pipeline_model_parallel_size",
        )
    if pp > 1 and m.variable_seq_lengths:
        _fail(
            "model.variable_seq_lengths",
            "pipeline stages exchange activations of the configured seq_length only",
            "set it to False",
        )


def check_world_divisible(m: ModelConfig, world_size: int) -> int:
    """The data-parallel size of ``world_size`` ranks; fails when the model-parallel sizes do not divide it."""
    tp = m.tensor_model_parallel_size
    if tp < 1:
        _fail("model.tensor_model_parallel_size", f"must be >= 1, got {tp}", "set a positive size")
    pp = m.pipeline_model_parallel_size
    if pp < 1:
        _fail("model.pipeline_model_parallel_size", f"must be >= 1, got {pp}", "set a positive size")
    if world_size % (tp * pp):
        _fail(
            "model.tensor_model_parallel_size",
            f"world size ({world_size}){shrink_note(world_size)} is not divisible by total_model_size (tensor "
            f"parallel {tp} x pipeline parallel {pp})",
            "use sizes whose product divides the number of ranks (in an elastic job, at every node count of MIN:MAX)",
        )
    return world_size // (tp * pp)


def _validate_deterministic_mode(m: ModelConfig) -> None:
    """``model.deterministic_mode``: no fused cross entropy, a fixed NCCL algorithm; torch's deterministic algorithms.

    As Megatron-Bridge's ``validate()``, it turns ``torch.use_deterministic_algorithms`` on.
    """
    if not m.deterministic_mode:
        return
    if m.cross_entropy_loss_fusion:
        _fail(
            "model.cross_entropy_loss_fusion",
            "Cross Entropy Fusion is currently not deterministic",
            "set it to False with model.deterministic_mode",
        )
    choices = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
    if os.environ.get("NCCL_ALGO") not in choices:
        _fail(
            "model.deterministic_mode",
            f"NCCL_ALGO must be one of {choices} (it is {os.environ.get('NCCL_ALGO')!r})",
            "export NCCL_ALGO=Ring (or another of them) in the job script",
        )
    torch.use_deterministic_algorithms(True)


def _validate_model(m: ModelConfig, world_size: int) -> None:
    check_world_divisible(m, world_size)
    tp = m.tensor_model_parallel_size
    _validate_pipeline(m)
    if m.context_parallel_size != 1:
        _fail(
            "model.context_parallel_size",
            f"{m.context_parallel_size}: context parallelism is not supported here",
            "set it to 1 (split long sequences with tensor parallelism and sequence_parallel instead)",
        )
    for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
        if name == "vocab_size" and m.vocab_size is None:
            continue  # the tokenizer's, once a tokenizer is configured (require_tokenizer)
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
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % groups:
        _fail(
            "model.num_query_groups",
            f"{groups} query groups do not divide {m.num_attention_heads} attention heads",
            "use a divisor of model.num_attention_heads",
        )
    if groups % tp:
        _fail(
            "model.num_query_groups",
            f"{groups} query groups are not divisible by tensor parallel size {tp}",
            "use a multiple of model.tensor_model_parallel_size",
        )
    if m.vocab_size is not None and m.padded_vocab_size % tp:
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
    try:
        copy.copy(m).finalize()  # megatron-core's own checks of the TransformerConfig, on a copy
    except (ValueError, AssertionError, TypeError, ZeroDivisionError) as err:
        _fail("model", f"megatron-core rejects the model config: {err}", "fix the field it names")


def check_precision_on_device(m: ModelConfig, device: torch.device | str, requested: str) -> None:
    """bfloat16 needs CUDA: refuse it when the run trains on the CPU (``device``, from ``dist.device=requested``).

    ``validate()`` calls it when ``dist.device`` names the device; with ``auto`` it runs at initialization, once the
    device is resolved (``initialize.prepare_device``). Validation never probes CUDA itself.
    """
    if torch.device(device).type != "cpu" or not (m.params_dtype == torch.bfloat16 or m.bf16):
        return
    how = "dist.device=cpu" if requested == "cpu" else f"dist.device={requested} resolved to cpu (no GPU on this node)"
    _fail(
        "model.params_dtype" if m.params_dtype == torch.bfloat16 else "model.bf16",
        f"bfloat16 needs CUDA (megatron-core's mixed-precision optimizer accepts only CUDA tensors), but {how} "
        f"(model.bf16={m.bf16}, model.params_dtype={m.params_dtype})",
        "to train on CPU set model.bf16=false and model.params_dtype=float32 (optimizer.bf16 and "
        "optimizer.params_dtype likewise); for bfloat16 run on GPU nodes with dist.device=cuda or auto",
    )


def _validate_device(cfg: Container) -> None:
    """``dist.device`` against the precision, when it names the device (``auto`` is checked at initialization)."""
    if cfg.dist.device in ("cpu", "cuda"):
        check_precision_on_device(cfg.model, cfg.dist.device, cfg.dist.device)


def _validate_train(cfg: Container, world_size: int) -> None:
    t, m = cfg.train, cfg.model
    if t.micro_batch_size is None:
        _fail("train.micro_batch_size", "train.micro_batch_size must be set", "set the samples per micro-batch")
    if t.micro_batch_size < 1:
        _fail("train.micro_batch_size", f"must be >= 1, got {t.micro_batch_size}", "set the samples per micro-batch")
    dp = data_parallel_size(m, world_size)
    if t.global_batch_size is None or "global_batch_size" in t.derived:
        t.global_batch_size = t.micro_batch_size * dp  # as in Megatron-Bridge: one micro-batch per replica
        t.derived.add("global_batch_size")
    if t.global_batch_size < 1:
        _fail("train.global_batch_size", f"must be >= 1, got {t.global_batch_size}", "set a positive size")
    if t.global_batch_size % (t.micro_batch_size * dp):
        _fail(
            "train.global_batch_size",
            f"{t.global_batch_size} is not a multiple of micro_batch_size * data_parallel_size "
            f"= {t.micro_batch_size} * {dp}",
            f"use a multiple of {t.micro_batch_size * dp}",
        )
    t.finalize()  # one way to give the run's length; train_iters from train_samples (num_epochs: field_support)
    if t.train_samples is not None and t.train_samples < t.global_batch_size:
        _fail(
            "train.train_samples",
            f"{t.train_samples} is less than one global batch ({t.global_batch_size})",
            "train on at least one global batch",
        )
    if t.train_iters is None:
        _fail("train.train_iters", "must be set", "set the number of optimizer steps")
    for name in ("eval_iters", "eval_interval", "skip_train"):
        if getattr(t, name) is not None:  # Megatron-Bridge's deprecation path: the value moves to validation
            warnings.warn(f"train.{name} is deprecated: use validation.{name}", DeprecationWarning, stacklevel=2)
            setattr(cfg.validation, name, getattr(t, name))
    if t.exit_interval is not None and t.exit_interval < 1:
        _fail("train.exit_interval", f"must be >= 1 or None, got {t.exit_interval}", "use a positive interval")
    interval = t.check_weight_hash_across_dp_replicas_interval
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
        _fail(
            "train.check_weight_hash_across_dp_replicas_interval",
            f"a hash interval that is not a positive integer is a config error, got {interval!r}",
            "use a number of steps >= 1 (e.g. 100), or None to turn the check off",
        )
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


def _validate_optimizer(cfg: Container) -> None:
    o, m = cfg.optimizer, cfg.model
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
    if o.use_distributed_optimizer != cfg.ddp.use_distributed_optimizer:
        _fail(
            "optimizer.use_distributed_optimizer",
            f"is {o.use_distributed_optimizer} but ddp.use_distributed_optimizer is {cfg.ddp.use_distributed_optimizer}"
            " (the optimizer shards its state over the gradient buffers DDP lays out for it)",
            "set both to the same value",
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


def _validate_runtime(cfg: Container) -> None:
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


def _validate_event_dir(cfg: Container) -> None:
    """The event stream's directory (``health.event_dir``, default ``<checkpoint.save>/events``) can be created."""
    directory = resolve_directory(cfg.health.event_dir, cfg.checkpoint.save)
    problem = directory_problem(directory) if directory is not None else None
    if problem is not None:
        origin = "health.event_dir" if cfg.health.event_dir else "health.event_dir (default: <checkpoint.save>/events)"
        fix = 'use a writable directory, or "" to turn the event stream off'
        _fail(origin, f"cannot write events to {directory}: {problem}", fix)
