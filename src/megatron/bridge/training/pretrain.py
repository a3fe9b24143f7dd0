"""Entry point: ``pretrain(config, forward_step_func, callbacks)`` and the command-line wrapper of the examples."""

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import torch.distributed as dist

from megatron.bridge.training import fault_tolerance
from megatron.bridge.training.callbacks import (
    Callback,
    CallbackManager,
    fire_checkpoint_event,
    fire_event,
    normalize_callbacks,
    should_fire,
)
from megatron.bridge.training.checkpointing import CheckpointManager, CheckpointType
from megatron.bridge.training.config import (
    ConfigContainer,
    NVRxStragglerDetectionConfig,
    is_enabled,
    runtime_config_update,
)
from megatron.bridge.training.config_checks.container import require_tokenizer
from megatron.bridge.training.eval import evaluate
from megatron.bridge.training.events import job_info
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.goodput import ENTRY as GOODPUT_ENTRY
from megatron.bridge.training.events.goodput import GoodputCallback, GoodputTracker
from megatron.bridge.training.events.metrics import MetricsWriter
from megatron.bridge.training.events.recorder import EventRecorder
from megatron.bridge.training.exit_codes import STOP_CODES, ExitCode, TrainingExit
from megatron.bridge.training.fault_tolerance import FaultToleranceCallback
from megatron.bridge.training.faults import injection as fault_injection
from megatron.bridge.training.faults.injection import StepFaults
from megatron.bridge.training.health.device import check_device_health
from megatron.bridge.training.health.hang_attribution import (
    HangWatch,
    HangWatchCallback,
    attempt_name,
    summarize_earlier_attempts,
)
from megatron.bridge.training.health.liveness import LivenessCallback, LivenessPing
from megatron.bridge.training.health.rerun import RerunController, check_losses
from megatron.bridge.training.initialize import (
    abort_distributed,
    destroy_distributed,
    init_rerun_state,
    initialize_distributed,
    set_seeds,
    setup_logging,
)
from megatron.bridge.training.inprocess_restart import (
    RestartIteration,
    begin_iteration,
    maybe_wrap_for_inprocess_restart,
    run_wrapped,
)
from megatron.bridge.training.nvrx_straggler import NVRxStragglerDetectionManager, StragglerCallback
from megatron.bridge.training.optim import build_optimizer, build_scheduler
from megatron.bridge.training.state import GlobalState
from megatron.bridge.training.train import TrainContext, train
from megatron.bridge.training.utils.garbage_collection import GarbageCollectionCallback
from megatron.bridge.training.utils.overrides import apply_overrides
from megatron.bridge.training.utils.sig_utils import DistributedSignalHandler
from megatron.bridge.training.utils.train_utils import prepare_forward_step_func
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
    start_time = time.monotonic()  # a deadline's start (exit_duration_in_mins): a wall-clock step must not move it
    started_at = time.time()  # the same start as a timestamp: events and goodput compare it with other processes'
    setup_logging(cfg.logger.logging_level)  # the rank may change between in-process restart iterations
    restart: Optional[RestartIteration] = None
    if inprocess_call_wrapper is not None:
        restart = begin_iteration(inprocess_call_wrapper, store, cfg.inprocess_restart)
    from megatron.bridge.data.builders import started
    from megatron.bridge.data.loaders import setup_data_iterators
    from megatron.bridge.data.utils import bind_provider_context, get_dataset_provider

    rank = int(os.environ.get("RANK", "0"))
    inprocess_iteration = restart.iteration if restart is not None else 0
    event_stream.configure(
        event_stream.resolve_directory(cfg.health.event_dir, cfg.checkpoint.save),
        rank=rank,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        inprocess_iteration=inprocess_iteration,
    )
    recorder = EventRecorder(rank, flush_interval=cfg.logger.log_interval)
    if is_enabled(cfg.ft, "enable_ft_package"):
        fault_tolerance.setup(cfg, global_state)  # first: a hang from here on is the ``setup`` section's
        if is_enabled(cfg.inprocess_restart):  # the inner layer acts first: no hang timeout below its hard timeout
            fault_tolerance.keep_timeouts_at_least(global_state, cfg.inprocess_restart.hard_timeout)
    ft_timeout = functools.partial(fault_tolerance.section_timeout, global_state)
    attempt = attempt_name(inprocess_iteration=inprocess_iteration)
    attribution_dir = _attribution_dir(cfg)
    hang_watch = HangWatch(
        attribution_dir, attempt, rank, lambda section: _stack_dump_delay(cfg, ft_timeout, hang_watch, section)
    )
    liveness = LivenessPing(cfg.health, attempt, hang_watch.where_is if attribution_dir is not None else None)
    # Goodput: an in-process restart iteration is an attempt of its own, from now; the first, from the process start.
    # One reading of the process start for both (each reading moves with /proc/uptime's 10 ms resolution).
    process_start = process_start_time()
    attempt_start = started_at if restart is not None and restart.iteration > 0 else process_start
    goodput = GoodputTracker(_job_id(), attempt, attempt_start, cfg.checkpoint.save, rank, process_start=process_start)
    recorder.attempt_started(
        process_start=process_start, attempt_start=attempt_start, attempt=attempt, job_id=_job_id()
    )
    hang_watch.open("setup")
    checkpoints = metrics = ctx = None
    # Off when cfg.nvrx_straggler is None: a disabled manager keeps the loop free of ``if`` around each use.
    straggler = global_state.nvrx_straggler_manager or NVRxStragglerDetectionManager(NVRxStragglerDetectionConfig())
    # Entered when the config was set on the state (train.exit_signal_handler on), or again after an in-process
    # restart's reset; else a stand-in never entered: the scheduler's signal is trapped only when asked to.
    signals = global_state.signal_handler or DistributedSignalHandler(cfg.train.exit_signal)
    collector = GarbageCollectionCallback(cfg.train, freeze=not is_enabled(cfg.inprocess_restart))
    handlers = contextlib.ExitStack()
    handlers.callback(signals.release)

    def teardown_steps() -> list[Callable[[], None]]:
        return [
            straggler.shutdown,  # first: the detector is process-global, a later pretrain() in this process needs it
            *([metrics.close] if metrics is not None else []),
            # A finished run closed it already (waiting for its saves); when unwinding, never commit collectives.
            *([functools.partial(checkpoints.close, abort=True)] if checkpoints is not None else []),
            functools.partial(setattr, global_state, "async_calls_queue", None),  # its queue is closed now
            # A finished run shut fault tolerance down already (learning its timeouts); when unwinding, disconnect.
            functools.partial(fault_tolerance.abort, global_state),
            hang_watch.shutdown,
            liveness.shutdown,
            collector.close,
            destroy_distributed,
            *([ctx.deadline.cancel] if ctx is not None and ctx.deadline is not None else []),
            handlers.close,
        ]

    teardown = _Teardown(teardown_steps)
    if restart is not None:
        restart.cleanups.append(teardown)
    try:
        device = initialize_distributed(cfg, store=restart.process_group_store() if restart is not None else None)
        # In-process restart's watchdog sees progress at each finished phase of the setup too: its soft timeout then
        # bounds one phase (a stuck rendezvous, load or data build), not the whole setup.
        setup_done = restart.ping if restart is not None else lambda: None
        setup_done()
        check_device_health(device)
        if dist.get_rank() == 0 and attribution_dir is not None:
            summarize_earlier_attempts(attribution_dir, attempt)
        liveness.setup()
        straggler.initialize()
        # Checkpoint events reach the event recorder, then the user's callbacks (the loop's own manager comes later).
        checkpoint_callbacks = CallbackManager.chain([recorder], callbacks)
        # Before the load: a fault may strike there (``skip_restore``).
        registry = fault_injection.install(cfg.fault_injection, restart.iteration if restart is not None else 0)
        checkpoints = CheckpointManager(
            cfg.checkpoint,
            run_config=cfg,
            common_extra={GOODPUT_ENTRY: goodput.snapshot},
            on_saved=lambda name, kind, iteration, finalize_seconds=None: fire_checkpoint_event(
                checkpoint_callbacks, "on_checkpoint_save", global_state, name, kind, iteration, finalize_seconds
            ),
        )
        global_state.async_calls_queue = checkpoints.async_queue
        metrics = MetricsWriter(cfg.logger, dist.get_rank())
        set_seeds(cfg.rng.seed)
        init_rerun_state(cfg)
        rerun = RerunController(cfg.rerun_state_machine, cfg.checkpoint.save)
        provider = cfg.model.for_device(device)  # a copy: the config keeps what the user asked for
        model = provider.provide_distributed_model(
            ddp_config=cfg.ddp, use_cpu_initialization=provider.use_cpu_initialization, device=device
        )
        setup_done()
        optimizer = build_optimizer(cfg, model)
        scheduler = build_scheduler(cfg, optimizer)
        state = global_state.train_state
        recorder.load_begins()
        checkpoints.load(model, optimizer, scheduler, state)
        setup_done()
        state.do_train = state.step < cfg.train.train_iters
        if checkpoints.resumed["tier"] is not None:
            fault_tolerance.on_checkpoint_loaded(checkpoints.resumed["tier"] == "local", global_state)
            kind = CheckpointType(checkpoints.resumed["tier"])
            where, iteration = checkpoints.resumed["directory"], checkpoints.resumed["iteration"]
            fire_checkpoint_event(checkpoint_callbacks, "on_checkpoint_load", global_state, where, kind, iteration)
        fire_event(callbacks, "on_data_init_start", global_state, model, optimizer=optimizer, scheduler=scheduler)
        rerun.import_state(checkpoints.loaded_rank_extra)
        goodput.resume(
            checkpoints.loaded_common_extra.get(GOODPUT_ENTRY), state.step, checkpoints.resumed["tier"] is not None
        )
        if dist.get_rank() == 0:
            ckpt = cfg.checkpoint
            info = job_info.collect(
                device=str(device),
                inprocess_iteration=restart.iteration if restart is not None else 0,
                checkpoint={"save": ckpt.save, "load": ckpt.load, "local": ckpt.non_persistent_local_ckpt_dir},
                resumed=checkpoints.resumed,
            )
            job_info.report(info, ckpt.save)

        from megatron.core import parallel_state

        # Training and validation streams, positioned by the samples consumed (a resumed run sees the same batches).
        skipped = "data" in checkpoints.skipped_restores  # a drill's restore fault: read from the start
        position = dataclasses.replace(state, consumed_train_samples=0) if skipped else state
        data_provider = bind_provider_context(
            get_dataset_provider(cfg.dataset), tokenizer=global_state.tokenizer, pg_collection=_process_groups()
        )
        data_iterator, valid_iterator, _ = setup_data_iterators(
            cfg, position, len(model), data_provider, parallel_state.get_data_parallel_group()
        )
        state.do_train = state.do_train and position.do_train  # steps remain, and there is training data
        state.do_valid, state.do_test = position.do_valid, position.do_test
        data_iterator = started(data_iterator)  # loader workers start inside ``setup``, not the first step
        setup_done()
        eval_forward_step = prepare_forward_step_func(forward_step_func, global_state)  # training wraps it more
        fault_tolerance.maybe_setup_simulated_fault(cfg.ft, seed=cfg.rng.seed)
        faults = StepFaults(dist.get_rank(), registry)
        features = [  # the loop's features, in the order they run at each event (train.py)
            GoodputCallback(goodput),
            recorder,
            FaultToleranceCallback(),
            HangWatchCallback(hang_watch),
            faults,
            LivenessCallback(liveness),
            StragglerCallback(straggler, metrics.log_scalars),
            collector,
        ]
        ctx = TrainContext(
            global_state=global_state,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            data_iterator=per_chunk(data_iterator, len(model), rerun.wrap_data_iterator),
            # Every loss is checked where the loss function computes it; straggler detection times the forward.
            forward_step_func=straggler.wrap_forward_step(check_losses(faults.wrap_forward_step(eval_forward_step))),
            checkpoints=checkpoints,
            metrics=metrics,
            straggler=straggler,
            signals=signals,
            rerun=rerun,
            goodput=goodput,
            start_time=start_time,
            callbacks=CallbackManager.chain(features, callbacks),
            user_wants_losses=should_fire(callbacks, "on_train_step_end"),
            valid_data_iterator=per_chunk(valid_iterator, len(model)),
            eval_forward_step_func=eval_forward_step,
            **({"report_progress": restart.ping} if restart is not None else {}),  # else: the no-op default
        )
        hang_watch.close()  # fault tolerance's ``setup`` section ends with the first step's start
        if cfg.validation.skip_train:
            evaluate(global_state, model, eval_forward_step, valid_iterator, callbacks)
            code, reason = ExitCode.FINISHED, "validation.skip_train: evaluated without training"
        else:
            code, reason = train(ctx)
        # The wait for the last async save runs outside any ft section: the launcher's out-of-section timeout bounds
        # it. A learned ``checkpointing`` timeout measures only the blocking part of saves (for async saves, their
        # scheduling), which a healthy background write outlasts: under load it killed finished runs right here.
        with goodput.saving():
            checkpoints.close()
        fault_tolerance.report_exit(global_state, code)
        fault_tolerance.shutdown(global_state)  # every rank ends here: the timeouts of the whole run can be learned
        goodput.finish(state.step, f"{code.name} (exit code {int(code)})")
        recorder.exited(int(code), reason)
        if rerun.transient_errors:
            logger.warning(
                "re-run state machine: %d transient fault(s) detected; each step was re-run and training went on",
                rerun.transient_errors,
            )
        logger.info("training stopped at iteration %d: %s (exit code %d)", state.step, reason, int(code))
        _leave_together(code)
        return code
    except BaseException as err:
        signals.unwinding = err  # a preemption signal from now on finds no step boundary: it ends the process
        if checkpoints is not None:
            checkpoints.close(abort=True)  # other ranks may be elsewhere: no commit collectives now
        # Before the abort: the peers' failures must not restart the job first.
        _no_restart_after_a_stop(global_state, err)
        abort_distributed()  # NCCL peers waiting in a collective with this rank fail now (gloo: at their timeout)
        _finish_goodput_unwinding(goodput, err)
        recorder.exited(_exit_code_of(err), f"{type(err).__name__}: {err}"[:500])
        raise
    finally:
        # Not under the wrapper's atomic(): its monitor thread holds that lock for soft_timeout after raising the
        # restart into this thread. A step the restart interrupts runs again in the wrapper's finalize step.
        teardown()


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


