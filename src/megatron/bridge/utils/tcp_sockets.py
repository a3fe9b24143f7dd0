"""The TCP sockets of this host as the kernel lists them (``/proc/net/tcp``, ``tcp6``); Linux only, none elsewhere.

One reader for the two users: the rendezvous-port check (who listens on a port) and the gloo abort shim (which of
this process's connections to shut down).
"""

import os
from dataclasses import dataclass

LISTEN = "0A"
"""The kernel's state code of a listening socket."""
ESTABLISHED = "01"
"""The kernel's state code of a connected socket."""


@dataclass(frozen=True)
class TcpSocket:
    """One row of the kernel's TCP table."""

    local_port: int
    remote_port: int
    state: str
    """The kernel's two-digit hex state code (:data:`LISTEN`, :data:`ESTABLISHED`, ...)."""
    inode: str
    """The socket's inode: ``/proc/<pid>/fd/N`` links to ``socket:[inode]``."""


def tcp_sockets() -> list[TcpSocket]:
    """Every TCP socket of this host (IPv4 and IPv6) the kernel lists; empty where ``/proc`` has no table."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) <= 9:
                continue
            found.append(TcpSocket(_port(cols[1]), _port(cols[2]), cols[3], cols[9]))
    return found


def socket_fds(pid: str = "self") -> dict[str, int]:
    """``inode -> fd`` of the sockets process ``pid`` holds open; empty when ``/proc`` does not tell."""
    fds = {}
    try:
        entries = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return {}
    for fd in entries:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            fds[target[len("socket:[") : -1]] = int(fd)
    return fds


def _port(address: str) -> int:
    """The port of a table address, ``HEXADDR:HEXPORT``."""
    return int(address.rsplit(":", 1)[1], 16)
