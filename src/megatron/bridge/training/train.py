"""The training loop, written as the ordered list of moments every step goes through.

The loop's features are components (``components/base.py``): callbacks on the same events user callbacks get
(``callbacks.py``), run before the user's in the one order ``pretrain.FEATURES`` declares (of those with loop
events: goodput, the event stream, fault tolerance, hang attribution, fault injection, the weight-hash check,
liveness ping, straggler detection, garbage collection); the loop knows none of them by name. ``on_train_start``:
garbage collection freezes what set-up built. One iteration:

1. ``on_train_step_start``: goodput (the first step ends this attempt's start-up); fault tolerance opens the
   ``step`` section and hang attribution watches it (this rank's stacks are written if it stays open too long);
   fault drills strike; the liveness ping, when due (before any collective of the step); then the user's;
2. forward and backward over the micro-batches (timed by straggler detection), once or, when the re-run state
   machine asks, again; its verdict on the losses (apply, skip, or stop with 16/17 and maybe a diagnostic
   checkpoint; a bad loss soon after a local-tier load stops with 23 instead, that checkpoint deleted); optimizer and
   scheduler step;
3. the step's one agreement: exit signal, duration limit, async saves still being written on some rank (carried
   by the re-run state machine's per-step all-reduce in step 2 when it makes one, else a single all-reduce here,
   none when nothing needs agreeing); commit the async saves finished on every rank (goodput counts it
   as ``checkpoint_save``);
4. ``on_train_step_end``: goodput counts the step as productive when its update was applied (else as ``rerun``),
   the event stream records it (``step_completed``); every ``check_weight_hash_across_dp_replicas_interval``
   steps the weight-hash check compares the data-parallel replicas (a mismatch stops the attempt: 31, or 30);
   fault tolerance closes ``step`` and hang attribution stops watching; straggler detection counts the step and,
   when a report is due, all ranks score each other (it may ask every rank to stop); ``train.manual_gc`` collects
   when due; then the user's;
5. count the step; log metrics; goodput rewrites its progress record and logs its scalars;
6. decide whether to stop (end of training, the agreed exit signal, a feature's stop request, ``exit_interval``,
   the agreed ``exit_duration_in_mins``); on a signal, start the stop deadline; report progress (in-process
   restart's watchdog); evaluate when due;
7. save a checkpoint when the interval is reached or training stops, or else a local-tier checkpoint when its
   interval is reached (a global save is never replaced by a local one), between ``on_checkpoint_save_start`` and
   ``_end``: fault tolerance's ``checkpointing`` section, hang attribution's watch, goodput's ``checkpoint_save``
   time (both tiers carry goodput's ledger); report progress again;
8. stop with the exit code of the reason.
"""

import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.bridge.training import eval as evaluation
from megatron.bridge.training.callbacks import CallbackManager, fire_event
from megatron.bridge.training.checkpoint.async_writer import AsyncSavesBusy
from megatron.bridge.training.checkpoint.manager import CheckpointManager
from megatron.bridge.training.config import ConfigContainer
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.goodput import GoodputTracker
from megatron.bridge.training.events.metrics import MetricsWriter
from megatron.bridge.training.events.stream import EventKind, Mechanism
from megatron.bridge.training.exit_codes import ExitCode
from megatron.bridge.training.health.rerun import RerunController, StepVerdict
from megatron.bridge.training.losses import reduce_losses
from megatron.bridge.training.nvrx_straggler import (
    check_nvrx_straggler_detection,  # noqa: F401 - Megatron-Bridge's train.py offers it too
)
from megatron.bridge.training.state import GlobalState, TrainState
from megatron.bridge.training.utils.garbage_collection import maybe_run_manual_gc  # noqa: F401 - Megatron-Bridge's name
from megatron.bridge.training.utils.sig_utils import DistributedSignalHandler, StopDeadline

logger = logging.getLogger(__name__)


