"""On-disk layout of a checkpoint directory and the atomic commit protocol.

Layout of ``checkpoint.save`` (Megatron-Bridge's, plus the manifest; the names are those of
``training/utils/checkpoint_utils.py``)::

    latest_checkpointed_iteration.txt   the tracker: the iteration of the newest committed checkpoint
    latest_train_state.pt               a copy of the tracker's checkpoint's train_state.pt
    iter_0000100/                       a committed checkpoint: the torch_dist files (.metadata, metadata.json,
                                        common.pt, __<rank>_<n>.distcp), run_config.yaml, train_state.pt and
                                        manifest.json (size and SHA-256 of every other file: ``manifest.py``)
    .tmp_iter_0000120.<attempt>/        a save in progress (never loaded; removed at the next start)
    .replaced_iter_0000100/             an older copy kept while a re-save at the same iteration commits
    .deleting_iter_0000040/             a checkpoint being deleted by retention

Commit protocol (all file data is already on disk, manifest last):

1. every rank writes into ``.tmp_iter_N.<attempt>`` (a fresh name per save, so a writer orphaned by a crash can
   never write into a later save); the manifest is written after all ranks finished;
2. rank 0 fsyncs the directory tree;
3. if ``iter_N`` already exists, it is renamed to ``.replaced_iter_N``;
4. ``.tmp_iter_N.<attempt>`` is renamed to ``iter_N`` and the parent directory fsynced;
5. the tracker is written to a temporary file, fsynced and renamed over the old tracker, and
   ``latest_train_state.pt`` replaced the same way by a copy of ``iter_N/train_state.pt``;
6. ``.replaced_iter_N`` is deleted.

A crash between any two steps leaves either the old state or the new one for :func:`recover`, which runs on the
save directory when a run starts (before it loads or saves anything): it deletes ``.tmp_iter_*`` and
``.deleting_iter_*``, restores ``.replaced_iter_N`` when ``iter_N`` is missing, and copies the tracker's
``train_state.pt`` to ``latest_train_state.pt`` again (a crash between steps 5's two writes left the older one).
The tracker is what this package loads by; ``latest_train_state.pt`` is kept for Megatron-Bridge, which reads it
first.

For fault drills, :func:`crash_point` marks each step: a ``save.<point>`` fault of the fault-injection registry
(``training/faults/injection.py``, e.g. ``kill@6:0:save.after_rename``) kills, stops or stalls the process there.
"""

import io
import logging
import os
import re
import shutil
import threading
from typing import Any, Optional

import torch

from megatron.bridge.training.checkpoint.names import (
    TRACKER_FILE,
    TRACKER_PREFIX,
    get_checkpoint_name,
    get_checkpoint_run_config_filename,
    get_checkpoint_tracker_filename,
    get_checkpoint_train_state_filename,
)
from megatron.bridge.training.faults import injection as fault_injection
from megatron.bridge.utils import fs

logger = logging.getLogger(__name__)

TRACKER_NAME = TRACKER_FILE
_TENSOR_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64}
_FLOAT_FIELDS = ("floating_point_operations_so_far",)  # a float64 tensor in Megatron-Bridge's train_state.pt
_ITER_RE = re.compile(r"^iter_(\d{7})$")
_TMP_RE = re.compile(r"^\.(tmp|deleting)_iter_(\d{7})(\.[\w-]+)?$")
_REPLACED_RE = re.compile(r"^\.replaced_iter_(\d{7})$")


def crash_point(name: str, rank: int, iteration: int) -> None:
    """Strike here if the fault registry has a fault due at this point of the save of ``iteration`` on ``rank``.

    ``name`` is one of ``fault_injection.SAVE_POINTS``. For fault drills.
    """
    fault_injection.at_save_point(name, rank, iteration)


def iter_dir(root: str, iteration: int) -> str:
    """Path of the committed checkpoint of ``iteration``."""
    return get_checkpoint_name(root, iteration)


def tmp_dir(root: str, iteration: int, attempt: str) -> str:
    """Path the save attempt ``attempt`` of ``iteration`` writes into before it is committed."""
    return os.path.join(root, f".tmp_iter_{iteration:07d}.{attempt}")


