"""The checks each config section runs on itself: what its ``finalize()`` does (``config.py``).

As in Megatron-Bridge, every section that can check itself alone has a ``finalize()``; ``ConfigContainer.validate()``
calls them all (then the checks across sections in ``config_checks/container.py``), and a caller may call one on its
own.
A failure is a :class:`~megatron.bridge.utils.fields.ConfigError` (a ``ValueError`` and an ``AssertionError``) of the
form ``"<field>: <problem>. Fix: <fix>."``; where Megatron-Bridge checks the same condition, the problem repeats its
wording, so a log or a test written for Megatron-Bridge still finds it. Calling a ``finalize()`` twice changes
nothing the second time.

This module imports nothing from ``config.py``: it gets the section.
"""

from __future__ import annotations

from typing import Any

from megatron.bridge.utils.fields import fail


def finalize_training(t: Any) -> None:
    """One way to give the run's length; ``train_iters`` from ``train_samples`` (``TrainingConfig.finalize``)."""
    from_epochs = t.train_iters is not None and t._train_iters_from_num_epochs
    from_samples = "train_iters" in t.derived
    modes = [
        name
        for name, given in (
            ("train_iters", t.train_iters is not None and not from_epochs and not from_samples),
            ("train_samples", t.train_samples is not None),
            ("num_epochs", t.num_epochs is not None),
        )
        if given
    ]
    if not modes:
        fail(
            "train.train_iters",
            "One of train_iters, train_samples, or num_epochs must be provided",
            "set the run's length",
        )
    if len(modes) > 1:
        fail(
            f"train.{modes[1]}",
            f"Cannot specify more than one of train_iters, train_samples, or num_epochs (got {', '.join(modes)})",
            "set only one of them",
        )
    if t.manual_gc and t.manual_gc_interval < 0:
        fail(
            "train.manual_gc_interval",
            f"Manual garbage collection interval should be larger than or equal to 0, got {t.manual_gc_interval}",
            "use 0 (collect only around evaluation) or a number of steps",
        )
    if t.num_epochs is not None:
        if t.num_epochs <= 0:
            fail("train.num_epochs", f"num_epochs must be a positive number, got {t.num_epochs}", "use e.g. 1.0")
        if t.rampup_batch_size is not None:
            fail("train.rampup_batch_size", "Batch size rampup not supported with epoch-based training", "unset it")
        if t.global_batch_size is None:
            fail("train.global_batch_size", "global_batch_size must be set when using num_epochs", "set it")
    if t.train_samples is not None:
        if t.train_samples <= 0:
            fail("train.train_samples", f"train_samples must be positive, got {t.train_samples}", "set it >= 1")
        if t.rampup_batch_size is not None:
            fail(
                "train.rampup_batch_size",
                "Batch size rampup not supported with sample-based training yet",
                "unset it, or count in train.train_iters",
            )
        if t.global_batch_size is None:
            fail("train.global_batch_size", "global_batch_size must be set when using train_samples", "set it")
        t.train_iters = t.train_samples // t.global_batch_size
        t.derived.add("train_iters")


def finalize_scheduler(s: Any) -> None:
    """The schedule's own fields, without the training length (``SchedulerConfig.finalize``)."""
    if s.max_steps is not None and s.max_steps <= 0:
        fail("scheduler.max_steps", f"scheduler.max_steps must be positive, got {s.max_steps}", "use null or >= 1")
    if s.start_weight_decay is not None and s.start_weight_decay < 0.0:
        fail("scheduler.start_weight_decay", "start_weight_decay should be positive", "use a value >= 0")
    if s.start_weight_decay is not None and s.end_weight_decay is not None:
        if s.end_weight_decay < s.start_weight_decay:
            fail(
                "scheduler.end_weight_decay",
                f"{s.end_weight_decay} is below start_weight_decay {s.start_weight_decay}",
                "set scheduler.start_weight_decay <= scheduler.end_weight_decay",
            )
    if s.override_opt_param_scheduler and s.use_checkpoint_opt_param_scheduler:
        fail(
            "scheduler.override_opt_param_scheduler",
            "both override and use-checkpoint are set",
            "choose whose schedule wins on resume",
        )
    decay_iters = None if "lr_decay_iters" in s.derived else s.lr_decay_iters
    wsd_iters = None if "lr_wsd_decay_iters" in s.derived else s.lr_wsd_decay_iters
    iters = {
        "lr_decay_iters": decay_iters,
        "lr_warmup_iters": s.lr_warmup_iters or None,
        "lr_wsd_decay_iters": wsd_iters,
    }
    samples = {
        "lr_decay_samples": None if "lr_decay_samples" in s.derived else s.lr_decay_samples,
        "lr_warmup_samples": s.lr_warmup_samples or None,
        "lr_wsd_decay_samples": s.lr_wsd_decay_samples,
    }
    given_iters = [n for n, v in iters.items() if v is not None]
    given_samples = [n for n, v in samples.items() if v is not None]
    if given_iters and given_samples:
        fail(
            f"scheduler.{given_samples[0]}",
            f"Cannot mix iteration-based and sample-based scheduler fields ({', '.join(given_iters)} with "
            f"{', '.join(given_samples)})",
            "use either iteration fields OR sample fields, not both",
        )
    for name in (*given_iters, *given_samples):
        value = getattr(s, name)
        if value < 0:
            fail(f"scheduler.{name}", f"must be >= 0, got {value}", "use a non-negative length")
    if s.lr_warmup_fraction is not None:
        if s.lr_warmup_iters != 0 or s.lr_warmup_samples != 0:
            fail(
                "scheduler.lr_warmup_fraction",
                f"Cannot specify lr_warmup_fraction={s.lr_warmup_fraction} with lr_warmup_iters={s.lr_warmup_iters} "
                f"or lr_warmup_samples={s.lr_warmup_samples}",
                "use either lr_warmup_fraction OR lr_warmup_iters OR lr_warmup_samples",
            )
        if not 0.0 <= s.lr_warmup_fraction < 1.0:
            fail("scheduler.lr_warmup_fraction", f"must be in [0, 1), got {s.lr_warmup_fraction}", "use e.g. 0.01")


