"""The background part of an async global save: the forked writer process and its helpers.

megatron-core forks one writer per save (``TemporalAsyncCaller``) and that writer forks again, once per write
bucket, coordinating through multiprocessing queues. Here the forked writer writes its buckets itself, one after the
other (one fork per save instead of two levels), then hashes this rank's shard files for the manifest. A writer
that runs long reports it, and prints its stack, every :data:`REPORT_SECONDS`.
"""

import faulthandler
import functools
import logging
import multiprocessing
import multiprocessing.managers
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from megatron.bridge.training.checkpoint import manifest
from megatron.bridge.utils import upstream

logger = logging.getLogger(__name__)

_FS_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_RESULTS_QUEUE = f"{_FS_ASYNC}:_results_queue"

REPORT_SECONDS = 120.0
"""A background writer still running after this many seconds (and every as many after) logs it with its stack."""


def _manager_dies_with_parent(parent_pid: int) -> None:
    """Runs in the manager process: ask the kernel to SIGKILL it when the training process dies (Linux).

    It ignores the usual preemption signals: Slurm signals every process of a job step, and a manager that died
    on them would fail the very save the training process makes before it exits. The writers' results
    (torch.distributed.checkpoint's ``WriteResult``) pass through this process: their module is imported here, at
    start-up, not while the first save's results are unpickled (seconds inside that save).
    """
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    import torch.distributed.checkpoint  # noqa: F401

    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def install_results_queue() -> None:
    """Give megatron-core's checkpoint writers a results queue whose manager process dies with this process.

    Upstream creates it lazily with a plain ``multiprocessing`` manager, which outlives a SIGKILLed rank, keeps
    its stdout open and leaks one process per rank at every in-job restart.
    """
    if upstream.owner(_RESULTS_QUEUE) is None or upstream.get(_RESULTS_QUEUE) is not None:
        return  # an upstream without this queue (logged), or the queue is in place
    sync_manager = multiprocessing.managers.SyncManager(ctx=multiprocessing.get_context("spawn"))
    sync_manager.start(initializer=_manager_dies_with_parent, initargs=(os.getpid(),))
    upstream.patch(_RESULTS_QUEUE, sync_manager.Queue())


def writer(write_fn: Callable[..., None], ckpt_dir: str, rank: int, iteration: int) -> Callable[..., None]:
    """The function the forked writer runs in place of megatron-core's ``write_fn`` (same arguments)."""
    return functools.partial(_write_and_hash, write_fn, ckpt_dir, rank, iteration)


def _write_and_hash(write_fn: Any, ckpt_dir: str, rank: int, iteration: int, *args: Any, **kwargs: Any) -> None:
    done = threading.Event()
    threading.Thread(target=_report_while_running, args=(done, rank, iteration), daemon=True).start()
    try:
        buckets_writer = _in_process_bucket_writer(write_fn)
        if buckets_writer is not None:
            buckets_writer(*args, **kwargs)
        else:  # an upstream writer of another shape: let it work its own way
            write_fn(*args, **kwargs)
        try:
            manifest.hash_rank_shards(ckpt_dir, rank)
        except Exception:  # noqa: BLE001 - the commit hashes whatever has no partial manifest
            logger.exception("background hashing failed; the commit will hash these shards")
    finally:
        done.set()


def _in_process_bucket_writer(write_fn: Any) -> Any:
    """:func:`_write_buckets_here` bound like ``write_fn`` if that is megatron-core's multi-process bucket writer."""
    if (
        isinstance(write_fn, functools.partial)
        and write_fn.func is upstream.find(f"{_FS_ASYNC}:FileSystemWriterAsync.write_preloaded_data_multiproc")
        and len(write_fn.args) == 2
        and not write_fn.keywords
    ):
        return functools.partial(_write_buckets_here, *write_fn.args)
    return None


def _write_buckets_here(
    transform_list: list, use_msc: bool, rank: int, write_buckets: list, results_queue: Any
) -> None:
    """Write every bucket in this process, then put the results where megatron-core's finalize reads them.

    Same results as ``FileSystemWriterAsync.write_preloaded_data_multiproc`` (``{bucket index: write results}``,
    or the first exception), without forking a process per bucket.
    """
    write_bucket = upstream.get(f"{_FS_ASYNC}:FileSystemWriterAsync.write_preloaded_data")
    outcome: Any = {}
    local_results: queue.SimpleQueue = queue.SimpleQueue()
    finished: queue.Queue = queue.Queue()
    extra = {"use_msc": True} if use_msc else {}
    for index, bucket in enumerate(write_buckets):
        finished.put(index)  # the bucket writer takes it back and marks it done
        write_bucket(transform_list, index, bucket, local_results, finished, True, **extra)
        _, result = local_results.get()
        if isinstance(result, Exception):
            logger.error("rank %d: writing checkpoint bucket %d failed: %s", rank, index, result)
            outcome = result
            break
        outcome[index] = result
    results_queue.put(outcome)


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
