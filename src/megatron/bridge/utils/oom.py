"""A rank killed by the kernel's out-of-memory killer, told apart from any other SIGKILL.

The failure: a rank whose host memory (pinned buffers, data-loader workers, a CPU copy of a checkpoint, a leak) grows
past its memory cgroup's limit, or past what the machine has, is killed by the kernel with SIGKILL. The rank writes
nothing; the launcher sees "killed by signal 9" (exit 137), exactly what a ``kill -9``, a rank monitor or a
scheduler's hard stop leaves. Nobody learns that memory was the cause, and a restart with the same settings dies the
same way.

How: when a launcher starts its workers it makes an :class:`OomWatch`, which notes the host's OOM-kill counter
(``oom_kill`` in ``/proc/vmstat``, which counts every kill of the kernel's OOM killer, memory-cgroup limits and
machine-wide shortage alike). When a worker dies by SIGKILL, :meth:`OomWatch.verdict` looks for the kernel's own
record of the kill in its log (``/dev/kmsg``: ``Killed process <pid> (...)``, and the ``oom-kill:`` line naming the
memory cgroup): a record naming the worker's pid is proof. Where the kernel log cannot be read (a container without
``/dev/kmsg``, a reader without the right) or names pids of another pid namespace, a rise of the counter since the
workers started is the evidence, reported as likely, not certain: another process of the host may have been the
victim. A readable log that names other pids only (same pid namespace) means the worker was killed by something
else. The cgroup's limit comes from the cgroup the kernel names (v1 ``memory.limit_in_bytes``, v2 ``memory.max``).

Counters of the worker's own memory cgroup (v1 ``memory.oom_control``'s ``oom_kill``, ``memory.failcnt``) are not
used: the worker's cgroup can no longer be read from ``/proc/<pid>`` once it is dead, and in cgroup v1 a kill in a
child cgroup is not counted in its parent's ``oom_kill``.

:func:`message` is the log line; the launchers (``megatron.bridge.launch``, and ``training/events/launcher.py`` under
``megatron.bridge.ft_launch --event-dir``) write it, the latter with a ``fault_detected`` event (``out_of_memory``).
"""

import errno
import os
import re
import time
from dataclasses import dataclass
from typing import Optional

VMSTAT = "/proc/vmstat"
KMSG = "/dev/kmsg"
CGROUP_ROOT = "/sys/fs/cgroup"
_KILLED = re.compile(r"Killed process (\d+) \(([^)]*)\)(?:.*?anon-rss:(\d+)kB)?")
_OOM_KILL = re.compile(r"oom-kill:constraint=(\w+),.*?task_memcg=([^,]*),.*?pid=(\d+)")
_WINDOW_SLACK_S = 60.0
"""Kernel-log records this long before the watch started still count (the log's clock and ``time.monotonic()``
may drift apart a little); older ones are of processes that used the same pid before."""

FIX = (
    "Fix: use less host memory per rank (lower train.micro_batch_size, turn on activation recomputation with "
    "model.recompute_granularity=selective or full, keep fewer data-loader workers), spread the model over more "
    "nodes (more tensor or pipeline parallelism), or raise the job's memory limit; a restart with the same settings "
    "will be killed again."
)


@dataclass(frozen=True)
class OomVerdict:
    """Why a SIGKILLed worker is thought killed by the kernel's out-of-memory killer."""

    pid: int
    certain: bool
    """The kernel log names this pid (else: the host's OOM-kill counter rose since the workers started)."""
    evidence: str
    """What was read, for people."""
    memcg: Optional[str] = None
    """The memory cgroup the kernel killed it in (``/`` or ``None``: the machine ran out, or not known)."""
    limit_bytes: Optional[int] = None
    """That cgroup's memory limit, where it could be read."""
    anon_rss_kb: Optional[int] = None
    """The process's anonymous memory when it was killed (kernel log)."""


def oom_kill_count(path: str = VMSTAT) -> Optional[int]:
    """The host's count of OOM-killer kills since boot (``None``: not readable, or a kernel without it)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def read_kernel_log(path: str = KMSG) -> Optional[list[tuple[float, str]]]:
    """(seconds since boot, message) of every record the kernel log still holds; ``None`` if it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    records = []
    try:
        while True:
            try:
                raw = os.read(fd, 8192)  # one record per read
            except BlockingIOError:
                break  # read everything
            except OSError as err:
                if err.errno == errno.EPIPE:  # records were overwritten under us: go on with the next
                    continue
                return None if not records else records
            if not raw:
                break
            for line in raw.decode("utf-8", "replace").splitlines():  # /dev/kmsg gives one record a read
                head, _, body = line.partition(";")
                fields = head.split(",")
                try:  # "<priority>,<sequence>,<microseconds since boot>,<flags>;<message>"; " KEY=value" lines
                    records.append((int(fields[2]) / 1e6, body))
                except (IndexError, ValueError):
                    continue
    finally:
        os.close(fd)
    return records


