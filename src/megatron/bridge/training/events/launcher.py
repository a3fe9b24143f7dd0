"""The launcher's part of the event stream: worker exits, in-job restarts phase by phase, rank-monitor timeouts.

The problem: only ft_launcher knows when a worker died and how (exit code or signal), when it decided to restart
the workers, how long stopping them took, when the new ones were running, and (in its rank monitors, processes it
forks) which section of which rank timed out. It says so in log lines whose wording changes between releases. Here
those facts become typed events (``training/events/stream.py``) in ``events-launcher-<host>.jsonl`` of the job's
event directory, next to the ranks' own files:

* ``worker_exited`` for every worker exit the agent sees (once per worker process), and ``fault_detected``
  (``launcher_worker_exit``) for each that failed (a non-zero code or a signal);
* ``restart_begun`` (layer ``in_job``, the restart count it leads to) when the agent restarts its workers,
  ``workers_stopped`` once they are stopped (``seconds``: the teardown), ``restart_ended`` once the new ones run
  (after the rendezvous and the spawn);
* ``fault_detected`` (``rank_monitor_section_timeout`` naming the section, or ``rank_monitor_heartbeat_timeout``)
  when a rank monitor is about to kill its rank, once per rank process;
* ``fault_detected`` (``out_of_memory``) after the ``launcher_worker_exit`` of a worker dead by SIGKILL that the
  kernel's out-of-memory killer killed (``utils/oom.py``), with a log line naming the rank, its pid and the fix.

How: :func:`install` wraps the agent's worker monitor, restart, stop and start methods and the rank monitor's
timeout handler (private upstream names, through ``utils/upstream.py``); the rank monitors are forked from the
launcher after that, so they run the wrapped handler. ``megatron.bridge.ft_launch --event-dir DIR`` calls it.
Every hook only observes: it calls the original first or last, unchanged, and an event that cannot be written is
dropped, never an error of the launcher's.
"""

import functools
import logging
import signal
import time
from typing import Any, Optional

from megatron.bridge.training.events.stream import (
    EventKind,
    EventWriter,
    Mechanism,
    Process,
    RestartLayer,
    launcher_file,
)
from megatron.bridge.utils import oom, upstream

_AGENT = "nvidia_resiliency_ext.fault_tolerance.launcher:LocalElasticAgent"
MONITOR, RESTART, STOP, START = (f"{_AGENT}.{m}" for m in ("_monitor_workers", "_restart_workers", "_stop_workers",
                                                            "_initialize_workers"))  # fmt: skip
RANK_MONITOR_TIMEOUT = "nvidia_resiliency_ext.fault_tolerance.rank_monitor_server:RankMonitorServer._handle_timeout"
logger = logging.getLogger(__name__)


def _signal_of(exit_code: Optional[int]) -> Optional[int]:
    return -exit_code if exit_code is not None and exit_code < 0 else None


