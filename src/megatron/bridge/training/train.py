"""The training loop, written as the ordered list of moments every step goes through.

Order of events in one iteration (features hook in at these moments, with their logic in their own modules):

1. goodput: the first step ends this attempt's start-up; fault tolerance: open the ``step`` section (everything up
   to 6 is inside it; hang attribution dumps this rank's stacks if it stays open too long); fault drills strike
   here; the liveness ping, when due;
2. commit async checkpoint saves that finished on every rank (goodput counts the wait as ``checkpoint_save``);
3. forward and backward over the micro-batches (timed by straggler detection), once or, when the re-run state
   machine asks, again; its verdict on the losses (apply, skip, or stop with 16/17 and maybe a diagnostic
   checkpoint; a bad loss soon after a local-tier load stops with 23 instead, that checkpoint deleted); optimizer and
   scheduler step; goodput counts the step time as productive when the update was applied (re-run passes and steps
   not applied as ``rerun``);
4. log metrics; goodput rewrites its progress record and logs its scalars;
5. straggler detection: count the step; when a report is due, all ranks score each other (may ask to stop);
6. decide whether to stop (end of training, exit signal on any rank, straggler, ``exit_interval``,
   ``exit_duration_in_mins``); on a signal, start the stop deadline; close ``step``; report progress (in-process
   restart's watchdog);
7. save a checkpoint (inside the ``checkpointing`` section) when the interval is reached or training stops, or
   else a local-tier checkpoint when its interval is reached (a global save is never replaced by a local one; both
   carry goodput's ledger, which counts the save as ``checkpoint_save`` and then rewrites its progress record), and
   report progress again;
8. stop with the exit code of the reason.
"""

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.bridge.training import eval as evaluation
from megatron.bridge.training import fault_tolerance
from megatron.bridge.training.callbacks import CallbackManager, fire_event, should_fire
from megatron.bridge.training.checkpointing import CheckpointManager
from megatron.bridge.training.config import ConfigContainer
from megatron.bridge.training.exit_codes import ExitCode
from megatron.bridge.training.fault_injection import StepFaults
from megatron.bridge.training.goodput import GoodputTracker
from megatron.bridge.training.hang_attribution import HangWatch
from megatron.bridge.training.liveness import LivenessPing
from megatron.bridge.training.losses import reduce_losses
from megatron.bridge.training.metrics import MetricsWriter
from megatron.bridge.training.nvrx_straggler import (
    NVRxStragglerDetectionManager,
    check_nvrx_straggler_detection,  # noqa: F401 - Megatron-Bridge's train.py offers it too
)
from megatron.bridge.training.rerun import RerunController, StepVerdict
from megatron.bridge.training.state import GlobalState, TrainState
from megatron.bridge.training.utils.sig_utils import DistributedSignalHandler, StopDeadline

logger = logging.getLogger(__name__)


@dataclass
class TrainContext:
    """Everything the loop works on."""

    global_state: GlobalState
    """The run's config and progress (``cfg`` and ``state`` below); what callbacks and a forward step see."""
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    data_iterator: Iterator
    forward_step_func: Callable
    checkpoints: CheckpointManager
    metrics: MetricsWriter
    faults: StepFaults
    straggler: NVRxStragglerDetectionManager
    signals: DistributedSignalHandler
    rerun: RerunController
    hang_watch: HangWatch
    liveness: LivenessPing
    goodput: GoodputTracker
    start_time: float
    callbacks: Optional[CallbackManager] = None
    """User callbacks (``pretrain(..., callbacks=...)``)."""
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
        ctx.model.zero_grad_buffer()
        ctx.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=ctx.forward_step_func,
            data_iterator=ctx.data_iterator,
            model=[ctx.model],
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
    loss_dict = reduce_losses(losses) if with_losses and verdict.stop is None and losses else {}
    metrics.update({name: value.item() for name, value in loss_dict.items()})
    return metrics, loss_dict, verdict


def _fire(ctx: TrainContext, event: str, **fields: Any) -> None:
    """Run the callbacks of ``event`` (nothing is built when there are none)."""
    fire_event(
        ctx.callbacks, event, ctx.global_state, ctx.model, optimizer=ctx.optimizer, scheduler=ctx.scheduler, **fields
    )


