"""Hang and crash detection through nvidia-resiliency-ext's rank monitor (the process must run under ft_launcher).

Each rank reports sections to its rank monitor through ``global_state.rank_monitor_client``: ``setup`` (from
:func:`setup` to the first training or evaluation step), ``step`` (one training or evaluation step, after the first
:data:`_NUM_WARMUP_ITERS` of each: the first steps compile and warm caches, and the ``step`` timeout should stay
short), ``checkpointing`` (one save), and implicitly the time out of any section. When a section stays open longer
than its timeout, the monitor kills the rank and ft_launcher restarts the workers, which resume from the newest
verified checkpoint. Launch with matching section names::

    ft_launcher --ft-rank-section-timeouts=setup:600,step:180,checkpointing:420 \
        --ft-rank-out-of-section-timeout=300 ...

The module functions are Megatron-Bridge's API, and the ones the training loop calls (``pretrain.py``, through
:class:`FaultToleranceCallback`); each is a no-op while no client is connected (fault tolerance off). Beyond it:

- if the launcher has no timeouts for these sections, heartbeats are sent instead, and under in-process restart the
  hang timeouts are kept at least its ``hard_timeout`` (``health/rank_monitor_client.py``,
  :func:`keep_timeouts_at_least`);
- if the rank monitor dies first (a scheduler signals every process of the job), the rank warns and goes on without
  it, so that it can still save its checkpoint;
- :func:`report_exit`: a finished run, or one ending with a code whose action is *stop*, is neither restarted by
  ft_launcher nor requeued by the job script.

With ``ft.calc_ft_timeouts``, timeouts are computed from what this run observed (the launcher's safety factor times
the longest time seen) after every checkpoint save and at the end of the run, each as soon as enough was seen
(:func:`_maybe_update_timeouts`), written atomically to ``ft_state.json`` in ``checkpoint.save`` and loaded from there
by the next run.
"""

import functools
import io
import json
import logging
import os
import random
from typing import Any, Optional

from megatron.bridge.training.components import Component, Run
from megatron.bridge.training.config import ConfigContainer, is_enabled
from megatron.bridge.training.exit_codes import STOP_CODES, ExitCode, exit_code_of
from megatron.bridge.training.faults import injection as fault_injection
from megatron.bridge.training.faults.injection import Fault
from megatron.bridge.training.health.rank_monitor_client import LayeredClient, describe, missing_sections, timeout_of
from megatron.bridge.utils.common_utils import get_rank_safe, get_world_size_safe, print_rank_0
from megatron.bridge.utils.fs import atomic_write

logger = logging.getLogger(__name__)

_NUM_WARMUP_ITERS: int = 1
"""Training (and evaluation) steps of each run (and each evaluation) left out of the ``step`` section."""
_MIN_ITERS_FOR_STEP_TIMEOUT_UPDATE: int = 16
"""Training steps a run must have seen before the ``step`` timeout is learned from it."""
STATE_FILE = "ft_state.json"


def setup(config: ConfigContainer, global_state: Any) -> None:
    """Connect this rank to its rank monitor, restore learned timeouts and open the ``setup`` section.

    Called when ``ft.enable_ft_package`` is on, at the start of each run (each in-process restart iteration
    reconnects: a client still connected from the last one is disconnected first).

    Raises:
        ValueError: ``checkpoint.save`` is not set (learned timeouts are kept there).
    """
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

    print_rank_0("[FaultTolerance] connecting to the rank monitor")
    checkpoint_dir = config.checkpoint.save
    if not checkpoint_dir:
        raise ValueError(
            "checkpointing save dir must be set to enable fault tolerance: set checkpoint.save "
            f"(the learned timeouts are kept there, in {STATE_FILE})"
        )
    if get_rank_safe() == 0 and not os.path.exists(checkpoint_dir):
        os.makedirs(checkpoint_dir, exist_ok=True)  # the timeouts may be saved before the first checkpoint

    previous = global_state.rank_monitor_client
    if previous is not None and previous.is_initialized:
        previous.shutdown_workload_monitoring()
    client = RankMonitorClient()
    global_state.rank_monitor_client = client

    ft_state = global_state.fault_tolerance_state
    ft_state.ft_state_path = os.path.join(checkpoint_dir, STATE_FILE)
    ft_state.is_async_chkpt_enabled = config.checkpoint.async_save
    ft_state.is_calculating_timeouts = config.ft.calc_ft_timeouts
    # What the counters count is what this client observes: a new client (an in-process restart) starts over.
    ft_state.seen_tr_iters_cnt = ft_state.seen_checkpoints_cnt = ft_state.curr_eval_iter_idx = 0
    ft_state.is_persistent_chkpt_loaded = False

    client.init_workload_monitoring()
    missing = missing_sections(client)
    if missing:
        logger.warning(
            "[FaultTolerance] ft_launcher has no timeouts for sections %s; sending heartbeats instead. For section "
            "monitoring launch with --ft-rank-section-timeouts=setup:600,step:180,checkpointing:420",
            missing,
        )
        global_state.rank_monitor_client = LayeredClient(client, heartbeats=True, rank=get_rank_safe())
    print_rank_0(describe(global_state.rank_monitor_client, "from the launcher"))
    _load_state_if_exists(global_state)

    global_state.rank_monitor_client.start_section("setup")
    ft_state.is_setup_section_open = True


