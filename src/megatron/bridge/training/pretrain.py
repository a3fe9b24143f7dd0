"""Entry point: ``pretrain(config, forward_step_func, callbacks)`` and the command-line wrapper of the examples."""

import dataclasses
import functools
import itertools
import logging
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import torch.distributed as dist

from megatron.bridge.training import checkpointing
from megatron.bridge.training.callbacks import (
    Callback,
    CallbackManager,
    fire_checkpoint_event,
    fire_event,
    normalize_callbacks,
    should_fire,
)
from megatron.bridge.training.checkpoint.manager import CheckpointManager
from megatron.bridge.training.checkpointing import CheckpointType
from megatron.bridge.training.components import Component, Components, Run
from megatron.bridge.training.components.base import Teardown
from megatron.bridge.training.config import ConfigContainer, is_enabled, runtime_config_update
from megatron.bridge.training.config_checks.container import require_tokenizer
from megatron.bridge.training.eval import evaluate
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.goodput import GoodputCallback
from megatron.bridge.training.events.job_info import JobInfo
from megatron.bridge.training.events.metrics import MetricsWriter
from megatron.bridge.training.events.phases import PhaseClock
from megatron.bridge.training.events.recorder import EventRecorder
from megatron.bridge.training.events.stream import CyclePhase
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.training.fault_tolerance import FaultToleranceCallback
from megatron.bridge.training.faults.component import FaultInjection
from megatron.bridge.training.health.device import DeviceHealth
from megatron.bridge.training.health.hang_attribution import HangWatchCallback, attempt_name
from megatron.bridge.training.health.liveness import LivenessCallback
from megatron.bridge.training.health.no_progress import NoProgressGuard
from megatron.bridge.training.health.rerun import RerunController, check_losses
from megatron.bridge.training.health.same_job import SameJobCheck
from megatron.bridge.training.health.weight_hash import WeightHashCheck
from megatron.bridge.training.initialize import (
    abort_distributed,
    destroy_distributed,
    init_rerun_state,
    initialize_distributed,
    set_seeds,
    setup_logging,
)
from megatron.bridge.training.inprocess_restart import (
    begin_iteration,
    maybe_wrap_for_inprocess_restart,
    run_wrapped,
)
from megatron.bridge.training.nvrx_straggler import StragglerCallback
from megatron.bridge.training.optim import build_optimizer, build_scheduler
from megatron.bridge.training.state import GlobalState
from megatron.bridge.training.train import TrainContext, train
from megatron.bridge.training.utils.garbage_collection import GarbageCollectionCallback
from megatron.bridge.training.utils.overrides import apply_overrides
from megatron.bridge.training.utils.sig_utils import DistributedSignalHandler
from megatron.bridge.training.utils.train_utils import prepare_forward_step_func
from megatron.bridge.utils import launch_env
from megatron.bridge.utils.dist import BarrierTimeout, barrier
from megatron.bridge.utils.fast_exit import exit_without_final_collection
from megatron.bridge.utils.process_start import process_start_time

logger = logging.getLogger(__name__)

_LEAVE_TOGETHER_TIMEOUT_S = 120.0  # how long a rank that stopped waits for its peers to stop too


def pretrain(
    config: ConfigContainer,
    forward_step_func: Callable,
    callbacks: Union[None, CallbackManager, Iterable[Callback]] = None,
) -> ExitCode:
    """Validate ``config``, set up the run, resume from the newest valid checkpoint and train.

    With ``inprocess_restart.enabled`` the whole of it (process groups included) runs again in the same processes
    after a rank fault; see ``inprocess_restart.maybe_wrap_for_inprocess_restart``.

    Args:
        config: the run's configuration.
        forward_step_func: one micro-batch forward, ``(state, data_iterator, model)`` (e.g.
            ``megatron.bridge.training.gpt_step.forward_step``) or ``(data_iterator, model)``, returning the output
            and the loss function to apply to it.
        callbacks: ``Callback`` objects, or a ``CallbackManager``, run at the loop's events (``callbacks.py``).

    Returns:
        The exit code of the way training ended (see ``exit_codes.py``).

    Raises:
        ValueError: the configuration is invalid (nothing was started).
        RuntimeError: in-process restart is on, but the caller already initialized the default process group.
        TrainingExit: training could not start or had to stop early (e.g. no valid checkpoint, or in-process
            restart gave up).
    """
    runtime_config_update(config)  # env_vars, derived fields, validation
    require_tokenizer(config)  # validate() alone accepts a config without one, as upstream's does; a run cannot
    state = GlobalState()
    state.cfg = config
    manager = normalize_callbacks(callbacks)
    if is_enabled(config.inprocess_restart) and dist.is_initialized():
        raise RuntimeError(
            "In-process restart is incompatible with user-initialized process groups: it creates every process group "
            "of each restart iteration itself and aborts them all after a fault, so a default group made before "
            "pretrain() would be destroyed under its owner. Either:\n"
            "1. Disable in-process restart (inprocess_restart.enabled=False) to keep managing your process group, or\n"
            "2. Let the framework initialize the process group: do not call torch.distributed.init_process_group() "
            "before pretrain()."
        )
    setup_logging(config.logger.logging_level)
    train_fn, store = maybe_wrap_for_inprocess_restart(_pretrain, config.inprocess_restart, state)
    if store is None:
        return train_fn(state, forward_step_func, manager)
    return run_wrapped(train_fn, config.inprocess_restart, state, forward_step_func, manager, store=store)


