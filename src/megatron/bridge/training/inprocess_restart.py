"""In-process restart: rerun the training function in the same processes after a rank fault.

nvidia-resiliency-ext's ``inprocess.Wrapper`` watches every rank (a monitor thread and a monitor process per rank,
heartbeats through a TCP store hosted by rank 0 on ``MASTER_PORT + 2``). When a rank raises, stops making progress
for ``soft_timeout`` seconds, or dies, every healthy rank aborts its process groups and its asynchronous checkpoint
saves, and calls the wrapped function again: no new processes, no new interpreter, no re-import. Each call is one
*restart iteration*: the training function (``pretrain._pretrain``, which receives the wrapper's ``CallWrapper`` as
``inprocess_call_wrapper``) builds the process group on the coordination store (``MASTER_PORT + 1``, under a fresh
prefix), the model-parallel groups, the re-run state machine and the checkpoint workers from scratch and resumes
from the newest verified checkpoint; on the way out, and once more in the wrapper's finalize step, everything it
built is torn down and the run's ``GlobalState`` forgets its handles.

Mapping of :class:`InProcessRestartConfig` onto the wrapper (every field reaches it):

- ``active_world_size`` and ``granularity``: the rank-assignment tree (a root layer of ``active_world_size`` active
  ranks, the rest warm reserves; with ``"node"`` a second layer per host, so a fault retires the whole node);
- ``max_iterations``: the retry controller allows that many restarts, then aborts the wrapper (the processes exit
  with :attr:`ExitCode.INPROCESS_RESTART_EXHAUSTED`, and an outer ``ft_launcher`` takes over when nested);
- ``soft_timeout``/``hard_timeout``/``heartbeat_*``/``barrier_timeout``/``completion_timeout``: the wrapper's
  timeouts of the same names;
- ``empty_cuda_cache``: the finalize step empties the CUDA cache (where CUDA is initialized);
- ``max_rank_faults``: a fault-counting health check that retires a rank past that many faults;
- ``monitor_process_logdir``: monitor-process logs in that directory: under Slurm one, of the job's rank 0
  (``monitor_<job>_<host>_<rank>_<local rank>.log``); otherwise one per rank (``monitor_process_<rank>.log``).

Health checks, before every iteration and after every fault: the fault counter and the CUDA context check (which
does nothing where CUDA is not initialized). nvidia-resiliency-ext >= 0.5 adds its own GPU (NVML), NVLink and NIC
checks of GPU ``LOCAL_RANK`` to those after a fault. On a node without a GPU they fail (no NVML) and would end the
wrapper at the first restart, so there they are left out, decided when the wrapper is built; each rank names what
it left out, and why, in one log line. On a node with a GPU they all run. Likewise the finalize steps run in a
thread bound to the rank's GPU (``ThreadedFinalize``) where CUDA is initialized, and in the calling thread elsewhere.

The progress watchdog is fed from the train loop (:meth:`RestartIteration.ping` after every step and save, and by
``pretrain`` after each setup phase): a rank that stops completing them, whether it holds the GIL or waits with it
released, is declared hung after ``soft_timeout`` even while its threads stay alive.
"""

import datetime
import gc
import logging
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.bridge.training.checkpoint import async_writer
from megatron.bridge.training.config import INPROCESS_STORE_PORT_OFFSET, InProcessRestartConfig
from megatron.bridge.training.config_sections.resiliency import INPROCESS_COORDINATION_PORT_OFFSET
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind, RestartLayer
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.training.health.device import visible_gpu
from megatron.bridge.utils import launch_env
from megatron.bridge.utils.fields import is_enabled
from megatron.bridge.utils.optional_imports import require

logger = logging.getLogger(__name__)

