"""``python -m megatron.bridge.ft_launch``: nvidia-resiliency-ext's ``ft_launcher``, without its port race.

The failure: with ``--rdzv-backend=c10d`` (the only one ``ft_launcher`` takes), the launcher picks the port rank 0's
store will listen on (``MASTER_PORT``) by binding port 0 and closing the socket, at every (re)start. Rank 0 binds it
seconds later, after its imports. In between, the kernel may hand the same port to any process on the node, as the
local end of an outgoing connection or a ``listen()`` on port 0, and rank 0 dies with ``EADDRINUSE``: a lost restart
on a busy node, and a failed attempt where none was due.

What this does: the same launcher, arguments and exit codes, except that the port is drawn at random from the ports
the kernel never hands out by itself (outside ``/proc/sys/net/ipv4/ip_local_port_range``) and checked by binding it.
Only an explicit bind of the same number in the same seconds can still collide. Where the range cannot be read, the
launcher's own choice stands.

``--event-dir DIR`` (ours, removed before ft_launcher parses the rest) writes the launcher's side of the event
stream into ``DIR`` (``launcher_events.py``: worker exits, in-job restarts and their phases, rank-monitor timeouts)
and ``exit`` with the launcher's exit code; give the ranks the same directory (``health.event_dir``, by default
``<checkpoint.save>/events``).

Example:
    python -m megatron.bridge.ft_launch --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:0
        --max-restarts=3 --event-dir=runs/x/events -m megatron.bridge.recipes.tiny_gpt train.train_iters=100
        health.event_dir=runs/x/events
"""

import random
import socket
import sys
from typing import Optional

from megatron.bridge import launcher_events, standby
from megatron.bridge.training.event_stream import EventKind
from megatron.bridge.training.goodput import process_start_time
from megatron.bridge.utils import upstream

_PICK_PORT = "nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.agent.server.api:_get_socket_with_port"
_PORT_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 10000
"""Below this, well-known and registered services live."""
EVENT_DIR = "--event-dir"
"""The launcher flag naming the event directory (``--event-dir DIR`` or ``--event-dir=DIR``)."""


def ports_outside_ephemeral_range(path: str = _PORT_RANGE) -> Optional[list[int]]:
    """Ports above the kernel's ephemeral range (else below it, from 10000); ``None`` if it cannot be read."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    above = list(range(high + 1, 65536))
    return above if len(above) >= 1000 else list(range(_LOWEST, low)) or None


def socket_on_a_quiet_port() -> socket.socket:
    """A socket bound to a free port outside the ephemeral range (the caller reads the port and closes it)."""
    candidates = ports_outside_ephemeral_range()
    for port in random.sample(candidates, min(64, len(candidates))) if candidates else []:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("", port))
            return sock
        except OSError:
            sock.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("", 0))
    return sock


def take_event_dir(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """(the ``--event-dir`` value, ``argv`` without it); ``-m``/``--module`` and what follows pass unchanged."""
    rest, found, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-m", "--module"):
            return found, rest + argv[i:]
        if arg == EVENT_DIR and i + 1 < len(argv):
            found, i = argv[i + 1], i + 2
            continue
        if arg.startswith(EVENT_DIR + "="):
            found = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return found, rest


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``ft_launcher`` with ``argv`` (default: this process's arguments); return its exit code."""
    import torch  # noqa: F401 - before the standby forks: its workers need it; ft_launcher's logging they do not

    event_dir, argv = take_event_dir(sys.argv[1:] if argv is None else argv)
    argv = standby.install("ft_launcher", argv)
    from nvidia_resiliency_ext.fault_tolerance.launcher import main as ft_launcher_main

    upstream.patch(_PICK_PORT, socket_on_a_quiet_port)
    events = launcher_events.install(event_dir) if event_dir else None
    if events is not None:
        events.writer.emit(EventKind.LAUNCHER_STARTED, process_start=process_start_time())
    code: Optional[int] = 1
    try:
        code = ft_launcher_main(argv) or 0
        return code
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
        raise
    finally:
        if events is not None:
            events.writer.emit(EventKind.EXIT, exit_code=code)


if __name__ == "__main__":
    sys.exit(main())
