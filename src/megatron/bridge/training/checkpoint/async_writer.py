"""The background part of an async global save: what the writer process runs, and its helpers.

megatron-core's writer (a process forked per save, or its persistent worker) forks again, once per write bucket,
coordinating through multiprocessing queues. Here the writer (on CPU, the persistent one of ``snapshot_writer.py``)
writes its buckets itself, one after the other, then hashes this rank's shard files for the manifest. A writer
that runs long reports it, and prints its stack, every :data:`REPORT_SECONDS`.

The writer of an async save retries a write that failed on an unavailable file system (``save_retry.py``): it
removes the files the failed attempt wrote, waits the backoff and writes again from the snapshot it holds, while
training goes on. Its failed attempts go back with its write results (:class:`WriteOutcome`, or the final error's
``failed_attempts``); :class:`FileResultsQueue` hands them to the training process (:func:`take_failed_attempts`).
"""

import atexit
import contextlib
import dataclasses
import faulthandler
import functools
import logging
import os
import pickle
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from megatron.bridge.training.checkpoint import manifest, save_retry, storage
from megatron.bridge.utils import fs, upstream

logger = logging.getLogger(__name__)

_FS_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_RESULTS_QUEUES = (f"{_FS_ASYNC}:_results_queue", f"{upstream.NVRX_ASYNC}.filesystem_async:_results_queue")
"""The writers' results queue of megatron-core's writer, and of nvidia-resiliency-ext's (which megatron-core 0.17
and later write through): both are given the same queue."""

REPORT_SECONDS = 120.0
"""A background writer still running after this many seconds (and every as many after) logs it with its stack."""
ATTEMPTS_ATTR = "failed_attempts"
"""The attribute of a write's final error that holds its failed attempts (a tuple of ``save_retry.FailedAttempt``)."""


@dataclass(frozen=True)
class InjectedIoError:
    """An ``io-error`` drill (``faults/injection.py``), as the writer applies it: its first ``attempts`` writes fail."""

    phase: str
    """``"write"`` (the rank's first shard file is cut to half its size) or ``"fsync"`` (it is written whole)."""
    error: OSError
    """What the failing write reports."""
    attempts: Optional[int] = 1
    """How many attempts fail, from the first; ``None``: every one (``:always``)."""

    def strikes(self, attempt: int) -> bool:
        """Whether attempt ``attempt`` (1-based) fails."""
        return self.attempts is None or attempt <= self.attempts


class WriteOutcome(dict):
    """A rank's write results (``{bucket index: write results}``, as megatron-core reads them) after failed attempts.

    ``attempts``: the attempts that failed before these results (``save_retry.FailedAttempt``); megatron-core sees a
    plain dict, :class:`FileResultsQueue` takes the attempts off for the finalize (:func:`take_failed_attempts`).
    """

    def __init__(self, results: dict, attempts: tuple) -> None:
        super().__init__(results)
        self.attempts = attempts


def failed_attempts(item: Any) -> tuple:
    """The failed attempts a write's results (or its final error) carry; none for a write that never retried."""
    if isinstance(item, WriteOutcome):
        return item.attempts
    return tuple(getattr(item, ATTEMPTS_ATTR, ())) if isinstance(item, BaseException) else ()


_received: list = []
"""The failed attempts of the writes whose results this process took from a :class:`FileResultsQueue`."""


def take_failed_attempts() -> list:
    """The failed attempts of this rank's writes whose results were read since the last call (then forgotten)."""
    found = list(_received)
    _received.clear()
    return found


@dataclass(frozen=True)
class AsyncSavesBusy:
    """Per tier, whether an async save is in flight whose background write has not finished.

    On one rank (``CheckpointManager.busy_here``), or on any rank once the training loop agreed it.
    """

    global_tier: bool
    """The global checkpoint's save."""
    local_tier: bool
    """The local tier's save."""