MONITOR_THREAD_STORE = "nvidia_resiliency_ext.inprocess.monitor_thread:MonitorThread.store"
"""The wrapper's store, held by the monitor thread that calls the abort step (listed in ``utils/upstream.py``)."""
WRAPPER_RESTART_HEALTH_CHECK = "nvidia_resiliency_ext.inprocess.wrap:Wrapper.restart_health_check"
"""The checks a wrapper (nvidia-resiliency-ext >= 0.5) runs after a fault (listed in ``utils/upstream.py``)."""
GPU_RESTART_CHECKS = ("ChainedGPUHealthCheck", "ChainedNVLHealthCheck", "ChainedNicHealthCheck")
"""The checks of ``inprocess.health_check`` that such a wrapper adds for device ``LOCAL_RANK``: they need a GPU."""
QUIET_CPP_LOG_LEVELS = ("error", "fatal")
"""``TORCH_CPP_LOG_LEVEL`` values that keep c10d's store-wait timeout warnings (one per poll while a peer restarts)
out of the logs; any other value is warned about when the wrapper is built."""
CPP_LOG_LEVEL_WARNING = "Set TORCH_CPP_LOG_LEVEL=error to suppress c10d waitForInput timeout warning messages"
"""The warning ``inprocess_restart`` gives when ``TORCH_CPP_LOG_LEVEL`` is not one of :data:`QUIET_CPP_LOG_LEVELS`."""
COORDINATION_STORE_TIMEOUT = datetime.timedelta(seconds=300)
"""How long rank 0 waits for every rank to join the coordination store, and the store's default wait timeout."""
FINALIZE_TIMEOUT = datetime.timedelta(seconds=60)
"""Bound of each finalize step run in its GPU-bound thread; past it the wrapper treats the rank as failed."""
_said_left_out = False
_running: dict[str, "RestartIteration"] = {}
"""The restart iteration now running in this process (the wrapper runs one at a time), for its finalize step."""


@dataclass
class RestartIteration:
    """What one call of the wrapped training function knows about the in-process restart around it."""

    iteration: int
    """0 for the first call, then one more for every in-process restart."""
    ping: Callable[[], None] = lambda: None
    """Tell the progress watchdog this rank made progress (a completed step or save)."""
    store: Optional[dist.Store] = None
    """The coordination store (``MASTER_PORT + 1``), shared by every iteration of this call."""
    store_prefix: str = "mbridge_pg"
    """Key prefix of this call's process groups on :attr:`store`."""
    store_timeout: datetime.timedelta = datetime.timedelta(minutes=30)
    """Timeout of store waits while the process group is built."""
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    """Teardown of what this iteration built; run again by the wrapper's finalize step (each must be idempotent),
    in case the restart interrupted the function's own ``finally``."""

    def process_group_store(self) -> dist.Store:
        """A store for this iteration's default process group: the coordination store under a fresh prefix.

        A restarted iteration must not meet keys the aborted one left behind, so every iteration has its own prefix.
        (The wrapper's own store works too, but creating the model-parallel groups on it took ~10 s, not ~0.1 s.)
        """
        store = dist.PrefixStore(f"{self.store_prefix}_iteration{self.iteration}", self.store)
        store.set_timeout(self.store_timeout)  # a rank waiting on a dead peer here must reach the restart
        return store

    def run_cleanups(self) -> None:
        """Run the registered teardown, newest first; log failures and go on."""
        for fn in reversed(self.cleanups):
            try:
                fn()
            except Exception as err:  # the next iteration rebuilds everything; one failed teardown must not stop it
                logger.warning("in-process restart: teardown %s failed: %s", getattr(fn, "__name__", fn), err)


def begin_iteration(call_wrapper: Any, store: Optional[dist.Store], cfg: InProcessRestartConfig) -> RestartIteration:
    """The :class:`RestartIteration` of the call the wrapper makes now, registered for its finalize step.

    ``call_wrapper`` is nvidia-resiliency-ext's ``CallWrapper`` the wrapper passed in; the iteration is logged and,
    for a restart, its end recorded in the event stream.
    """
    restart = RestartIteration(
        iteration=call_wrapper.iteration,
        ping=call_wrapper.ping,
        store=store,
        store_timeout=_seconds(cfg.soft_timeout),
    )
    _running["iteration"] = restart
    launch = launch_env.current()  # as the wrapper numbered the ranks for this iteration
    if restart.iteration > 0:
        event_stream.emit(EventKind.RESTART_ENDED, layer=RestartLayer.IN_PROCESS, inprocess_iteration=restart.iteration)
    logger.log(
        logging.WARNING if restart.iteration > 0 else logging.INFO,
        "in-process restart: iteration %d starts in pid %d as rank %s of %s",
        restart.iteration,
        os.getpid(),
        launch.rank,
        launch.world_size,
    )
    return restart