class LauncherEvents:
    """What the hooks write: one object per launcher (its rank monitors use a copy after the fork).

    Args:
        writer: the launcher's writer.
        rank_monitor_writer: the rank monitors' writer (same file, ``process`` ``rank_monitor``).
    """

    def __init__(self, writer: EventWriter, rank_monitor_writer: EventWriter) -> None:
        self.writer = writer
        self.rank_monitor_writer = rank_monitor_writer
        self._seen_exits: set[int] = set()
        self._restarting: Optional[int] = None
        self._restart_begun: Optional[float] = None
        self._stop_began: Optional[float] = None
        self._timed_out: set[int] = set()
        self.memory = oom.OomWatch()
        """OOM kills since the workers started (``utils/oom.py``): a worker dead by SIGKILL is looked up there."""

    # ---------------------------------------------------------------- agent

    def monitored(self, worker_group: Any, result: Any) -> None:
        """After a look at the workers: their exits (failures, or every worker of a group that succeeded)."""
        failures = getattr(result, "failures", None) or {}
        for global_rank, failure in failures.items():
            self._exited(global_rank, failure.local_rank, failure.pid, failure.exitcode)
        if failures:
            return
        returned = getattr(result, "return_values", None) or {}
        for worker in getattr(worker_group, "workers", []):
            if worker.global_rank in returned and worker.id is not None:
                self._exited(worker.global_rank, worker.local_rank, worker.id, 0)

    def _exited(self, rank: int, local_rank: int, pid: Any, exit_code: int) -> None:
        key = pid if isinstance(pid, int) else hash((rank, local_rank, pid))
        if key in self._seen_exits:
            return
        self._seen_exits.add(key)
        fields = {"rank": rank, "local_rank": local_rank, "exit_code": exit_code, "signal": _signal_of(exit_code)}
        fields["worker_pid"] = pid if isinstance(pid, int) else None
        self.writer.emit(EventKind.WORKER_EXITED, **fields)
        if exit_code != 0:
            self.writer.emit(EventKind.FAULT_DETECTED, mechanism=Mechanism.LAUNCHER_WORKER_EXIT, **fields)
        if exit_code == -signal.SIGKILL and isinstance(pid, int):
            try:
                verdict = self.memory.verdict(pid)
            except Exception as err:  # noqa: BLE001 - a hook only observes: never an error of the launcher's
                logger.warning("could not tell whether worker pid %d was killed for memory: %r", pid, err)
                verdict = None
            if verdict is not None:
                logger.error("%s", oom.message(rank, verdict))
                fields["detail"] = verdict.evidence
                self.writer.emit(EventKind.FAULT_DETECTED, mechanism=Mechanism.OUT_OF_MEMORY, **fields)

    def workers_starting(self) -> None:
        """The agent starts (or restarts) its workers: a SIGKILL from here on is checked against OOM kills since."""
        self.memory = oom.OomWatch()

    def restart_begins(self, agent: Any, worker_group: Any) -> None:
        """The agent restarts its workers (its count of restarts left is already decremented)."""
        self._restarting = upstream.agent_restart_count(agent)
        self._restart_begun = time.monotonic()
        self.writer.emit(EventKind.RESTART_BEGUN, layer=RestartLayer.IN_JOB, restart_count=self._restarting)

    def stop_begins(self) -> None:
        """The agent starts stopping its workers."""
        self._stop_began = time.monotonic()

    def stopped(self) -> None:
        """The workers are stopped."""
        began, self._stop_began = self._stop_began, None
        self.writer.emit(
            EventKind.WORKERS_STOPPED,
            layer=RestartLayer.IN_JOB if self._restarting is not None else None,
            restart_count=self._restarting,
            seconds=None if began is None else time.monotonic() - began,
        )

    def started(self) -> None:
        """New workers run (after the rendezvous and the spawn): the end of a restart, if one was under way."""
        if self._restarting is None:
            return
        begun = self._restart_begun
        self.writer.emit(
            EventKind.RESTART_ENDED,
            layer=RestartLayer.IN_JOB,
            restart_count=self._restarting,
            seconds=None if begun is None else time.monotonic() - begun,
        )
        self._restarting = self._restart_begun = None

    # ---------------------------------------------------------------- rank monitor

    def rank_monitor_timeout(self, server: Any) -> None:
        """A rank monitor is about to kill its rank: which timeout expired, once per rank process."""
        info = getattr(server, "rank_info", None)
        if info is None or info.pid in self._timed_out:
            return
        self._timed_out.add(info.pid)
        mechanism, section, elapsed, timeout = timed_out(server, time.monotonic())
        if section == "checkpointing":  # a save, not a step: slow or stuck storage, said so before the restart
            logger.error(
                "rank %s (pid %d): slow checkpoint save, not a hung step: the save has been running %.1f s, past the "
                "checkpointing section timeout of %.1f s; the rank is stopped and restarted, and the run resumes from "
                "the newest committed checkpoint. Fix: check the checkpoint storage's write bandwidth, or raise the "
                "checkpointing timeout (--ft-rank-section-timeouts checkpointing:<s>, or ft.calc_ft_timeouts=true)",
                info.global_rank, info.pid, elapsed or 0.0, timeout or 0.0,
            )  # fmt: skip
        self.rank_monitor_writer.emit(
            EventKind.FAULT_DETECTED,
            mechanism=mechanism,
            rank=int(info.global_rank),  # the rank monitor holds the ranks as the launcher's strings
            local_rank=int(info.local_rank),
            section=section,
            seconds=elapsed,
            timeout=timeout,
            worker_pid=info.pid,
        )


