"""A launch whose rendezvous port another process already holds: one clear error and exit code 28, at once.

The failure: the launcher that hosts the rendezvous store (torchrun's node rank 0 with ``--master-port``; with
``--rdzv-backend=c10d``, the launcher on the ``--rdzv-endpoint`` host) binds that port when it starts. If another
process listens on it (an earlier job's launcher still running, another service), torchrun's static rendezvous dies
with a raw ``DistNetworkError`` traceback and exit code 1, and the c10d rendezvous (``ft_launcher``'s only one) falls
back to connecting to the port as a client and waits for the squatter to answer like a store: for its read and join
timeouts (600 s and 900 s under ``ft_launcher``) before it fails.

What this does: before the launcher starts anything, :func:`hosted_store` works out, from the launcher's parsed
arguments, the store this launcher will host, and :func:`port_taken` probes its port the way the store binds it (every
address, IPv6 then IPv4, ``SO_REUSEADDR``, then ``listen``). A port in use gives one paragraph naming the host, the
port, the process holding it where ``/proc`` tells, and the fix, and the launcher exits with
``ExitCode.LAUNCH_FAILED`` (28). A port the launcher picks itself (``0``, ``--standalone``, torchrun on one node
without ``--master-port``) is not probed, nor one this launcher will not host (another node's, or
``--rdzv-conf=is_host=false``: the way to run a second launcher of the same job on the store's host). On several
nodes without ``is_host``, a port in use where a store answers is another launcher of the job hosting it: this one
joins when the process listening there is such a launcher (another program holding it is still refused). When the
store's own error surfaces anyway (a port taken between the probe and the bind, an endpoint that cannot be reached),
:func:`launch_error` turns it into the same kind of paragraph.
"""

import argparse
import errno
import os
import re
import socket
from dataclasses import dataclass
from typing import Optional

from megatron.bridge.utils.tcp_sockets import LISTEN, socket_fds, tcp_sockets

C10D_DEFAULT_PORT = 29400
"""The port of a c10d ``--rdzv-endpoint`` without one (torch's ``DEFAULT_PORT``)."""
STATIC_DEFAULT_PORT = 29500
"""torchrun's ``--master-port`` when none is given."""
TORCHRUN, FT_LAUNCHER = "torchrun", "ft_launcher"

FT_LAUNCHER_PREFIXES = ("--ft-", "--ft_")
"""ft_launcher's own options (every release: 0.4's ``--ft-param-*`` aliases, 0.6's and 0.7's ``--ft-*``)."""
FT_LAUNCHER_OPTIONS = (
    "--term-timeout", "--term_timeout", "--workers-stop-timeout", "--workers_stop_timeout",
    "--fault-tol-cfg-path", "--restart-policy", "--restart_policy",
)  # fmt: skip
"""ft_launcher's other options beyond torchrun's that take a value (the last three: 0.4's aliases, gone in 0.6)."""
FT_LAUNCHER_FLAGS = ("--ignore-missing-fault-tol-cfg", "--ft-ignore-missing-cfg")
"""ft_launcher's options that take no value (0.4's spelling, 0.7's; 0.6 has none)."""


def _without_ft_launcher_options(argv: list[str]) -> Optional[list[str]]:
    """``argv`` without ft_launcher's own options and their values (up to the script); ``None``: one lacks its value.

    So that torchrun's parser reads the rest without importing ft_launcher (whose import sets up logging the
    standby's workers must not inherit), and without a list of ft_launcher's options that each release changes:
    every ``--ft-*`` option takes a value, but for :data:`FT_LAUNCHER_FLAGS`.
    """
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):  # the script or module: what follows is its own
            return rest + argv[i:]
        name = arg.split("=", 1)[0]
        if name in FT_LAUNCHER_FLAGS:
            i += 1
        elif name.startswith(FT_LAUNCHER_PREFIXES) or name in FT_LAUNCHER_OPTIONS:
            if "=" not in arg and i + 1 >= len(argv):
                return None
            i += 1 if "=" in arg else 2
        else:
            rest.append(arg)
            i += 1
    return rest