def inprocess_restart(train_fn: Callable[..., Any], config: InProcessRestartConfig, global_state: Any) -> Callable:
    """``train_fn`` wrapped in nvidia-resiliency-ext's ``inprocess.Wrapper`` configured from ``config``.

    Every call of the result calls ``train_fn(*args, inprocess_call_wrapper=<CallWrapper>, **kwargs)`` once per
    restart iteration; ``train_fn`` builds every piece of distributed state itself (on the ``store=`` it is given,
    see :func:`begin_iteration`) and tears it down on the way out. Between iterations the wrapper's finalize step
    runs the aborted iteration's teardown again and resets ``global_state`` (:meth:`GlobalState.reset_for_restart`).
    Call the result through :func:`run_wrapped`, which turns the wrapper giving up into a :class:`TrainingExit`.
    """
    if os.environ.get("TORCH_CPP_LOG_LEVEL") not in QUIET_CPP_LOG_LEVELS:
        warnings.warn(CPP_LOG_LEVEL_WARNING)  # noqa: B028 - Megatron-Bridge's call, as its users' filters expect
    inprocess = require("nvidia_resiliency_ext.inprocess")
    from megatron.bridge.training.initialize import abort_distributed

    def finish_iteration() -> None:
        restart = _running.pop("iteration", None)  # let the aborted iteration's objects go before the next one
        if restart is not None:
            restart.run_cleanups()
        global_state.reset_for_restart()  # every handle of the aborted iteration is rebuilt

    def _adapter(*args: Any, inprocess_call_wrapper: Optional[inprocess.CallWrapper] = None, **kwargs: Any) -> Any:
        # The wrapper hands its CallWrapper to the parameter annotated with it; train_fn takes it by this name.
        return train_fn(*args, inprocess_call_wrapper=inprocess_call_wrapper, **kwargs)

    wrapper = build_wrapper(config, finish_iteration, abort_distributed, global_state)
    return wrapper(_adapter)


def maybe_wrap_for_inprocess_restart(
    train_fn: Callable[..., Any], config: Optional[InProcessRestartConfig], state: Any
) -> tuple[Callable[..., Any], Optional[dist.Store]]:
    """``(train_fn, None)``, or with ``config.enabled`` the wrapped function and the coordination store to pass it.

    The store is a ``torch.distributed.TCPStore`` that rank 0 (``RANK``) hosts on ``MASTER_PORT + 1`` for all
    ``WORLD_SIZE`` ranks, reserves included, made before the wrapper renumbers the ranks (a rank renumbered 0 later
    must not host a second one); every restart iteration builds its process groups on it under its own prefix.
    """
    if not is_enabled(config):
        return train_fn, None
    launch = launch_env.current()
    master_addr, master_port = launch.master_endpoint()
    store = torch.distributed.TCPStore(
        host_name=master_addr,
        port=master_port + INPROCESS_COORDINATION_PORT_OFFSET,
        world_size=launch.world_size,
        is_master=launch.rank == 0,
        timeout=COORDINATION_STORE_TIMEOUT,
        wait_for_workers=True,
        use_libuv=True,
    )
    return inprocess_restart(train_fn, config, state), store


def run_wrapped(wrapped: Callable[..., Any], config: InProcessRestartConfig, *args: Any, **kwargs: Any) -> Any:
    """Call a function :func:`maybe_wrap_for_inprocess_restart` wrapped (``config`` is its section).

    Returns its result, or ``ExitCode.FINISHED`` on a warm reserve that never trained.

    Raises:
        TrainingExit: :attr:`ExitCode.INPROCESS_RESTART_EXHAUSTED` when the wrapper gives up (``max_iterations``
            used up, too few healthy ranks, or a rank past ``max_rank_faults``).
    """
    inprocess = require("nvidia_resiliency_ext.inprocess")
    # What exists now (imports, config) lives as long as the process: moved out of the collector's sight, the full
    # collections the wrapper runs between iterations walk only what training built (on a 2-core machine the
    # abort-to-next-iteration time fell from 0.86 s to 0.1 s with this and no second collection of ours).
    gc.freeze()
    try:
        result = wrapped(*args, **kwargs)
    except (inprocess.exception.RestartAbort, inprocess.exception.RestartError) as err:
        raise TrainingExit(ExitCode.INPROCESS_RESTART_EXHAUSTED, _gave_up(config, err)) from err
    finally:
        _running.clear()
    return ExitCode.FINISHED if result is None else result  # None: a reserve rank, never activated


