"""Two run configurations where the rank monitor cannot be told about sections as they are: heartbeats, a floor.

Fault tolerance's module functions (``fault_tolerance.py``) speak nvidia-resiliency-ext's section API to
``global_state.rank_monitor_client``. :class:`LayeredClient` wraps the real ``RankMonitorClient`` and translates
that API where the plain client would fail or undercut another recovery layer:

- **No section timeouts in the launcher.** The rank monitor looks up the timeout of every section a rank opens; one
  ft_launcher was given no timeout for (``setup``, ``step``, ``checkpointing``) would break its check. Each section's
  end becomes a heartbeat instead (the first, at the end of ``setup``, is bounded by the initial heartbeat timeout,
  the others by the subsequent one), and timeouts are learned as heartbeat timeouts.
- **In-process restart as the inner layer.** A hang that in-process restart can abort (a stalled rank, a collective
  waiting on it) must be recovered in place; only a rank it cannot abort (stopped, stuck in a system call) falls
  through to the rank monitor's kill. So the ``step`` and ``checkpointing`` timeouts (or the subsequent heartbeat
  timeout), given by the launcher, loaded from ``ft_state.json`` or learned, are raised to at least
  ``inprocess_restart.hard_timeout``: by then the inner layer has recovered or terminated the rank.

Everything else (``state_dict``, ``shutdown_workload_monitoring``, ``send_workload_control_request``, ...) goes to
the wrapped client unchanged.
"""

import dataclasses
import logging
from collections.abc import Collection, Mapping
from typing import Any, Optional

from megatron.bridge.utils import upstream

logger = logging.getLogger(__name__)

SECTIONS = ("setup", "step", "checkpointing")
"""The sections the training loop reports (``ft_launcher --ft-rank-section-timeouts`` must name all three)."""
FLOORED_SECTIONS = ("step", "checkpointing")
"""The sections whose timeouts in-process restart's hard timeout bounds from below (``setup`` is not restarted in
place: its hangs are the monitor's)."""
SET_TIMEOUTS = "nvidia_resiliency_ext.fault_tolerance.rank_monitor_client:RankMonitorClient._set_calculated_timeouts"


def _fmt(value: Optional[float]) -> str:
    return "off" if value is None else f"{value:.1f}s"


def missing_sections(client: Any) -> list[str]:
    """Our sections that the launcher gave no timeout for (the config the rank monitor sent at connection).

    A client that does not carry nvidia-resiliency-ext's config (``cfg.rank_section_timeouts``) has nothing to
    check: none are reported missing.
    """
    configured = getattr(getattr(client, "cfg", None), "rank_section_timeouts", None)
    if not isinstance(configured, Mapping):
        return []
    return [name for name in SECTIONS if name not in configured]


def timeout_of(client: Any, section: str) -> Optional[float]:
    """Seconds ``client``'s rank monitor lets ``section`` stay open (``None``: no timeout)."""
    if isinstance(client, LayeredClient):
        return client.timeout(section)
    return client.section_timeouts.section.get(section)


def describe(client: Any, origin: str) -> str:
    """The log line of the timeouts in force, e.g. ``[FaultTolerance] section timeouts (calculated): setup=...``."""
    if isinstance(client, LayeredClient) and client.heartbeats:
        hb = client.hb_timeouts
        limits = f"initial={_fmt(hb.initial)}, subsequent={_fmt(hb.subsequent)}"
        return f"[FaultTolerance] heartbeat timeouts ({origin}): {limits}"
    timeouts = client.section_timeouts
    by_section = getattr(timeouts, "section", None)
    if not isinstance(by_section, Mapping):  # a client with its own representation of timeouts
        return f"[FaultTolerance] section timeouts ({origin}): {timeouts}"
    listed = ", ".join(f"{name}={_fmt(by_section.get(name))}" for name in SECTIONS)
    return f"[FaultTolerance] section timeouts ({origin}): {listed}, out-of-section={_fmt(timeouts.out_of_section)}"


