"""Checkpoint storage faults at run time: every rank checks, decides and stops together (the logic: ``storage.py``).

The failure it handles: a checkpoint directory that fills up, turns read-only or unreadable, or is deleted or replaced
while the run goes on. One rank cannot stop a multi-rank save on its own (its peers would wait for it in a collective
until a timeout), so every decision here is taken by all ranks at the same point of a save:

* Before every save (:meth:`StorageGuard.before_save`: global, sync or async, and local tier) and at start
  (:meth:`StorageGuard.check_start`), each rank checks that ``checkpoint.save`` is still the directory it saved into
  (``st_dev``/``st_ino``; if not: an error-level log, a ``save_dir_changed`` event, and the directory is created again
  since the state in memory is the best copy left), creates the save's temporary directory and reads the free space;
  one ``all_gather``; too little space on any rank's file system (:func:`storage.needed_bytes`), or a directory that
  cannot be created, stops the run before anything is written.
* After a save failed (:meth:`StorageGuard.save_failed`), the error is classified (full: exit code 26, unavailable:
  27). When every rank saw the failure at the same point (megatron-core's ``CheckpointException`` after the write,
  a failed commit on rank 0, the local tier's agreed failure) the ranks agree on the fault with one ``all_gather``;
  otherwise the rank that saw it stops alone and its peers fail on their next collective with it. The partial save
  is removed, a ``fault_detected`` event is written and the run stops with one paragraph naming the directory, the
  tier, the iteration, the space and the fix. The tracker never moved, so the newest committed checkpoint is still
  the one a restart loads.
* ``checkpoint.global_save_failure_policy="continue_local"`` turns a failed global save into a warning: training goes
  on and the caller keeps the state in the local tier.
* :meth:`StorageGuard.reading` turns an unreadable checkpoint directory at start (``EACCES``, ``EIO``, ...) into exit
  code 27 with the path, instead of a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from torch.distributed.checkpoint import CheckpointException

from megatron.bridge.training.checkpoint import layout, manifest, storage
from megatron.bridge.training.checkpoint.storage import StorageFault, human
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind, Mechanism
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.utils.dist import RankZeroError, all_gather_object, on_rank0, rank

if TYPE_CHECKING:
    from megatron.bridge.training.config import CheckpointConfig

logger = logging.getLogger(__name__)

GLOBAL, LOCAL = "global", "local"
_MECHANISM = {
    ExitCode.STORAGE_FULL: Mechanism.STORAGE_FULL,
    ExitCode.STORAGE_UNAVAILABLE: Mechanism.STORAGE_UNAVAILABLE,
}


def raised_by_every_rank(err: BaseException) -> bool:
    """Whether every rank raised ``err`` at the same point, so that they can agree on its cause with a collective."""
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import CheckpointingException

    # The local manager raises exactly CheckpointingException after its collective check of a save (subclasses such
    # as SameMachineReplicationException come from one rank).
    return isinstance(err, (CheckpointException, RankZeroError)) or type(err) is CheckpointingException


@dataclass(frozen=True)
class _View:
    """One rank's look at a checkpoint directory just before a save (gathered from every rank)."""

    host: str
    free: Optional[int]
    last: Optional[int]
    """This rank's size of its tier's last checkpoint (global: all files; local: its node's files)."""
    estimate: int
    """Bytes of the tensors this rank writes in this save (0: not computed)."""
    fault: Optional[StorageFault]