def abort_async_saves(global_state: Any) -> None:
    """Stop this rank's asynchronous checkpoint saves without finalizing them, and reset the writers' results queues.

    The run's async call queue (``global_state.async_calls_queue``) is closed with ``abort=True`` and forgotten; both
    results queues the forked writers report through (megatron-core's and nvidia-resiliency-ext's, which the local
    tier and megatron-core >= 0.17 write through) are reset, so that the next iteration's saves never read a result
    an aborted writer left behind: the next checkpoint manager installs fresh ones.
    """
    queue = getattr(global_state, "async_calls_queue", None)
    try:
        if queue is not None:
            queue.close(abort=True)
    except Exception as err:  # noqa: BLE001 - a half-closed queue must not stop the restart
        logger.warning("in-process restart: closing the async checkpoint queue failed: %s", err)
    finally:
        if global_state is not None:
            global_state.async_calls_queue = None
        async_writer.reset_results_queues()


def _gave_up(cfg: InProcessRestartConfig, err: BaseException) -> str:
    cause = err.__cause__ or err.__context__
    detail = f"{type(err).__name__}: {err}" + (f" (caused by {type(cause).__name__}: {cause})" if cause else "")
    return (
        f"in-process restart gave up ({detail}); inprocess_restart.max_iterations={cfg.max_iterations}, "
        f"max_rank_faults={cfg.max_rank_faults}. Under ft_launcher the job restarts in-job from the newest checkpoint"
    )


