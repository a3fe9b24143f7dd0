"""Processes a rank forks while it saves die with the rank, instead of outliving it hung.

Failure handled: megatron-core writes a checkpoint with processes forked from the rank, one per write bucket, which
report their end through a multiprocessing queue. When the rank is killed in the middle of a save (a rank monitor's
section timeout, the launcher's SIGKILL before a restart), a writer signalling its end waits forever for the dead
rank to acknowledge it (a multiprocessing ``Condition.notify`` waits for the sleeper it woke). Orphaned, it keeps the
rank's stdout and stderr open: whatever reads the job's log (``tee``, a scheduler's log pipe) never sees its end,
and the job looks hung long after its launcher exited (seen in the fault-tolerance example's drill).

How: :func:`die_with_this_process` marks a span; a process forked inside it (by any thread) asks the kernel for
SIGKILL when the thread that forked it ends (``PR_SET_PDEATHSIG``, Linux; a no-op elsewhere), and exits at once if
its parent is already gone. Forks outside the span are left alone (in-process restart's monitor, data-loader
workers), and a process the rank *spawns* (a fresh interpreter) asks for the same itself (:func:`die_with_parent`).
"""

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from collections.abc import Iterator

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal a process gets when its parent thread ends (``<linux/prctl.h>``)."""

_lock = threading.Lock()
_depth = 0
"""How many :func:`die_with_this_process` spans are open in this process (a forked child inherits the count)."""
_registered = False
_parent = 0
"""The pid that forked: set just before the fork, read in the child."""


def _before_fork() -> None:
    global _parent
    _parent = os.getpid()


def _in_child() -> None:
    if _depth == 0:
        return
    if _set_parent_death_signal(signal.SIGKILL) and os.getppid() != _parent:
        os._exit(1)  # the parent died between the fork and the request: nothing will kill this process later


def _set_parent_death_signal(sig: int) -> bool:
    """Ask for ``sig`` when the parent thread ends; whether the kernel took the request."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent(parent: int) -> bool:
    """In a process the rank *spawned*: be SIGKILLed when the rank's spawning thread ends.

    Returns ``False`` when ``parent`` is already gone (the caller should exit).
    """
    return not (_set_parent_death_signal(signal.SIGKILL) and os.getppid() != parent)


@contextlib.contextmanager
def die_with_this_process() -> Iterator[None]:
    """Within the span, processes forked by this process are SIGKILLed when the forking thread ends."""
    global _depth, _registered
    with _lock:
        if not _registered:
            os.register_at_fork(before=_before_fork, after_in_child=_in_child)
            _registered = True
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
