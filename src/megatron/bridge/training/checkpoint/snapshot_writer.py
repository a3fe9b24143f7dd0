"""A persistent async checkpoint writer for training on CPU, fed through shared memory.

Failure handled: on CPU an async save used to fork its writer from the rank in the middle of training. While that
fork lived, every page the rank wrote for the first time was copied by the kernel (copy-on-write): the step after
each save paid for its whole working set (0.3-0.4 s for a few hundred MiB, ``benchmarks/fork_copy_on_write.py``),
on top of the fork itself. megatron-core's persistent worker is no way out on CPU: it is spawned without the CPU
shims and stages the tensors itself, in the worker, and handing it a CPU tensor moves the tensor's live storage into
shared memory, where the worker would read it while training goes on writing it: a torn checkpoint.

How: one writer per rank, forked when the checkpoint manager is built, before the model and the optimizer exist:
it shares none of their pages, so training never pays copy-on-write for them. At each save the rank copies every
tensor of the request into a shared-memory slot of its own (allocated at the first save that needs it, reused
while the shape stays the same) and sends the request with the slots named in place of the tensors. That copy is
the snapshot: training goes on at full speed once it is done, and the writer runs the request's write function on
the slots. The writer dies with its rank (a parent-death signal) and ignores the job's SIGTERM and SIGINT (the
rank decides when a save is abandoned). A save whose writer died is seen at its finalize the way a dead forked
writer's is: its results are missing; later saves fork a writer each, as do saves that cannot be snapshotted or
sent (tensors inside objects other than lists, tuples, dicts and ``TensorAwareStateDict``; an unpicklable write
function: the request's pickler refuses any tensor that is not a slot), whose slots ``/dev/shm`` cannot hold for
every rank of the node or that need more open files than the limit allows (logged once), or that come while the
writer still reads the slots of an earlier save (a second save in flight on the same queue). A rank with nothing
to write still joins the poll's all-reduce, as with megatron-core's own caller.

Both tiers use it: megatron-core's write buckets are lists of tuples; the local tier's state dict is sent without
its tensors (``pop_tensors``) and refilled from the slots in the writer (``insert_tensors``).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import signal
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

import torch

from megatron.bridge.utils import launch_env
from megatron.bridge.utils.orphans import die_with_parent, die_with_this_process

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
"""Where shared memory lives (Linux): its free space is checked before slots are allocated."""
SHM_HEADROOM_BYTES = 256 * 2**20
"""Free space left in :data:`SHM_DIR` after the slots (a full tmpfs kills the process that touches a page)."""


@dataclass(frozen=True)
class SlotRef:
    """A tensor of a request, by the key of the shared-memory slot that holds its copy."""

    key: tuple
    """Where the tensor sat in the request's arguments (positions, also in dicts: a key may change between saves)."""


@dataclass(frozen=True)
class HollowRef:
    """An object that gives its tensors up and takes them back (a ``TensorAwareStateDict``: the local tier's).

    Sent pickled without its tensors; the tensors by slot.
    """

    pickled: bytes
    """The object while hollow."""
    tensors: list
    """:class:`SlotRef` of each popped tensor, in order."""


@dataclass
class WriteCall:
    """One save, as sent to the writer."""

    call_idx: int
    """megatron-core's index of the async call: reported back when the write finished."""
    fn: Any
    """The request's write function."""
    args: list
    """Its arguments, tensors replaced by :class:`SlotRef`."""
    kwargs: dict
    """Its keyword arguments, likewise."""
    new_slots: dict
    """Slots the writer does not hold yet (key -> shared tensor): sent once, reused by later saves."""
    dropped: list
    """Keys of slots the writer lets go (this save no longer has their tensors)."""


class NotSnapshottable(TypeError):
    """A request argument holds tensors inside an object the snapshot cannot walk."""