def _replaced_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f".replaced_iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    """Iteration named by the tracker in ``root``, or ``None`` when there is no readable tracker."""
    path = get_checkpoint_tracker_filename(root)
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    try:
        return int(text)
    except ValueError:
        logger.warning("%s holds %r, not an iteration; ignoring the tracker", path, text[:40])
        return None


def write_tracker(root: str, iteration: int, rank: int = 0) -> None:
    """Atomically replace the tracker in ``root`` with ``iteration`` (write temp, fsync, rename, fsync dir).

    ``latest_train_state.pt`` follows it: see :func:`sync_latest_train_state`.
    """
    path = get_checkpoint_tracker_filename(root)
    fs.atomic_write(path, f"{iteration}\n", before_rename=lambda: crash_point("after_tracker_tmp", rank, iteration))
    sync_latest_train_state(root, iteration)


def train_state_tensors(train_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A train state as Megatron-Bridge stores it in ``train_state.pt``: one 0-d tensor per field.

    ``TrainState.state_dict()`` gives them so; plain values (an older state dict) are converted.
    """
    return {
        name: value
        if isinstance(value, torch.Tensor)
        else torch.tensor(
            value, dtype=torch.float64 if name in _FLOAT_FIELDS else _TENSOR_DTYPES.get(type(value), torch.int64)
        )
        for name, value in train_state.items()
    }


def write_iteration_files(ckpt_dir: str, train_state: dict[str, Any], run_config: Optional[str]) -> None:
    """Write ``train_state.pt`` and, when given, ``run_config.yaml`` into a checkpoint being saved (one rank).

    Both are Megatron-Bridge's per-checkpoint files; they are written before the manifest, so it covers them.

    Args:
        ckpt_dir: the save's temporary directory.
        train_state: ``TrainState.state_dict()`` at the save's step.
        run_config: the run's configuration as YAML text (``config_utils.yaml_text`` of ``ConfigContainer.to_dict()``,
            rendered once per run), or ``None``: Megatron-Bridge's tools read a checkpoint's settings from it
            (``checkpoint_utils.read_run_config``). It is read, never executed: loading a checkpoint here never builds
            anything from it.
    """
    from megatron.bridge.training.utils.config_utils import write_yaml

    buffer = io.BytesIO()
    torch.save(train_state_tensors(train_state), buffer)
    fs.atomic_write(get_checkpoint_train_state_filename(ckpt_dir), buffer.getvalue(), durable=False)
    if run_config is not None:
        write_yaml(run_config, get_checkpoint_run_config_filename(ckpt_dir))