class LayeredClient:
    """A ``RankMonitorClient`` seen through the section API, sending heartbeats and/or keeping a timeout floor.

    Args:
        client: the connected ``RankMonitorClient``.
        heartbeats: the launcher has no timeouts for our sections: report heartbeats.
        floor: seconds below which no hang timeout may be (``inprocess_restart.hard_timeout``); ``None``: none.
        rank: this process's global rank (rank 0 logs).
    """

    def __init__(self, client: Any, heartbeats: bool = False, floor: Optional[float] = None, rank: int = 0) -> None:
        self.client = client
        self.heartbeats = heartbeats
        self.floor = floor
        self.rank = rank
        self._floor_logged = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    # ------------------------------------------------------------------ sections

    def start_section(self, section: str) -> None:
        """Open ``section`` (nothing to send with heartbeats: only ends are reported)."""
        if not self.heartbeats:
            self.client.start_section(section)

    def end_section(self, section: str) -> None:
        """Close ``section``, or send a heartbeat."""
        if self.heartbeats:
            self.client.send_heartbeat()
        else:
            self.client.end_section(section)

    def end_all_sections(self) -> None:
        """Close every open section (nothing is open with heartbeats)."""
        if not self.heartbeats:
            self.client.end_all_sections()

    # ------------------------------------------------------------------ timeouts

    def calculate_and_set_section_timeouts(
        self,
        selected_sections: Optional[Collection[str]] = None,
        calc_out_of_section: bool = True,
        skip_if_not_ready: bool = False,
    ) -> bool:
        """Learn timeouts from what the rank monitor observed (heartbeat timeouts with heartbeats), then the floor."""
        if self.heartbeats:
            done = self.client.calculate_and_set_hb_timeouts(skip_if_not_ready=skip_if_not_ready)
        else:
            done = self.client.calculate_and_set_section_timeouts(
                selected_sections=selected_sections,
                calc_out_of_section=calc_out_of_section,
                skip_if_not_ready=skip_if_not_ready,
            )
        if done:
            self.apply_floor()
        return done

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore timeouts learned by an earlier run, then apply the floor."""
        self.client.load_state_dict(state)
        self.apply_floor()

    def timeout(self, section: str) -> Optional[float]:
        """Seconds ``section`` may stay open before the rank monitor kills the rank (``None``: no timeout)."""
        if self.heartbeats:
            hb = self.client.hb_timeouts
            return hb.initial if section == "setup" else hb.subsequent
        return self.client.section_timeouts.section.get(section)

    def keep_at_least(self, floor: float) -> None:
        """From now on no hang timeout is below ``floor`` seconds (raised at once, and after every update)."""
        self.floor = float(floor)
        self.apply_floor()

    def apply_floor(self) -> None:
        """Raise the hang timeouts below the floor to it, on the rank monitor too."""
        if self.floor is None:
            return
        floor = self.floor
        if self.heartbeats:
            current = self.client.hb_timeouts
            if current.subsequent is None or current.subsequent >= floor:
                return
            low = {"heartbeat": current.subsequent}
            update = {"new_hb_timeouts": dataclasses.replace(current, subsequent=floor), "new_section_timeouts": None}
        else:
            current = self.client.section_timeouts
            low = {n: t for n, t in current.section.items() if n in FLOORED_SECTIONS and t is not None and t < floor}
            if not low:
                return
            raised = dataclasses.replace(current, section={**current.section, **dict.fromkeys(low, floor)})
            update = {"new_hb_timeouts": None, "new_section_timeouts": raised}
        upstream.bound(self.client, SET_TIMEOUTS)(**update)
        if self.rank == 0:
            logger.log(
                logging.DEBUG if self._floor_logged else logging.INFO,
                "[FaultTolerance] %s raised to inprocess_restart.hard_timeout=%.1fs: in-process restart recovers "
                "a hang first, the rank monitor only what it cannot abort",
                ", ".join(f"{name} timeout {t:.1f}s" for name, t in low.items()),
                floor,
            )
            self._floor_logged = True