def build_wrapper(
    cfg: InProcessRestartConfig,
    teardown: Callable[[], None],
    abort_process_groups: Callable[[], None],
    global_state: Any = None,
) -> Any:
    """The ``inprocess.Wrapper`` for ``cfg``; its finalize step calls ``teardown()`` (the aborted iteration's).

    ``abort_process_groups()`` must abort every process group of this rank, closing its connections (the wrapper
    calls it from its monitor thread when any rank fails, to free ranks blocked in collectives); the abort step then
    aborts the asynchronous saves of ``global_state`` (:func:`abort_async_saves`).
    """
    inprocess = require("nvidia_resiliency_ext.inprocess")

    class AbortProcessGroups(inprocess.abort.Abort):
        """Abort: abort every process group (closing its connections) so that every blocked collective fails."""

        def __call__(self, state: Any) -> Any:
            _report_interruption(state)
            abort_process_groups()
            return state

    class AbortCheckpoint(inprocess.abort.Abort):
        """Abort: stop the asynchronous checkpoint saves and reset the writers' results queues."""

        def __call__(self, state: Any) -> Any:
            abort_async_saves(global_state)
            return state

    class WhereCudaRuns(inprocess.finalize.Finalize):
        """Finalize: ``ThreadedFinalize`` (a thread bound to the rank's GPU) where CUDA is initialized.

        Elsewhere its function runs in the calling thread (``ThreadedFinalize`` refuses to run without CUDA).
        """

        def __init__(self, threaded: Any) -> None:
            self.threaded = threaded

        def __call__(self, state: Any) -> Any:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                return self.threaded(state)
            self.threaded.fn(*self.threaded.args, **self.threaded.kwargs)
            return state

    class PromptTCPStore(inprocess.store.TCPStore):
        """The wrapper's store; a rank that does not host it connects once the host listens.

        torch's store client retries a refused connection after a growing delay: started with the host (ranks
        forked together after an in-job restart) it waited 0.3-0.7 s for a host that was up after 0.05 s.
        """

        def __init__(self, **kwargs: Any) -> None:
            launch = launch_env.current()  # as the wrapper numbered the ranks
            if launch.rank != self.TCP_STORE_HOST_RANK:
                host = kwargs.get("host_name") or launch.master_endpoint()[0]
                _wait_until_listening(host, int(kwargs["port"]), kwargs["timeout"].total_seconds())
            super().__init__(**kwargs)

    def finalize_step(fn: Callable[[], None]) -> Any:
        return WhereCudaRuns(inprocess.finalize.ThreadedFinalize(timeout=FINALIZE_TIMEOUT, fn=fn))

    finalize = [finalize_step(teardown)]
    if cfg.empty_cuda_cache:
        finalize.append(finalize_step(_empty_cuda_cache))
    # The CUDA context check synchronizes with the GPU where CUDA is initialized, and does nothing elsewhere.
    health_checks = [
        inprocess.health_check.FaultCounter(max_rank_faults=cfg.max_rank_faults),
        inprocess.health_check.CudaHealthCheck(timeout=_seconds(10)),
    ]
    launch = launch_env.current()
    active = cfg.active_world_size or launch.world_size
    master_port = launch.store_port()
    wrapper = inprocess.Wrapper(
        store_factory=PromptTCPStore,
        store_kwargs={
            "port": master_port + INPROCESS_STORE_PORT_OFFSET,
            "timeout": _seconds(cfg.barrier_timeout),
        },
        initialize=inprocess.Compose(
            inprocess.initialize.RetryController(
                max_iterations=None if cfg.max_iterations is None else cfg.max_iterations + 1,
                min_world_size=active,
                min_active_world_size=active,
            ),
            inprocess.nested_restarter.NestedRestarterHandlingCompleted(),
        ),
        abort=inprocess.Compose(
            inprocess.abort.AbortTransformerEngine(),  # its userbuffers (does nothing without TransformerEngine)
            AbortProcessGroups(),
            AbortCheckpoint(),
            inprocess.nested_restarter.NestedRestarterHandlingStarting(),
        ),
        finalize=inprocess.Compose(*finalize),
        health_check=inprocess.Compose(*health_checks),
        completion=inprocess.nested_restarter.NestedRestarterFinalized(),
        terminate=inprocess.nested_restarter.NestedRestarterAborted(),
        rank_assignment=inprocess.rank_assignment.Tree(layers=_layers(inprocess, cfg, active)),
        monitor_thread_interval=_seconds(cfg.monitor_thread_interval),
        monitor_process_interval=_seconds(cfg.monitor_process_interval),
        progress_watchdog_interval=_seconds(cfg.progress_watchdog_interval),
        last_call_wait=_seconds(cfg.last_call_wait),
        termination_grace_time=_seconds(cfg.termination_grace_time),
        soft_timeout=_seconds(cfg.soft_timeout),
        hard_timeout=_seconds(cfg.hard_timeout),
        heartbeat_interval=_seconds(cfg.heartbeat_interval),
        heartbeat_timeout=_seconds(cfg.heartbeat_timeout),
        barrier_timeout=_seconds(cfg.barrier_timeout),
        completion_timeout=_seconds(cfg.completion_timeout),
        monitor_process_logfile=monitor_process_logfile(cfg.monitor_process_logdir),
        enabled=True,
    )
    if not visible_gpu():
        _say_left_out(_leave_out_gpu_restart_checks(inprocess, wrapper))
    return wrapper


def monitor_process_logfile(logdir: Optional[str]) -> Optional[str]:
    """The monitor-process log file of this rank in ``logdir`` (created), or ``None`` (no log).

    Under Slurm (``SLURM_PROCID`` set) only the job's rank 0 logs, to ``monitor_<job>_<host>_<rank>_<local rank>.log``
    (one file per job, whatever its size). Elsewhere every rank logs, to ``monitor_process_<rank>.log`` (the wrapper
    fills in the rank).
    """
    if logdir is None:
        return None
    launch = launch_env.current()
    if launch.slurm_procid is not None and launch.slurm_procid != 0:
        return None
    os.makedirs(logdir, exist_ok=True)
    if launch.slurm_procid is None:
        name = "monitor_process_{rank}.log"
    else:
        name = f"monitor_{launch.job_id}_{socket.gethostname()}_{launch.slurm_procid}_{launch.slurm_localid}.log"
    return os.path.join(os.path.abspath(logdir), name)


def _seconds(value: float) -> datetime.timedelta:
    """A duration of ``value`` seconds (any real number: an int from an override, a float from the config)."""
    return datetime.timedelta(seconds=float(value))