def _job_id() -> str:
    """The job's identity for goodput: the Slurm job id, else the launcher's run id, else ``local``."""
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "local"


def _exit_code_of(err: BaseException) -> Optional[int]:
    """The exit code ``err`` ends the process with (``None`` when an outer layer may still catch it)."""
    code = getattr(err, "exit_code", None)
    if code is not None:
        return int(code)
    if isinstance(err, SystemExit):
        return err.code if isinstance(err.code, int) else 1
    return None


def _no_restart_after_a_stop(global_state: GlobalState, err: BaseException) -> None:
    """Best effort: an exit whose action is *stop* (a full disk, say) tells the launcher and job script so."""
    code = _exit_code_of(err)
    if code not in STOP_CODES:
        return
    try:
        fault_tolerance.report_exit(global_state, ExitCode(code))
    except Exception:  # noqa: BLE001 - must not hide the error being raised
        logger.warning("could not tell the launcher not to restart", exc_info=True)


def _finish_goodput_unwinding(goodput: GoodputTracker, err: BaseException) -> None:
    """Best effort: the goodput summary of an attempt that is ending with an exception."""
    code = getattr(err, "exit_code", None)
    try:
        ended = f"{code.name} (exit code {int(code)})" if code is not None else type(err).__name__
        goodput.finish(None, ended, failed=True)
    except Exception:  # noqa: BLE001 - accounting must not hide the error being raised
        logger.warning("goodput: no summary for this attempt", exc_info=True)