@dataclass(frozen=True)
class StorePort:
    """The rendezvous store a launcher will host."""

    host: str
    port: int
    flag: str
    """The launcher option that named the port (for the message)."""
    shared: bool = False
    """Another launcher of the same job may host it instead (c10d on several nodes, ``is_host`` not given): torch's
    c10d rendezvous then joins the store already listening as a client."""


def parse_ft_launcher_args(argv: list[str]) -> Optional[argparse.Namespace]:
    """ft_launcher's arguments read with torchrun's parser and ft_launcher's extra options; ``None`` if unreadable."""
    from torch.distributed.run import get_args_parser

    torchrun_argv = _without_ft_launcher_options(argv)
    if torchrun_argv is None:
        return None
    parser = get_args_parser()

    def refuse(message: str) -> None:
        raise ValueError(message)

    parser.error = refuse  # type: ignore[method-assign]  # an option no launcher knows: no probe, never an exit
    try:
        return parser.parse_args(torchrun_argv)
    except (ValueError, SystemExit):
        return None


def _conf(text: Optional[str]) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in (text or "").split(",") if "=" in item)
    return {key.strip(): value.strip() for key, value in pairs}


def _split(endpoint: str, default: int) -> tuple[str, int]:
    """(host, port) of ``host[:port]`` (an IPv6 host in brackets), as torch reads it."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    return parse_rendezvous_endpoint(endpoint, default)


def is_local(host: str) -> bool:
    """``host`` is an address of this machine (binding a socket to it works)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0, *address[2:]))
            return True
        except OSError:
            continue
    return False


def hosted_store(args: argparse.Namespace) -> Optional[StorePort]:
    """The store this launcher will bind, from torchrun's or ft_launcher's parsed arguments.

    ``None`` when it binds none on a fixed port: it picks a free one itself, another node hosts it, the rendezvous is
    not torchrun's ``static`` or ``c10d`` one, or ``--rdzv-conf=is_host=false``.
    """
    if getattr(args, "standalone", False):
        return None
    backend, endpoint = args.rdzv_backend, (args.rdzv_endpoint or "").strip()
    if backend == "static":
        if not endpoint and args.master_port is None:
            max_nodes = str(args.nnodes).split(":")[-1]
            if max_nodes == "1":  # torchrun on one node without --master-port: c10d on a free port
                return None
        if getattr(args, "node_rank", 0) != 0:  # node rank 0 hosts the static store, on every address
            return None
        if endpoint:
            host, port = _split(endpoint, -1)
            return StorePort(host, port, "--rdzv-endpoint") if port > 0 else None
        port = STATIC_DEFAULT_PORT if args.master_port is None else int(args.master_port)
        return StorePort(args.master_addr, port, "--master-port") if port > 0 else None
    if backend != "c10d" or not endpoint:
        return None
    host, port = _split(endpoint, C10D_DEFAULT_PORT)
    if port == 0:
        return None
    choice = _conf(args.rdzv_conf).get("is_host", "").lower()
    hosts = choice in ("1", "true", "yes", "y", "t") if choice else is_local(host)
    shared = not choice and str(args.nnodes).split(":")[-1] != "1"
    return StorePort(host, port, "--rdzv-endpoint", shared=shared) if hosts else None


def endpoint(args: argparse.Namespace) -> str:
    """The rendezvous endpoint the launcher uses, as ``host:port`` (torchrun's static one from ``--master-*``)."""
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        port = STATIC_DEFAULT_PORT if args.master_port is None else args.master_port
        return f"{args.master_addr}:{port}"
    return str(args.rdzv_endpoint or "")


def in_use(port: int) -> bool:
    """Another socket listens on ``port``: the store's own bind (every address, IPv6 then IPv4) would fail."""
    refused = False
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((address, port))
                probe.listen(1)
                return False
            except OSError as err:
                refused = refused or err.errno == errno.EADDRINUSE
    return refused


def holder(port: int) -> Optional[str]:
    """``pid N (command line)`` of a process listening on TCP ``port`` of this host, where ``/proc`` tells."""
    found = listener(port)
    return None if found is None else f"pid {found[0]} ({' '.join(found[1])[:120]})"


