"""In-process restart: rerun the training function in the same processes after a rank fault.

nvidia-resiliency-ext's ``inprocess.Wrapper`` watches every rank (a monitor thread and a monitor process per rank,
heartbeats through a TCP store hosted by rank 0). When a rank raises, stops making progress for ``soft_timeout``
seconds, or dies, every healthy rank aborts its process groups and calls the wrapped function again: no new
processes, no new interpreter, no re-import. Each call here is one *restart iteration*: the training function
builds the process group (on a fresh store prefix), the model-parallel groups, the re-run state machine and the
checkpoint workers from scratch and resumes from the newest verified checkpoint; on the way out, and once more in
the wrapper's ``finalize`` step, everything it built is torn down.

Mapping of :class:`InProcessRestartConfig` onto the wrapper (every field reaches it):

- ``active_world_size`` and ``granularity``: the rank-assignment tree (a root layer of ``active_world_size`` active
  ranks, the rest warm reserves; with ``"node"`` a second layer per host, so a fault retires the whole node);
- ``max_iterations``: a retry controller that allows that many restarts, then aborts the wrapper (the processes
  exit with :attr:`ExitCode.INPROCESS_RESTART_EXHAUSTED`, and an outer ``ft_launcher`` takes over when nested);
- ``soft_timeout``/``hard_timeout``/``heartbeat_*``/``barrier_timeout``/``completion_timeout``: the wrapper's
  timeouts of the same names;
- ``empty_cuda_cache``: the finalize step empties the CUDA cache (where CUDA is initialized);
- ``max_rank_faults``: a fault-counting health check that retires a rank past that many faults;
- ``monitor_process_logdir``: one monitor-process log per rank in that directory.

Health checks, before every iteration and after every fault: the fault counter, and the CUDA context check where
CUDA is available. nvidia-resiliency-ext >= 0.5 adds its own GPU (NVML), NVLink and NIC checks of GPU ``LOCAL_RANK``
to those after a fault. On a node without a GPU they fail (no NVML) and would end the wrapper at the first restart,
so there they are left out, decided when the wrapper is built; each rank names what it left out, and why, in one
log line. On a node with a GPU they all run.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.bridge.training import event_stream
from megatron.bridge.training.config import INPROCESS_STORE_PORT_OFFSET, InProcessRestartConfig
from megatron.bridge.training.device_health import visible_gpu
from megatron.bridge.training.event_stream import EventKind, RestartLayer
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.utils.optional_imports import require

logger = logging.getLogger(__name__)

MONITOR_THREAD_STORE = "nvidia_resiliency_ext.inprocess.monitor_thread:MonitorThread.store"
"""The wrapper's store, held by the monitor thread that calls the abort step (listed in ``utils/upstream.py``)."""
WRAPPER_RESTART_HEALTH_CHECK = "nvidia_resiliency_ext.inprocess.wrap:Wrapper.restart_health_check"
"""The checks a wrapper (nvidia-resiliency-ext >= 0.5) runs after a fault (listed in ``utils/upstream.py``)."""
GPU_RESTART_CHECKS = ("ChainedGPUHealthCheck", "ChainedNVLHealthCheck", "ChainedNicHealthCheck")
"""The checks of ``inprocess.health_check`` that such a wrapper adds for device ``LOCAL_RANK``: they need a GPU."""
_said_left_out = False