def _attribution_dir(cfg: ConfigContainer) -> Optional[str]:
    """Where hang attribution writes stacks: ``<checkpoint.save>/attribution`` when a stack dump can happen."""
    after = cfg.health.stack_dump_after
    watched = (
        is_enabled(cfg.ft, "enable_ft_package")
        or is_enabled(cfg.inprocess_restart)
        or cfg.health.liveness_ping_interval > 0
    )
    if cfg.checkpoint.save is None or after == 0 or (after is None and not watched):
        return None
    return os.path.join(cfg.checkpoint.save, "attribution")


def _stack_dump_delay(
    cfg: ConfigContainer, section_timeout: Callable[[str], Optional[float]], watch: HangWatch, section: str
) -> Optional[float]:
    """Seconds ``section`` may stay open before the stacks are dumped (evaluated at every section start).

    The configured value, or the earliest of: half of each hang timeout on the section's own length (an ft section
    timeout, learned ones included; ``inprocess_restart.soft_timeout``), and for a step, half of
    ``health.liveness_ping_timeout`` past the last step's length (the ping bounds how far ranks drift apart, not how
    long a step takes, so a long healthy step never dumps; a rank stuck before the ping dumps before its peers give up).
    """
    if cfg.health.stack_dump_after is not None:
        return cfg.health.stack_dump_after or None
    limits = [t / 2 for t in (section_timeout(section),) if t]
    if is_enabled(cfg.inprocess_restart) and section != "setup":
        limits.append(cfg.inprocess_restart.soft_timeout / 2)
    if section == "step" and cfg.health.liveness_ping_interval:
        limits.append(cfg.health.liveness_ping_timeout / 2 + watch.last_duration("step"))
    return min(limits) if limits else None


