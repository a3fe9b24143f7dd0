"""Small collectives every rank calls together: rank 0 does some work and all ranks get its result, a barrier.

A file operation done by rank 0 for everyone (read a tracker, commit a checkpoint, update a record) must not leave
the other ranks waiting in a broadcast when it raises: :func:`on_rank0` sends the exception's text instead of a
result, and every rank raises :class:`RankZeroError`. :func:`barrier` waits for every rank; given a timeout it
waits through the rendezvous store (no collective, so it behaves the same on gloo and NCCL) and names the ranks
that did not arrive. Every helper also works without an initialized process group (a single process).
"""

import datetime
import logging
from collections.abc import Callable
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist

from megatron.bridge.utils import upstream

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RankZeroError(RuntimeError):
    """The work :func:`on_rank0` ran on rank 0 raised; raised on every rank with rank 0's error text."""


class BarrierTimeout(TimeoutError):
    """Some ranks did not reach a :func:`barrier` within its timeout."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing
        """The ranks that had not arrived."""


def collective_device(local_rank: Optional[int] = None) -> torch.device:
    """Where a collective's tensors live: a GPU for NCCL, the CPU for gloo and without a process group.

    Args:
        local_rank: the GPU of this rank under NCCL; ``None``: the current CUDA device.

    Raises:
        RuntimeError: the backend is neither NCCL nor gloo.
    """
    if not dist.is_initialized():
        return torch.device("cpu")
    backend = dist.get_backend()
    if backend == "nccl":
        return torch.device("cuda") if local_rank is None else torch.device("cuda", local_rank)
    if backend == "gloo":
        return torch.device("cpu")
    raise RuntimeError(f"no collective device for the torch.distributed backend {backend!r} (use nccl or gloo)")


def rank() -> int:
    """The rank of this process (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def broadcast_from_rank0(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (a picklable object)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def on_rank0(fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` on rank 0 only and return its result on every rank.

    Args:
        fn: the work; called on rank 0 only.
        what: names the work in the error (``"the checkpoint commit"``).

    Raises:
        RankZeroError: on every rank when ``fn`` raised on rank 0 (logged there with its traceback).
    """
    outcome: tuple[bool, Any] = (True, None)
    if rank() == 0:
        try:
            outcome = (True, fn())
        except Exception as err:  # noqa: BLE001 - raised again on every rank below
            logger.exception("%s failed on rank 0", what)
            outcome = (False, f"{type(err).__name__}: {err}")
    ok, value = broadcast_from_rank0(outcome)
    if not ok:
        raise RankZeroError(f"{what} failed on rank 0: {value}")
    return value


def barrier(timeout: Optional[float] = None, name: str = "barrier") -> None:
    """Return once every rank called this barrier.

    Args:
        timeout: seconds to wait. ``None``: ``torch.distributed.barrier`` of the default group, bounded by that
            group's own timeout. A number: the ranks check in at the default group's store and wait there.
        name: names the barrier in the store (a barrier of one name may be passed any number of times) and in the
            timeout's message.

    Raises:
        BarrierTimeout: with a timeout, when some ranks did not arrive in time (they are named).
    """
    if world_size() == 1:
        return
    if timeout is None:
        dist.barrier()
        return
    # Store keys, under the store's prefix (fresh for every process group, restarts included): how often each rank
    # arrived, and how many arrivals in all. The arrival completing a round sets that round's done key.
    store = upstream.default_store()
    me, world = rank(), world_size()
    key = f"mbridge_barrier/{name}"
    round_ = store.add(f"{key}/rank{me}", 1)
    if store.add(f"{key}/count", 1) == round_ * world:
        store.set(f"{key}/done{round_}", "1")
    try:
        store.wait([f"{key}/done{round_}"], datetime.timedelta(seconds=timeout))
    except RuntimeError:  # the store's timeout (DistStoreError is a RuntimeError)
        missing = [r for r in range(world) if store.add(f"{key}/rank{r}", 0) < round_]
        raise BarrierTimeout(
            f"{name}: rank(s) {missing} did not arrive within {timeout:g} s (seen from rank {me})", missing
        ) from None