def sync_latest_train_state(root: str, iteration: int) -> None:
    """Make ``latest_train_state.pt`` in ``root`` a copy of ``iter_N/train_state.pt`` (atomically, durable).

    Removed when that checkpoint has no ``train_state.pt`` (saved before this file existed): a stale copy would point
    Megatron-Bridge at another checkpoint than the tracker.
    """
    latest = get_checkpoint_train_state_filename(root, prefix=TRACKER_PREFIX)
    try:
        with open(get_checkpoint_train_state_filename(iter_dir(root, iteration)), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        if os.path.exists(latest):
            os.remove(latest)
        return
    try:
        with open(latest, "rb") as f:
            if f.read() == data:
                return  # already in step: nothing is written (a read-only save directory stays untouched)
    except FileNotFoundError:
        pass
    fs.atomic_write(latest, data)


def committed_iterations(root: str) -> list[int]:
    """Iterations of the ``iter_NNNNNNN`` directories in ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    found = [int(m.group(1)) for name in os.listdir(root) if (m := _ITER_RE.match(name))]
    return sorted(found, reverse=True)


def commit(root: str, iteration: int, attempt: str, rank: int = 0) -> None:
    """Publish ``.tmp_iter_N.<attempt>`` as ``iter_N`` and point the tracker at it (steps 2-6 of the protocol).

    Call on one rank, after every rank finished writing and the manifest is in place.
    """
    crash_point("after_manifest", rank, iteration)
    src = tmp_dir(root, iteration, attempt)
    dst = iter_dir(root, iteration)
    fs.fsync_tree(src)
    replaced = None
    if os.path.exists(dst):
        replaced = _replaced_dir(root, iteration)
        if os.path.exists(replaced):
            shutil.rmtree(replaced)
        os.rename(dst, replaced)
        crash_point("after_replace_old", rank, iteration)
    os.rename(src, dst)
    fs.fsync_path(root)
    crash_point("after_rename", rank, iteration)
    write_tracker(root, iteration, rank)
    crash_point("after_tracker", rank, iteration)
    if replaced is not None:
        shutil.rmtree(replaced)


def recover(root: str) -> None:
    """Undo what an interrupted save left in ``root``; run on one rank when a run starts.

    Deletes ``.tmp_iter_*`` and ``.deleting_iter_*`` directories and the tracker's temporary files. A
    ``.replaced_iter_N`` is moved back to ``iter_N`` when the re-save never got there, and deleted otherwise.
    """
    if not os.path.isdir(root):
        return
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if _TMP_RE.match(name):
            logger.warning("removing %s left by an interrupted save", path)
            shutil.rmtree(path, ignore_errors=True)
        elif m := _REPLACED_RE.match(name):
            final = iter_dir(root, int(m.group(1)))
            if os.path.exists(final):
                logger.warning("removing %s: its re-save %s was committed", path, final)
                shutil.rmtree(path, ignore_errors=True)
            else:
                logger.warning("restoring %s: the re-save that replaced it never committed", final)
                os.rename(path, final)
    tracker = get_checkpoint_tracker_filename(root)
    latest = get_checkpoint_train_state_filename(root, prefix=TRACKER_PREFIX)
    fs.remove_temporaries(tracker)
    fs.remove_temporaries(latest)
    tracked = read_tracker(root)
    if tracked is not None and os.path.isdir(iter_dir(root, tracked)):
        sync_latest_train_state(root, tracked)
    fs.fsync_path(root)


def apply_retention(root: str, keep: int, protect: set[int], retain_interval: Optional[int] = None) -> list[int]:
    """Delete committed checkpoints beyond the newest ``keep`` ones, or off ``retain_interval``; never one protected.

    The tracker's checkpoint is always protected too. With ``retain_interval`` (``checkpoint.save_retain_interval``,
    never together with ``keep``), every checkpoint whose iteration is not a multiple of it is deleted once a newer
    one is committed: the multiples and the newest stay. Returns the deleted iterations.

    Args:
        root: the save directory.
        keep: how many of the newest committed checkpoints to keep; -1 keeps all.
        protect: iterations that must not be deleted (e.g. a save still being finalized).
        retain_interval: keep only the checkpoints whose iteration is a multiple of it (and the newest).
    """
    if keep < 0 and not retain_interval:
        return []
    protected = set(protect)
    tracked = read_tracker(root)
    if tracked is not None:
        protected.add(tracked)
    if retain_interval:
        doomed_iterations = [i for i in committed_iterations(root)[1:] if i % retain_interval]
    else:
        doomed_iterations = committed_iterations(root)[keep:]
    deleted = []
    for iteration in doomed_iterations:
        if iteration in protected:
            continue
        path = iter_dir(root, iteration)
        # Rename first so that a crash mid-delete never leaves a partial iter_N behind.
        doomed = os.path.join(root, f".deleting_iter_{iteration:07d}")
        os.rename(path, doomed)
        deleted.append(iteration)
        # Deleting a large checkpoint can take seconds on a shared file system: not on the training path.
        # If the process dies first, recover() finishes the job.
        threading.Thread(target=shutil.rmtree, args=(doomed, True), name="ckpt-retention", daemon=True).start()
    if deleted:
        policy = f"save_retain_interval={retain_interval}" if retain_interval else f"most_recent_k={keep}"
        logger.info("retention (%s): deleted checkpoints at iterations %s", policy, deleted)
    return deleted


def remove_checkpoints(root: str, iterations: list[int], background: bool = False) -> None:
    """Delete the committed checkpoints of ``iterations`` in ``root`` (in a daemon thread with ``background``).

    Each ``iter_N`` is renamed to ``.deleting_iter_N`` first (as :func:`apply_retention` does), so a crash
    mid-delete never leaves a partial ``iter_N`` behind; :func:`recover` finishes an interrupted deletion.
    """
    doomed = []
    for iteration in iterations:
        path = os.path.join(root, f".deleting_iter_{iteration:07d}")
        os.rename(iter_dir(root, iteration), path)
        doomed.append(path)

    def delete() -> None:
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)

    if background:
        threading.Thread(target=delete, name="ckpt-retention", daemon=True).start()
    else:
        delete()