def finalize_checkpoint(c: Any) -> None:
    """The checkpoint section's own combinations (``CheckpointConfig.finalize``); the rest is checked at validate."""
    if c.pretrained_checkpoint is not None and not _exists(c.pretrained_checkpoint):
        fail(
            "checkpoint.pretrained_checkpoint",
            f"Pretrained checkpoint {c.pretrained_checkpoint} does not exist",
            "give an existing checkpoint directory",
        )
    if c.load_main_params_from_ckpt and c.load_optim:
        fail(
            "checkpoint.load_main_params_from_ckpt",
            "load_main_params_from_ckpt must be used with load_optim=False",
            "set checkpoint.load_optim=False",
        )
    if c.async_save and c.save is None:
        fail(
            "checkpoint.async_save",
            "async_save is enabled, but save is not set. Set save to a valid path.",
            "set checkpoint.save, or turn checkpoint.async_save off",
        )
    if c.async_save and not c.use_persistent_ckpt_worker:
        fail(
            "checkpoint.use_persistent_ckpt_worker",
            "async_save requires use_persistent_ckpt_worker=True.",
            "set it to True, or turn checkpoint.async_save off",
        )
    if c.ckpt_step is not None and c.load is None:
        fail(
            "checkpoint.ckpt_step",
            f"ckpt_step={c.ckpt_step} specified but checkpoint.load is None. Please set checkpoint.load to the base "
            "checkpoint directory",
            "set checkpoint.load to the directory holding iter_<ckpt_step>",
        )
    keep = c.save_retain_interval
    if keep is not None:
        if keep < 1:
            fail("checkpoint.save_retain_interval", f"must be >= 1 or None, got {keep}", "use null to keep none")
        if c.most_recent_k != -1:
            fail(
                "checkpoint.save_retain_interval",
                f"cannot be combined with most_recent_k={c.most_recent_k}: the two retention policies disagree on "
                "which checkpoints to delete",
                "set checkpoint.most_recent_k=-1, or save_retain_interval=null",
            )
        if c.save_interval and keep % c.save_interval:
            fail(
                "checkpoint.save_retain_interval",
                f"{keep} is not a multiple of save_interval {c.save_interval}: no saved checkpoint would ever match",
                f"use a multiple of {c.save_interval}",
            )


def _exists(path: str) -> bool:
    from megatron.bridge.training.utils import checkpoint_utils

    return checkpoint_utils.file_exists(path)


def finalize_profiling(p: Any) -> None:
    """One profiler at a time and a step range that exists (``ProfilingConfig.finalize``)."""
    if p.use_pytorch_profiler and p.use_nsys_profiler:
        fail(
            "profiling.use_nsys_profiler",
            "Exactly one of pytorch or nsys profiler should be enabled, not both",
            "turn one of them off",
        )
    if p.profile_step_start < 0:
        fail("profiling.profile_step_start", f"profile_step_start must be >= 0, got {p.profile_step_start}", "raise it")
    if p.profile_step_end < 0:
        fail("profiling.profile_step_end", f"profile_step_end must be >= 0, got {p.profile_step_end}", "raise it")
    if p.profile_step_end < p.profile_step_start:
        fail(
            "profiling.profile_step_end",
            f"profile_step_end ({p.profile_step_end}) must be >= profile_step_start ({p.profile_step_start})",
            "end the range at or after its start",
        )