class FileResultsQueue:
    """The writers' results queue, as files in a private directory: ``put`` in a writer, ``get_nowait`` here.

    megatron-core passes write results from its forked writers back through a queue served by a spawned
    ``multiprocessing`` manager process: 2-3 s to start on every rank at every (re)start, a process to leak when the
    rank is SIGKILLed, and one that dies on the signals Slurm sends the whole job step. A writer here is a fork of
    the training process, so a file is enough: each ``put`` writes one pickle atomically, each ``get_nowait`` takes
    the oldest. Nothing can block (a pipe could fill up), and a writer killed before its ``put`` leaves nothing.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def put(self, item: Any) -> None:
        """Add ``item`` (picklable); called in a writer process."""
        name = f"{time.time_ns():020d}-{os.getpid()}.pkl"
        fs.atomic_write(os.path.join(self.directory, name), pickle.dumps(item), durable=False)

    def get_nowait(self) -> Any:
        """Remove and return the oldest item; ``queue.Empty`` if there is none."""
        names = self._items()
        if not names:
            raise queue.Empty
        path = os.path.join(self.directory, names[0])
        with open(path, "rb") as f:
            item = pickle.load(f)
        os.remove(path)
        _received.extend(failed_attempts(item))
        return item

    def empty(self) -> bool:
        """Whether no item is waiting."""
        return not self._items()

    def _items(self) -> list[str]:
        return sorted(n for n in os.listdir(self.directory) if n.endswith(".pkl") and not n.startswith("."))


_RESULTS_DIR_PREFIX = "mbridge-write-results-"


def install_results_queue() -> None:
    """Give the checkpoint writers a :class:`FileResultsQueue` (removed when this process exits).

    The directories of processes that died without exiting (SIGKILL) are removed here, by the next process.
    """
    empty = [key for key in _RESULTS_QUEUES if upstream.owner(key) is not None and upstream.get(key) is None]
    if not empty:
        return  # an upstream without these queues (logged), or the queues are in place
    _remove_results_of_dead_processes(tempfile.gettempdir())
    directory = tempfile.mkdtemp(prefix=f"{_RESULTS_DIR_PREFIX}{os.getpid()}-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    results = FileResultsQueue(directory)
    for key in empty:
        upstream.patch(key, results)


def reset_results_queues() -> None:
    """Forget the writers' results queues (megatron-core's and nvidia-resiliency-ext's), after an aborted run.

    A writer of an aborted in-process restart iteration may still report into them; the next checkpoint manager
    installs fresh ones (:func:`install_results_queue`), so that no save of the next iteration reads such a result.
    A queue served by a ``multiprocessing`` manager (megatron-core's own, when not replaced) has the manager shut down.
    """
    stopped: set[int] = set()
    _received.clear()
    for key in _RESULTS_QUEUES:
        if upstream.owner(key) is None:
            continue
        results = upstream.get(key)
        manager = getattr(results, "_manager", None) if results is not None else None
        if manager is not None and id(manager) not in stopped:
            stopped.add(id(manager))
            try:
                manager.shutdown()
            except Exception as err:  # noqa: BLE001 - a manager gone with its process: forgetting it is enough
                logger.warning("results queue manager shutdown failed: %s", err)
        upstream.patch(key, None)


def _remove_results_of_dead_processes(parent: str) -> None:
    for name in os.listdir(parent):
        pid = name[len(_RESULTS_DIR_PREFIX) :].split("-")[0]
        if not name.startswith(_RESULTS_DIR_PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        except OSError:
            pass  # alive, owned by someone else


def writer(
    write_fn: Callable[..., None],
    ckpt_dir: str,
    rank: int,
    iteration: int,
    fail: Optional[InjectedIoError] = None,
    retry: Optional[save_retry.RetryPolicy] = None,
) -> Callable[..., None]:
    """The function the writer runs in place of megatron-core's ``write_fn`` (same arguments).

    Args:
        write_fn: megatron-core's write function of the save.
        ckpt_dir: the save's temporary directory.
        rank: this rank.
        iteration: the iteration saved.
        fail: an injected ``io-error``: the rank's first shard file fails as it says, in the attempts it says,
            reported as megatron-core reports a failed write.
        retry: an async save's retries (``checkpoint.save_retries``), made here; ``None``: the caller retries.
    """
    return functools.partial(_write_and_hash, write_fn, ckpt_dir, rank, iteration, fail, retry)


def _write_and_hash(
    write_fn: Any, ckpt_dir: str, rank: int, iteration: int, fail: Any, retry: Any, *args: Any, **kwargs: Any
) -> None:
    done = threading.Event()
    threading.Thread(target=_report_while_running, args=(done, rank, iteration), daemon=True).start()
    try:
        buckets_writer = _in_process_bucket_writer(write_fn, fail, retry)
        if buckets_writer is not None:
            buckets_writer(*args, **kwargs)
        else:  # an upstream writer of another shape: let it work its own way
            write_fn(*args, **kwargs)
        try:
            manifest.hash_rank_shards(ckpt_dir, rank)
        except Exception as err:  # noqa: BLE001 - the commit hashes whatever has no partial manifest
            if storage.classify(err) is not None:  # the write failed on the same storage: the finalize reports it
                logger.error("rank %d: background hashing of iteration %d not done: %s", rank, iteration, err)
            else:
                logger.exception("background hashing failed; the commit will hash these shards")
    finally:
        done.set()


def _in_process_bucket_writer(write_fn: Any, fail: Any = None, retry: Any = None) -> Any:
    """:func:`_write_buckets_here` bound like ``write_fn`` if that is megatron-core's multi-process bucket writer."""
    if (
        isinstance(write_fn, functools.partial)
        and upstream.applicable((upstream.MCORE_FORKING_WRITER,)) is not None
        and write_fn.func is upstream.find(upstream.MCORE_FORKING_WRITER)
        and len(write_fn.args) == 2
        and not write_fn.keywords
    ):
        return functools.partial(_write_buckets_here, *write_fn.args, fail=fail, retry=retry)
    if fail is not None or (retry is not None and not _Warned.shape):
        _Warned.shape = True
        logger.warning("an upstream writer of another shape: no injected io-error, no retry of a failed write")
    return None


class _Warned:
    shape = False
    """An upstream writer of another shape was reported."""


def _write_buckets_here(
    transform_list: list,
    use_msc: bool,
    rank: int,
    write_buckets: list,
    results_queue: Any,
    fail: Optional[InjectedIoError] = None,
    retry: Optional[save_retry.RetryPolicy] = None,
) -> None:
    """Write every bucket in this process, then put the results where megatron-core's finalize reads them.

    Same results as ``FileSystemWriterAsync.write_preloaded_data_multiproc`` (``{bucket index: write results}``,
    or the first exception), without forking a process per bucket. ``fail``: see :func:`writer`; a ``"write"``
    failure leaves the first bucket's file cut to half its size, as a write that broke off does. ``retry``: an
    attempt that failed on an unavailable file system (``save_retry.writer_retries``) has its files removed and is
    written again after the backoff; the failed attempts go with the results (:func:`failed_attempts`).
    """
    import torch

    write_bucket = upstream.get(f"{_FS_ASYNC}:FileSystemWriterAsync.write_preloaded_data")
    extra = {"use_msc": True} if use_msc else {}
    failed: list[save_retry.FailedAttempt] = []
    # torch.save's per-record CRC32 duplicates the manifest's SHA-256 of every file, which the writer computes next
    # and every load checks: skip it (torch.load does not read it).
    previous = upstream.get("torch.utils.serialization:config.save.compute_crc32")
    torch.serialization.set_crc32_options(False)
    try:
        number = 0
        while True:
            number += 1
            began = time.monotonic()
            strike = fail if fail is not None and fail.strikes(number) else None
            outcome = _write_buckets_once(write_bucket, transform_list, write_buckets, rank, extra, strike)
            fault = storage.classify(outcome) if isinstance(outcome, Exception) and retry is not None else None
            if fault is None:
                break
            again = save_retry.writer_retries(fault, number, retry)
            wait = save_retry.wait_before(number, retry.backoff) if again else None
            if again:
                _remove_written(write_buckets)
                logger.warning(
                    "rank %d: attempt %d of the background write into %s failed (%s); its files were removed; retry "
                    "%d of checkpoint.save_retries (%d) in %g s",
                    rank,
                    number,
                    os.path.dirname(write_buckets[0][0]),
                    fault.text,
                    number,
                    retry.retries,
                    wait,
                )
                time.sleep(wait)
            seen = dataclasses.replace(fault, rank=rank)
            failed.append(save_retry.FailedAttempt(number, seen, wait, time.monotonic() - began))
            if not again:
                break
    finally:
        torch.serialization.set_crc32_options(previous)
    results_queue.put(_with_attempts(outcome, tuple(failed)))


def _write_buckets_once(
    write_bucket: Any, transform_list: list, write_buckets: list, rank: int, extra: dict, fail: Any
) -> Any:
    """One attempt: every bucket written in turn; ``{bucket index: write results}``, or the first exception."""
    outcome: dict = {}
    local_results: queue.SimpleQueue = queue.SimpleQueue()
    finished: queue.Queue = queue.Queue()
    for index, bucket in enumerate(write_buckets):
        finished.put(index)  # the bucket writer takes it back and marks it done
        write_bucket(transform_list, index, bucket, local_results, finished, True, **extra)
        _, result = local_results.get()
        if fail is not None and not isinstance(result, Exception):
            result = _injected_failure(bucket[0], fail)
        if isinstance(result, Exception):
            logger.error("rank %d: writing checkpoint bucket %d failed: %s", rank, index, result)
            return result
        outcome[index] = result
    return outcome


def _remove_written(write_buckets: list) -> None:
    """Remove the files of ``write_buckets`` that exist (a failed attempt's, before the next one writes them)."""
    for bucket in write_buckets:
        with contextlib.suppress(OSError):  # gone, or the storage still fails: the next attempt truncates it
            os.remove(bucket[0])


def _with_attempts(outcome: Any, attempts: tuple) -> Any:
    """``outcome`` carrying ``attempts`` (:func:`failed_attempts` reads them back after pickling)."""
    if not attempts:
        return outcome
    if isinstance(outcome, BaseException):
        setattr(outcome, ATTEMPTS_ATTR, attempts)  # pickled with the error's ``__dict__``
        return outcome
    return WriteOutcome(outcome, attempts)


def _injected_failure(path: str, fail: InjectedIoError) -> OSError:
    """Make the written file ``path`` look as ``fail`` leaves it; return the error to report."""
    if fail.phase == "write":
        with open(path, "r+b") as f:
            f.truncate(f.seek(0, os.SEEK_END) // 2)
    return fail.error


def _report_while_running(done: threading.Event, rank: int, iteration: int) -> None:
    start = time.monotonic()
    while not done.wait(REPORT_SECONDS):
        logger.warning(
            "async checkpoint writer of iteration %d (rank %d, pid %d) still running after %.0f s; its stack:",
            iteration,
            rank,
            os.getpid(),
            time.monotonic() - start,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