def listener(port: int) -> Optional[tuple[int, list[str]]]:
    """(pid, command-line arguments) of a process listening on TCP ``port`` of this host, where ``/proc`` tells."""
    inodes = {sock.inode for sock in tcp_sockets() if sock.state == LISTEN and sock.local_port == port}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()) if inodes else ():
        if not inodes.intersection(socket_fds(pid)):
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:  # gone meanwhile
            continue
        return int(pid), [arg for arg in argv if arg]
    return None


def _fix(store: StorePort, launcher: str) -> str:
    if launcher == TORCHRUN and store.flag == "--master-port":
        another = (
            "--master-port=<a free port> (on a single node, leave --master-port out, or give --standalone, and "
            "torchrun picks a free one)"
        )
    else:
        another = (
            f"--rdzv-endpoint={store.host}:<a free port> (on a single node, --rdzv-endpoint={store.host}:0 makes "
            "the launcher pick a free one)"
        )
        if launcher == FT_LAUNCHER:
            another += (
                "; if another launcher of this same job on this host hosts the store, give this one "
                "--rdzv-conf=is_host=false"
            )
    return f"Fix: free the port (stop the process holding it), or launch with another port: {another}."


def port_in_use_message(store: StorePort, launcher: str) -> str:
    """The paragraph for a port another process holds."""
    held = holder(store.port)
    by = f" by {held}" if held else ""
    return (
        f"launch failed: the rendezvous port {store.host}:{store.port} ({store.flag}) is already in use on this "
        f"host{by}, so this launcher cannot host the rendezvous store; no worker was started. {_fix(store, launcher)} "
        "Exit code 28 (LAUNCH_FAILED)."
    )


def port_taken(store: Optional[StorePort], launcher: str) -> Optional[str]:
    """The paragraph if ``store``'s port is in use (``None``: free, nothing to probe, or a peer's store).

    A ``shared`` port in use is fine when a launcher holds it: the launcher of another node of the job (several
    "nodes" on one host, or a replacement node on the store's host) hosts it, and this one joins.
    """
    if store is None or not in_use(store.port):
        return None
    if store.shared and peer_launcher(store.port):
        return None
    return port_in_use_message(store, launcher)


LAUNCHERS = ("megatron.bridge.ft_launch", "ft_launcher", "torch.distributed.run", "torchrun", "megatron.bridge.launch")
"""The launchers whose rendezvous store another launcher of the same job may join: a module run with ``-m`` or an
executable, matched as a whole argument (or an executable's file name), never as part of one."""


def peer_launcher(port: int) -> bool:
    """A launcher process of this host listens on ``port``: another node of the job (its agent) hosts the store.

    Asking the listener to answer as a store would block without bound on a squatter that accepts and never
    replies (torch's store client ignores its timeout there), so the listener's command line decides.
    """
    found = listener(port)
    return found is not None and any(os.path.basename(arg) in LAUNCHERS for arg in found[1])


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: Optional[BaseException] = err
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def launch_error(
    err: BaseException, store: Optional[StorePort], endpoint: Optional[str], launcher: str
) -> Optional[str]:
    """The paragraph for a rendezvous error the launcher raised (``None``: not one).

    A bind that failed with ``EADDRINUSE`` is a port in use; a ``DistNetworkError`` or a
    ``RendezvousConnectionError`` otherwise is an endpoint that cannot be reached.
    """
    from torch.distributed import DistNetworkError

    chain = _chain(err)
    texts = " | ".join(str(e) for e in chain)
    if "EADDRINUSE" in texts or "address already in use" in texts.lower():
        if store is None:
            host, port = _split(endpoint or "localhost", 0)
            named = re.search(r"port: (\d+)", texts)  # the store's message names the port it could not bind
            store = StorePort(host, int(named.group(1)) if named else port, "--rdzv-endpoint")
        return port_in_use_message(store, launcher)
    if any(isinstance(e, DistNetworkError) or type(e).__name__ == "RendezvousConnectionError" for e in chain):
        where = f"{store.host}:{store.port}" if store is not None else endpoint or "the rendezvous endpoint"
        return (
            f"launch failed: the rendezvous store at {where} cannot be reached ({type(chain[-1]).__name__}: "
            f"{str(chain[-1]).strip()[:300]}). Fix: check that the host is right and reachable from this node and "
            "that the node hosting the store started; requeue once it is. Exit code 28 (LAUNCH_FAILED)."
        )
    return None
