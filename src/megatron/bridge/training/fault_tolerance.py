"""Hang and crash detection through nvidia-resiliency-ext's rank monitor (the process must run under ft_launcher).

Each rank reports sections to its rank monitor: ``setup`` (process start to the loaded checkpoint), ``step``
(one training iteration), ``checkpointing`` (one save), and implicitly the time out of any section. When a section
stays open longer than its timeout, the monitor kills the rank and ft_launcher restarts the workers, which resume
from the newest verified checkpoint. Launch with matching section names::

    ft_launcher --ft-rank-section-timeouts=setup:600,step:180,checkpointing:420 \
        --ft-rank-out-of-section-timeout=300 ...

If the launcher was given no timeouts for these sections, heartbeats (one per step) are sent instead.

When training ends with a code whose action is *stop* although the job did not finish (17: a result failed
validation and re-running cannot help), every rank asks ft_launcher to shut the workload down instead of restarting
it, and the finished flag keeps a requeueing job script from starting it again.

Layered under in-process restart (``inprocess_restart.enabled``), the rank monitor is the outer layer: a rank hung in
a way in-process restart can abort (a stalled rank, a collective waiting on it) must be restarted in place, and only
a rank it cannot abort (stopped, stuck in a system call) falls through to the monitor's kill and ft_launcher's in-job
restart. So the ``step`` and ``checkpointing`` timeouts (or the subsequent heartbeat timeout), given or learned, are
kept at least ``inprocess_restart.hard_timeout``: by then the inner layer has recovered or terminated the rank. Each
in-process restart iteration reconnects to the rank monitor and opens ``setup`` again.

With ``ft.calc_ft_timeouts``, the ``step`` and ``checkpointing`` timeouts are computed from what this run observed
(the launcher's safety factor times the longest time seen) after every checkpoint save, written atomically to
``ft_state.json`` in the save directory, and loaded from the load directory by the next run.
"""

import dataclasses
import json
import logging
import os
import random
from typing import Any, Optional

from megatron.bridge.training import fault_injection
from megatron.bridge.training.callbacks import Callback
from megatron.bridge.training.config import ConfigContainer, FaultToleranceConfig
from megatron.bridge.training.exit_codes import STOP_CODES, ExitCode
from megatron.bridge.training.fault_injection import Fault
from megatron.bridge.utils import upstream
from megatron.bridge.utils.fs import atomic_write, atomic_write_json

logger = logging.getLogger(__name__)

SECTIONS = ("setup", "step", "checkpointing")
LEARNED_SECTIONS = ("step", "checkpointing")
STATE_FILE = "ft_state.json"
RANK_MONITOR_ENV = "FT_RANK_MONITOR_IPC_SOCKET"
SET_TIMEOUTS = "nvidia_resiliency_ext.fault_tolerance.rank_monitor_client:RankMonitorClient._set_calculated_timeouts"


def _fmt(value: Optional[float]) -> str:
    return "off" if value is None else f"{value:.1f}s"


