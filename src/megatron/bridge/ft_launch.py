"""``python -m megatron.bridge.ft_launch``: nvidia-resiliency-ext's ``ft_launcher``, without its port race.

The failure: with ``--rdzv-backend=c10d`` (the only one ``ft_launcher`` takes), the launcher picks the port rank 0's
store will listen on (``MASTER_PORT``) by binding port 0 and closing the socket, at every (re)start. Rank 0 binds it
seconds later, after its imports. In between, the kernel may hand the same port to any process on the node, as the
local end of an outgoing connection or a ``listen()`` on port 0, and rank 0 dies with ``EADDRINUSE``: a lost restart
on a busy node, and a failed attempt where none was due.

What this does: the same launcher and arguments, except that the port is drawn at random from the ports
the kernel never hands out by itself (outside ``/proc/sys/net/ipv4/ip_local_port_range``) and checked by binding it.
Only an explicit bind of the same number in the same seconds can still collide. Where the range cannot be read, the
launcher's own choice stands. When ft_launcher ends after its workers failed (restarts used up, or a rank asked it
not to restart), it exits 1 whatever their codes; this launcher exits with theirs instead (:class:`WorkerFailures`),
chosen as ``megatron.bridge.launch`` does. A worker that exits with a code whose action is *stop* (a config error, a
full disk: ``exit_codes.STOP_CODES``) is not restarted, even when it failed before it could ask the rank monitor not
to restart it (a config error found at start-up): the restarts left are dropped, the rendezvous is closed, and the
launcher exits with its code.

``--event-dir DIR`` (ours, removed before ft_launcher parses the rest) writes the launcher's side of the event
stream into ``DIR`` (``training/events/launcher.py``: worker exits, in-job restarts and their phases, rank-monitor
timeouts)
and ``exit`` with the launcher's exit code; give the ranks the same directory (``health.event_dir``, by default
``<checkpoint.save>/events``).

Host and launch faults: a ``--rdzv-endpoint`` port on this host that another process listens on is found before
anything starts (a bind probe, ``utils/rendezvous_port.py``), instead of a rendezvous that waits 600 s for the
squatter to answer; the store's own bind or connection error, if it surfaces later, is mapped the same way: one
paragraph naming the host, the port and the fix, exit code 28 (``LAUNCH_FAILED``; with ``--event-dir``, an ``exit``
event with the paragraph as its ``detail``). With ``--event-dir``, a worker the kernel's out-of-memory killer killed
is named as such (``training/events/launcher.py``, ``utils/oom.py``).

Elastic ranges: ``--nnodes=MIN:MAX`` with ``--standalone`` (no other node can join) is refused before anything
starts, exit code 2 (``CONFIG_ERROR``); under nvidia-resiliency-ext's barrier rendezvous (0.6's default, 0.7's only
one) a range means MIN training nodes plus hot spares, which a line says. The range the workers will see is passed
to them as ``MBRIDGE_NNODES`` (``utils/elastic.py``): training checks every node count of it at start.

Example:
    python -m megatron.bridge.ft_launch --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:0
        --max-restarts=3 --event-dir=runs/x/events -m megatron.bridge.recipes.tiny_gpt train.train_iters=100
        health.event_dir=runs/x/events
"""

import functools
import random
import socket
import sys
from typing import Any, Optional

from megatron.bridge import standby
from megatron.bridge.training.config_sections.resiliency import (
    INPROCESS_COORDINATION_PORT_OFFSET,
    INPROCESS_STORE_PORT_OFFSET,
)
from megatron.bridge.training.events import launcher as launcher_events
from megatron.bridge.training.events.stream import EventKind, EventWriter, Process, launcher_file
from megatron.bridge.training.exit_codes import STOP_CODES, ExitCode, job_exit_code
from megatron.bridge.utils import elastic, rendezvous_keep_alive, rendezvous_port, upstream
from megatron.bridge.utils.process_start import process_start_time
from megatron.bridge.utils.rendezvous_port import StorePort

_PORT_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 10000
_PORTS_ABOVE = max(INPROCESS_STORE_PORT_OFFSET, INPROCESS_COORDINATION_PORT_OFFSET)
"""How many ports above ``MASTER_PORT`` the workers use."""
"""Below this, well-known and registered services live."""
EVENT_DIR = "--event-dir"
"""The launcher flag naming the event directory (``--event-dir DIR`` or ``--event-dir=DIR``)."""


def ports_outside_ephemeral_range(path: str = _PORT_RANGE) -> Optional[list[int]]:
    """Ports above the kernel's ephemeral range (else below it, from 10000); ``None`` if it cannot be read.

    Each leaves room for the ports the workers derive from it (in-process restart's stores on ``MASTER_PORT + 1``
    and ``+ 2``): those are real ports outside the ephemeral range too.
    """
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    above = list(range(high + 1, 65536 - _PORTS_ABOVE))
    return above if len(above) >= 1000 else list(range(_LOWEST, low - _PORTS_ABOVE)) or None


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