class SlotArena:
    """A rank's shared-memory slots, one per tensor position of the requests, reused across saves."""

    def __init__(self) -> None:
        self.slots: dict[tuple, torch.Tensor] = {}
        self.used: set[tuple] = set()
        """The slots the current save's :meth:`snapshot` calls filled."""

    def drop_unused(self) -> list[tuple]:
        """Free the slots the current save did not use (a tensor gone or reshaped); return their keys."""
        stale = [key for key in self.slots if key not in self.used]
        for key in stale:
            del self.slots[key]
        self.used = set()
        return stale

    def snapshot(self, obj: Any, path: tuple, new: dict) -> Any:
        """``obj`` with every tensor copied into its slot and replaced by a :class:`SlotRef`; new slots into ``new``.

        Raises:
            NotSnapshottable: a tensor sits inside an object other than a list, tuple, named tuple or dict.
        """
        kind = type(obj)
        if isinstance(obj, torch.Tensor):
            slot = self.slots.get(path)
            if slot is None or slot.shape != obj.shape or slot.dtype != obj.dtype:
                slot = torch.empty(obj.shape, dtype=obj.dtype).share_memory_()
                self.slots[path] = new[path] = slot
            slot.copy_(obj.detach())
            self.used.add(path)
            return SlotRef(path)
        if _is_tensor_holder(obj):
            with _popped(obj) as tensors:
                pickled = pickle.dumps(obj)
            return HollowRef(pickled, self.snapshot(list(tensors), (*path, "tensors"), new))
        if kind in (list, tuple):
            return kind(self.snapshot(v, (*path, i), new) for i, v in enumerate(obj))
        if kind is dict:  # slots by position: a key may change from save to save (the local tier's checkpoint id)
            return {k: self.snapshot(v, (*path, i), new) for i, (k, v) in enumerate(obj.items())}
        if isinstance(obj, tuple) and hasattr(kind, "_fields"):  # a named tuple
            return kind(*(self.snapshot(v, (*path, i), new) for i, v in enumerate(obj)))
        if _holds_tensor(obj):
            raise NotSnapshottable(
                f"an async save argument of type {kind.__name__} holds tensors the snapshot cannot reach"
            )
        return obj

    def slots_needed(self, obj: Any, path: tuple) -> int:
        """How many slots ``obj``'s tensors use: those it already has and the new ones."""
        kind = type(obj)
        if isinstance(obj, torch.Tensor):
            return 1
        if _is_tensor_holder(obj):
            with _popped(obj) as tensors:
                return len(tensors)
        if kind in (list, tuple) or (isinstance(obj, tuple) and hasattr(kind, "_fields")):
            return sum(self.slots_needed(v, (*path, i)) for i, v in enumerate(obj))
        if kind is dict:
            return sum(self.slots_needed(v, (*path, i)) for i, v in enumerate(obj.values()))
        return 0

    def bytes_needed(self, obj: Any, path: tuple) -> int:
        """Bytes of new slots :meth:`snapshot` would allocate for ``obj`` (copies nothing).

        Raises:
            NotSnapshottable: as :meth:`snapshot` would.
        """
        kind = type(obj)
        if isinstance(obj, torch.Tensor):
            slot = self.slots.get(path)
            fits = slot is not None and slot.shape == obj.shape and slot.dtype == obj.dtype
            return 0 if fits else obj.numel() * obj.element_size()
        if _is_tensor_holder(obj):
            with _popped(obj) as tensors:
                return self.bytes_needed(list(tensors), (*path, "tensors"))
        if kind in (list, tuple) or (isinstance(obj, tuple) and hasattr(kind, "_fields")):
            return sum(self.bytes_needed(v, (*path, i)) for i, v in enumerate(obj))
        if kind is dict:
            return sum(self.bytes_needed(v, (*path, i)) for i, v in enumerate(obj.values()))
        if _holds_tensor(obj):
            raise NotSnapshottable(
                f"an async save argument of type {kind.__name__} holds tensors the snapshot cannot reach"
            )
        return 0


def open_file_limit() -> int:
    """The open-file limit of this process, raised to the hard limit first (once is enough; the writer inherits it)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 30


_FD_HEADROOM = 512
"""Open files left for everything else when the slots' count is checked against the limit."""