def keep_timeouts_at_least(global_state: Any, seconds: float) -> None:
    """Keep the hang timeouts at least ``seconds`` from now on (in-process restart's ``hard_timeout``).

    Call it after :func:`setup`; a no-op while no client is connected. See ``health/rank_monitor_client.py``.
    """
    client = global_state.rank_monitor_client
    if client is None:
        return
    if not isinstance(client, LayeredClient):
        client = LayeredClient(client, rank=get_rank_safe())
        global_state.rank_monitor_client = client
    client.keep_at_least(seconds)


def _send(global_state: Any, method: str, *args: Any) -> None:
    """Call ``method`` of the client; if the rank monitor is gone, warn and go on without it.

    The monitor is a process of the launcher's. When a scheduler signals every process of a job step (Slurm does),
    the monitor dies while this rank may still have a checkpoint to save: failing here would lose it.
    """
    client = global_state.rank_monitor_client
    if client is None:
        return
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_client import RankMonitorClientError

    try:
        getattr(client, method)(*args)
    except RankMonitorClientError as err:
        global_state.rank_monitor_client = None
        logger.warning(
            "[FaultTolerance] the rank monitor is gone (%s); continuing without hang detection so that this rank "
            "can finish its work (normal while the job is being stopped)",
            err,
        )


def _end_setup(global_state: Any) -> None:
    ft_state = global_state.fault_tolerance_state
    if ft_state.is_setup_section_open:
        _send(global_state, "end_section", "setup")
        ft_state.is_setup_section_open = False


def on_training_step_start(global_state: Any) -> None:
    """Close ``setup`` if still open (the first step), then open ``step`` (after the warm-up steps)."""
    if global_state.rank_monitor_client is None:
        return
    ft_state = global_state.fault_tolerance_state
    _end_setup(global_state)
    if ft_state.seen_tr_iters_cnt >= _NUM_WARMUP_ITERS:
        _send(global_state, "start_section", "step")
    ft_state.curr_eval_iter_idx = 0  # training goes on: the next evaluation warms up again


def on_training_step_end(global_state: Any) -> None:
    """Close ``step`` (after the warm-up steps) and count the step."""
    if global_state.rank_monitor_client is None:
        return
    ft_state = global_state.fault_tolerance_state
    if ft_state.seen_tr_iters_cnt >= _NUM_WARMUP_ITERS:
        _send(global_state, "end_section", "step")
    ft_state.seen_tr_iters_cnt += 1


def on_eval_step_start(global_state: Any) -> None:
    """Close ``setup`` if still open (an evaluation before any training), then open ``step`` after the warm-up."""
    if global_state.rank_monitor_client is None:
        return
    _end_setup(global_state)
    if global_state.fault_tolerance_state.curr_eval_iter_idx >= _NUM_WARMUP_ITERS:
        _send(global_state, "start_section", "step")


def on_eval_step_end(global_state: Any) -> None:
    """Close ``step`` (after the warm-up) and count the evaluation step."""
    if global_state.rank_monitor_client is None:
        return
    ft_state = global_state.fault_tolerance_state
    if ft_state.curr_eval_iter_idx >= _NUM_WARMUP_ITERS:
        _send(global_state, "end_section", "step")
    ft_state.curr_eval_iter_idx += 1


def on_checkpointing_start(global_state: Any) -> None:
    """Open the ``checkpointing`` section."""
    _send(global_state, "start_section", "checkpointing")


def on_checkpointing_end(is_async_finalization: bool, global_state: Any) -> None:
    """Close ``checkpointing``; after a save (not an async save's finalization) count it and maybe learn timeouts.

    Learning is a collective (every rank passes here at the same save).
    """
    _send(global_state, "end_section", "checkpointing")
    if not is_async_finalization:
        global_state.fault_tolerance_state.seen_checkpoints_cnt += 1
        _maybe_update_timeouts(global_state)