def _agreed_stop_flags(ctx: TrainContext) -> tuple[bool, bool]:
    """(a rank received the exit signal, ``exit_duration_in_mins`` passed on a rank), agreed by every rank.

    One MAX all-reduce of two integers per step, and none when neither feature is on.
    """
    train = ctx.cfg.train
    if not train.exit_signal_handler and train.exit_duration_in_mins is None:
        return False, False
    signalled = ctx.signals.received  # agreed below, with the duration flag, in one all-reduce
    elapsed_min = (time.time() - ctx.start_time) / 60.0
    timed_out = train.exit_duration_in_mins is not None and elapsed_min >= train.exit_duration_in_mins
    device = next(ctx.model.parameters()).device
    flags = torch.tensor([int(signalled), int(timed_out)], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0].item()), bool(flags[1].item())


def _straggler_stop(ctx: TrainContext) -> Optional[str]:
    """Let straggler detection count this step; on a report step, log its scores and return a stop reason, if any."""
    result = ctx.straggler.check(ctx.state.step)
    if result is None:
        return None
    if result.scalars:
        ctx.metrics.log_scalars(result.scalars, ctx.state.step)
    return result.stop_reason


def exit_condition(ctx: TrainContext, straggler_stop: Optional[str] = None) -> Optional[tuple[ExitCode, str]]:
    """The reason to stop after this step, if any (finishing wins over every early stop)."""
    train, it = ctx.cfg.train, ctx.state.step
    if it >= train.train_iters:
        return ExitCode.FINISHED, f"reached train.train_iters={train.train_iters}"
    signalled, timed_out = _agreed_stop_flags(ctx)
    if signalled:
        return ExitCode.PREEMPTED, f"a rank received {ctx.signals.sig.name} (train.exit_signal)"
    if straggler_stop is not None:
        return ExitCode.STRAGGLER_STOP, straggler_stop
    if train.exit_interval is not None and it % train.exit_interval == 0:
        return ExitCode.EXIT_INTERVAL, f"reached train.exit_interval={train.exit_interval} at iteration {it}"
    if timed_out:
        return ExitCode.DURATION_LIMIT, f"ran train.exit_duration_in_mins={train.exit_duration_in_mins}"
    return None


def start_stop_deadline(ctx: TrainContext) -> Optional[StopDeadline]:
    """On preemption, bound the time left for the save and the exit by ``train.exit_signal_deadline``."""
    seconds = ctx.cfg.train.exit_signal_deadline
    logger.warning("Preemption detected, saving checkpoint and exiting")
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
    fault_tolerance.on_training_step_end(ctx.global_state)
    ctx.hang_watch.close()
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
    ctx.model.train()
    _fire(ctx, "on_train_start")
    while True:
        ctx.goodput.step_start()  # the first one ends this attempt's start-up
        fault_tolerance.on_training_step_start(ctx.global_state)
        ctx.hang_watch.open("step")
        ctx.faults.before_step(ctx.state.step + 1)
        ctx.liveness.maybe_ping(ctx.state.step + 1)  # before any collective of the step, a save commit too
        with ctx.goodput.saving():
            ctx.checkpoints.finalize(blocking=False)
        log_this_step = ctx.metrics.due(ctx.state.step + 1)
        _fire(ctx, "on_train_step_start")
        with ctx.straggler.step_section():
            metrics, loss_dict, verdict = train_step(
                ctx, with_losses=log_this_step or should_fire(ctx.callbacks, "on_train_step_end")
            )
        ctx.goodput.step_end(metrics["step time"], kept=verdict.apply)  # productive, or else ``rerun`` time
        applied = {"loss_dict": loss_dict, "grad_norm": metrics["grad norm"], "skipped_iter": not verdict.apply}
        _fire(ctx, "on_train_step_end", **applied)
        if verdict.skipped or verdict.stop is not None:
            blamed = ctx.checkpoints.blame_local_tier(ctx.state.step + 1)
            if blamed is not None:  # the state came from a suspect local checkpoint: save nothing of it
                fault_tolerance.on_training_step_end(ctx.global_state)
                ctx.hang_watch.close()
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
        straggler_stop = _straggler_stop(ctx)
        stop = exit_condition(ctx, straggler_stop)
        if stop is not None and stop[0] == ExitCode.PREEMPTED:
            ctx.deadline = start_stop_deadline(ctx)
        fault_tolerance.on_training_step_end(ctx.global_state)
        ctx.hang_watch.close()
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
    """One checkpoint save inside fault tolerance's ``checkpointing`` section, watched, counted by goodput."""
    fault_tolerance.on_checkpointing_start(ctx.global_state)
    ctx.hang_watch.open("checkpointing")
    with ctx.goodput.saving(ctx.state.step):
        save(ctx.model, ctx.optimizer, ctx.scheduler, ctx.state, **extra)
    fault_tolerance.on_checkpointing_end(is_async_finalization=False, global_state=ctx.global_state)
    ctx.hang_watch.close()
