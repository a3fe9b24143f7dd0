"""Checks across config sections that ``ConfigContainer.validate()`` runs besides ``config_checks/container.py``'s.

- :func:`validate_schedule`: the learning-rate and weight-decay schedules against the run's length, in
  Megatron-Bridge's units (iterations or samples), filling in their lengths in samples.
- :func:`validate_evaluation_batches`: evaluation's batch sizes (the training ones by default).
- :func:`validate_precision_consistency`: the model's and the optimizer's precision flags (Megatron-Bridge's
  ``_validate_mixed_precision_consistency``, which ``config.py`` exports under that name).

Failures are :class:`~megatron.bridge.utils.fields.ConfigError` naming the field and the fix; where Megatron-Bridge
checks the same condition, the message repeats its wording. Like ``config_checks/container.py``, this module imports
nothing from ``config.py`` or ``config_sections/``, not even for annotations.
"""

from __future__ import annotations

import warnings

from megatron.bridge.training.config_checks.types import Container
from megatron.bridge.utils.fields import fail


def validate_schedule(cfg: Container) -> None:
    """The schedule against the run's length; fill its lengths in samples (``lr_warmup_steps``, ...).

    As in Megatron-Bridge: an iteration-based run counts the schedule in iterations and a sample-based one in
    samples; ``lr_decay_iters`` defaults to ``scheduler.max_steps`` or ``train.train_iters``; a warmup as long as
    the decay is shortened to one step less, with a warning.
    """
    s, t, o = cfg.scheduler, cfg.train, cfg.optimizer
    gbs = t.global_batch_size
    for name in s.derived:  # fields an earlier validate() filled in are derived again
        setattr(s, name, None)
    s.derived.clear()
    if t.train_samples is not None:
        if s.max_steps is not None:
            fail(
                "scheduler.max_steps",
                "scheduler.max_steps is only supported for iteration-based training",
                "use the sample-based scheduler fields with train.train_samples",
            )
        for name, instead in (("lr_decay_iters", "lr_decay_samples"), ("lr_warmup_iters", "lr_warmup_samples")):
            if getattr(s, name):
                fail(
                    f"scheduler.{name}",
                    f"Use {instead} for sample-based training, not {name}",
                    f"set scheduler.{instead}",
                )
        if s.lr_decay_samples is None:
            s.lr_decay_samples = t.train_samples
            s.derived.add("lr_decay_samples")
        decay = s.lr_decay_samples
        s.wd_incr_steps = t.train_samples
        s.wsd_decay_steps = s.lr_wsd_decay_samples
        warmup = s.lr_warmup_samples
    else:
        for name, instead in (("lr_decay_samples", "lr_decay_iters"), ("lr_warmup_samples", "lr_warmup_iters")):
            if getattr(s, name):
                fail(
                    f"scheduler.{name}",
                    f"Use {instead} for iteration-based training, not {name}",
                    f"set scheduler.{instead}",
                )
        if s.max_steps is not None:
            if s.max_steps < t.train_iters:
                fail(
                    "scheduler.max_steps",
                    f"scheduler.max_steps ({s.max_steps}) must be greater than or equal to train.train_iters "
                    f"({t.train_iters})",
                    "give the full run's length, or leave it null",
                )
            if s.lr_decay_iters is not None and s.lr_decay_iters != s.max_steps:
                fail(
                    "scheduler.lr_decay_iters",
                    f"{s.lr_decay_iters} differs from scheduler.max_steps={s.max_steps}, which sets it",
                    "leave scheduler.lr_decay_iters null",
                )
        if s.lr_decay_iters is None:
            s.lr_decay_iters = s.max_steps if s.max_steps is not None else t.train_iters
            s.derived.add("lr_decay_iters")
        if s.lr_wsd_decay_iters is None and s.lr_decay_style == "WSD":
            s.lr_wsd_decay_iters = s.lr_decay_iters
            s.derived.add("lr_wsd_decay_iters")
        decay = s.lr_decay_iters * gbs
        s.wd_incr_steps = (s.max_steps or t.train_iters) * gbs
        s.wsd_decay_steps = s.lr_wsd_decay_iters * gbs if s.lr_wsd_decay_iters is not None else None
        warmup = s.lr_warmup_iters * gbs
    if s.lr_warmup_fraction is not None:
        warmup = s.lr_warmup_fraction * decay
    if decay <= 0:
        by_samples = t.train_samples is not None
        name = "lr_decay_samples" if by_samples else "lr_decay_iters"
        if name in s.derived:  # the default decay: the run's own length is what is wrong
            name = "train.train_samples" if by_samples else "train.train_iters"
            name = "scheduler.max_steps" if s.max_steps and not by_samples else name
        else:
            name = f"scheduler.{name}"
        fail(
            name,
            f"lr_decay_steps must be > 0, got {decay} (the decay length in samples)",
            "increase train.train_iters/train_samples or scheduler.lr_decay_iters/lr_decay_samples",
        )
    if warmup >= decay:
        warnings.warn(
            f"lr_warmup_steps ({warmup}) >= lr_decay_steps ({decay}); capping lr_warmup_steps to {decay - 1}. "
            "Reduce scheduler.lr_warmup_iters (or lr_warmup_samples) for short training runs.",
            UserWarning,
            stacklevel=2,
        )
        warmup = decay - 1
    if s.lr_decay_style == "WSD" and s.wsd_decay_steps is None:
        fail("scheduler.lr_wsd_decay_samples", "a WSD schedule needs its final anneal's length", "set it")
    if not 0.0 <= s.lr_warmup_init <= o.lr:
        fail("scheduler.lr_warmup_init", f"must be in [0, optimizer.lr={o.lr}], got {s.lr_warmup_init}", "lower it")
    start = s.start_weight_decay if s.start_weight_decay is not None else o.weight_decay
    end = s.end_weight_decay if s.end_weight_decay is not None else o.weight_decay
    if not 0.0 <= start <= end:
        fail(
            "scheduler.end_weight_decay",
            f"the weight decay must go from start {start} >= 0 up to end {end}",
            "set scheduler.start_weight_decay <= scheduler.end_weight_decay",
        )
    s.lr_warmup_steps, s.lr_decay_steps = warmup, decay


