"""A full disk, a kernel OOM kill and a wall-clock jump, simulated for real once the registry says one is due.

The registry (``faults/injection.py``) decides when; this fills a file system (``fill``), allocates memory until the
kernel kills the process (``oom``), moves the wall clock (``clock-jump``), and finds the processes a rank started
(``preempt-tree`` signals them all). Kept apart so that the registry reads as the list of faults and when they strike.
"""

import errno
import logging
import os
import time

from megatron.bridge.utils import oom

logger = logging.getLogger("megatron.bridge.training.faults.injection")  # the drills look for these lines there

FILL_FILE = "mbridge-fill.bin"
"""The file a ``fill`` fault fills a checkpoint directory's file system with (delete it to free the space)."""
FILL_LEAVES = 64 * 1024
"""Free bytes a ``fill`` fault leaves: room for a small file, not for a checkpoint shard."""


def fill_filesystem(directory: str) -> None:
    """Fill the file system of ``directory`` up to :data:`FILL_LEAVES` free bytes, into :data:`FILL_FILE` there."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, FILL_FILE)
    with open(path, "ab", buffering=0) as f:
        cap = None  # other ranks may write meanwhile: what they took makes a request fail, then ask for less
        for _ in range(1000):
            st = os.statvfs(directory)
            size = st.f_bavail * st.f_frsize - FILL_LEAVES
            size = size if cap is None else min(size, cap)
            if size < 4096:
                break
            try:
                os.posix_fallocate(f.fileno(), f.seek(0, os.SEEK_END), size)
                cap = None
            except OSError as err:
                if err.errno == errno.ENOSPC:
                    cap = size // 2
                    continue
                try:  # a file system without fallocate: write the bytes
                    f.write(bytes(min(size, 1 << 26)))
                except OSError:
                    break
        filled = f.seek(0, os.SEEK_END)
    logger.error("fault injection: filled the file system of %s with %d bytes (%s)", directory, filled, path)


def descendants(pid: int) -> list[int]:
    """PIDs of every process below ``pid`` (Linux ``/proc``), children before grandchildren."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop(0)
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:  # exited meanwhile
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            queue += children
    return found


OOM_CHUNK = 64 << 20
"""Bytes the ``oom`` fault allocates (and writes) at a time."""
OOM_MARGIN, OOM_WITHOUT_LIMIT = 256 << 20, 2 << 30
"""How far past its memory limit, or how far without one, the ``oom`` fault allocates before it gives up."""


def allocate_until_killed() -> None:
    """Allocate and touch host memory until the kernel's OOM killer kills this process (the ``oom`` fault).

    Bounded: past its memory cgroup's limit plus 256 MiB (2 GiB without a limit), nothing killed it, and a
    ``RuntimeError`` says so rather than starving the machine.
    """
    limit = oom.own_memory_limit()
    bound = limit + OOM_MARGIN if limit is not None else OOM_WITHOUT_LIMIT
    held = []
    while len(held) * OOM_CHUNK < bound:
        held.append(b"\x01" * OOM_CHUNK)  # written, so charged to the cgroup (a zero-filled mapping would not be)
    del held
    where = f"its memory cgroup's limit of {limit >> 20} MiB" if limit is not None else "no memory limit"
    raise RuntimeError(
        f"fault injection: oom allocated {bound >> 20} MiB and the kernel did not kill the rank ({where}); "
        "run it in a memory cgroup with a limit (Slurm's --mem sets one)"
    )


def jump_clock(hours: float) -> None:
    """Move this process's wall clock ``hours`` ahead from now on (the ``clock-jump`` fault).

    ``time.time()`` and ``time.time_ns()`` read ``hours`` later; the monotonic clocks are not touched. A real step
    of the system clock needs ``CAP_SYS_TIME`` and moves every process on the machine; this moves one rank's, where
    every timeout it keeps can be watched.
    """
    offset = hours * 3600.0
    wall, wall_ns = time.time, time.time_ns
    time.time = lambda: wall() + offset
    time.time_ns = lambda: wall_ns() + int(offset * 1e9)
    logger.error("fault injection: wall clock moved %+g h (time.time() now %.0f)", hours, time.time())