def _empty_cuda_cache() -> None:
    """Free the aborted iteration's cached CUDA blocks (where CUDA is initialized)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()  # the aborted iteration's tensors, so that their cached blocks can be released
        torch.cuda.empty_cache()
    # Otherwise the wrapper's own collection before the next iteration frees them (a second one here cost 0.35 s of
    # every restart on a 2-core machine).


def _leave_out_gpu_restart_checks(inprocess: Any, wrapper: Any) -> list[str]:
    """Take the wrapper's own GPU, NVLink and NIC checks out of its restart checks; return their class names.

    For a node without a GPU. nvidia-resiliency-ext >= 0.5 runs ``restart_health_check`` after every fault: our
    ``health_check`` plus these checks of GPU ``LOCAL_RANK``, which it adds whenever ``LOCAL_RANK`` is set. Without
    a GPU (no NVML) the GPU check fails and the NVLink check raises, so every restart would end the wrapper (exit
    22). Older releases have neither: nothing to do.
    """
    attr = WRAPPER_RESTART_HEALTH_CHECK.rsplit(".", 1)[-1]
    composed = getattr(wrapper, attr, None)
    gpu_classes = tuple(
        cls for name in GPU_RESTART_CHECKS if isinstance(cls := getattr(inprocess.health_check, name, None), type)
    )
    if composed is None or not gpu_classes:
        return []
    checks = getattr(composed, "instances", (composed,))
    dropped = [type(check).__name__ for check in checks if isinstance(check, gpu_classes)]
    if dropped:
        kept = [check for check in checks if not isinstance(check, gpu_classes)]
        setattr(wrapper, attr, inprocess.Compose(*kept) if kept else None)
    return dropped


def _say_left_out(left_out: list[str]) -> None:
    """Log, once per process, which health checks were left out for want of a GPU, and why."""
    global _said_left_out
    if not left_out or _said_left_out:
        return
    _said_left_out = True
    logger.info(
        "in-process restart: left out the health checks that need a GPU (%s): this node has no GPU (CUDA counts "
        "none, no /dev/nvidia<N>); nvidia-resiliency-ext's NVML and NIC errors logged while it built them are "
        "expected here",
        ", ".join(left_out),
    )


def _wait_until_listening(host: str, port: int, timeout: float, poll: float = 0.01) -> None:
    """Return once ``host:port`` accepts a connection, or after ``timeout`` seconds.

    After the timeout the caller's own connect fails with its own error.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=max(poll, 1.0)).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                return
            time.sleep(poll)


def _layers(inprocess: Any, cfg: InProcessRestartConfig, active: int) -> list[Any]:
    """Rank-assignment layers: ``active`` ranks work, the rest wait as reserves; per node with ``"node"``."""
    ra = inprocess.rank_assignment
    layers = [ra.Layer(min_ranks=active, max_ranks=active, flag=ra.LayerFlag.RESERVE)]
    if cfg.granularity == "node":
        # Ranks per host: the launcher's count, else one per GPU.
        per_node = launch_env.current().local_world_size or torch.cuda.device_count() or 1
        layers.append(
            ra.Layer(
                min_ranks=per_node,
                max_ranks=per_node,
                key_or_fn=lambda _: socket.gethostname(),
                flag=ra.LayerFlag.RESERVE,
            )
        )
    return layers


def _report_interruption(state: Any) -> None:
    """Events for an in-process restart about to begin: each rank's interruption (its cause), then the restart.

    The wrapper's monitor thread calls the abort step right after it locked the interruption records in the
    wrapper's store (its own ``store``): they are read back from there, typed.
    """
    store = getattr(threading.current_thread(), MONITOR_THREAD_STORE.rsplit(".", 1)[-1], None)
    try:
        records = store.get_interruption_records() if store is not None else []
    except Exception:  # noqa: BLE001 - observation only: a store gone with a dead host must not stop the restart
        records = []
    for record in records:
        event_stream.emit(
            EventKind.FAULT_DETECTED,
            mechanism=event_stream.inprocess_mechanism(record.interruption),
            rank=record.rank,
            local_rank=None,
            detail=f"{record.interruption} on rank {record.rank}",
        )
    event_stream.emit(EventKind.RESTART_BEGUN, layer=RestartLayer.IN_PROCESS, inprocess_iteration=state.iteration + 1)