def on_checkpoint_loaded(is_local_chkpt: bool, global_state: Any) -> None:
    """Record which tier the run resumed from: only a global (persistent) load makes ``setup`` worth learning.

    A local checkpoint loads fast; a ``setup`` timeout learned from it would be too short for a global load.
    """
    global_state.fault_tolerance_state.is_persistent_chkpt_loaded = not is_local_chkpt


def shutdown(global_state: Any) -> None:
    """After a run that ended normally: learn the timeouts of the whole run, end all sections, disconnect.

    ``setup`` is closed first if no step closed it (a resumed run with nothing left to train): its time is then
    known, and can be learned. Learning is a collective: every rank must call this (use :func:`abort` on a failure).
    """
    if global_state.rank_monitor_client is not None:
        print_rank_0("[FaultTolerance] closing")
        _end_setup(global_state)
        _maybe_update_timeouts(global_state, is_closing_ft=True)
        _send(global_state, "end_all_sections")
        client = global_state.rank_monitor_client
        if client is not None:
            client.shutdown_workload_monitoring()
        print_rank_0("[FaultTolerance] closed")
    global_state.rank_monitor_client = None


def abort(global_state: Any) -> None:
    """Disconnect after a failure, without learning timeouts (a collective; the peers may be stuck); idempotent."""
    client = global_state.rank_monitor_client
    try:
        if client is not None:
            client.shutdown_workload_monitoring()
    finally:
        global_state.rank_monitor_client = None


def section_timeout(global_state: Any, section: str) -> Optional[float]:
    """Seconds the rank monitor lets ``section`` stay open before it kills the rank (``None``: none, or FT off)."""
    client = global_state.rank_monitor_client
    return None if client is None else timeout_of(client, section)


def report_exit(global_state: Any, code: ExitCode) -> None:
    """Tell the launcher and the job script whether to start the workload again (also with fault tolerance off).

    nemo_run's fault-tolerant Slurm script requeues the job after every run unless the file named by
    ``$FAULT_TOL_FINISHED_FLAG_FILE`` exists; ft_launcher restarts failed workers unless a rank asked it to shut the
    workload down. Neither is wanted when training finished (rank 0 writes the file) or when any rank ends with a
    code whose action is *stop* (:data:`STOP_CODES`: a restart would meet the same full disk, bad config or
    reproducible NaN; that rank writes the file and asks ft_launcher not to restart).
    """
    stop = code in STOP_CODES
    client = global_state.rank_monitor_client
    if stop and client is not None:  # first: the flag's write may fail (ENOSPC)
        from nvidia_resiliency_ext.fault_tolerance.data import WorkloadAction, WorkloadControlRequest

        request = WorkloadControlRequest(WorkloadAction.ShutdownWorkload, f"exit code {int(code)} ({code.name})")
        try:
            client.send_workload_control_request(request)
            logger.warning("[FaultTolerance] asked ft_launcher not to restart the workers: %s", request.description)
        except Exception as err:  # no IPC to the launcher (or it is gone): the exit code still says stop
            logger.warning("[FaultTolerance] could not ask the launcher to stop: %s", err)
    flag = os.environ.get("FAULT_TOL_FINISHED_FLAG_FILE")
    if flag and (stop or (code == ExitCode.FINISHED and get_rank_safe() == 0)):
        try:
            atomic_write(flag, f"training ended with exit code {int(code)} ({code.name})\n")
            logger.info("[FaultTolerance] wrote %s: the job will not be requeued", flag)
        except OSError as err:  # on the full or broken storage that is stopping the run, say: the code stands
            logger.error("[FaultTolerance] could not write %s (%s): the job script may requeue the job", flag, err)


# --------------------------------------------------------------------- learned timeouts


def _load_state_if_exists(global_state: Any) -> None:
    """Restore the timeouts an earlier run learned (``ft_state.json``); an unreadable file is ignored with a warning."""
    client = global_state.rank_monitor_client
    path = global_state.fault_tolerance_state.ft_state_path
    if not path or not os.path.exists(path):
        return
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError) as err:
        logger.warning("[FaultTolerance] ignoring unreadable %s: %s", path, err)
        return
    client.load_state_dict(state)
    print_rank_0(describe(client, f"loaded from {STATE_FILE}"))


