"""Checkpoint storage that misbehaves: the pure logic (what is wrong, how much space a save needs, who changed what).

The failures it handles: a checkpoint directory whose file system is full (``ENOSPC``, ``EDQUOT``), that cannot be
written or read (read-only mount, no permission, I/O error, a dead network mount), or that was deleted or replaced
while the run was going. Without these checks a full disk surfaces as a raw ``[Errno 28]`` traceback from a forked
writer (or as a rank waiting forever for a peer that died of it), a read-only mount as a crash at the first save hours
into the run, and a deleted directory as checkpoints silently written where nobody looks.

How, in this module (no communication; ``storage_guard.py`` makes every rank decide together and stops the run):

* :func:`classify` finds the ``OSError`` behind any exception (its cause chain, the per-rank failures of a
  ``CheckpointException``, or the ``[Errno N]`` text of an error that crossed a process boundary as text) and maps
  its errno to ``STORAGE_FULL`` (:data:`FULL_ERRNOS`) or ``STORAGE_UNAVAILABLE`` (:data:`UNAVAILABLE_ERRNOS`).
* :func:`needed_bytes` is what a save needs free: the size of the last checkpoint of that tier times :data:`MARGIN`
  plus :data:`SLACK_BYTES`; before the first save of a run, the size of the checkpoint it loaded, else
  :func:`tensor_bytes` of the state about to be written. :func:`free_bytes` is what ``statvfs`` says an unprivileged
  writer may still use.
* :func:`write_problem` probes a directory by really creating and deleting a file (``os.access`` says yes to root
  whatever the mode bits say).
* :func:`identity` is a directory's ``(st_dev, st_ino)``; :func:`identity_change` says how it changed.
* :func:`note_writer_error` / :func:`take_writer_errors` carry a storage error out of a forked background writer.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

from megatron.bridge.training.exit_codes import ExitCode
from megatron.bridge.utils import fs

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""Errors of a file system that has no room (or no quota) left: exit code 26 (``STORAGE_FULL``)."""
UNAVAILABLE_ERRNOS = frozenset(
    {errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.ESTALE, errno.ENOTCONN, errno.ENODEV, errno.ENXIO,
     errno.EREMOTEIO, errno.ENOMEDIUM, errno.EHOSTDOWN}
)  # fmt: skip
"""Errors of a file system that cannot be written or read (read-only, no permission, I/O error, a network mount
that is gone): exit code 27 (``STORAGE_UNAVAILABLE``)."""

MARGIN = 1.1
"""A save needs this many times the size of the last checkpoint of its tier free (checkpoints grow a little: the
goodput ledger, the re-run state), ..."""
SLACK_BYTES = 1 << 20
"""... plus this many bytes (the manifest, the tracker, the metadata files, the events written meanwhile)."""

_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^\n'\"]*(?:'[^'\n]*')?)")


@dataclass(frozen=True)
class StorageFault:
    """A storage error, as every rank can be told about it (picklable, plain values)."""

    code: ExitCode
    """``STORAGE_FULL`` or ``STORAGE_UNAVAILABLE``."""
    errno: int
    text: str
    """The error as the system said it: ``[Errno 28] No space left on device``."""
    rank: Optional[int] = None
    """The rank that saw it, once known."""

    @property
    def full(self) -> bool:
        """Whether the file system is full (else it is unavailable)."""
        return self.code == ExitCode.STORAGE_FULL


def code_of(number: Optional[int]) -> Optional[ExitCode]:
    """The exit code of an errno: 26 for a full file system, 27 for an unavailable one, ``None`` for any other."""
    if number in FULL_ERRNOS:
        return ExitCode.STORAGE_FULL
    if number in UNAVAILABLE_ERRNOS:
        return ExitCode.STORAGE_UNAVAILABLE
    return None


def _chain(err: BaseException) -> Iterator[BaseException]:
    """``err``, its causes and contexts, and the per-rank failures of a ``CheckpointException``, each once."""
    todo: list[Any] = [err]
    seen: list[BaseException] = []
    while todo:
        item = todo.pop(0)
        if not isinstance(item, BaseException) or any(item is s for s in seen):
            continue
        seen.append(item)
        yield item
        todo += [item.__cause__, item.__context__]
        failures = getattr(item, "failures", None)  # torch.distributed.checkpoint: rank -> (exception, traceback)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]


def classify(err: BaseException) -> Optional[StorageFault]:
    """The storage fault behind ``err`` (full or unavailable), or ``None`` when it is not one.

    The errno of an ``OSError`` in the exception chain wins; else the first ``[Errno N]`` in the text of an error in
    the chain (a forked writer's error reaches the training process as text: megatron-core's ``Worker failure: ...``,
    :class:`~megatron.bridge.utils.dist.RankZeroError`).
    """
    chain = list(_chain(err))
    for item in chain:
        if isinstance(item, OSError) and code_of(item.errno) is not None:
            return StorageFault(code_of(item.errno), item.errno, _os_error_text(item))
    for item in chain:
        for match in _ERRNO_TEXT.finditer(str(item)):
            number = int(match.group(1))
            if code_of(number) is not None:
                return StorageFault(code_of(number), number, match.group(0).strip())
    return None


def failure_text(err: BaseException, limit: int = 200) -> str:
    """A short text of what failed: the first per-rank failure of a ``CheckpointException``, else ``err`` itself."""
    for item in _chain(err):
        if not isinstance(getattr(item, "failures", None), dict) and str(item).strip():
            text = " ".join(f"{type(item).__name__}: {item}".split())
            return text if len(text) <= limit else text[: limit - 3] + "..."
    return type(err).__name__


def _os_error_text(err: OSError) -> str:
    text = f"[Errno {err.errno}] {err.strerror or os.strerror(err.errno)}"
    return text + (f": {err.filename!r}" if err.filename else "")