def timed_out(server: Any, now: float) -> tuple[Mechanism, Optional[str], Optional[float], Optional[float]]:
    """(mechanism, section, seconds open, timeout) of the timeout a rank monitor acts on, from its state at ``now``.

    The rank monitor's own rule: an open section past its timeout; with none open, the time out of sections past
    ``rank_out_of_section_timeout`` (section ``out_of_section``); else the heartbeat timeout.
    """
    cfg = server.cfg
    for section, opened in dict(getattr(server, "open_sections", {}) or {}).items():
        limit = cfg.rank_section_timeouts.get(section)
        if limit is not None and now - opened > limit:
            return Mechanism.RANK_MONITOR_SECTION_TIMEOUT, section, now - opened, limit
    since = getattr(server, "out_of_section_time", None)
    limit = cfg.rank_out_of_section_timeout
    if not getattr(server, "open_sections", None) and since is not None and limit is not None and now - since > limit:
        return Mechanism.RANK_MONITOR_SECTION_TIMEOUT, "out_of_section", now - since, limit
    last = getattr(server, "last_hb_time", None)
    if last is None:
        started = getattr(server, "start_time", None)
        return (Mechanism.RANK_MONITOR_HEARTBEAT_TIMEOUT, None, None if started is None else now - started,
                cfg.initial_rank_heartbeat_timeout)  # fmt: skip
    return Mechanism.RANK_MONITOR_HEARTBEAT_TIMEOUT, None, now - last, cfg.rank_heartbeat_timeout


# -------------------------------------------------------------------------------------- the hooks


def _after(original: Any, hook: Any) -> Any:
    @functools.wraps(original)
    def wrapper(agent: Any, worker_group: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(agent, worker_group, *args, **kwargs)
        hook(agent, worker_group, result)
        return result

    return wrapper


def _around(original: Any, before: Any, after: Any) -> Any:
    @functools.wraps(original)
    def wrapper(agent: Any, worker_group: Any, *args: Any, **kwargs: Any) -> Any:
        before(agent, worker_group)
        result = original(agent, worker_group, *args, **kwargs)
        after()
        return result

    return wrapper


def install(directory: str) -> Optional[LauncherEvents]:
    """Write this launcher's events to ``directory``; ``None`` (nothing hooked) if the agent's methods are gone."""
    originals = {key: upstream.find(key) for key in (MONITOR, RESTART, STOP, START, RANK_MONITOR_TIMEOUT)}
    if any(value is None for value in originals.values()):
        return None  # upstream.find logged which one: events from the launcher are off, the launcher is not
    name = launcher_file()
    events = LauncherEvents(
        EventWriter(directory, name, Process.LAUNCHER), EventWriter(directory, name, Process.RANK_MONITOR)
    )
    upstream.patch(MONITOR, _after(originals[MONITOR], lambda agent, group, result: events.monitored(group, result)))
    upstream.patch(RESTART, _around(originals[RESTART], events.restart_begins, lambda: None))
    upstream.patch(STOP, _around(originals[STOP], lambda agent, group: events.stop_begins(), events.stopped))
    upstream.patch(START, _around(originals[START], lambda agent, group: events.workers_starting(), events.started))
    timeout_handler = originals[RANK_MONITOR_TIMEOUT]

    @functools.wraps(timeout_handler)
    async def _handle_timeout(server: Any) -> None:
        events.rank_monitor_timeout(server)
        await timeout_handler(server)

    upstream.patch(RANK_MONITOR_TIMEOUT, _handle_timeout)
    return events