def _update_timeouts(selected_sections: list[str], calc_out_of_section: bool, global_state: Any) -> None:
    """Learn the timeouts of ``selected_sections`` (and out-of-section) from this run; rank 0 saves them.

    A collective: nvidia-resiliency-ext takes the longest times over all ranks. If the monitor cannot compute them
    (too little seen) or is gone, the timeouts stay as they are.
    """
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_client import RankMonitorClientError

    print_rank_0(
        f"[FaultTolerance] learning the timeouts of sections {selected_sections}"
        f"{' and out-of-section' if calc_out_of_section else ''}"
    )
    client = global_state.rank_monitor_client
    try:
        client.calculate_and_set_section_timeouts(
            selected_sections=selected_sections, calc_out_of_section=calc_out_of_section
        )
    except RankMonitorClientError as err:
        logger.warning("[FaultTolerance] timeouts not updated: %s", err)
        return
    if get_rank_safe() == 0:
        _save_state(client.state_dict(), global_state.fault_tolerance_state.ft_state_path)
    print_rank_0(describe(client, "calculated"))


def _save_state(state: dict, path: str) -> None:
    """Write ``state`` to ``path`` whole or not at all: a crash mid-write leaves the previous file for the restart."""
    text = io.StringIO()
    json.dump(state, text)  # serialized in full before anything is written
    atomic_write(path, text.getvalue())


def _maybe_update_timeouts(global_state: Any, is_closing_ft: bool = False) -> None:
    """Learn the timeouts this run has seen enough of (with ``ft.calc_ft_timeouts``).

    - ``setup``: once a global checkpoint was loaded (a fresh start or a fast local load would make it too short);
    - ``step``: after :data:`_MIN_ITERS_FOR_STEP_TIMEOUT_UPDATE` training steps;
    - ``checkpointing``: after a save, unless saves are asynchronous (their blocking part varies too much between
      runs, and the end-of-run wait for the last write is out of section);
    - out-of-section: only at the end of the run (``is_closing_ft``), once ``setup``, ``step`` and a save were seen.
    """
    if global_state.rank_monitor_client is None:
        return
    ft_state = global_state.fault_tolerance_state
    if not ft_state.is_calculating_timeouts:
        return
    sections = []
    if ft_state.is_persistent_chkpt_loaded:
        sections.append("setup")
    else:
        print_rank_0("[FaultTolerance] setup timeout not learned: this run loaded no global checkpoint")
    if ft_state.seen_tr_iters_cnt >= _MIN_ITERS_FOR_STEP_TIMEOUT_UPDATE:
        sections.append("step")
    else:
        print_rank_0(
            f"[FaultTolerance] step timeout not learned yet: {ft_state.seen_tr_iters_cnt} of "
            f"{_MIN_ITERS_FOR_STEP_TIMEOUT_UPDATE} training steps seen"
        )
    if ft_state.seen_checkpoints_cnt > 0 and not ft_state.is_async_chkpt_enabled:
        sections.append("checkpointing")
    else:
        print_rank_0("[FaultTolerance] checkpointing timeout not learned: no save yet, or saves are asynchronous")
    out_of_section = is_closing_ft and {"setup", "step"} <= set(sections) and ft_state.seen_checkpoints_cnt > 0
    if is_closing_ft and not out_of_section:
        print_rank_0("[FaultTolerance] out-of-section timeout not learned: the run did not see every section")
    if sections or out_of_section:
        _update_timeouts(selected_sections=sections, calc_out_of_section=out_of_section, global_state=global_state)


# --------------------------------------------------------------------- the loop's callback, simulated faults