def a_quiet_port() -> int:
    """A free port outside the ephemeral range (closed again: the caller's process binds it)."""
    with socket_on_a_quiet_port() as sock:
        return sock.getsockname()[1]


def pick_quiet_ports() -> bool:
    """Make the installed ft_launcher pick the workers' store port with :func:`a_quiet_port`; ``False``: not found.

    Before nvidia-resiliency-ext 0.6 its own elastic agent asks for a bound socket; from 0.6 torch's rendezvous
    asks for a port number.
    """
    key = upstream.applicable((upstream.PICK_PORT_SOCKET, upstream.PICK_PORT_NUMBER))
    if key is None:
        return False
    return upstream.patch(key, socket_on_a_quiet_port if key == upstream.PICK_PORT_SOCKET else a_quiet_port)


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


def _rendezvous_errors_exit_28(run: Any, store: Optional[StorePort], parsed: Any) -> Any:
    """ft_launcher's ``run``, with a rendezvous error (a port in use, an endpoint not reached) ending in exit 28.

    ft_launcher's ``main`` turns every exception of ``run`` into exit code 1; ``SystemExit`` passes through it.
    """
    endpoint = rendezvous_port.endpoint(parsed) if parsed is not None else None

    @functools.wraps(run)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - only a rendezvous error is ours to explain; others go on
            failed = rendezvous_port.launch_error(err, store, endpoint, rendezvous_port.FT_LAUNCHER)
            if failed is None:
                raise
            print(failed, file=sys.stderr)
            raise SystemExit(int(ExitCode.LAUNCH_FAILED)) from err

    return wrapper