def validate_evaluation_batches(cfg: Container, dp: int) -> None:
    """Evaluation's batch sizes and steps: the batch sizes default to training's and divide over ``dp`` replicas."""
    v, t = cfg.validation, cfg.train
    batch_sizes = (("eval_global_batch_size", t.global_batch_size), ("eval_micro_batch_size", t.micro_batch_size))
    for name, train_value in batch_sizes:
        value = getattr(v, name)
        if value is None or v.derived.get(name) == value:  # as in Megatron-Bridge: training's, when not given
            setattr(v, name, train_value)
            v.derived[name] = train_value
        else:  # set by the user (also after an earlier validate() filled it in)
            v.derived.pop(name, None)
    for name, _ in batch_sizes:
        if getattr(v, name) < 1:
            fail(f"validation.{name}", f"must be >= 1, got {getattr(v, name)}", "use null for the training value")
    eval_dp = v.eval_micro_batch_size * dp
    if v.eval_global_batch_size % eval_dp:
        fail(
            "validation.eval_global_batch_size",
            f"eval_global_batch_size ({v.eval_global_batch_size}) must be divisible by eval_micro_batch_size * "
            f"eval_data_parallel_size ({v.eval_micro_batch_size} * {dp} = {eval_dp})",
            f"use a multiple of {eval_dp}",
        )
    if (v.eval_iters is None or v.eval_iters < 1) and (v.eval_interval is not None or v.skip_train):
        fail("validation.eval_iters", f"must be >= 1 to evaluate, got {v.eval_iters}", "set a positive number of steps")
    if v.eval_interval is not None and v.eval_interval < 1:
        fail("validation.eval_interval", f"must be >= 1 or None, got {v.eval_interval}", "use null to never evaluate")


def validate_precision_consistency(config: Container) -> None:
    """The model's and the optimizer's precision flags do not contradict each other (Megatron-Bridge's check)."""
    m, o = config.model, config.optimizer
    for section, obj in (("model", m), ("optimizer", o)):
        if obj.bf16 and obj.fp16:
            fail(
                f"{section}.fp16",
                f"{section.capitalize()} config cannot have both bf16=True and fp16=True",
                "Please set only one precision mode",
            )
    if not o.use_precision_aware_optimizer:
        return
    for flag in ("bf16", "fp16"):
        if getattr(m, flag) and not getattr(o, flag):
            fail(
                f"optimizer.{flag}",
                f"optimizer.{flag}=True must be set when model.{flag}=True and use_precision_aware_optimizer=True",
                f"set optimizer.{flag}=True",
            )
    if not (m.bf16 or m.fp16) and (o.bf16 or o.fp16):
        fail(
            "optimizer.bf16" if o.bf16 else "optimizer.fp16",
            "optimizer.bf16 and optimizer.fp16 must both be False when model is using fp32 precision "
            "(model.bf16=False, model.fp16=False) and use_precision_aware_optimizer=True",
            "set both to False, or train the model in that precision",
        )