@dataclass
class RestartIteration:
    """What one call of the wrapped training function knows about the in-process restart around it."""

    iteration: int
    """0 for the first call, then one more for every in-process restart."""
    ping: Callable[[], None] = lambda: None
    """Tell the progress watchdog this rank made progress (a completed step or save)."""
    store: Optional[dist.Store] = None
    """The launcher's rendezvous store, shared by every iteration of this call."""
    store_prefix: str = ""
    """Key prefix of this call (a process may call the wrapped function more than once)."""
    store_timeout: datetime.timedelta = datetime.timedelta(minutes=30)
    """Timeout of store waits while the process group is built."""
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    """Teardown of what this iteration built; run again by the wrapper's finalize step (each must be idempotent),
    in case the restart interrupted the function's own ``finally``."""

    def process_group_store(self) -> dist.Store:
        """A store for this iteration's default process group: the launcher's store under a fresh prefix.

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


def wrap(
    fn: Callable[..., Any], cfg: InProcessRestartConfig, abort_process_groups: Callable[[], None]
) -> Callable[..., Any]:
    """``fn`` wrapped for in-process restart; ``fn`` receives ``restart=RestartIteration(...)`` on every call.

    ``abort_process_groups()`` must abort every process group of this rank, closing its connections (the wrapper
    calls it from its monitor thread when any rank fails, to free ranks blocked in collectives).

    The returned function raises :class:`TrainingExit` with :attr:`ExitCode.INPROCESS_RESTART_EXHAUSTED` when the
    wrapper gives up (``max_iterations`` used up, too few healthy ranks, or a rank past ``max_rank_faults``); a warm
    reserve that never trained returns :attr:`ExitCode.FINISHED` when the others finish.
    """
    inprocess = require("nvidia_resiliency_ext.inprocess")
    current: dict[str, RestartIteration] = {}
    calls = [0]

    def run(*args: Any, call_wrapper: Optional[inprocess.CallWrapper] = None, store: Any = None, **kwargs: Any) -> Any:
        restart = RestartIteration(
            iteration=call_wrapper.iteration,
            ping=call_wrapper.ping,
            store=store,
            store_prefix=f"mbridge_pg_call{calls[0]}",
            store_timeout=datetime.timedelta(seconds=cfg.soft_timeout),
        )
        current["iteration"] = restart
        if restart.iteration > 0:
            event_stream.emit(
                EventKind.RESTART_ENDED, layer=RestartLayer.IN_PROCESS, inprocess_iteration=restart.iteration
            )
        logger.log(
            logging.WARNING if restart.iteration > 0 else logging.INFO,
            "in-process restart: iteration %d starts in pid %d as rank %s of %s",
            restart.iteration,
            os.getpid(),
            os.environ.get("RANK"),
            os.environ.get("WORLD_SIZE"),
        )
        return fn(*args, restart=restart, **kwargs)

    def finalize() -> None:
        restart = current.pop("iteration", None)  # let the aborted iteration's objects go before the next one
        if restart is not None:
            restart.run_cleanups()

    wrapped = build_wrapper(cfg, finalize, abort_process_groups)(run)

    def guarded(*args: Any, store: Optional[dist.Store] = None, **kwargs: Any) -> Any:
        calls[0] += 1
        if store is None:
            # The store env:// would use, created once per call with the ranks the launcher gave (reserves
            # included), before the wrapper renumbers ranks: a rank renumbered 0 later must not host a second one.
            store, _, _ = next(dist.rendezvous("env://", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])))
        # What exists now (imports, config) lives as long as the process: moved out of the collector's sight, the
        # full collections the wrapper runs between iterations walk only what training built (on a 2-core machine
        # the abort-to-next-iteration time fell from 0.86 s to 0.1 s with this and no second collection of ours).
        gc.freeze()
        try:
            result = wrapped(*args, store=store, **kwargs)
        except inprocess.exception.RestartAbort as err:
            raise TrainingExit(ExitCode.INPROCESS_RESTART_EXHAUSTED, _gave_up(cfg, err)) from err
        except inprocess.exception.RestartError as err:
            raise TrainingExit(ExitCode.INPROCESS_RESTART_EXHAUSTED, _gave_up(cfg, err)) from err
        finally:
            current.clear()
        return ExitCode.FINISHED if result is None else result  # None: a reserve rank, never activated

    return guarded


def inprocess_restart(train_fn: Callable[..., Any], config: InProcessRestartConfig, global_state: Any) -> Callable:
    """``train_fn`` wrapped for in-process restart; every restart iteration starts from a reset ``global_state``.

    ``train_fn(*args, restart=RestartIteration(...), **kwargs)`` must build every piece of distributed state itself
    and tear it down on the way out (see :func:`wrap`).
    """
    from megatron.bridge.training.initialize import abort_distributed

    def fresh_start(*args: Any, restart: RestartIteration, **kwargs: Any) -> Any:
        if restart.iteration > 0:
            global_state.reset_for_restart()  # every handle of the aborted iteration is rebuilt
        return train_fn(*args, restart=restart, **kwargs)

    return wrap(fresh_start, config, abort_process_groups=abort_distributed)


def maybe_wrap_for_inprocess_restart(
    train_fn: Callable[..., Any], config: Optional[InProcessRestartConfig], state: Any
) -> tuple[Callable[..., Any], Optional[dist.Store]]:
    """``(train_fn, None)``, or with ``config.enabled`` the wrapped function and the store to call it with.

    The store is ``None`` here either way: each call of the wrapped function makes its own from the launcher's
    ``MASTER_ADDR``/``MASTER_PORT`` (``env://``); a store passed as ``store=`` is used instead.
    """
    if config is None or not config.enabled:
        return train_fn, None
    return inprocess_restart(train_fn, config, state), None


def _gave_up(cfg: InProcessRestartConfig, err: BaseException) -> str:
    cause = err.__cause__ or err.__context__
    detail = f"{type(err).__name__}: {err}" + (f" (caused by {type(cause).__name__}: {cause})" if cause else "")
    return (
        f"in-process restart gave up ({detail}); inprocess_restart.max_iterations={cfg.max_iterations}, "
        f"max_rank_faults={cfg.max_rank_faults}. Under ft_launcher the job restarts in-job from the newest checkpoint"
    )


def build_wrapper(
    cfg: InProcessRestartConfig, teardown: Callable[[], None], abort_process_groups: Callable[[], None]
) -> Any:
    """The ``inprocess.Wrapper`` for ``cfg``; its finalize step calls ``teardown()`` (the aborted iteration's)."""
    inprocess = require("nvidia_resiliency_ext.inprocess")
    seconds = datetime.timedelta

    class AbortProcessGroups(inprocess.abort.Abort):
        """Abort: abort every process group (closing its connections) so that every blocked collective fails."""

        def __call__(self, state: Any) -> Any:
            _report_interruption(state)
            abort_process_groups()
            return state

    class Teardown(inprocess.finalize.Finalize):
        """Finalize: tear down what the aborted iteration built, free memory, before the health check."""

        def __call__(self, state: Any) -> Any:
            teardown()
            if cfg.empty_cuda_cache and torch.cuda.is_available() and torch.cuda.is_initialized():
                gc.collect()  # the aborted iteration's tensors, so that their cached blocks can be released
                torch.cuda.empty_cache()
            # Otherwise the wrapper's own collection before the next iteration frees them (a second one here cost
            # 0.35 s of every restart on a 2-core machine).
            return state

    class PromptTCPStore(inprocess.store.TCPStore):
        """The wrapper's store; a rank that does not host it connects once the host listens.

        torch's store client retries a refused connection after a growing delay: started with the host (ranks
        forked together after an in-job restart) it waited 0.3-0.7 s for a host that was up after 0.05 s.
        """

        def __init__(self, **kwargs: Any) -> None:
            if int(os.environ["RANK"]) != self.TCP_STORE_HOST_RANK:
                host = kwargs.get("host_name") or os.environ["MASTER_ADDR"]
                _wait_until_listening(host, int(kwargs["port"]), kwargs["timeout"].total_seconds())
            super().__init__(**kwargs)

    health_checks = [inprocess.health_check.FaultCounter(max_rank_faults=cfg.max_rank_faults)]
    left_out = []
    if torch.cuda.is_available():  # needs a GPU: on a CPU machine there is no device to synchronize with
        health_checks.append(inprocess.health_check.CudaHealthCheck(timeout=seconds(seconds=10)))
    else:
        left_out.append("CudaHealthCheck")
    initial_world_size = int(os.environ.get("WORLD_SIZE", "1"))
    active = cfg.active_world_size or initial_world_size
    log_file = None
    if cfg.monitor_process_logdir is not None:
        os.makedirs(cfg.monitor_process_logdir, exist_ok=True)
        log_file = os.path.join(os.path.abspath(cfg.monitor_process_logdir), "monitor_process_{rank}.log")
    master_port = int(os.environ["MASTER_PORT"])
    wrapper = inprocess.Wrapper(
        store_factory=PromptTCPStore,
        store_kwargs={
            "port": master_port + INPROCESS_STORE_PORT_OFFSET,
            "timeout": seconds(seconds=cfg.barrier_timeout),
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
            AbortProcessGroups(),
            inprocess.nested_restarter.NestedRestarterHandlingStarting(),
        ),
        finalize=Teardown(),
        health_check=inprocess.Compose(*health_checks),
        completion=inprocess.nested_restarter.NestedRestarterFinalized(),
        terminate=inprocess.nested_restarter.NestedRestarterAborted(),
        rank_assignment=inprocess.rank_assignment.Tree(layers=_layers(inprocess, cfg, active)),
        monitor_thread_interval=seconds(seconds=cfg.monitor_thread_interval),
        monitor_process_interval=seconds(seconds=cfg.monitor_process_interval),
        progress_watchdog_interval=seconds(seconds=cfg.progress_watchdog_interval),
        last_call_wait=seconds(seconds=cfg.last_call_wait),
        termination_grace_time=seconds(seconds=cfg.termination_grace_time),
        soft_timeout=seconds(seconds=cfg.soft_timeout),
        hard_timeout=seconds(seconds=cfg.hard_timeout),
        heartbeat_interval=seconds(seconds=cfg.heartbeat_interval),
        heartbeat_timeout=seconds(seconds=cfg.heartbeat_timeout),
        barrier_timeout=seconds(seconds=cfg.barrier_timeout),
        completion_timeout=seconds(seconds=cfg.completion_timeout),
        monitor_process_logfile=log_file,
    )
    gpu = visible_gpu()
    if not gpu:
        left_out += _leave_out_gpu_restart_checks(inprocess, wrapper)
    _say_left_out(left_out, gpu)
    return wrapper


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


def _say_left_out(left_out: list[str], gpu: str) -> None:
    """Log, once per process, which health checks were left out for want of a GPU, and why."""
    global _said_left_out
    if not left_out or _said_left_out:
        return
    _said_left_out = True
    why = f"CUDA is not available ({gpu})" if gpu else "this node has no GPU (CUDA counts none, no /dev/nvidia<N>)"
    built = any(name in GPU_RESTART_CHECKS for name in left_out)
    logger.info(
        "in-process restart: left out the health checks that need a GPU (%s): %s%s",
        ", ".join(left_out),
        why,
        "; nvidia-resiliency-ext's NVML and NIC errors logged while it built them are expected here" if built else "",
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
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
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