@dataclass
class TrainContext:
    """Everything the loop works on."""

    global_state: GlobalState
    """The run's config and progress (``cfg`` and ``state`` below); what callbacks and a forward step see."""
    model: list[torch.nn.Module]
    """This rank's model chunks (one per virtual pipeline stage), each in megatron-core DDP."""
    optimizer: Any
    scheduler: Any
    data_iterator: Iterator
    forward_step_func: Callable
    checkpoints: CheckpointManager
    metrics: MetricsWriter
    wrap_train_step: Callable[[Callable], Callable]
    """The whole step wrapped by the run's features (straggler detection times it on the device)."""
    signals: DistributedSignalHandler
    rerun: RerunController
    goodput: GoodputTracker
    """Counts re-run passes, the wait for async commits and the progress record (its step and save accounting is a
    callback)."""
    start_time: float
    """``time.monotonic()`` when the attempt started (``train.exit_duration_in_mins`` counts from it)."""
    callbacks: CallbackManager
    """The loop's features, then the user's callbacks (``pretrain(..., callbacks=...)``)."""
    user_wants_losses: bool = False
    """A user callback handles ``on_train_step_end``: reduce the step's losses for its ``loss_dict`` every step."""
    report_progress: Callable[[], None] = lambda: None
    """Called after every completed step and save: in-process restart's progress watchdog declares a rank that
    stops calling it hung after ``inprocess_restart.soft_timeout``."""
    deadline: Optional[StopDeadline] = None
    """Running while a preempted run saves and exits."""
    valid_data_iterator: Optional[Iterator] = None
    """Validation micro-batches, when ``validation.eval_interval`` is set."""
    eval_forward_step_func: Optional[Callable] = None
    """The user's forward step as evaluation calls it (no loss checks, no fault injection, no straggler timing)."""

    @property
    def cfg(self) -> ConfigContainer:
        """The run's configuration."""
        return self.global_state.cfg

    @property
    def state(self) -> TrainState:
        """Training progress (``global_state.train_state``)."""
        return self.global_state.train_state


def train_step(ctx: TrainContext, with_losses: bool) -> tuple[dict[str, float], dict[str, torch.Tensor], StepVerdict]:
    """Run one step over a global batch; return its metrics, its losses (when ``with_losses``) and the verdict.

    The losses are each reported loss averaged over the step (``losses.reduce_losses``); the metrics carry them as
    floats.

    The optimizer steps only when the verdict says so (not for a skipped NaN step or a re-run stop).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg = ctx.cfg
    dp_size = parallel_state.get_data_parallel_world_size()
    num_microbatches = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp_size)
    start = time.perf_counter()
    losses: list[dict] = []
    rerun_from: Optional[float] = None
    for n in ctx.rerun.passes(ctx.data_iterator, ctx.state.step):
        if n == 1:
            rerun_from = time.perf_counter()  # the passes after the first are goodput's ``rerun`` time
        for chunk in ctx.model:
            chunk.zero_grad_buffer()
        ctx.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=ctx.forward_step_func,
            data_iterator=ctx.data_iterator,
            model=ctx.model,
            num_microbatches=num_microbatches,
            seq_length=cfg.model.seq_length,
            micro_batch_size=cfg.train.micro_batch_size,
            forward_only=False,
        )
    if rerun_from is not None:
        ctx.goodput.add_rerun(time.perf_counter() - rerun_from)
    verdict = ctx.rerun.end_step(ctx.state.step, losses)
    metrics: dict[str, float] = {"grad norm": float("nan"), "lr": ctx.scheduler.get_lr(ctx.optimizer.param_groups[0])}
    if verdict.apply:
        update_ok, grad_norm, _ = ctx.optimizer.step()
        if update_ok:
            ctx.scheduler.step(increment=cfg.train.global_batch_size)
        metrics["grad norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = ctx.scheduler.get_lr(ctx.optimizer.param_groups[0])
    metrics["step time"] = time.perf_counter() - start
    loss_dict = reduce_losses(losses) if with_losses and verdict.stop is None else {}
    metrics.update({name: value.item() for name, value in loss_dict.items()})
    return metrics, loss_dict, verdict


def _fire(ctx: TrainContext, event: str, **fields: Any) -> None:
    """Run the callbacks of ``event`` (nothing is built when there are none)."""
    fire_event(
        ctx.callbacks, event, ctx.global_state, ctx.model, optimizer=ctx.optimizer, scheduler=ctx.scheduler, **fields
    )


@dataclass(frozen=True)
class StepAgreement:
    """What every rank agreed on after a step, in the step's one collective (:func:`agree_after_step`)."""

    signalled: bool = False
    """A rank received the exit signal (``train.exit_signal_handler``)."""
    timed_out: bool = False
    """``train.exit_duration_in_mins`` passed on a rank."""
    saves_busy: Optional[AsyncSavesBusy] = None
    """Per tier, whether a rank is still writing its async save; ``None``: no async save was in flight."""