FEATURES: tuple[type[Component], ...] = (
    DeviceHealth,  # health/device.py: the device's checks, first once the process group exists
    SameJobCheck,  # health/same_job.py: every rank runs the job's code and config (a wrong spare is refused)
    GoodputCallback,  # events/goodput.py: productive and lost time, across restarts (carried by checkpoints)
    EventRecorder,  # events/recorder.py: the attempt's, steps', checkpoints' and exit events
    FaultToleranceCallback,  # fault_tolerance.py: the rank monitor's sections and timeouts; the exit it is told
    NoProgressGuard,  # health/no_progress.py: a restart that would repeat the same failure again stops (exit 29)
    HangWatchCallback,  # health/hang_attribution.py: stacks of a rank stuck in a section (reads ft's timeouts)
    FaultInjection,  # faults/component.py: the drills' faults (after ft: ``ft.simulate_fault`` joins them)
    WeightHashCheck,  # health/weight_hash.py: replicas' weights compared (after the faults: a bitflip first)
    LivenessCallback,  # health/liveness.py: a dead or stuck peer named before a collective times out
    StragglerCallback,  # nvrx_straggler.py: slow ranks scored from step timings (outermost forward-step timer)
    GarbageCollectionCallback,  # utils/garbage_collection.py: set-up's objects frozen, manual collections
    JobInfo,  # events/job_info.py: what the run is and what it resumed from, once ready
)
"""The run's features in their order: set up, at each loop event and when finishing in this order (before the
user's callbacks), wrapping the forward step first-innermost, closed in reverse. A new feature is a
:class:`~megatron.bridge.training.components.Component` in its own module and one line here."""