class StorageGuard:
    """The storage checks of one run's checkpoints (every method that says so is called by all ranks together).

    Args:
        cfg: the checkpoint section.
    """

    SAVE_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)
    """What a failed save raises: any ``Exception``, and torch's ``CheckpointException`` (a ``BaseException``)."""

    def __init__(self, cfg: CheckpointConfig) -> None:
        self.cfg = cfg
        self.continue_local = cfg.global_save_failure_policy == "continue_local"
        self.sizes: dict[str, Optional[int]] = {GLOBAL: None, LOCAL: None}
        """Bytes of the last checkpoint of each tier, once known (global: all its files; local: this node's)."""
        self._needed: dict[str, int] = {}
        self._identity = storage.identity(cfg.save)
        self._since = "the start of the run"
        storage.receive_writer_errors()

    @property
    def local_dir(self) -> str:
        """``checkpoint.non_persistent_local_ckpt_dir``."""
        return str(self.cfg.non_persistent_local_ckpt_dir)

    def _where(self, tier: str) -> tuple[str, str]:
        if tier == GLOBAL:
            return "checkpoint.save", str(self.cfg.save)
        return "checkpoint.non_persistent_local_ckpt_dir", str(self.cfg.non_persistent_local_ckpt_dir)

    # ------------------------------------------------------------------ before a save

    def before_save(self, tier: str, iteration: int, estimate: int, tmp: Optional[str] = None, when: str = "") -> bool:
        """Check ``tier``'s directory before saving ``iteration`` (all ranks); create ``tmp`` when given.

        Args:
            tier: ``"global"`` (``checkpoint.save``) or ``"local"`` (the local tier's directory).
            iteration: the iteration about to be saved.
            estimate: bytes of the tensors this rank is about to write (used until a checkpoint's size is known).
            tmp: the save's temporary directory, created here (global saves).
            when: what is checked, for the message (default: the checkpoint of ``iteration``).

        Returns:
            ``True``: save. ``False``: do not (a global save under ``continue_local``; a warning was logged).

        Raises:
            TrainingExit: ``STORAGE_FULL`` (too little space) or ``STORAGE_UNAVAILABLE`` (cannot create ``tmp``).
        """
        field, directory = self._where(tier)
        if tier == GLOBAL:
            self._check_identity(directory, iteration)
        fault = None
        try:
            if tmp is not None:
                os.makedirs(tmp, exist_ok=True)
            free = storage.free_bytes(directory)
        except OSError as err:
            fault, free = dataclasses.replace(storage.fault_of_os_error(err), rank=rank()), None
        if tier == GLOBAL and fault is None and self._identity is None:
            self._identity, self._since = storage.identity(directory), f"iteration {iteration}"
        views = all_gather_object(_View(socket.gethostname(), free, self.sizes[tier], estimate, fault))
        what = when or f"the {tier} checkpoint of iteration {iteration}"
        verdict = self._judge(tier, views, what)
        if verdict is None:
            return True
        if tmp is not None and rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # empty: nothing was written
        self._stop_or_continue(tier, iteration, *verdict)  # raises, or training goes on without this save
        return False

    def _judge(self, tier: str, views: list[_View], what: str) -> Optional[tuple[StorageFault, str]]:
        field, directory = self._where(tier)
        faults = [v.fault for v in views if v.fault is not None]
        if faults:
            fault = faults[0]
            return fault, (
                f"{field}={directory}: cannot prepare {what}: {fault.text} (rank {fault.rank}). Nothing was written. "
                f"{self._last_good()} Fix: {self._fix(tier, fault)}"
            )
        total = sum(v.estimate for v in views)
        factor = self.cfg.replication_factor if tier == LOCAL and self.cfg.replication else 1
        worst = None
        for index, view in enumerate(views):
            if view.last is not None:
                size = view.last
                where = " on that node" if tier == LOCAL else ""
                basis = f"the last {tier} checkpoint{where} was {human(size)}"
            elif total > 0:
                share = sum(v.host == view.host for v in views) / len(views) if tier == LOCAL else 1.0
                size = int(total * share * factor)
                basis = f"the tensors this save writes{' there' if tier == LOCAL else ''} are {human(size)}"
            else:
                continue  # no size known yet and none estimated (at start, before the first save): nothing to check
            need = storage.needed_bytes(size)
            if index == rank():
                self._needed[tier] = need
            if view.free is not None and view.free < need and (worst is None or view.free - need < worst[0]):
                worst = (view.free - need, index, view, need, basis)
        if worst is None:
            return None
        _, index, view, need, basis = worst
        fault = StorageFault(ExitCode.STORAGE_FULL, errno.ENOSPC, "not enough free space", index)
        margin = f"plus {round((storage.MARGIN - 1) * 100)}% and {human(storage.SLACK_BYTES)}"
        return fault, (
            f"{field}={directory}: not enough free space for {what}: {human(view.free)} free (seen by rank {index} "
            f"on {view.host}), about {human(need)} needed ({basis}; {margin}). Nothing was written. "
            f"{self._last_good()} Fix: {self._fix(tier, fault)}"
        )

    def _check_identity(self, directory: str, iteration: int) -> None:
        """Report a save directory that is not the one this run saved into (removed, or replaced)."""
        change = storage.identity_change(self._identity, storage.identity(directory))
        if change is None:
            return
        message = (
            f"checkpoint.save={directory} {change}, since {self._since}. The checkpoints this run saved there "
            "before are gone from this path. The training state in memory is the best copy left: the directory is "
            f"created again and the global checkpoint of iteration {iteration} is saved into it, and saving goes on "
            "there. Find out what removed it."
        )
        logger.error(message)
        writer = event_stream.writer()
        if writer is not None:
            writer.close()  # its file may have gone with the directory: the next event opens the file again
        event_stream.emit(
            EventKind.FAULT_DETECTED,
            mechanism=Mechanism.SAVE_DIR_CHANGED,
            rank=None,
            tier=GLOBAL,
            iteration=iteration,
            detail=message,
        )
        self._identity = None  # recorded again once the directory exists

    # ------------------------------------------------------------------ at start

    def check_start(self, iteration: int, global_size: Optional[int], local_size: Optional[int]) -> None:
        """The free-space check when the run starts (all ranks), from the size of the checkpoints already there.

        Args:
            iteration: the iteration the run starts at.
            global_size: bytes of the global checkpoint this run loaded (or of the newest in ``checkpoint.save``);
                the same on every rank. ``None``: unknown, no check (the first save checks its own size).
            local_size: bytes of this node's files of its newest local checkpoint (``None``: none).
        """
        if global_size is not None:
            self.sizes[GLOBAL] = global_size
        if local_size is not None:
            self.sizes[LOCAL] = local_size
        if self.cfg.save is not None:
            self.before_save(GLOBAL, iteration, 0, when="the next global checkpoint (checked at start)")
        if self.cfg.non_persistent_ckpt_type == "local" and self.cfg.non_persistent_local_ckpt_dir:
            self.before_save(LOCAL, iteration, 0, when="the next local checkpoint (checked at start)")

    # ------------------------------------------------------------------ after a failed save

    def save_failed(self, err: BaseException, tier: str, iteration: int, tmp: Optional[str] = None) -> bool:
        """Deal with a save of ``tier`` that raised ``err`` (all ranks when ``err`` is collective, else this one).

        Returns:
            ``True``: a storage fault, and training goes on (a global save under ``continue_local``). ``False``:
            ``err`` is no storage fault; the caller raises it again.

        Raises:
            TrainingExit: ``STORAGE_FULL`` or ``STORAGE_UNAVAILABLE``, after the partial save was removed.
        """
        me = rank()
        fault = storage.classify(err)
        noted = storage.take_writer_errors()  # a writer's own error (the local tier reports failures without it)
        fault = fault or (noted[0] if noted else None) or self._diagnose(tier, err)
        if fault is not None and fault.rank is None:
            fault = dataclasses.replace(fault, rank=me)
        collective = raised_by_every_rank(err)
        if collective:
            agreed = [f for f in all_gather_object(fault) if f is not None]
            fault = min(agreed, key=lambda f: (not f.full, f.rank)) if agreed else None
        if fault is None:
            return False
        field, directory = self._where(tier)

        def remove_partial_save() -> Optional[int]:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            try:
                return storage.free_bytes(directory)
            except OSError:
                return None

        # A global save's directory is shared: rank 0 removes it (every rank wrote its files by now) and says what
        # is free then. The local tier's files were removed by its manager on every node; each sees its own node.
        if collective and tier == GLOBAL:
            free = on_rank0(remove_partial_save, "removing the failed save")
        else:
            free = remove_partial_save()
        removed = (
            f"Its partial files ({os.path.basename(tmp)}) were removed: a loader never sees them."
            if tmp is not None
            else "Its partial files were removed."
        )
        state = "full" if fault.full else "unavailable"
        message = (
            f"{field}={directory}: the file system is {state}: the {tier} checkpoint of iteration {iteration} could "
            f"not be written ({fault.text}, seen by rank {fault.rank}; {human(free)} free now"
            f"{' on this node' if tier == LOCAL else ''}, a checkpoint of this run needs about "
            f"{human(self._needed.get(tier))}). {removed} {self._last_good()} Fix: {self._fix(tier, fault)}"
        )
        return self._stop_or_continue(tier, iteration, fault, message)

    def _diagnose(self, tier: str, err: BaseException) -> Optional[StorageFault]:
        """The storage fault behind a failed write whose errno was lost on the way, from a look at the file system.

        A writer's error can cross a process boundary as text only (torch's ``unexpected pos`` when a file could not
        be written). The file system is looked at now, before the partial save is removed: less free space than a
        checkpoint needs is a full one, a directory that cannot be written an unavailable one.
        """
        _, directory = self._where(tier)
        what = storage.failure_text(err)
        try:
            free = storage.free_bytes(directory)
        except OSError as probe_error:
            return storage.fault_of_os_error(probe_error)
        if free < self._needed.get(tier, storage.SLACK_BYTES):
            text = f"a write failed ({what}) with {human(free)} free on the file system"
            return StorageFault(ExitCode.STORAGE_FULL, errno.ENOSPC, text)
        problem = storage.write_problem(directory)
        if problem is not None:
            text = f"a write failed ({what}); {directory} {problem}"
            return StorageFault(ExitCode.STORAGE_UNAVAILABLE, errno.EIO, text)
        return None

    def _stop_or_continue(self, tier: str, iteration: int, fault: StorageFault, message: str) -> bool:
        event_stream.emit(
            EventKind.FAULT_DETECTED,
            mechanism=_MECHANISM[fault.code],
            rank=fault.rank,
            tier=tier,
            iteration=iteration,
            detail=message,
        )
        if tier == GLOBAL and self.continue_local:
            logger.warning(
                "%s [checkpoint.global_save_failure_policy=continue_local: training goes on, its state is kept in the "
                "local tier until a global save succeeds]",
                message,
            )
            return True
        raise TrainingExit(fault.code, message)

    def _last_good(self) -> str:
        try:
            tracked = layout.read_tracker(str(self.cfg.save)) if self.cfg.save else None
        except OSError:
            return "The tracker of checkpoint.save cannot be read."
        if tracked is None:
            return "checkpoint.save holds no committed checkpoint yet."
        return f"The tracker still names iteration {tracked}, the newest committed checkpoint, which a restart loads."

    def _fix(self, tier: str, fault: StorageFault) -> str:
        _, directory = self._where(tier)
        policy = "" if tier == LOCAL or self.continue_local else (
            ' (or, with a local tier, checkpoint.global_save_failure_policy="continue_local" trains on through it)'
        )  # fmt: skip
        if fault.full:
            fewer = "checkpoint.most_recent_k keeps fewer checkpoints" if tier == GLOBAL else "it holds other data"
            return f"free space in {directory} or raise its quota ({fewer}), then requeue the job{policy}."
        return (
            f"make {directory} writable again (remount it read-write, fix its owner, mode or network mount), then "
            f"requeue the job{policy}."
        )

    def committed_bytes(self, resumed: dict) -> Optional[int]:
        """Bytes of the global checkpoint a run resumed from, else of the newest one in ``checkpoint.save`` (rank 0).

        From the checkpoint's manifest; ``None`` when there is none. ``resumed``: ``CheckpointManager.resumed``.
        """
        directory = resumed.get("directory") if resumed.get("tier") == GLOBAL else None
        try:
            if directory is None and self.cfg.save is not None:
                tracked = layout.read_tracker(self.cfg.save)
                directory = layout.iter_dir(self.cfg.save, tracked) if tracked is not None else None
            return sum(entry.size for entry in manifest.read_manifest(directory).values()) if directory else None
        except (OSError, ValueError):
            return None

    # ------------------------------------------------------------------ reading at start

    @contextlib.contextmanager
    def reading(self, what: str) -> Iterator[None]:
        """Turn an unreadable checkpoint directory met while ``what`` into ``STORAGE_UNAVAILABLE`` (exit code 27)."""
        try:
            yield
        except (RankZeroError, OSError) as err:
            fault = storage.classify(err)
            if fault is None:
                raise
            dirs = (("checkpoint.load", self.cfg.load), ("checkpoint.save", self.cfg.save))
            named = [f"{field}={path}" for field, path in dirs if path]
            message = (
                f"cannot read the checkpoint directory while {what}: {fault.text} ({', '.join(named)}). Nothing was "
                "loaded or changed. Fix: make it readable by this job's user (owner, mode, or the mount), then requeue "
                "the job; or point checkpoint.load at another copy."
            )
            unavailable = Mechanism.STORAGE_UNAVAILABLE
            event_stream.emit(EventKind.FAULT_DETECTED, mechanism=unavailable, rank=None, tier=GLOBAL, detail=message)
            raise TrainingExit(ExitCode.STORAGE_UNAVAILABLE, message) from None


def missing_checkpoint(field: str, directory: str, exists: bool) -> str:
    """The error of ``checkpoint.exit_on_missing_checkpoint`` when ``directory`` holds no checkpoint to resume."""
    what = "holds no committed checkpoint" if exists else "does not exist"
    return (
        f"{field}={directory} {what}, and checkpoint.exit_on_missing_checkpoint forbids starting from iteration 0. "
        f"Fix: point {field} at the directory that holds the run's checkpoints (latest_checkpointed_iteration.txt "
        "and iter_*/), or set checkpoint.exit_on_missing_checkpoint=false to start from scratch."
    )