class _SlotsOnlyPickler(ForkingPickler):
    """Pickles a request for the writer; refuses any tensor that is not a slot (its live storage would be shared)."""

    def __init__(self, *args: Any, allowed: Any = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._allowed = {id(t) for t in allowed}

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and id(obj) not in self._allowed:
            raise NotSnapshottable(f"a {tuple(obj.shape)} tensor outside the snapshot's slots")
        return NotImplemented

    @classmethod
    def dumps(cls, obj: Any, allowed: Any = ()) -> bytes:  # type: ignore[override]
        buf = io.BytesIO()
        cls(buf, pickle.HIGHEST_PROTOCOL, allowed=allowed).dump(obj)
        return buf.getvalue()

    @classmethod
    def check(cls, obj: Any) -> None:
        """Raise as :meth:`dumps` would for ``obj`` (a tensor it holds, or anything that cannot be pickled)."""
        cls(io.BytesIO(), pickle.HIGHEST_PROTOCOL).dump(obj)


@contextlib.contextmanager
def _popped(holder: Any) -> Iterator[list]:
    """A tensor holder's tensors, taken out for the span (the holder is hollow) and put back after."""
    tensors = holder.pop_tensors()
    try:
        yield tensors
    finally:
        holder.insert_tensors(tensors)


def _is_tensor_holder(obj: Any) -> bool:
    """Whether ``obj`` gives its tensors up and takes them back (``TensorAwareStateDict``'s interface)."""
    return hasattr(obj, "pop_tensors") and hasattr(obj, "insert_tensors") and not getattr(obj, "is_hollow", True)


def _holds_tensor(obj: Any, depth: int = 3) -> bool:
    """Whether a tensor is inside ``obj`` (containers and object attributes, ``depth`` levels down)."""
    if isinstance(obj, torch.Tensor):
        return True
    if depth == 0 or isinstance(obj, (str, bytes, int, float)):
        return False
    if isinstance(obj, (list, tuple, set, frozenset)):
        values: Any = obj
    elif isinstance(obj, dict):
        values = obj.values()
    elif hasattr(obj, "__dict__"):
        values = vars(obj).values()
    else:
        return False
    return any(_holds_tensor(v, depth - 1) for v in values)


def resolve(obj: Any, slots: dict) -> Any:
    """``obj`` with every :class:`SlotRef` replaced by its slot (in the writer)."""
    kind = type(obj)
    if kind is SlotRef:
        return slots[obj.key]
    if kind is HollowRef:
        holder = pickle.loads(obj.pickled)
        holder.insert_tensors(resolve(obj.tensors, slots))
        return holder
    if kind in (list, tuple):
        return kind(resolve(v, slots) for v in obj)
    if kind is dict:
        return {k: resolve(v, slots) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(kind, "_fields"):
        return kind(*(resolve(v, slots) for v in obj))
    return obj


def shm_free_bytes() -> Optional[int]:
    """Free bytes in :data:`SHM_DIR` (``None`` where there is none)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


_JOB_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def serve(parent: int, rank: int, requests: Any, done: Any) -> None:
    """The writer's loop (the forked writer): run each :class:`WriteCall`, report its index; ``None`` ends it."""
    if not die_with_parent(parent):
        return
    for sig in _JOB_SIGNALS:  # the job's signals are the rank's to handle (blocked since the fork: none is lost)
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _JOB_SIGNALS)
    torch.set_num_threads(1)
    slots: dict[tuple, torch.Tensor] = {}
    while True:
        payload = requests.get()
        if payload is None:
            return
        call = pickle.loads(payload)
        for key in call.dropped:
            slots.pop(key, None)
        slots.update(call.new_slots)
        try:
            call.fn(*resolve(call.args, slots), **resolve(call.kwargs, slots))
        except BaseException:  # noqa: BLE001 - reported; the finalize finds this save's results missing
            logger.exception("rank %d: async checkpoint write %d failed in the persistent writer", rank, call.call_idx)
        done.put(call.call_idx)
        del call


def _kill(process: Any) -> None:
    """Kill a writer still running (at close, or at the rank's exit: multiprocessing would wait for it forever)."""
    if process.is_alive():
        process.kill()
        process.join(5)


_WRITER = "writer"
"""A call in flight on the persistent writer (the other kind: the forked caller that runs it)."""


class _Classes:
    caller: Optional[type] = None
    queue: Optional[type] = None


def caller_class() -> type:
    """:class:`SharedMemoryAsyncCaller`, built on megatron-core's ``AsyncCaller`` when first needed."""
    if _Classes.caller is None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCaller, TemporalAsyncCaller

        def _forked(async_req: Any) -> Any:
            """megatron-core's forked caller running ``async_req`` (none when it has no write function)."""
            forked = TemporalAsyncCaller()
            with die_with_this_process():  # a writer forked here must not outlive its rank
                forked.schedule_async_call(async_req)
            return forked

        class SharedMemoryAsyncCaller(AsyncCaller):
            """megatron-core's async caller interface over one persistent writer fed through shared memory.

            A call that cannot be snapshotted (tensors inside an object, or ``/dev/shm`` too small for the slots)
            runs on a forked writer instead, as every call did before; calls finish in the order they came.
            """

            def __init__(self, rank: int) -> None:
                self.rank = rank
                self.process: Any = None
                self.queue: Any = None
                self.comp_q: Any = None
                self.arena = SlotArena()
                self._writer_has: set = set()
                self._calls: deque = deque()  # _WRITER or the forked caller of each call in flight, oldest first
                self._finished: Optional[int] = None  # the writer's notice of the oldest call, once read
                self._notices: deque = deque()  # notices read from the writer's queue, not yet matched to a call
                self._sent = self._noticed = 0  # calls sent to the writer, notices it gave
                self._warned = False
                self._lost = False  # the writer died: later saves fork their writer
                self._pending_drops: list = []  # slots freed here that the writer still has to let go
                self._start()

            # ---------------------------------------------------------- schedule

            def schedule_async_call(self, async_req: Any) -> None:
                if async_req.async_fn is None:  # nothing to write on this rank; its poll still joins the all-reduce
                    self._calls.append(_forked(async_req))
                    return
                args = list(async_req.async_fn_args)
                if async_req.preload_fn:
                    args[1] = async_req.preload_fn()  # CPU tensors: the same tensors; copied into slots below
                kwargs = dict(async_req.async_fn_kwargs or {})
                why = self._cannot_snapshot(args, kwargs)
                if why is None and (self._lost or self.process is None or not self.process.is_alive()):
                    why, self._lost = "the persistent writer is gone", True
                if why is None:
                    self._take_notice(None)
                    if self._sent > self._noticed:  # its slots are still being read: this save forks
                        logger.info("rank %d: the writer still writes an earlier save; this one forks", self.rank)
                        why = ""
                if why is None:
                    try:  # here, not in the queue's feeder thread: what cannot be copied or sent is forked instead
                        payload = self._snapshot_and_pickle(async_req, args, kwargs)
                    except Exception as err:  # noqa: BLE001 - a fork needs neither: it gets the rank's memory
                        self.arena.used = set()
                        why = f"the request cannot be sent to the writer ({type(err).__name__}: {err})"
                    else:
                        self._sent += 1
                        self.queue.put(payload)
                        self._calls.append(_WRITER)
                        return
                if why and not self._warned:
                    logger.warning("rank %d: async saves fork their writer: %s", self.rank, why)
                    self._warned = True
                self._calls.append(_forked(async_req._replace(preload_fn=None, async_fn_args=tuple(args))))

            def _snapshot_and_pickle(self, async_req: Any, args: list, kwargs: dict) -> bytes:
                """Copy the request's tensors into slots; the pickled :class:`WriteCall` (bookkeeping when it is)."""
                _SlotsOnlyPickler.check(async_req.async_fn)  # before any copy: a function that cannot go never will
                new: dict = {}
                refs = self.arena.snapshot(args, ("args",), new)
                kwrefs = self.arena.snapshot(kwargs, ("kwargs",), new)
                dropped = self._pending_drops + self.arena.drop_unused()
                self._pending_drops = dropped  # until a call carries them
                new = {k: v for k, v in self.arena.slots.items() if k not in self._writer_has or k in new}
                call = WriteCall(async_req.call_idx, async_req.async_fn, refs, kwrefs, new, dropped)
                payload = _SlotsOnlyPickler.dumps(call, allowed=new.values())
                self._writer_has.difference_update(dropped)
                self._writer_has.update(new)
                self._pending_drops = []
                return payload

            def _cannot_snapshot(self, args: list, kwargs: dict) -> Optional[str]:
                """Why this call cannot go to the persistent writer (``None``: it can)."""
                try:
                    needed = self.arena.bytes_needed(args, ("args",)) + self.arena.bytes_needed(kwargs, ("kwargs",))
                    slots = self.arena.slots_needed(args, ("args",)) + self.arena.slots_needed(kwargs, ("kwargs",))
                except NotSnapshottable as err:
                    return str(err)
                free = shm_free_bytes()
                # Every rank of the node may allocate its slots at this same save: count them all.
                node = needed * launch_env.current().ranks_per_node
                if needed and (free is None or free < node + SHM_HEADROOM_BYTES):
                    return (
                        f"{SHM_DIR} has {0 if free is None else free >> 20} MiB free, the node's snapshot slots need "
                        f"{node >> 20} MiB (+{SHM_HEADROOM_BYTES >> 20} MiB headroom); enlarge it "
                        "(e.g. docker --shm-size) for a persistent writer"
                    )
                limit = open_file_limit()
                if slots + _FD_HEADROOM > limit:  # each slot keeps a file descriptor open
                    return (
                        f"{slots} snapshot slots need as many open files, the limit is {limit}: raise it "
                        "(ulimit -n) for a persistent writer"
                    )
                return None

            def _start(self) -> None:
                ctx = mp.get_context("fork")  # inherits the imports and the CPU shims; no model pages exist yet
                self.queue, self.comp_q = ctx.Queue(), ctx.Queue()
                for q in (self.queue, self.comp_q):  # never wait at exit to flush a queue no one reads any more
                    q.cancel_join_thread()
                self.process = ctx.Process(
                    target=serve,
                    args=(os.getpid(), self.rank, self.queue, self.comp_q),
                    name=f"checkpoint-writer-{self.rank}",
                )
                # The job's signals wait in the rank during the fork: the writer ignores them before it sees one.
                blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _JOB_SIGNALS)
                try:
                    with die_with_this_process():
                        self.process.start()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
                atexit.register(_kill, self.process)  # the process, not the caller: works if the caller is lost
                logger.info("rank %d: persistent async checkpoint writer started (pid %d)", self.rank, self.process.pid)

            # ---------------------------------------------------------- poll

            def finished_here(self) -> bool:
                """Whether this rank's oldest call finished (no collective, nothing committed)."""
                if not self._calls:
                    return True
                head = self._calls[0]
                if head is _WRITER:
                    return not self._writing(blocking=False)
                return head.process is None or not head.process.is_alive()

            def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
                if not self._calls:  # not reached through the queue; still one all-reduce, as every rank makes
                    return True if no_dist else self.sync_all_async_calls(False)
                head = self._calls[0]
                if head is not _WRITER:
                    is_done = head.is_current_async_call_done(blocking, no_dist)
                else:
                    is_alive = self._writing(blocking)
                    is_done = not is_alive if no_dist else self.sync_all_async_calls(is_alive)
                    if is_done:
                        self._finished = None
                if is_done:
                    self._calls.popleft()
                return is_done

            def _take_notice(self, timeout: Optional[float]) -> None:
                """Move the writer's completion notices from its queue to ``_notices`` (wait ``timeout`` for one)."""
                while True:
                    try:
                        notice = self.comp_q.get(timeout=timeout) if timeout else self.comp_q.get_nowait()
                    except queue_module.Empty:
                        return
                    self._notices.append(notice)
                    self._noticed += 1
                    timeout = None

            def _writing(self, blocking: bool) -> bool:
                """Whether the writer still runs the oldest call (waits for it with ``blocking``)."""
                while self._finished is None:
                    process = self.process  # close(abort=True) may clear it from another thread (in-process restart)
                    if process is None:
                        break
                    self._take_notice(None)
                    if self._notices:
                        self._finished = self._notices.popleft()
                    elif blocking and process.is_alive():
                        self._take_notice(0.05)
                    elif not process.is_alive():
                        logger.error(
                            "rank %d: the persistent checkpoint writer (pid %d) died (exit code %s) during a save",
                            self.rank,
                            process.pid,
                            process.exitcode,
                        )
                        self._finished, self.process, self._lost = -1, None, True  # the finalize finds no results
                    else:
                        return True
                return False

            # ---------------------------------------------------------- close

            def close(self, abort: bool = False) -> None:
                for head in list(self._calls):
                    if head is not _WRITER:
                        head.close(abort=abort)
                self._calls.clear()
                process, self.process = self.process, None
                if process is not None:
                    if not abort and process.is_alive():
                        self.queue.put(None)
                        process.join(60)
                        if process.is_alive():
                            logger.warning("rank %d: the checkpoint writer did not stop in 60 s; killing it", self.rank)
                    _kill(process)  # killed if still running (abort, or stuck)
                self.arena.slots.clear()
                self._writer_has = set()

            def __del__(self) -> None:
                pass  # close() is explicit; the atexit hook kills a writer left running

        _Classes.caller = SharedMemoryAsyncCaller
    return _Classes.caller


def calls_queue(rank: int) -> Any:
    """megatron-core's ``AsyncCallsQueue`` whose calls all go to one :class:`SharedMemoryAsyncCaller` of ``rank``."""
    if _Classes.queue is None:
        from megatron.bridge.utils import upstream

        class SharedMemoryCallsQueue(upstream.base_class(f"{upstream.ASYNC_UTILS}:AsyncCallsQueue")):
            """The queue, with its caller chosen here (``persistent=False``: upstream's own worker never starts)."""

            def __init__(self, caller: Any) -> None:
                super().__init__(persistent=False)
                self.caller = caller

            def _get_async_caller(self) -> Any:
                return self.caller

            def close(self, abort: bool = False) -> None:
                try:
                    super().close(abort=abort)
                finally:
                    self.caller.close(abort=abort)

        _Classes.queue = SharedMemoryCallsQueue
    return _Classes.queue(caller_class()(rank))
