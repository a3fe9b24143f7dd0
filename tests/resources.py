"""Ports and directories for tests, from one place, so that two test runs on one machine never collide.

A port "free a moment ago" (bind to port 0, close, hand the number out) is not enough when several pytest workers
and several suites run side by side: another process can be handed the same number before the launcher binds it.
:func:`free_port` instead reserves each port for the life of the process that asked: it takes an exclusive
``flock`` on a lock file named after the port (in one machine-wide directory, shared by every run on the
machine) and keeps it until the process exits, so no other test process on the machine can be given that port
meanwhile. Ports go out in blocks (a launch also listens on the ports just above its own), from a range below the
kernel's ephemeral range, which the kernel never hands out on its own to a socket bound to port 0 or to an
outgoing connection.

Directories: every test writes under pytest's ``tmp_path`` / ``tmp_path_factory``; ``scripts/run_tests.sh`` gives
each run its own ``--basetemp``, so runs do not share or clean up each other's directories. Set-up that several
tests (and several pytest-xdist workers) share is made once per run with :func:`once_per_run`.
"""

import contextlib
import fcntl
import os
import pickle
import random
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

PORT_RANGE = (20000, 32000)
"""Ports handed out to tests: below Linux's default ephemeral range (32768-60999)."""
PORT_BLOCK = 4
"""Ports reserved together: a launch listens on its port and on the next ones (in-process restart's store is on
``MASTER_PORT + 2``)."""
_LOCK_DIR = "/tmp/mbridge-test-ports"
"""Machine-wide, whatever ``TMPDIR`` a run sets: every test process on the machine must see the same locks."""
T = TypeVar("T")
_held: dict[int, int] = {}
"""First port of a block -> file descriptor of its lock, held until this process exits."""


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 such that it and the next ``PORT_BLOCK - 1`` ports are given to no other test
    process on this machine while this one lives."""
    os.makedirs(_LOCK_DIR, exist_ok=True)
    with contextlib.suppress(PermissionError):  # another user made it: they made it 0o777 too
        os.chmod(_LOCK_DIR, 0o777)
    low, count = PORT_RANGE[0], (PORT_RANGE[1] - PORT_RANGE[0]) // PORT_BLOCK
    first = random.randrange(count)
    for offset in range(count):
        port = low + (first + offset) % count * PORT_BLOCK
        if port in _held:
            continue
        try:
            fd = os.open(os.path.join(_LOCK_DIR, f"{port}.lock"), os.O_CREAT | os.O_RDWR, 0o666)
        except PermissionError:  # another user's lock file: that user's tests use the block
            continue
        with contextlib.suppress(PermissionError):
            os.fchmod(fd, 0o666)  # past the umask, so another user's runs can lock it too
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another test process holds it
            os.close(fd)
            continue
        if not all(_bindable(p) for p in range(port, port + PORT_BLOCK)):  # something outside the tests uses one
            os.close(fd)
            continue
        _held[port] = fd
        return port
    raise RuntimeError(f"no free port block left in {PORT_RANGE}: {len(_held)} held by this process")


def shared_root(tmp_path_factory) -> Path:
    """A directory shared by every pytest worker of this run (pytest-xdist workers each have their own basetemp)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(parents=True, exist_ok=True)
    return root


def once_per_run(tmp_path_factory, name: str, make: Callable[[Path], T]) -> T:
    """``make(directory)``, run once per test run whichever worker asks first; the others wait and get its result.

    For expensive shared set-up (a reference training run, a base checkpoint) that several workers need: the
    first caller holds a lock while it makes ``<shared>/<name>/`` and pickles the result; a later caller, in any
    worker, takes the lock, finds the result and returns it. A failed ``make`` leaves no result: its caller gets
    the error and the next caller makes it afresh.
    """
    root = shared_root(tmp_path_factory)
    directory, result = root / name, root / f"{name}.result.pickle"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocks while another worker makes it
        if result.exists():
            return pickle.loads(result.read_bytes())
        if directory.exists():  # an earlier attempt failed half-way
            shutil.rmtree(directory)
        directory.mkdir()
        value = make(directory)
        result.write_bytes(pickle.dumps(value))
        return value