def step_flags(ctx: TrainContext) -> Optional[list[int]]:
    """The per-step flags of this rank: exit signal, duration limit, global and local async save still writing here.

    ``None`` when no flag is needed (neither stop feature on and no async save in flight): that depends only on the
    configuration and on saves every rank made together, so every rank agrees them or none does.
    """
    train = ctx.cfg.train
    stop_flags = train.exit_signal_handler or train.exit_duration_in_mins is not None
    in_flight = ctx.checkpoints.async_save_in_flight
    if not stop_flags and not in_flight:
        return None
    elapsed_min = (time.monotonic() - ctx.start_time) / 60.0
    timed_out = train.exit_duration_in_mins is not None and elapsed_min >= train.exit_duration_in_mins
    busy = ctx.checkpoints.busy_here() if in_flight else AsyncSavesBusy(False, False)
    return [int(ctx.signals.received), int(timed_out), int(busy.global_tier), int(busy.local_tier)]


def agree_after_step(ctx: TrainContext) -> StepAgreement:
    """Agree every per-step flag (:func:`step_flags`) in one collective the step makes anyway, or in one of its own.

    With the re-run state machine on, its per-step all-reduce carried the flags (:meth:`RerunController.carry`);
    else one MAX all-reduce here, and none when no flag is needed. An in-flight save's poll is folded in instead of
    costing an all-reduce of its own per step and tier. A save neither starts nor commits between the two points.
    """
    agreed = ctx.rerun.agreed()
    if agreed is None:
        flags = step_flags(ctx)
        if flags is None:
            return StepAgreement()
        tensor = torch.tensor(flags, dtype=torch.int32, device=next(ctx.model[0].parameters()).device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        agreed = tuple(bool(f) for f in tensor.tolist())
    signalled, timed_out, global_busy, local_busy = agreed
    in_flight = ctx.checkpoints.async_save_in_flight
    return StepAgreement(signalled, timed_out, AsyncSavesBusy(global_busy, local_busy) if in_flight else None)


def exit_condition(ctx: TrainContext, agreed: StepAgreement) -> Optional[tuple[ExitCode, str]]:
    """The reason to stop after this step, if any (finishing wins over every early stop)."""
    train, it = ctx.cfg.train, ctx.state.step
    if it >= train.train_iters:
        return ExitCode.FINISHED, f"reached train.train_iters={train.train_iters}"
    if agreed.signalled:
        return ExitCode.PREEMPTED, f"a rank received {ctx.signals.sig.name} (train.exit_signal)"
    if ctx.global_state.stop_request is not None:  # e.g. straggler detection with stop_if_detected
        return ctx.global_state.stop_request
    if train.exit_interval is not None and it % train.exit_interval == 0:
        return ExitCode.EXIT_INTERVAL, f"reached train.exit_interval={train.exit_interval} at iteration {it}"
    if agreed.timed_out:
        return ExitCode.DURATION_LIMIT, f"ran train.exit_duration_in_mins={train.exit_duration_in_mins}"
    return None


def start_stop_deadline(ctx: TrainContext) -> Optional[StopDeadline]:
    """On preemption, bound the time left for the save and the exit by ``train.exit_signal_deadline``."""
    seconds = ctx.cfg.train.exit_signal_deadline
    logger.warning("Preemption detected, saving checkpoint and exiting")
    event_stream.emit(
        EventKind.FAULT_DETECTED,
        mechanism=Mechanism.PREEMPTION_SIGNAL,
        iteration=ctx.state.step,
        signal=int(ctx.signals.sig),
        detail="received here" if ctx.signals.received else "received by another rank",
    )
    if seconds is None:
        return None
    since_signal = time.monotonic() - (ctx.signals.received_at or time.monotonic())
    last = ctx.checkpoints.last_saved_iteration
    committed = f"iteration {last}" if last is not None else "the one this run started from, if any"

    def describe() -> str:
        return (
            f"the preemption stop did not finish within train.exit_signal_deadline={seconds} s of the signal: "
            f"exiting now with {int(ExitCode.PREEMPTED)}; the save in progress is abandoned (never loaded), the "
            f"newest committed checkpoint is {committed}"
        )

    return StopDeadline(seconds - since_signal, int(ExitCode.PREEMPTED), describe)


def stop_before_step(ctx: TrainContext, verdict: StepVerdict) -> tuple[ExitCode, str]:
    """End the run on a re-run verdict, saving the pre-step state as the verdict asks."""
    if verdict.checkpoint == "force" or (verdict.checkpoint == "if_due" and _should_save(ctx, stopping=True)):
        _save(ctx, ctx.checkpoints.save, rank_extra=ctx.rerun.export_state())
    return verdict.stop


def _should_save(ctx: TrainContext, stopping: bool) -> bool:
    ckpt = ctx.cfg.checkpoint
    if ckpt.save is None:
        return False
    if ctx.checkpoints.last_saved_iteration == ctx.state.step:
        return False
    return stopping or (ckpt.save_interval is not None and ctx.state.step % ckpt.save_interval == 0)


def _due_save(ctx: TrainContext, stopping: bool) -> Optional[Callable[..., None]]:
    """The save to make after this step: global (interval or stop), else local (its interval), else none."""
    if _should_save(ctx, stopping):
        return ctx.checkpoints.save
    interval = ctx.cfg.checkpoint.non_persistent_save_interval
    if interval is not None and ctx.state.step % interval == 0:
        return ctx.checkpoints.save_local
    return None


def train(ctx: TrainContext) -> tuple[ExitCode, str]:
    """Train until an exit condition holds; return its code and reason. Every rank runs the same sequence."""
    cfg = ctx.cfg
    if ctx.state.step >= cfg.train.train_iters:
        return ExitCode.FINISHED, f"checkpoint is already at train.train_iters={cfg.train.train_iters}"
    for chunk in ctx.model:
        chunk.train()
    _fire(ctx, "on_train_start")
    ctx.rerun.carry(functools.partial(step_flags, ctx))  # the re-run machine's all-reduce carries the step's flags
    try:
        return _train_loop(ctx)
    finally:
        ctx.rerun.carry(None)


def _train_loop(ctx: TrainContext) -> tuple[ExitCode, str]:
    cfg = ctx.cfg
    timed_train_step = ctx.wrap_train_step(train_step)  # train_step itself when no feature wraps it
    while True:
        _fire(ctx, "on_train_step_start")
        log_this_step = ctx.metrics.due(ctx.state.step + 1)
        metrics, loss_dict, verdict = timed_train_step(ctx, with_losses=log_this_step or ctx.user_wants_losses)
        agreed = agree_after_step(ctx)
        if agreed.saves_busy is not None:
            with ctx.goodput.saving():
                ctx.checkpoints.finalize(busy_anywhere=agreed.saves_busy)
        _fire(
            ctx,
            "on_train_step_end",
            loss_dict=loss_dict,
            grad_norm=metrics["grad norm"],
            skipped_iter=not verdict.apply,
            step_time=metrics["step time"],
        )
        if verdict.skipped or verdict.stop is not None:
            blamed = ctx.checkpoints.blame_local_tier(ctx.state.step + 1)
            if blamed is not None:  # the state came from a suspect local checkpoint: save nothing of it
                return ExitCode.LOCAL_CHECKPOINT_REJECTED, blamed
        if verdict.stop is not None:  # the step was not applied: the iteration stays where it was
            return stop_before_step(ctx, verdict)
        ctx.state.step += 1
        ctx.state.consumed_train_samples += cfg.train.global_batch_size
        if verdict.skipped:
            ctx.state.skipped_train_samples += cfg.train.global_batch_size
        if log_this_step:
            ctx.metrics.log_step(ctx.state.step, cfg.train.train_iters, ctx.state.consumed_train_samples, metrics)
            if ctx.metrics.console_due(ctx.state.step):
                ctx.metrics.log_scalars(ctx.goodput.progress(ctx.state.step), ctx.state.step)
        stop = exit_condition(ctx, agreed)
        if stop is not None and stop[0] == ExitCode.PREEMPTED:
            ctx.deadline = start_stop_deadline(ctx)
        ctx.report_progress()
        if ctx.valid_data_iterator is not None and evaluation.is_due(ctx.global_state):
            totals = evaluation.evaluate(
                ctx.global_state, ctx.model, ctx.eval_forward_step_func, ctx.valid_data_iterator, ctx.callbacks
            )
            ctx.metrics.log_scalars({f"validation/{k.replace(' ', '_')}": v for k, v in totals.items()}, ctx.state.step)
            ctx.report_progress()
        save = _due_save(ctx, stopping=stop is not None)
        if save is not None:
            _save(ctx, save)
            ctx.report_progress()  # a save longer than inprocess_restart.soft_timeout is taken for a hang
        if stop is not None:
            if stop[0] == ExitCode.FINISHED:  # as in Megatron-Bridge: not on an early exit
                _fire(ctx, "on_train_end")
            return stop


def _save(ctx: TrainContext, save: Callable[..., None], **extra: Any) -> None:
    """One checkpoint save, between the events that open and close fault tolerance's ``checkpointing`` section."""
    _fire(ctx, "on_checkpoint_save_start")
    save(ctx.model, ctx.optimizer, ctx.scheduler, ctx.state, **extra)
    _fire(ctx, "on_checkpoint_save_end")
