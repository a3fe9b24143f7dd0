"""Retries of a failed global save: which failures are tried again, how long to wait, what to say when it gives up.

Failure handled: a transient storage error during a synchronous global save (``EIO`` from an overloaded file server,
``ESTALE`` or ``ENOTCONN`` from a network mount that comes back) used to end the job with ``STORAGE_UNAVAILABLE``
(exit code 27) although the next attempt would have worked. ``SavePath.save`` (``saving.py``) now tries the save
again, up to ``checkpoint.save_retries`` times: every rank raised the failure at the same point (megatron-core's
``CheckpointException`` after the write, a failed commit on rank 0), so they agree on its cause with one
``all_gather`` and retry together. The failed attempt's temporary directory is removed before the retry, which
writes into a fresh one: a loader never sees a half-written save, and the tracker only moves on a whole commit.

An asynchronous save is retried inside its background writer (``async_writer.py``), which still holds the snapshot
of the state it writes: on an unavailable file system it removes the files its failed attempt wrote into the
temporary directory, waits the same backoff and writes them again, while training goes on. Each rank's writer
decides alone (:func:`writer_retries`); its failed attempts (:class:`FailedAttempt`) travel back to the training
process with its write results, and the finalize, where every rank agrees on the write's outcome as before, gathers
them (:func:`merged_attempts`, :func:`retry_seconds`) for the events and goodput. The temporary directory is
committed only by that finalize, once every rank's last attempt succeeded: a loader never sees an attempt.

This module is the pure part (no I/O, no communication): :func:`retry_fault` decides from every rank's view of the
failure, :func:`wait_before` is the backoff (``checkpoint.save_retry_backoff`` doubled at each retry, at most
:data:`MAX_WAIT_SECONDS`), and :func:`exhausted_note` is the sentence the final error adds. A full file system is
not retried: space does not come back by waiting, and the storage guard's message (exit code 26) says what to do.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

from megatron.bridge.training.checkpoint.storage import StorageFault
from megatron.bridge.training.exit_codes import ExitCode

MAX_WAIT_SECONDS = 60.0
"""The longest wait before one retry, however many came before."""


def wait_before(retry: int, backoff: float) -> float:
    """Seconds to wait before retry number ``retry`` (1-based): ``backoff * 2 ** (retry - 1)``, at most 60 s."""
    if retry < 1:
        raise ValueError(f"retry {retry} is not >= 1")
    return min(backoff * 2.0 ** (retry - 1), MAX_WAIT_SECONDS)


def schedule(retries: int, backoff: float) -> list[float]:
    """The waits before each of ``retries`` retries, in order (what the docs and the final error quote)."""
    return [wait_before(n, backoff) for n in range(1, retries + 1)]


def retry_fault(views: Iterable[Optional[StorageFault]]) -> Optional[StorageFault]:
    """The storage fault to retry, from every rank's classification of the same failure; ``None``: do not retry.

    A failure is retried when some rank saw an unavailable file system (``STORAGE_UNAVAILABLE``) and none a full one:
    a full disk, or a failure that is no storage error at all (a bug, a peer lost), is left to the storage guard as
    before. The fault of the lowest rank that saw one is returned (the one the messages name).
    """
    seen = [fault for fault in views if fault is not None]
    if not seen or any(fault.full for fault in seen):
        return None
    unavailable = [fault for fault in seen if fault.code == ExitCode.STORAGE_UNAVAILABLE]
    if not unavailable:
        return None
    return min(unavailable, key=lambda fault: -1 if fault.rank is None else fault.rank)


def exhausted_note(attempts: int, retries: int, backoff: float) -> str:
    """The sentence the final error adds once ``attempts`` attempts of a save failed (``checkpoint.save_retries``)."""
    waits = ", ".join(f"{seconds:g}" for seconds in schedule(retries, backoff))
    return (
        f"The save was tried {attempts} times (checkpoint.save_retries={retries}, waiting {waits or 'no'} s between "
        "attempts) and failed every time: the error persists. If the file system's outages last longer than that, "
        "raise checkpoint.save_retries or checkpoint.save_retry_backoff."
    )


@dataclass(frozen=True)
class RetryPolicy:
    """``checkpoint.save_retries`` and ``checkpoint.save_retry_backoff``, as a background writer is given them."""

    retries: int
    """How many times a failed write is tried again."""
    backoff: float
    """Seconds before the first retry (doubled at each further one, :func:`wait_before`)."""


@dataclass(frozen=True)
class FailedAttempt:
    """One failed attempt of a rank's background write of an async save (picklable: it travels with the results)."""

    number: int
    """Which attempt (1: the first)."""
    fault: StorageFault
    """Its storage error, with the rank that saw it."""
    wait: Optional[float]
    """Seconds waited before the next attempt; ``None``: the write was not tried again (the last attempt)."""
    seconds: float
    """The attempt's time in the writer, its backoff included: what it added to the background write."""


def writer_retries(fault: Optional[StorageFault], number: int, policy: RetryPolicy) -> bool:
    """Whether a background writer writes again after its attempt ``number`` failed with ``fault``.

    As :func:`retry_fault`, for one rank: an unavailable file system only (not a full one, nor an error that is no
    storage error), while the budget lasts.
    """
    return fault is not None and fault.code == ExitCode.STORAGE_UNAVAILABLE and number <= policy.retries


def merged_attempts(views: Iterable[Sequence[FailedAttempt]]) -> list[FailedAttempt]:
    """The failed attempts of a save, from every rank's (rank order): per attempt number, the lowest rank's.

    The ranks' writers retry on their own, so attempt ``n`` of the save failed if it failed on any rank; the one
    kept is the first rank's that saw it (the one the messages name), in attempt order.
    """
    merged: dict[int, FailedAttempt] = {}
    for attempts in views:
        for attempt in attempts:
            merged.setdefault(attempt.number, attempt)
    return [merged[number] for number in sorted(merged)]


def retry_seconds(views: Iterable[Sequence[FailedAttempt]]) -> float:
    """How much later the slowest rank's write finished because of its retries: its retried attempts and waits."""
    return max((sum(a.seconds for a in attempts if a.wait is not None) for attempts in views), default=0.0)