class FaultToleranceCallback(Component):
    """Fault tolerance as a run's component: the rank monitor's sections, its timeouts, and the exit it is told.

    Always in the run (telling the launcher and job script not to restart after a stop works with fault tolerance
    off too); it connects to the rank monitor only with ``ft.enable_ft_package``. It offers the sections' timeouts
    as :attr:`Run.section_timeout` (hang attribution dumps stacks before they strike).
    """

    def __init__(self, global_state: Any = None) -> None:
        self._state = global_state

    @classmethod
    def build(cls, run: Run) -> "FaultToleranceCallback":
        """Connect first: a hang from here on is the ``setup`` section's."""
        cfg, state = run.cfg, run.global_state
        if is_enabled(cfg.ft):
            setup(cfg, state)
            if is_enabled(cfg.inprocess_restart):  # the inner layer acts first: no hang timeout below its hard timeout
                keep_timeouts_at_least(state, cfg.inprocess_restart.hard_timeout)
        run.section_timeout = functools.partial(section_timeout, state)
        return cls(state)

    def ready(self, run: Run) -> None:
        """Tell the monitor which tier the run resumed from; arm ``ft.simulate_fault``."""
        tier = run.checkpoints.resumed["tier"]
        if tier is not None:
            on_checkpoint_loaded(tier == "local", run.global_state)
        maybe_setup_simulated_fault(run.cfg.ft, seed=run.cfg.rng.seed)

    def finish(self, run: Run, code: Any, reason: str) -> None:
        """Tell the launcher whether to restart; every rank ends here, so the whole run's timeouts can be learned."""
        report_exit(run.global_state, code)
        shutdown(run.global_state)

    def fail(self, run: Run, err: BaseException) -> None:
        """Best effort, before the process group is aborted: an exit whose action is *stop* is no restart."""
        code = exit_code_of(err)
        if code in STOP_CODES:
            report_exit(run.global_state, ExitCode(code))

    def close(self) -> None:
        """Disconnect from the rank monitor (a finished run shut down already, learning its timeouts)."""
        if self._state is not None:
            abort(self._state)

    def on_train_step_start(self, context: Any) -> None:
        """Open ``step`` (the first step closes ``setup``)."""
        on_training_step_start(context.state)

    def on_train_step_end(self, context: Any) -> None:
        """Close ``step``."""
        on_training_step_end(context.state)

    def on_eval_step_start(self, context: Any) -> None:
        """Open ``step`` for an evaluation step."""
        on_eval_step_start(context.state)

    def on_eval_step_end(self, context: Any) -> None:
        """Close an evaluation step's ``step``."""
        on_eval_step_end(context.state)

    def on_checkpoint_save_start(self, context: Any) -> None:
        """Open ``checkpointing``."""
        on_checkpointing_start(context.state)

    def on_checkpoint_save_end(self, context: Any) -> None:
        """Close ``checkpointing`` (and learn timeouts, with ``calc_ft_timeouts``)."""
        on_checkpointing_end(is_async_finalization=False, global_state=context.state)


_SIMULATED = {"rank_hung": "hang", "rank_killed": "kill"}
"""The fault kind (``faults/spec.py``) of each ``ft.simulated_fault_type``."""
SIMULATED_SOURCE = "ft.simulate_fault (ft.simulated_fault_type, ft.simulated_fault_rank, ft.simulated_fault_base_delay)"
"""How a bad simulated fault's error names its source."""


def maybe_setup_simulated_fault(config: Any, seed: int = 0, world_size: Optional[int] = None) -> list[Fault]:
    """Arm ``ft.simulate_fault`` in the fault-injection registry; return the fault armed (none when it is off).

    The fields become the fault spec ``<kind>@<delay>s:<rank>`` (``faults/spec.py``), read by the one parser:
    ``rank_hung`` is ``hang`` (SIGSTOP), ``rank_killed`` is ``kill`` (SIGKILL), ``random`` one of the two; with
    ``simulated_fault_rank=None`` the rank is drawn too, the same on every rank (from ``seed``; the loop passes
    ``rng.seed``), so no collective is needed. It strikes ``simulated_fault_base_delay`` seconds after the rank
    starts training, in the first attempt of a job only (the restart can then finish).

    Args:
        config: the ``FaultToleranceConfig`` (``cfg.ft``).
        seed: seed of the random choices.
        world_size: ranks to draw from; the process group's (or ``$WORLD_SIZE``) by default.

    Raises:
        ValueError: ``simulated_fault_type`` is none of ``rank_hung``, ``rank_killed``, ``random``; or the fault is
            not a valid spec (a negative delay or rank), named as from :data:`SIMULATED_SOURCE`.
    """
    if not (is_enabled(config) and config.simulate_fault):
        return []
    kind = config.simulated_fault_type
    if kind not in (*_SIMULATED, "random"):
        raise ValueError(f"Unknown fault type {kind}: ft.simulated_fault_type must be rank_hung, rank_killed or random")
    world_size = world_size if world_size is not None else get_world_size_safe()
    chooser = random.Random(seed)  # the same choice on every rank
    rank = config.simulated_fault_rank if config.simulated_fault_rank is not None else chooser.randrange(world_size)
    if kind == "random":
        kind = chooser.choice(["rank_hung", "rank_killed"])
    delay = float(config.simulated_fault_base_delay)
    (fault,) = fault_injection.parse(f"{_SIMULATED[kind]}@{delay!r}s:{rank}", SIMULATED_SOURCE)
    if get_rank_safe() == rank:
        logger.warning("[FaultTolerance] simulated fault %s on rank %d: injected as %s", kind, rank, fault)
    fault_injection.registry().add(fault)
    return [fault]
