"""Writes that a crash cannot tear: a file is replaced whole or not at all, and stays replaced after a power loss.

A process killed half-way through writing a file leaves a truncated file that a restart then reads (a tracker naming
no iteration, a record that no longer parses). :func:`atomic_write` writes into a temporary file in the same
directory, flushes it, fsyncs it, renames it over the target and fsyncs the directory: a reader sees the old
content or the new, never a mix, and the rename survives a machine crash. A caller that only keeps accounting may
skip the fsyncs (``durable=False``): the rename still makes the replacement atomic for readers. :func:`fsync_tree`
flushes a whole directory (a checkpoint before it is renamed into place).
"""

import json
import os
import uuid
from collections.abc import Callable
from typing import Any, Optional, Union

TMP_SUFFIX = ".tmp"
"""Temporary files are ``.<target name>.<unique>.tmp`` next to their target."""


def fsync_path(path: str) -> None:
    """Flush the file or directory ``path`` to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """Flush every file and directory below ``path``, and ``path`` itself, to disk."""
    for root, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def atomic_write(
    path: str,
    data: Union[str, bytes],
    durable: bool = True,
    before_rename: Optional[Callable[[], None]] = None,
) -> None:
    """Replace ``path`` with ``data`` atomically (temporary file in the same directory, then rename).

    Args:
        path: the file to write; its directory must exist.
        data: text (written as UTF-8) or bytes.
        durable: fsync the temporary file before the rename and the directory after it. ``False`` for records
            whose loss in a machine crash costs nothing but accounting.
        before_rename: called once the temporary file is complete, just before it is renamed (fault drills).
    """
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
    payload = data.encode() if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_path(directory)


def atomic_write_json(path: str, obj: Any, durable: bool = True, **dump_kwargs: Any) -> None:
    """:func:`atomic_write` of ``obj`` as JSON (``dump_kwargs`` go to :func:`json.dumps`)."""
    atomic_write(path, json.dumps(obj, **dump_kwargs), durable=durable)


def is_temporary_of(name: str, target: str) -> bool:
    """Whether the file ``name`` is a temporary file an interrupted :func:`atomic_write` of ``target`` left."""
    return name.startswith(f".{target}.") and name.endswith(TMP_SUFFIX)


def remove_temporaries(path: str) -> list[str]:
    """Delete what interrupted :func:`atomic_write` calls of ``path`` left in its directory; return their paths."""
    directory, target = os.path.split(os.path.abspath(path))
    removed = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if is_temporary_of(name, target):
            try:
                os.remove(os.path.join(directory, name))
                removed.append(os.path.join(directory, name))
            except FileNotFoundError:
                pass
    return removed