def _pretrain(
    global_state: GlobalState,
    forward_step_func: Callable,
    callbacks: Optional[CallbackManager] = None,
    store: Optional[dist.Store] = None,
    inprocess_call_wrapper: Optional[Any] = None,
) -> ExitCode:
    """One training run (one in-process restart iteration when wrapped): set up, resume, train, tear down.

    Under in-process restart the wrapper passes its ``CallWrapper`` as ``inprocess_call_wrapper`` and ``store`` is
    the coordination store every iteration builds its process groups on.
    """
    cfg = global_state.cfg
    setup_logging(cfg.logger.logging_level)  # the rank may change between in-process restart iterations
    run = _begin_attempt(global_state, inprocess_call_wrapper, store)
    restart = run.restart
    # Entered when the config was set on the state (train.exit_signal_handler on), or again after an in-process
    # restart's reset; else a stand-in never entered: the scheduler's signal is trapped only when asked to.
    signals = global_state.signal_handler or DistributedSignalHandler(cfg.train.exit_signal)
    features, loop = Components(), _Loop()
    teardown = Teardown(lambda: _teardown_steps(run, features, loop, signals))
    if restart is not None:
        restart.cleanups.append(teardown)
    try:
        features.build(FEATURES, run)
        run.device = initialize_distributed(cfg, store=restart.process_group_store() if restart is not None else None)
        run.rank = dist.get_rank()
        setup_done = run.phases.lap  # each set-up phase's `phase` event (and the watchdog's ping: it bounds each)
        setup_done(CyclePhase.PROCESS_GROUP)
        features.setup(run)
        setup_done(CyclePhase.HEALTH_CHECKS)
        manager = CallbackManager.chain(features.items, callbacks)  # checkpoint events too: the recorder, the user's
        run.checkpoints = CheckpointManager(
            cfg.checkpoint,
            run_config=cfg,
            common_extra=run.checkpoint_extras,
            on_saved=functools.partial(fire_checkpoint_event, manager, "on_checkpoint_save", global_state),
            api=checkpointing,
        )
        global_state.async_calls_queue = run.checkpoints.async_queue
        run.metrics = MetricsWriter(cfg.logger, run.rank)
        set_seeds(cfg.rng.seed)
        init_rerun_state(cfg)
        loop.rerun = RerunController(cfg.rerun_state_machine, cfg.checkpoint.save)
        model, optimizer, scheduler = _build_model(cfg, run.device)
        setup_done(CyclePhase.MODEL_BUILD)
        _resume(run, manager, model, optimizer, scheduler)
        setup_done(CyclePhase.CHECKPOINT_LOAD)
        loop.rerun.import_state(run.checkpoints.loaded_rank_extra)
        data_iterator, valid_iterator = _build_data(run, len(model))
        setup_done(CyclePhase.DATA_BUILD)
        features.ready(run)
        model_parts, data = (model, optimizer, scheduler), (data_iterator, valid_iterator)
        loop.ctx = _train_context(run, features, manager, loop.rerun, signals, model_parts, data, forward_step_func)
        loop.ctx.user_wants_losses = should_fire(callbacks, "on_train_step_end")
        if cfg.validation.skip_train:
            evaluate(global_state, model, loop.ctx.eval_forward_step_func, valid_iterator, callbacks)
            code, reason = ExitCode.FINISHED, "validation.skip_train: evaluated without training"
        else:
            code, reason = train(loop.ctx)
        return _finish(run, features, loop.rerun, code, reason)
    except BaseException as err:
        signals.unwinding = err  # a preemption signal from now on finds no step boundary: it ends the process
        if run.checkpoints is not None:
            run.checkpoints.close(abort=True)  # other ranks may be elsewhere: no commit collectives now
        features.fail(run, err)  # before the abort: fault tolerance tells the launcher not to restart after a stop
        abort_distributed()  # NCCL peers waiting in a collective with this rank fail now (gloo: at their timeout)
        raise
    finally:
        # Not under the wrapper's atomic(): its monitor thread holds that lock for soft_timeout after raising the
        # restart into this thread. A step the restart interrupts runs again in the wrapper's finalize step.
        teardown()


@dataclasses.dataclass
class _Loop:
    """What only the loop uses, kept for the teardown."""

    rerun: Optional[RerunController] = None
    ctx: Optional[TrainContext] = None


def _train_context(
    run: Run,
    features: Components,
    manager: CallbackManager,
    rerun: RerunController,
    signals: DistributedSignalHandler,
    model_parts: tuple[list, Any, Any],
    data: tuple[Any, Any],
    forward_step_func: Callable,
) -> TrainContext:
    """What the loop works on: the model, its data and forward step as the features and the re-run checks wrap them."""
    model, optimizer, scheduler = model_parts
    data_iterator, valid_iterator = data
    eval_forward_step = prepare_forward_step_func(forward_step_func, run.global_state)  # training wraps it more
    return TrainContext(
        global_state=run.global_state,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        data_iterator=per_chunk(data_iterator, len(model), rerun.wrap_data_iterator),
        # Every loss is checked where the loss function computes it (the faults' NaN included).
        forward_step_func=check_losses(features.wrap_forward_step(eval_forward_step)),
        wrap_train_step=features.wrap_train_step,
        checkpoints=run.checkpoints,
        metrics=run.metrics,
        signals=signals,
        rerun=rerun,
        goodput=run.goodput,
        start_time=run.start_time,
        callbacks=manager,
        valid_data_iterator=per_chunk(valid_iterator, len(model)),
        eval_forward_step_func=eval_forward_step,
        **({"report_progress": run.restart.ping} if run.restart is not None else {}),  # else: the no-op default
    )