def fault_of_os_error(err: OSError) -> StorageFault:
    """:func:`classify` of an ``OSError`` met while preparing a save; one of another errno counts as unavailable."""
    return classify(err) or StorageFault(ExitCode.STORAGE_UNAVAILABLE, err.errno or 0, _os_error_text(err))


# ------------------------------------------------------------------------------------------------ space


def nearest_existing(path: str) -> str:
    """``path`` itself if it exists, else its nearest existing ancestor (what a ``makedirs`` would create under)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    return existing


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still write on the file system of ``path`` (or of its nearest ancestor)."""
    st = os.statvfs(nearest_existing(path))
    return st.f_bavail * st.f_frsize


def needed_bytes(size: int) -> int:
    """Free bytes a save of a checkpoint of ``size`` bytes needs: ``size * MARGIN + SLACK_BYTES``."""
    return int(size * MARGIN) + SLACK_BYTES


def tensor_bytes(sharded_state_dict: Any) -> int:
    """Bytes of the tensors this rank writes for ``sharded_state_dict``: its main replicas.

    The other replicas are written by another rank, or not at all: summed over ranks it is what a checkpoint holds,
    less its small files.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    total = 0
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor) and sh.data is not None and is_main_replica(sh.replica_id):
            part = sh.flattened_range
            count = sh.data.numel() if part is None else part.stop - part.start
            total += count * sh.data.element_size()
    return total


def files_bytes(paths: Any) -> int:
    """Bytes of the files ``paths`` (one deleted meanwhile counts 0)."""
    total = 0
    for path in paths:
        try:
            total += os.lstat(path).st_size
        except FileNotFoundError:
            pass
    return total


def human(count: Optional[int]) -> str:
    """``1,580,836 bytes (1.5 MiB)``: exact for a script, readable for a person."""
    if count is None:
        return "unknown"
    size, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            break
        size /= 1024
    return f"{count:,} bytes ({size:.1f} {unit})"


# ------------------------------------------------------------------------------------------------ writability


def write_problem(path: str) -> Optional[str]:
    """Why checkpoints cannot be written into directory ``path`` (``None``: they can).

    Probes for real: a file is created in ``path`` (or, when ``path`` does not exist yet, in its nearest existing
    ancestor, where it would be created) and deleted again. ``os.access`` would say yes to root on a directory of any
    mode, and says nothing about a server that refuses writes.
    """
    target = os.path.abspath(path)
    existing = nearest_existing(target)
    if not os.path.isdir(existing):
        return f"cannot be created: {existing} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".mbridge-write-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        reason = f"{err.strerror} (errno {errno.errorcode.get(err.errno, err.errno)})"
        if existing == target:
            return f"is not writable: creating a file in it failed: {reason}"
        return f"cannot be created: creating a file in its parent {existing} failed: {reason}"
    return None


# ------------------------------------------------------------------------------------------------ identity


def identity(path: Optional[str]) -> Optional[tuple[int, int]]:
    """``(st_dev, st_ino)`` of the directory ``path``; ``None`` when it does not exist (or is no directory)."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if os.path.isdir(path) else None


def identity_change(before: Optional[tuple[int, int]], now: Optional[tuple[int, int]]) -> Optional[str]:
    """What happened to a directory known as ``before`` that is ``now`` (``None``: nothing, or it was never seen)."""
    if before is None or before == now:
        return None
    if now is None:
        return "was removed: it no longer exists"
    return (
        f"was replaced: device {before[0]} inode {before[1]} then, device {now[0]} inode {now[1]} now (it was removed "
        "and created again, by something else or by this run's own writes, or another directory was put in its place)"
    )


# ------------------------------------------------------------------------------------------------ forked writers

_owner = os.getpid()
"""The training process (:func:`receive_writer_errors`); a writer forked from it inherits this value."""
_noted: list[StorageFault] = []
_NOTES_PREFIX = "mbridge-storage-notes-"


def receive_writer_errors() -> None:
    """Make this process the one :func:`take_writer_errors` collects for (call it in the training process)."""
    global _owner
    _owner = os.getpid()


def _notes_dir(owner: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"{_NOTES_PREFIX}{owner}")


def note_writer_error(err: BaseException, rank: int) -> Optional[StorageFault]:
    """Remember the storage fault behind ``err`` for :func:`take_writer_errors` of the training process.

    Called in a checkpoint writer: the training process itself (a synchronous save) or a writer forked from it (an
    asynchronous one, whose memory dies with it: the fault goes to a file in the temporary directory). Returns the
    fault, or ``None`` when ``err`` is not a storage error (nothing is noted).
    """
    fault = classify(err)
    if fault is None:
        return None
    fault = StorageFault(fault.code, fault.errno, fault.text, rank)
    if os.getpid() == _owner:
        _noted.append(fault)
        return fault
    directory = _notes_dir(_owner)
    os.makedirs(directory, exist_ok=True)
    record = {"code": int(fault.code), "errno": fault.errno, "text": fault.text, "rank": rank}
    name = f"{time.time_ns():020d}-{os.getpid()}.json"
    fs.atomic_write(os.path.join(directory, name), json.dumps(record), durable=False)
    return fault


def take_writer_errors() -> list[StorageFault]:
    """The faults :func:`note_writer_error` noted in this process and its forked writers since the last call."""
    found = list(_noted)
    _noted.clear()
    directory = _notes_dir(os.getpid())
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        try:
            with open(path) as f:
                record = json.load(f)
            found.append(StorageFault(ExitCode(record["code"]), record["errno"], record["text"], record["rank"]))
        except (OSError, ValueError, KeyError):
            pass
    shutil.rmtree(directory, ignore_errors=True)
    return found