def _nested_pid_namespace() -> bool:
    """Whether the pids this process sees are not the kernel log's (a pid namespace below the host's)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return len(line.split()) > 2
    except OSError:
        pass
    return False


def cgroup_memory_limit(memcg: str, root: str = CGROUP_ROOT) -> Optional[int]:
    """The memory limit of cgroup ``memcg`` (v1 or v2); ``None`` for none, or if it cannot be read (gone)."""
    for path in (f"{root}/memory{memcg}/memory.limit_in_bytes", f"{root}{memcg}/memory.max"):
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value == "max" or not value.isdigit() or int(value) >= 1 << 60:  # v1 writes "no limit" as ~2^63
            return None
        return int(value)
    return None


def own_memory_limit(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> Optional[int]:
    """The memory limit that applies to this process: the lowest of its memory cgroup's and its ancestors'.

    cgroup v1: ``hierarchical_memory_limit`` of its ``memory`` cgroup's ``memory.stat``; v2: the lowest
    ``memory.max`` up the tree. ``None``: no limit, or none that can be read.
    """
    try:
        with open(proc_cgroup) as f:
            lines = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    for _, controllers, path in lines:
        if "memory" in controllers.split(","):
            try:
                with open(f"{root}/memory{path}/memory.stat") as f:
                    stat = dict(line.split() for line in f if line.count(" ") == 1)
                value = int(stat["hierarchical_memory_limit"])
            except (OSError, KeyError, ValueError):
                return None
            return value if value < 1 << 60 else None
    unified = next((path for hierarchy, controllers, path in lines if hierarchy == "0" and not controllers), None)
    limits = []
    while unified:
        limits.append(cgroup_memory_limit(unified, root))
        unified = "" if unified == "/" else os.path.dirname(unified)
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


class OomWatch:
    """The launcher's view of OOM kills since its workers started: make one when they start.

    Args:
        vmstat, kmsg, cgroup_root: where to read (tests point them at files).
    """

    def __init__(self, vmstat: str = VMSTAT, kmsg: str = KMSG, cgroup_root: str = CGROUP_ROOT) -> None:
        self._vmstat, self._kmsg, self._cgroup_root = vmstat, kmsg, cgroup_root
        self.started = time.monotonic()
        self.count = oom_kill_count(vmstat)

    def verdict(self, pid: int) -> Optional[OomVerdict]:
        """Why worker ``pid``, dead by SIGKILL, was killed by the OOM killer; ``None`` if nothing says it was."""
        log = read_kernel_log(self._kmsg)
        if log is not None:
            recent = [m for stamp, m in log if stamp >= self.started - _WINDOW_SLACK_S]
            found = self._from_log(pid, recent)
            if found is not None:
                return found
            if any(_KILLED.search(m) for m in recent) and not _nested_pid_namespace():
                return None  # the kernel killed other processes, not this one
        now = oom_kill_count(self._vmstat)
        if self.count is None or now is None or now <= self.count:
            return None
        source = "the kernel log is not readable here" if log is None else "the kernel log names other pids"
        return OomVerdict(
            pid, False, f"the host's oom_kill counter ({self._vmstat}) rose by {now - self.count} since the workers "
            f"started; {source}, so this is likely, not certain"
        )  # fmt: skip

    def _from_log(self, pid: int, messages: list[str]) -> Optional[OomVerdict]:
        killed = next((m for m in messages if (k := _KILLED.search(m)) and int(k.group(1)) == pid), None)
        if killed is None:
            return None
        rss = _KILLED.search(killed).group(3)  # type: ignore[union-attr]
        memcg = None
        for m in messages:
            record = _OOM_KILL.search(m)
            if record and int(record.group(3)) == pid:
                memcg = record.group(2) if record.group(1) == "CONSTRAINT_MEMCG" else "/"
        limit = cgroup_memory_limit(memcg, self._cgroup_root) if memcg not in (None, "/") else None
        return OomVerdict(pid, True, f"the kernel log: {killed.strip()}", memcg, limit, int(rss) if rss else None)


def message(rank: Optional[int], verdict: OomVerdict) -> str:
    """The launcher's line: who was killed, by what evidence, in which cgroup, and the fix."""
    who = f"rank {rank} (pid {verdict.pid})" if rank is not None else f"worker pid {verdict.pid}"
    how = "was killed" if verdict.certain else "was most likely killed"
    where = ""
    if verdict.memcg == "/":
        where = " The machine ran out of memory (no cgroup limit was reached)."
    elif verdict.memcg is not None:
        limit = f", limit {verdict.limit_bytes / 2**20:.0f} MiB" if verdict.limit_bytes is not None else ""
        where = f" It reached the limit of its memory cgroup {verdict.memcg}{limit}."
    return f"{who} {how} by the kernel's out-of-memory killer (SIGKILL; {verdict.evidence}).{where} {FIX}"