def _begin_attempt(global_state: GlobalState, call_wrapper: Optional[Any], store: Optional[dist.Store]) -> Run:
    """The :class:`Run` of this attempt (an in-process restart iteration begun), its event stream open."""
    cfg = global_state.cfg
    start_time = time.monotonic()  # a deadline's start (exit_duration_in_mins): a wall-clock step must not move it
    started_at = time.time()  # the same start as a timestamp: events and goodput compare it with other processes'
    restart = begin_iteration(call_wrapper, store, cfg.inprocess_restart) if call_wrapper is not None else None
    env = launch_env.current()
    iteration = restart.iteration if restart is not None else 0
    event_stream.configure(
        event_stream.resolve_directory(cfg.health.event_dir, cfg.checkpoint.save),
        rank=env.rank,
        local_rank=env.local_rank,
        restart_count=env.restart_count,
        inprocess_iteration=iteration,
    )
    # Goodput: an in-process restart iteration is an attempt of its own, from now; the first, from the process start.
    # One reading of the process start for both (each reading moves with /proc/uptime's 10 ms resolution).
    process_start = process_start_time()
    phases = PhaseClock(started_at, ping=restart.ping if restart is not None else None)
    if iteration == 0:  # a new process: from its fork to here (interpreter, imports, the in-process wrapper)
        phases.record(CyclePhase.PROCESS_START, process_start, started_at)
    return Run(
        cfg=cfg,
        global_state=global_state,
        rank=env.rank,
        attempt=attempt_name(inprocess_iteration=iteration),
        inprocess_iteration=iteration,
        job_id=env.job_id,
        start_time=start_time,
        process_start=process_start,
        attempt_start=started_at if iteration > 0 else process_start,
        restart=restart,
        phases=phases,
    )


def _build_model(cfg: ConfigContainer, device: Any) -> tuple[list, Any, Any]:
    """The model chunks of this rank in megatron-core DDP, their optimizer and learning-rate scheduler."""
    provider = cfg.model.for_device(device)  # a copy: the config keeps what the user asked for
    model = provider.provide_distributed_model(
        ddp_config=cfg.ddp, use_cpu_initialization=provider.use_cpu_initialization, device=device
    )
    optimizer = build_optimizer(cfg, model)
    return model, optimizer, build_scheduler(cfg, optimizer)


def _resume(run: Run, manager: CallbackManager, model: list, optimizer: Any, scheduler: Any) -> None:
    """Load the newest valid checkpoint (none: a fresh start); ``on_checkpoint_load``, then ``on_data_init_start``."""
    state, checkpoints = run.global_state.train_state, run.checkpoints
    run.load_started = time.perf_counter()
    checkpoints.load(model, optimizer, scheduler, state)
    state.do_train = state.step < run.cfg.train.train_iters
    if checkpoints.resumed["tier"] is not None:
        kind = CheckpointType(checkpoints.resumed["tier"])
        where, iteration = checkpoints.resumed["directory"], checkpoints.resumed["iteration"]
        fire_checkpoint_event(manager, "on_checkpoint_load", run.global_state, where, kind, iteration)
    fire_event(manager, "on_data_init_start", run.global_state, model, optimizer=optimizer, scheduler=scheduler)


def _build_data(run: Run, chunks: int) -> tuple[Any, Any]:
    """The training and validation streams, positioned by the samples consumed (a resumed run sees the same batches)."""
    from megatron.core import parallel_state

    from megatron.bridge.data.builders import started
    from megatron.bridge.data.loaders import setup_data_iterators
    from megatron.bridge.data.utils import bind_provider_context, get_dataset_provider

    cfg, state = run.cfg, run.global_state.train_state
    skipped = "data" in run.checkpoints.skipped_restores  # a drill's restore fault: read from the start
    position = dataclasses.replace(state, consumed_train_samples=0) if skipped else state
    data_provider = bind_provider_context(
        get_dataset_provider(cfg.dataset), tokenizer=run.global_state.tokenizer, pg_collection=_process_groups()
    )
    data_iterator, valid_iterator, _ = setup_data_iterators(
        cfg, position, chunks, data_provider, parallel_state.get_data_parallel_group()
    )
    state.do_train = state.do_train and position.do_train  # steps remain, and there is training data
    state.do_valid, state.do_test = position.do_valid, position.do_test
    return started(data_iterator), valid_iterator  # loader workers start inside ``setup``, not the first step


