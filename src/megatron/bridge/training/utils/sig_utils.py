"""Preemption signals: one rank receiving ``train.exit_signal`` stops every rank at the same step boundary.

A scheduler about to preempt a job (Slurm's ``--signal``, a time limit, a higher-priority job) or torchrun shutting
down sends a signal that may reach only some of the ranks. :class:`DistributedSignalHandler` records it in the
receiving process; at every step boundary the train loop ORs the flag across ranks (one small all-reduce, shared
with the other stop flags), so all ranks agree on the step after which they save and exit with
``ExitCode.PREEMPTED``. ``signals_received()`` is the same agreement (an all-gather) for code of its own.

:class:`StopDeadline` bounds the time from the signal to the exit: the scheduler's SIGKILL follows its signal after
a fixed time, and a process still saving by then gets killed anyway. Checkpoint commits are atomic, so a save cut
short is never loaded; the deadline makes the process leave on its own terms, with the exit code and a log line
that say what happened, instead of dying to SIGKILL.

Example:
    >>> with DistributedSignalHandler(signal.SIGTERM) as handler:
    ...     while training:
    ...         step()
    ...         if any(handler.signals_received()):  # a collective: every rank calls it
    ...             break
"""

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, Optional

from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

logger = logging.getLogger(__name__)


def get_device(local_rank: Optional[int] = None) -> "torch.device":
    """Where a collective's tensors live: a GPU for NCCL, the CPU for gloo (``utils.dist.collective_device``).

    Args:
        local_rank: the GPU of this rank under NCCL; ``None``: the current CUDA device.

    Raises:
        RuntimeError: the backend is neither NCCL nor gloo.
    """
    from megatron.bridge.utils.dist import collective_device

    return collective_device(local_rank)


def all_gather_item(
    item: Any,
    dtype: "torch.dtype",
    group: Optional["dist.ProcessGroup"] = None,
    async_op: bool = False,
    local_rank: Optional[int] = None,
) -> list[Any]:
    """One number from every rank of ``group`` (default: all ranks), in rank order, as Python numbers.

    Without an initialized ``torch.distributed``, ``[item]``.

    Args:
        item: this rank's number.
        dtype: the tensor type it travels as (e.g. ``torch.int32`` for a flag).
        group: the process group; ``None``: the default one.
        async_op: passed to ``all_gather``.
        local_rank: the GPU under NCCL (:func:`get_device`).
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [item]
    mine = torch.tensor([item], dtype=dtype, device=get_device(local_rank))
    size = group.size() if group is not None else dist.get_world_size()
    every = [torch.zeros_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group, async_op)
    return [t.item() for t in every]


class DistributedSignalHandler:
    """Records ``sig`` in this process while active; :meth:`release` (or leaving ``with``) restores the old handler.

    Installed only from the main thread (Python delivers signals there); entered elsewhere it warns, records
    nothing and leaves the handlers alone, and leaving it still marks it :attr:`released`.
    """

    def __init__(self, sig: int = signal.SIGTERM) -> None:
        self.sig = signal.Signals(sig)
        self.received_at: Optional[float] = None
        """``time.monotonic()`` of the first receipt, or ``None``."""
        self.released = False
        """The previous handler is back (set by :meth:`release`)."""
        self.unwinding: Optional[BaseException] = None
        """The error a run is ending with, set by the run: no step boundary will act on a signal received now, so
        :meth:`release` logs the error with its traceback and delivers the signal again to the previous handler (by
        default the process ends on it). A launcher stopping the survivors of a failed rank, say, then stops them at
        once instead of waiting out its timeout."""
        self._previous: Any = None
        self._installed = False
        self._entered = False

    @property
    def received(self) -> bool:
        """Whether this process has received the signal (a local answer, no communication)."""
        return self.received_at is not None

    @property
    def _signal_received(self) -> bool:
        """Megatron-Bridge's name for :attr:`received` (its handler keeps this flag; code written for it reads it)."""
        return self.received

    def signals_received(self) -> list[bool]:
        """Whether each rank has received the signal, in rank order; ``any(...)`` of it is the decision.

        A collective when ``torch.distributed`` is initialized (:func:`all_gather_item`): every rank must call it at
        the same point. Without it, a one-element list for this process.
        """
        import torch

        return [bool(flag) for flag in all_gather_item(int(self.received), dtype=torch.int32)]

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
            logger.warning("Received signal %d, initiating graceful stop", signum)

    def __enter__(self) -> "DistributedSignalHandler":
        self.received_at = None
        self.released, self.unwinding = False, None
        self._entered = True
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not in the main thread: %s is not handled; the process will die on it", self.sig.name)
            return self
        self._previous = signal.signal(self.sig, self._handle)
        self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> bool:
        """End this activation: restore the handler that was there before (if one was installed).

        Returns:
            ``True`` the first time after entering (also off the main thread, where nothing was installed);
            ``False`` when released already or never entered.
        """
        if self.released or not self._entered:
            return False
        self._entered = False
        self.released = True
        if not self._installed:
            return True
        signal.signal(self.sig, self._previous)
        self._installed = False
        if self.unwinding is not None and self.received:
            logger.error(
                "%s arrived while the run was ending with %s: delivered again",
                self.sig.name,
                type(self.unwinding).__name__,
                exc_info=self.unwinding,
            )
            os.kill(os.getpid(), self.sig)
        return True


class StopDeadline:
    """After ``seconds``, log why and leave the process with ``exit_code`` unless :meth:`cancel` came first."""

    def __init__(
        self, seconds: float, exit_code: int, describe: Callable[[], str], exit_fn: Callable[[int], Any] = os._exit
    ) -> None:
        self._describe = describe
        self._exit_code = exit_code
        self._exit_fn = exit_fn
        self._timer = threading.Timer(max(seconds, 0.0), self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        reason = self._describe()
        logger.error("%s", reason)
        event_stream.emit(EventKind.EXIT, exit_code=self._exit_code, detail=reason)
        for handler in logging.getLogger().handlers:
            handler.flush()
        self._exit_fn(self._exit_code)

    def cancel(self) -> None:
        """The stop finished in time."""
        self._timer.cancel()