class WorkerFailures:
    """The workers' failures the agent saw last: what the job's exit code is taken from when ft_launcher exits 1.

    ft_launcher exits 1 whatever its workers' codes were, both when its restarts are used up and when a rank asked it
    not to restart (a stop code: its rendezvous is closed, and the agent ends on that). The agent's worker monitor
    (a private upstream method, through ``utils/upstream.py``) is wrapped to keep the last failures it returned; when
    they hold a stop code, the agent's restarts left are dropped and the rendezvous closed, so that it stops instead of
    restarting.
    """

    def __init__(self) -> None:
        self.codes: list[int] = []
        """The last failed workers' exit codes (negative: a signal), in the order they failed."""

    def install(self) -> bool:
        """Wrap the agent's worker monitor; ``False`` (the launcher's own exit code stands) when it is gone."""
        original = upstream.find(launcher_events.MONITOR)
        if original is None:
            return False

        @functools.wraps(original)
        def monitor(agent: Any, worker_group: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(agent, worker_group, *args, **kwargs)
            self.seen(getattr(result, "failures", None) or {})
            stop = self.stop_code()
            if stop is not None and upstream.agent_restarts_left(agent) > 0:
                print(f"ft_launch: a worker exited with exit code {stop} ({ExitCode(stop).name}), whose action is "
                      "stop: the worker group is not restarted", file=sys.stderr)  # fmt: skip
                upstream.drop_agent_restarts(agent)
                _close_rendezvous(worker_group)
            return result

        return upstream.patch(launcher_events.MONITOR, monitor)

    def seen(self, failures: dict[int, Any]) -> None:
        """A look at the workers returned ``failures`` (global rank -> failure with ``exitcode`` and ``timestamp``).

        Every look replaces what the last one saw: after a restart whose workers run healthy, an old failure must not
        name a later end of the job (a signal to the launcher, a rendezvous error). ft_launcher's own ends after a
        failure (restarts used up, a rank asked it to stop) come right after a look that saw it.
        """
        in_order = sorted(failures.values(), key=lambda failure: failure.timestamp)
        self.codes = [int(failure.exitcode) for failure in in_order]

    def stop_code(self) -> Optional[int]:
        """The job's exit code when the last look saw a failure whose action is *stop* (else ``None``)."""
        code = job_exit_code(self.codes) if self.codes else None
        return code if code in STOP_CODES else None

    def exit_code(self, launcher_code: int) -> int:
        """The job's exit code: the workers' (:func:`job_exit_code`) where ft_launcher's 1 hides it, else its own.

        nvidia-resiliency-ext 0.4 with ``--max-restarts=0`` exits 0 after its workers failed ("Agent .run() is OK. No
        failures in the result"): the workers' code replaces that 0 too.
        """
        workers = job_exit_code(self.codes) if self.codes else None
        if launcher_code == 0 and workers not in (None, 0):
            print(f"ft_launch: ft_launcher exits 0 though its workers failed (exit code {workers}) and none was "
                  "restarted; the launcher exits with their code", file=sys.stderr)  # fmt: skip
            return workers
        if launcher_code != 1 or workers in (None, 1):
            return launcher_code
        known = {int(c): c.name for c in ExitCode}
        name = known.get(workers) or ("killed by a signal" if workers > 128 else "not one of ours")
        print(f"ft_launch: the workers failed with exit code {workers} ({name}); the launcher exits with it, not with "
              "ft_launcher's 1", file=sys.stderr)  # fmt: skip
        return workers


def _close_rendezvous(worker_group: Any) -> None:
    """Close the job's rendezvous, as a rank's request not to restart does: no node's agent starts another round.

    With ``--ft-restart-policy=min-healthy`` the agent recounts its restarts from the rendezvous round, so this is
    what stops it there; other nodes' agents stop at their next rendezvous either way.
    """
    handler = getattr(getattr(worker_group, "spec", None), "rdzv_handler", None)
    if handler is None:
        return
    try:
        handler.set_closed()
    except Exception as err:  # noqa: BLE001 - the store may be gone with its host; the dropped restarts still hold
        print(f"ft_launch: could not close the rendezvous ({type(err).__name__}: {err})", file=sys.stderr)


def _elastic_range(parsed: Any, argv: list[str]) -> Optional[str]:
    """Why ``--nnodes=MIN:MAX`` cannot be honoured (``None``: it can); exports the workers' range (``utils/elastic``).

    Under nvidia-resiliency-ext's barrier rendezvous a range means hot spares, not shrinking: a line says so.
    """
    refused = elastic.refusal(parsed, "ft_launch")
    if refused is not None:
        return refused
    notice = elastic.notice(parsed, argv)
    if notice is not None:
        print(notice, file=sys.stderr)
    elastic.export(elastic.workers_range(parsed, argv))
    return None


def _keep_alive(parsed: Any, argv: list[str]) -> Optional[str]:
    """Why ``--rdzv-conf``'s heartbeat settings cannot be used (``None``: they are used, or not given).

    nvidia-resiliency-ext's legacy rendezvous ignores them (``utils/rendezvous_keep_alive.py``); this makes it honour
    them. Its barrier rendezvous does not drop nodes by heartbeats: there a line says they have no effect.
    """
    try:
        wanted = rendezvous_keep_alive.from_rdzv_conf(getattr(parsed, "rdzv_conf", None))
    except ValueError as err:
        return f"ft_launch: {err}"
    if wanted is None:
        return None
    if elastic.barrier_rendezvous(argv):
        print("ft_launch: --rdzv-conf keep_alive_interval/keep_alive_max_attempt have no effect under "
              "nvidia-resiliency-ext's barrier rendezvous: it does not drop nodes by their heartbeats",
              file=sys.stderr)  # fmt: skip
    elif rendezvous_keep_alive.install(wanted):
        print(f"ft_launch: the rendezvous drops a node after {wanted.dropped_after_s:g} s without heartbeats "
              f"(keep_alive_interval={wanted.interval_s:g}, keep_alive_max_attempt={wanted.max_attempt})",
              file=sys.stderr)  # fmt: skip
    else:
        print("ft_launch: --rdzv-conf keep_alive_interval/keep_alive_max_attempt cannot be applied: this "
              "nvidia-resiliency-ext has no legacy rendezvous settings to set (utils/upstream.py)",
              file=sys.stderr)  # fmt: skip
    return None


def _refuse(why: str, code: ExitCode, event_dir: Optional[str]) -> int:
    """Say ``why`` the launch stops before anything started (and write it as the launcher's ``exit`` event)."""
    print(why, file=sys.stderr)
    if event_dir:
        EventWriter(event_dir, launcher_file(), Process.LAUNCHER).emit(EventKind.EXIT, exit_code=int(code), detail=why)
    return int(code)


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``ft_launcher`` with ``argv`` (default: this process's arguments); return its exit code."""
    import torch  # noqa: F401 - before the standby forks: its workers need it; ft_launcher's logging they do not

    event_dir, argv = take_event_dir(sys.argv[1:] if argv is None else argv)
    parsed = rendezvous_port.parse_ft_launcher_args([a for a in argv if a != standby.OPT_OUT])
    refused = (_elastic_range(parsed, argv) or _keep_alive(parsed, argv)) if parsed is not None else None
    if refused is not None:
        return _refuse(refused, ExitCode.CONFIG_ERROR, event_dir)
    store = rendezvous_port.hosted_store(parsed) if parsed is not None else None
    taken = rendezvous_port.port_taken(store, rendezvous_port.FT_LAUNCHER)  # before the standby starts importing
    if taken is not None:
        return _refuse(taken, ExitCode.LAUNCH_FAILED, event_dir)
    argv = standby.install("ft_launcher", argv)
    from nvidia_resiliency_ext.fault_tolerance import launcher as ft_launcher
    from nvidia_resiliency_ext.fault_tolerance.launcher import main as ft_launcher_main

    ft_launcher.run = _rendezvous_errors_exit_28(ft_launcher.run, store, parsed)
    pick_quiet_ports()
    events = launcher_events.install(event_dir) if event_dir else None
    failures = WorkerFailures()
    failures.install()
    if events is not None:
        events.writer.emit(EventKind.LAUNCHER_STARTED, process_start=process_start_time())
    code = 1
    try:
        code = ft_launcher_main(argv) or 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        code = failures.exit_code(code)
        if events is not None:
            events.writer.emit(EventKind.EXIT, exit_code=code)
    return code


if __name__ == "__main__":
    sys.exit(main())