def _finish(run: Run, features: Components, rerun: RerunController, code: ExitCode, reason: str) -> ExitCode:
    """Wait for the last saves, tell every feature how training ended, and leave together."""
    # The wait for the last async save runs outside any ft section: the launcher's out-of-section timeout bounds
    # it. A learned ``checkpointing`` timeout measures only the blocking part of saves (for async saves, their
    # scheduling), which a healthy background write outlasts: under load it killed finished runs right here.
    with run.goodput.saving():
        run.checkpoints.close()
    features.finish(run, code, reason)
    if rerun.transient_errors:
        logger.warning(
            "re-run state machine: %d transient fault(s) detected; each step was re-run and training went on",
            rerun.transient_errors,
        )
    logger.info(
        "training stopped at iteration %d: %s (exit code %d)", run.global_state.train_state.step, reason, int(code)
    )
    _leave_together(code)
    return code


def _teardown_steps(
    run: Run, features: Components, loop: _Loop, signals: DistributedSignalHandler
) -> list[Callable[[], None]]:
    """The end of an attempt on every path, in order, from what it had built."""
    return [
        *([run.metrics.close] if run.metrics is not None else []),
        # A finished run closed it already (waiting for its saves); when unwinding, never commit collectives.
        *([functools.partial(run.checkpoints.close, abort=True)] if run.checkpoints is not None else []),
        functools.partial(setattr, run.global_state, "async_calls_queue", None),  # its queue is closed now
        *features.close_steps(),  # the features, the last declared first; while the process group is still up
        destroy_distributed,
        *([loop.ctx.deadline.cancel] if loop.ctx is not None and loop.ctx.deadline is not None else []),
        signals.release,
    ]


def _leave_together(code: ExitCode) -> None:
    """Wait until every rank has logged its stop before any rank exits.

    A launcher ends the other workers as soon as one exits with a non-zero code (an early stop's code): a rank still
    finishing its last save or its log lines would be killed mid-way. Bounded, so a peer lost after training cannot
    hold the exit.
    """
    try:
        barrier(timeout=_LEAVE_TOGETHER_TIMEOUT_S, name="training stopped")
    except BarrierTimeout as err:
        logger.warning("leaving with exit code %d without waiting for every rank: %s", int(code), err)


def per_chunk(iterator: Any, chunks: int, wrap: Callable[[Any], Any] = lambda it: it) -> Any:
    """``wrap(iterator)``, or with interleaved pipeline stages one copy per model chunk.

    megatron-core's interleaved schedule reads each chunk's micro-batches from its own iterator; every copy yields
    the same batches.
    """
    if iterator is None or chunks == 1:
        return None if iterator is None else wrap(iterator)
    return [wrap(copy) for copy in itertools.tee(iterator, chunks)]


def _process_groups() -> Any:
    """The run's process groups as megatron-core's ``ProcessGroupCollection`` (what a dataset provider is given)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(
        tp=parallel_state.get_tensor_model_parallel_group(),
        pp=parallel_state.get_pipeline_model_parallel_group(),
        dp=parallel_state.get_data_parallel_group(),
    )


def main(
    build_config: Callable[[], ConfigContainer],
    forward_step_func: Callable,
    argv: Optional[list[str]] = None,
    callbacks: Union[None, CallbackManager, Iterable[Callback]] = None,
) -> None:
    """Command-line entry: apply dotted overrides to ``build_config()``, pretrain, exit with the exit code.

    Exit codes: 0 finished, 2 bad config or override, 1 unexpected error, others as in ``exit_codes.py``.
    """
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = apply_overrides(build_config(), argv)
        cfg.validate()
        require_tokenizer(cfg)
    except ValueError as err:
        logging.basicConfig()
        logger.error("configuration error: %s", err)
        sys.exit(int(ExitCode.CONFIG_ERROR))
    try:
        code = pretrain(cfg, forward_step_func, callbacks)
    except TrainingExit as stop:
        logger.error("training stopped: %s", stop)
        code = stop.exit_code
    except Exception:  # noqa: BLE001 - a crash (a peer lost in a collective): exit 1 as Python does, but at once
        # The interpreter's own exit would first collect the heap: seconds before the launcher sees this rank go,
        # that every recovery waits for (a survivor of a lost node, on a loaded machine: 1.3 to 2.4 s measured).
        traceback.print_exc()
        code = ExitCode.UNEXPECTED_ERROR
    exit_without_final_collection(int(code))