class _Teardown:
    """The end of one run, in order; each step runs once, and a second call finishes what an interrupted one left.

    The steps are listed at the first call (from what the run had built by then). An in-process restart can
    interrupt the ``finally`` of an aborted iteration (its interruption is a ``BaseException``): the step it struck
    stays, and the wrapper's finalize step calls this again before the next iteration starts. A step that fails
    (an ``Exception``, such as a writer an interrupted close left half-closed) is logged and dropped, and the steps
    after it still run: otherwise one broken close would keep the rank monitor's connection open for good, and the
    next iteration would wait on it.
    """

    def __init__(self, list_steps: Callable[[], list[Callable[[], None]]]) -> None:
        self._list_steps: Optional[Callable[[], list[Callable[[], None]]]] = list_steps
        self._steps: list[Callable[[], None]] = []

    def __call__(self) -> None:
        if self._list_steps is not None:
            self._steps, self._list_steps = self._list_steps(), None  # the closure holds the model: let it go
        while self._steps:
            step = self._steps[0]
            try:
                step()  # removed once done: a step interrupted half-way runs again on the next call
            except Exception as err:  # noqa: BLE001 - a failed step must not hold back the ones after it
                logger.warning("teardown: %s failed (%s: %s); going on", _step_name(step), type(err).__name__, err)
            self._steps.pop(0)


def _step_name(step: Callable[[], None]) -> str:
    """A teardown step's name for the log (a partial's function)."""
    func = getattr(step, "func", step)
    return getattr(func, "__qualname__", None) or repr(func)


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
    exit_without_final_collection(int(code))
