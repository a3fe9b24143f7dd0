"""A lost node is dropped from the rendezvous as soon as ``--rdzv-conf`` says, under ft_launcher as under torchrun.

The failure: a node that is lost whole (its agent SIGKILLed with its ranks, the machine gone) sends no more
keep-alive heartbeats, and a c10d rendezvous drops it only once ``keep_alive_max_attempt`` heartbeats of
``keep_alive_interval`` are overdue. Until then the survivors' next round cannot take a hot spare in its place or
close without it. torchrun reads both settings from ``--rdzv-conf``; nvidia-resiliency-ext's legacy rendezvous (the
only one before 0.6) fixes them at 5 s and 3 attempts whatever ``--rdzv-conf`` says: every node loss costs up to
15 s of waiting, on top of the recovery itself. (Its barrier rendezvous, the default from 0.6, does not drop nodes by
heartbeats at all: there the two settings have no effect, and ``ft_launch`` says so.)

What this does: :func:`from_rdzv_conf` reads the two settings from ``--rdzv-conf`` with torch's names and defaults;
:func:`install` makes the legacy rendezvous build its settings with them (its settings class, a private upstream
name, through ``utils/upstream.py``). ``megatron.bridge.ft_launch`` calls both, so
``--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3`` drops a lost node after 3 s. The cost is load on the
store host: every node writes the rendezvous state once per interval, so keep the interval at seconds, not less,
on jobs of thousands of nodes.
"""

import functools
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from megatron.bridge.utils import upstream

DEFAULT_INTERVAL_S = 5.0
DEFAULT_MAX_ATTEMPT = 3
"""torch's c10d rendezvous defaults (and nvidia-resiliency-ext's fixed values)."""


@dataclass(frozen=True)
class KeepAlive:
    """The heartbeat settings a rendezvous drops a silent node by."""

    interval_s: float = DEFAULT_INTERVAL_S
    """Seconds between a node's heartbeats (``keep_alive_interval``)."""
    max_attempt: int = DEFAULT_MAX_ATTEMPT
    """Heartbeats a node may miss before it is dropped (``keep_alive_max_attempt``)."""

    @property
    def dropped_after_s(self) -> float:
        """Seconds of silence after which a node is dropped."""
        return self.interval_s * self.max_attempt


def from_rdzv_conf(conf: Optional[str]) -> Optional[KeepAlive]:
    """The settings ``--rdzv-conf`` (``key=value,...``) gives; ``None`` when it names neither.

    Raises:
        ValueError: a value that is not a positive number (the message names the key and the fix).
    """
    pairs = dict(item.split("=", 1) for item in (conf or "").split(",") if "=" in item)
    if "keep_alive_interval" not in pairs and "keep_alive_max_attempt" not in pairs:
        return None
    try:
        interval = float(pairs.get("keep_alive_interval", DEFAULT_INTERVAL_S))
        attempts = int(pairs.get("keep_alive_max_attempt", DEFAULT_MAX_ATTEMPT))
    except ValueError:
        interval, attempts = -1.0, -1
    if not math.isfinite(interval) or interval <= 0 or attempts <= 0:
        raise ValueError(
            f"--rdzv-conf: keep_alive_interval={pairs.get('keep_alive_interval')!r}, keep_alive_max_attempt="
            f"{pairs.get('keep_alive_max_attempt')!r}: give a positive number of seconds and a positive whole number "
            f"of attempts, e.g. keep_alive_interval=1,keep_alive_max_attempt=3"
        )
    return KeepAlive(interval, attempts)


def install(keep_alive: KeepAlive) -> bool:
    """Make nvidia-resiliency-ext's legacy rendezvous use ``keep_alive``; ``False`` when it is not installed."""
    key = upstream.RENDEZVOUS_SETTINGS
    original = upstream.find(key) if upstream.applicable((key,)) else None
    return original is not None and upstream.patch(key, _with_keep_alive(original, keep_alive))


def _with_keep_alive(settings_class: Any, keep_alive: KeepAlive) -> Any:
    """``settings_class``'s constructor with the two heartbeat settings replaced."""

    @functools.wraps(settings_class)
    def build(*args: Any, **kwargs: Any) -> Any:
        kwargs["keep_alive_interval"] = timedelta(seconds=keep_alive.interval_s)
        kwargs["keep_alive_max_attempt"] = keep_alive.max_attempt
        return settings_class(*args, **kwargs)

    return build