class FaultTolerance:
    """The rank-monitor client of one training process; every method is a no-op when FT is disabled."""

    def __init__(self, cfg: ConfigContainer, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.ft = cfg.ft or FaultToleranceConfig()  # None: off
        self.rank = rank
        self.world_size = world_size
        self.enabled = self.ft.enable_ft_package
        self._client = None
        self._use_sections = False
        self._monitor_lost = False
        self._floor_logged = False

    @property
    def client(self) -> Any:
        """The rank-monitor client while connected, else ``None``."""
        return self._client

    # ----------------------------------------------------------------- lifecycle

    def on_setup_start(self) -> None:
        """Connect to the rank monitor, restore learned timeouts and open the ``setup`` section."""
        if not self.enabled:
            return
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        self._client = RankMonitorClient()
        state = self._read_state()
        if state is not None:
            self._client.load_state_dict(state)
        self._client.init_workload_monitoring()
        configured = self._client.section_timeouts.section
        self._use_sections = all(name in configured for name in SECTIONS)
        if self._use_sections:
            self._send("start_section", "setup")
        else:
            logger.warning(
                "[FaultTolerance] ft_launcher has no timeouts for sections %s (got %s); sending heartbeats instead. "
                "For section monitoring launch with --ft-rank-section-timeouts=setup:600,step:180,checkpointing:420",
                list(SECTIONS),
                sorted(configured),
            )
            self._send("send_heartbeat")
        self._keep_above_inprocess_restart()
        self._log_timeouts("loaded from " + STATE_FILE if state else "from the launcher")

    def on_setup_end(self) -> None:
        """Close the ``setup`` section (the checkpoint is loaded, training starts)."""
        if self.enabled and self._use_sections:
            self._send("end_section", "setup")

    def on_step_start(self) -> None:
        """Open the ``step`` section."""
        if self.enabled and self._use_sections:
            self._send("start_section", "step")

    def on_step_end(self) -> None:
        """Close the ``step`` section (or send a heartbeat)."""
        if not self.enabled:
            return
        if self._use_sections:
            self._send("end_section", "step")
        else:
            self._send("send_heartbeat")

    def on_checkpoint_start(self) -> None:
        """Open the ``checkpointing`` section."""
        if self.enabled and self._use_sections:
            self._send("start_section", "checkpointing")

    def on_checkpoint_end(self, update_timeouts: bool = True) -> None:
        """Close the ``checkpointing`` section; with ``calc_ft_timeouts`` update and persist the timeouts.

        Updating (unless ``update_timeouts`` is false) is a collective: every rank passes here at the same save.
        """
        if not self.enabled:
            return
        if self._use_sections:
            self._send("end_section", "checkpointing")
        if self.ft.calc_ft_timeouts and update_timeouts:
            self._update_timeouts()

    def on_train_end(self, code: ExitCode) -> None:
        """Tell the launcher and the job script whether to start the workload again.

        nemo_run's fault-tolerant Slurm script requeues the job after every run unless the file named by
        ``$FAULT_TOL_FINISHED_FLAG_FILE`` exists; ft_launcher restarts failed workers unless a rank asked it to
        shut the workload down. Neither is wanted when training finished (rank 0 writes the file) or when any rank
        ends with a code whose action is *stop* (:data:`STOP_CODES`: a restart would meet the same full disk, bad
        config or reproducible NaN; that rank writes the file and asks ft_launcher not to restart).
        """
        stop = code in STOP_CODES
        if stop and self._client is not None and not self._monitor_lost:  # first: the flag's write may fail (ENOSPC)
            from nvidia_resiliency_ext.fault_tolerance.data import WorkloadAction, WorkloadControlRequest

            request = WorkloadControlRequest(WorkloadAction.ShutdownWorkload, f"exit code {int(code)} ({code.name})")
            try:
                self._client.send_workload_control_request(request)
                logger.warning("[FaultTolerance] asked ft_launcher not to restart the workers: %s", request.description)
            except Exception as err:  # no IPC to the launcher (or it is gone): the exit code still says stop
                logger.warning("[FaultTolerance] could not ask the launcher to stop: %s", err)
        flag = os.environ.get("FAULT_TOL_FINISHED_FLAG_FILE")
        if flag and (stop or (code == ExitCode.FINISHED and self.rank == 0)):
            try:
                atomic_write(flag, f"training ended with exit code {int(code)} ({code.name})\n")
                logger.info("[FaultTolerance] wrote %s: the job will not be requeued", flag)
            except OSError as err:  # on the full or broken storage that is stopping the run, say: the code stands
                logger.error("[FaultTolerance] could not write %s (%s): the job script may requeue the job", flag, err)

    def section_timeout(self, section: str) -> Optional[float]:
        """Seconds the rank monitor lets ``section`` stay open before it kills the rank (``None``: no timeout)."""
        if self._client is None or self._monitor_lost:
            return None
        if self._use_sections:
            return self._client.section_timeouts.section.get(section)
        hb = self._client.hb_timeouts
        return hb.initial if section == "setup" else hb.subsequent

    def shutdown(self) -> None:
        """Disconnect from the rank monitor (after training ended normally)."""
        if self._client is not None:
            if self._use_sections:
                self._send("end_all_sections")
            self._send("shutdown_workload_monitoring")
            self._client = None

    def _send(self, method: str, *args: Any) -> None:
        """Call ``method`` of the rank-monitor client; if the monitor is gone, warn once and stop reporting.

        The monitor is a process of the launcher's. When a scheduler signals every process of a job step (Slurm
        does), the monitor dies while this rank still has a checkpoint to save: failing here would lose it.
        """
        if self._client is None or self._monitor_lost:
            return
        from nvidia_resiliency_ext.fault_tolerance.rank_monitor_client import RankMonitorClientError

        try:
            getattr(self._client, method)(*args)
        except RankMonitorClientError as err:
            self._monitor_lost = True
            logger.warning(
                "[FaultTolerance] the rank monitor is gone (%s); continuing without hang detection so that this "
                "rank can finish its work (normal while the job is being stopped)",
                err,
            )

    # ----------------------------------------------------------------- timeouts

    def _update_timeouts(self) -> None:
        """Compute timeouts from observed times (a collective: all ranks call it at the same save)."""
        if self._monitor_lost:
            return
        if self._use_sections:
            # Only `step` and `checkpointing` are learned. `setup` varies too much between a first start and a
            # restart that loads a checkpoint, and out-of-section periods are bookkeeping between sections that
            # lasts microseconds: a timeout learned from either would only add false alarms. Both keep the
            # launcher's values.
            ok = self._client.calculate_and_set_section_timeouts(
                selected_sections=LEARNED_SECTIONS, calc_out_of_section=False, skip_if_not_ready=True
            )
        else:
            ok = self._client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
        if ok:
            self._keep_above_inprocess_restart()
            self._log_timeouts("calculated")
            self._write_state()

    def _keep_above_inprocess_restart(self) -> None:
        """Raise hang timeouts below ``inprocess_restart.hard_timeout`` to it: in-process restart acts first."""
        ipr = self.cfg.inprocess_restart
        if ipr is None or not ipr.enabled or self._monitor_lost:
            return
        floor = float(ipr.hard_timeout)
        if self._use_sections:
            current = self._client.section_timeouts
            low = {n: t for n, t in current.section.items() if n in LEARNED_SECTIONS and t is not None and t < floor}
            if not low:
                return
            update = {"new_hb_timeouts": None, "new_section_timeouts": dataclasses.replace(
                current, section={**current.section, **dict.fromkeys(low, floor)}
            )}  # fmt: skip
        else:
            current = self._client.hb_timeouts
            low = {"heartbeat": current.subsequent} if current.subsequent is not None else {}
            if not low or current.subsequent >= floor:
                return
            update = {"new_hb_timeouts": dataclasses.replace(current, subsequent=floor), "new_section_timeouts": None}
        upstream.bound(self._client, SET_TIMEOUTS)(**update)
        if self.rank == 0:
            logger.log(
                logging.DEBUG if self._floor_logged else logging.INFO,
                "[FaultTolerance] %s raised to inprocess_restart.hard_timeout=%.1fs: in-process restart recovers "
                "a hang first, the rank monitor only what it cannot abort",
                ", ".join(f"{name} timeout {t:.1f}s" for name, t in low.items()),
                floor,
            )
            self._floor_logged = True

    def _log_timeouts(self, origin: str) -> None:
        if self.rank != 0:
            return
        if self._use_sections:
            st = self._client.section_timeouts
            logger.info(
                "[FaultTolerance] section timeouts (%s): %s, out-of-section=%s",
                origin,
                ", ".join(f"{name}={_fmt(st.section.get(name))}" for name in SECTIONS),
                _fmt(st.out_of_section),
            )
        else:
            hb = self._client.hb_timeouts
            logger.info(
                "[FaultTolerance] heartbeat timeouts (%s): initial=%s, subsequent=%s",
                origin,
                _fmt(hb.initial),
                _fmt(hb.subsequent),
            )

    def _read_state(self) -> Optional[dict]:
        directory = self.cfg.checkpoint.load or self.cfg.checkpoint.save
        if not (self.ft.calc_ft_timeouts and directory):
            return None
        path = os.path.join(directory, STATE_FILE)
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            logger.warning("[FaultTolerance] ignoring unreadable %s: %s", path, err)
            return None

    def _write_state(self) -> None:
        directory = self.cfg.checkpoint.save
        if self.rank != 0 or not directory:
            return
        atomic_write_json(os.path.join(directory, STATE_FILE), self._client.state_dict(), indent=1)


_SIMULATED = {"rank_hung": "hang", "rank_killed": "kill"}
"""The fault-injection kind of each ``ft.simulated_fault_type``."""


# --------------------------------------------------------------------- Megatron-Bridge's module functions
#
# The functions below are the public face: the loop and user code call them with the run's GlobalState, which holds
# the FaultTolerance object of the run (``global_state.fault_tolerance``), its rank-monitor client and the counters
# of ``global_state.fault_tolerance_state``. Each is a no-op when fault tolerance is off.


def _engine(global_state: Any) -> Optional[FaultTolerance]:
    return getattr(global_state, "fault_tolerance", None)


def setup(config: ConfigContainer, global_state: Any) -> None:
    """Connect this rank to its rank monitor (ft_launcher), restore learned timeouts, open the ``setup`` section."""
    rank = int(os.environ.get("RANK", "0"))
    engine = FaultTolerance(config, rank=rank, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    global_state.fault_tolerance = engine
    engine.on_setup_start()
    ft_state = global_state.fault_tolerance_state
    directory = config.checkpoint.save
    ft_state.ft_state_path = os.path.join(directory, STATE_FILE) if directory else None
    ft_state.is_async_chkpt_enabled = config.checkpoint.async_save
    ft_state.is_calculating_timeouts = engine.enabled and engine.ft.calc_ft_timeouts
    ft_state.is_setup_section_open = engine.enabled
    global_state.rank_monitor_client = engine.client


def on_training_step_start(global_state: Any) -> None:
    """Close ``setup`` if it is still open (the first step), then open the ``step`` section."""
    engine = _engine(global_state)
    if engine is None:
        return
    ft_state = global_state.fault_tolerance_state
    if ft_state.is_setup_section_open:
        engine.on_setup_end()
        ft_state.is_setup_section_open = False
    engine.on_step_start()


def on_training_step_end(global_state: Any) -> None:
    """Close the ``step`` section (or send a heartbeat when the launcher has no section timeouts)."""
    engine = _engine(global_state)
    if engine is None:
        return
    engine.on_step_end()
    global_state.fault_tolerance_state.seen_tr_iters_cnt += 1


def on_checkpointing_start(global_state: Any) -> None:
    """Open the ``checkpointing`` section."""
    engine = _engine(global_state)
    if engine is not None:
        engine.on_checkpoint_start()


def on_checkpointing_end(is_async_finalization: bool, global_state: Any) -> None:
    """Close the ``checkpointing`` section.

    After a save (not the finalization of an async one) the learned timeouts are updated when ``ft.calc_ft_timeouts``
    is on.
    """
    engine = _engine(global_state)
    if engine is None:
        return
    engine.on_checkpoint_end(update_timeouts=not is_async_finalization)
    if not is_async_finalization:
        global_state.fault_tolerance_state.seen_checkpoints_cnt += 1


def on_checkpoint_loaded(is_local_chkpt: bool, global_state: Any) -> None:
    """Record which tier the run resumed from (a global load makes ``setup`` include a real read)."""
    global_state.fault_tolerance_state.is_persistent_chkpt_loaded = not is_local_chkpt


def shutdown(global_state: Any) -> None:
    """End every open section and disconnect from the rank monitor; idempotent."""
    engine = _engine(global_state)
    if engine is not None:
        engine.shutdown()
    global_state.rank_monitor_client = None


class FaultToleranceCallback(Callback):
    """The loop's ``step`` and ``checkpointing`` sections, reported through Megatron-Bridge's module functions."""

    def on_train_step_start(self, context: Any) -> None:
        """Open the ``step`` section (the first one also closes ``setup``)."""
        on_training_step_start(context.state)

    def on_train_step_end(self, context: Any) -> None:
        """Close the ``step`` section."""
        on_training_step_end(context.state)

    def on_checkpoint_save_start(self, context: Any) -> None:
        """Open the ``checkpointing`` section."""
        on_checkpointing_start(context.state)

    def on_checkpoint_save_end(self, context: Any) -> None:
        """Close the ``checkpointing`` section (and learn its timeout, with ``calc_ft_timeouts``)."""
        on_checkpointing_end(is_async_finalization=False, global_state=context.state)


def maybe_setup_simulated_fault(config: Any, seed: int = 0, world_size: Optional[int] = None) -> list[Fault]:
    """Arm ``ft.simulate_fault`` in the fault-injection registry; return the fault armed (none when it is off).

    ``rank_hung`` is ``hang`` (SIGSTOP), ``rank_killed`` is ``kill`` (SIGKILL), ``random`` one of the two; with
    ``simulated_fault_rank=None`` the rank is drawn too, the same on every rank (from ``seed``; the loop passes
    ``rng.seed``). It strikes ``simulated_fault_base_delay`` seconds after the rank starts training, in the first
    attempt of a job only.

    Args:
        config: the ``FaultToleranceConfig`` (``cfg.ft``).
        seed: seed of the random choices.
        world_size: ranks to draw from; ``$WORLD_SIZE`` by default.
    """
    if config is None or not (config.enable_ft_package and config.simulate_fault):
        return []
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    chooser = random.Random(seed)  # the same choice on every rank
    rank = config.simulated_fault_rank if config.simulated_fault_rank is not None else chooser.randrange(world_size)
    kind = config.simulated_fault_type
    if kind == "random":
        kind = chooser.choice(["rank_hung", "rank_killed"])
    fault = Fault(_SIMULATED[kind], None, rank, seconds=float(config.simulated_fault_base_delay))
    if int(os.environ.get("RANK", "0")) == rank:
        logger.warning("[FaultTolerance] simulated fault %s on rank %d: injected as %s", kind, rank, fault)
    fault_injection.registry().add(fault)
    return [fault]
