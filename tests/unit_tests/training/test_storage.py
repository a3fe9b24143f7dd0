"""Storage faults, the pure logic: which errors mean a full or an unavailable file system, how much space a save
needs, the write probe, the directory identity, the forked writer's notes, and the guard's decisions on one rank.

File systems are real where it matters: a size-limited or read-only tmpfs (skipped where mounting is not allowed).
"""

import errno
import logging
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tests.mounts import tmpfs
from tests.unit_tests.configs import base_config

from megatron.bridge.training.checkpoint import layout, storage
from megatron.bridge.training.checkpoint.storage import StorageFault
from megatron.bridge.training.checkpoint.storage_guard import GLOBAL, LOCAL, StorageGuard, missing_checkpoint
from megatron.bridge.training.config import CheckpointConfig
from megatron.bridge.training.config_checks.checkpoint import validate_checkpoint
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.reader import read_events
from megatron.bridge.training.events.stream import EventKind, Mechanism
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.training.faults import injection as fault_injection
from megatron.bridge.training.faults.injection import Fault, parse
from megatron.bridge.utils.dist import RankZeroError

REPO = Path(__file__).resolve().parents[3]
FULL, UNAVAILABLE = ExitCode.STORAGE_FULL, ExitCode.STORAGE_UNAVAILABLE


@pytest.fixture
def events(tmp_path):
    """This process's event stream, into ``tmp_path/events``; returns a reader."""
    event_stream.configure(str(tmp_path / "events"), rank=0)
    yield lambda: read_events(str(tmp_path / "events"))[0]
    event_stream.configure(None, rank=0)


# ------------------------------------------------------------------------------------------------ classify


@pytest.mark.timeout(30)
def test_errnos_map_to_full_unavailable_or_nothing():
    assert storage.classify(OSError(errno.ENOSPC, "No space left on device", "/c/x")) == StorageFault(
        FULL, errno.ENOSPC, "[Errno 28] No space left on device: '/c/x'"
    )
    assert storage.classify(OSError(errno.EDQUOT, "Disk quota exceeded")).code == FULL
    for number in (errno.EROFS, errno.EACCES, errno.EIO, errno.ESTALE, errno.ENOTCONN):
        assert storage.classify(OSError(number, os.strerror(number))).code == UNAVAILABLE
    assert storage.classify(FileNotFoundError(errno.ENOENT, "No such file")) is None
    assert storage.classify(RuntimeError("no errno here")) is None
    assert storage.code_of(None) is None


@pytest.mark.timeout(30)
def test_the_errno_is_found_behind_wrappers_and_in_text_that_crossed_a_process():
    try:  # torch.save into a full file raises RuntimeError("unexpected pos ...") with the OSError as its context
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    except RuntimeError as err:
        wrapped = err
    wrapped.__context__ = OSError(errno.ENOSPC, "No space left on device")
    assert storage.classify(wrapped).code == FULL

    from torch.distributed.checkpoint import CheckpointException

    failures = {1: (RuntimeError("Worker failure: [Errno 28] No space left on device"), None)}
    fault = storage.classify(CheckpointException("write", failures))
    assert (fault.code, fault.errno, fault.text) == (FULL, 28, "[Errno 28] No space left on device")
    text = "the checkpoint commit failed on rank 0: OSError: [Errno 30] Read-only file system: '/ckpt/manifest.json'"
    fault = storage.classify(RankZeroError(text))
    assert (fault.code, fault.text) == (UNAVAILABLE, "[Errno 30] Read-only file system: '/ckpt/manifest.json'")
    assert storage.classify(RankZeroError("failed on rank 0: OSError: [Errno 2] No such file")) is None
    assert storage.failure_text(CheckpointException("write", failures)) == (
        "RuntimeError: Worker failure: [Errno 28] No space left on device"
    )


@pytest.mark.timeout(60)
def test_a_real_full_tmpfs_is_classified_full(tmp_path):
    with tmpfs(tmp_path / "fs", "size=64k") as fs:
        with pytest.raises(Exception) as raised:
            with open(fs / "x.pt", "wb") as f:
                torch.save({"w": torch.zeros(100_000)}, f)
        assert storage.classify(raised.value).code == FULL
        assert storage.free_bytes(fs / "not" / "yet") == storage.free_bytes(fs)  # the nearest existing ancestor


# ------------------------------------------------------------------------------------------------ sizes


@pytest.mark.timeout(30)
def test_needed_bytes_is_the_size_with_a_margin_and_slack():
    assert storage.needed_bytes(0) == storage.SLACK_BYTES
    assert storage.needed_bytes(10_000_000) == int(10_000_000 * storage.MARGIN) + storage.SLACK_BYTES
    assert storage.human(1_580_836) == "1,580,836 bytes (1.5 MiB)"
    assert storage.human(512) == "512 bytes (512.0 B)"
    assert storage.human(None) == "unknown"


@pytest.mark.timeout(60)
def test_tensor_bytes_counts_main_replicas_only():
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    main = ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))  # float32: 48 bytes
    replica = ShardedTensor.from_rank_offsets("b", torch.zeros(10), replica_id=1)  # written by another rank
    half = ShardedTensor.from_rank_offsets("h", torch.zeros(8, dtype=torch.bfloat16))  # 16 bytes
    state = {"model": {"w": main, "b": replica}, "h": [half], "obj": ShardedObject("o", 1, (1,), (0,)), "x": 3}
    assert storage.tensor_bytes(state) == 48 + 16


# ------------------------------------------------------------------------------------------------ write probe


@pytest.mark.timeout(60)
def test_write_probe_creates_nothing_and_names_the_problem(tmp_path):
    assert storage.write_problem(str(tmp_path)) is None
    assert storage.write_problem(str(tmp_path / "a" / "b")) is None  # created later, under a writable parent
    assert sorted(os.listdir(tmp_path)) == []  # the probe file is gone, nothing was created
    (tmp_path / "file").write_text("")
    assert (
        storage.write_problem(str(tmp_path / "file" / "ckpt"))
        == f"cannot be created: {tmp_path / 'file'} is not a directory"
    )
    with tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        assert (
            storage.write_problem(str(ro))
            == "is not writable: creating a file in it failed: Read-only file system (errno EROFS)"
        )
        assert storage.write_problem(str(ro / "ckpt")) == (
            f"cannot be created: creating a file in its parent {ro} failed: Read-only file system (errno EROFS)"
        )


@pytest.mark.timeout(60)
def test_validate_names_the_unwritable_field_and_the_policy_needs_a_local_tier(tmp_path):
    with tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        with pytest.raises(ValueError, match=rf"^checkpoint\.save: '{re.escape(str(ro))}/ckpt' cannot be created: .*"
                           r"Read-only file system \(errno EROFS\)\. Fix: remount it read-write"):  # fmt: skip
            validate_checkpoint(CheckpointConfig(save=str(ro / "ckpt")), 2)
        local = CheckpointConfig(
            save=str(tmp_path / "ckpt"),
            load=str(tmp_path / "ckpt"),
            non_persistent_ckpt_type="local",
            non_persistent_save_interval=2,
            non_persistent_local_ckpt_dir=str(ro),
        )
        with pytest.raises(ValueError, match=r"^checkpoint\.non_persistent_local_ckpt_dir: .* is not writable"):
            validate_checkpoint(local, 2)
    validate_checkpoint(local, 2)  # the mount is gone: a writable directory again
    local.global_save_failure_policy = "continue_local"
    validate_checkpoint(local, 2)
    cfg = CheckpointConfig(save=str(tmp_path / "ckpt"), global_save_failure_policy="continue_local")
    with pytest.raises(
        ValueError, match=r"^checkpoint\.global_save_failure_policy: .*non_persistent_ckpt_type is None"
    ):
        validate_checkpoint(cfg, 2)
    container = base_config()
    container.checkpoint = cfg
    with pytest.raises(ValueError, match="checkpoint.non_persistent_ckpt_type"):
        container.validate(world_size=1)


# ------------------------------------------------------------------------------------------------ identity


@pytest.mark.timeout(30)
def test_identity_tells_removed_from_replaced(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    before = storage.identity(str(d))
    assert storage.identity_change(before, storage.identity(str(d))) is None
    assert storage.identity_change(None, storage.identity(str(d))) is None  # never seen: nothing to compare
    keep = tmp_path / "keep"  # hold the old inode, so that a new directory cannot reuse its number
    d.rename(keep)
    assert storage.identity_change(before, storage.identity(str(d))) == "was removed: it no longer exists"
    d.mkdir()
    assert storage.identity_change(before, storage.identity(str(d))).startswith("was replaced: device ")
    assert storage.identity(str(tmp_path / "nothing")) is None and storage.identity(None) is None


# ------------------------------------------------------------------------------------------------ writer notes


@pytest.mark.timeout(60)
def test_a_forked_writers_storage_error_reaches_the_training_process():
    storage.receive_writer_errors()
    assert storage.take_writer_errors() == []
    assert storage.note_writer_error(RuntimeError("not storage"), 0) is None
    storage.note_writer_error(OSError(errno.ENOSPC, "No space left on device"), 0)
    pid = os.fork()
    if pid == 0:  # the writer: its memory dies with it
        code = 0
        try:
            storage.note_writer_error(OSError(errno.EIO, "Input/output error"), 1)
        except BaseException:  # noqa: BLE001
            code = 1
        os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    taken = storage.take_writer_errors()
    assert [(f.code, f.errno, f.rank) for f in taken] == [(FULL, errno.ENOSPC, 0), (UNAVAILABLE, errno.EIO, 1)]
    assert storage.take_writer_errors() == []


# ------------------------------------------------------------------------------------------------ the guard


def _guard(tmp_path, **fields) -> StorageGuard:
    return StorageGuard(CheckpointConfig(save=str(tmp_path / "ckpt"), **fields))


@pytest.mark.timeout(30)
def test_too_little_space_stops_before_anything_is_written(tmp_path, monkeypatch, events):
    guard = _guard(tmp_path)
    (tmp_path / "ckpt").mkdir()
    layout.write_tracker(str(tmp_path / "ckpt"), 3)
    guard.sizes[GLOBAL] = 10_000_000
    monkeypatch.setattr(storage, "free_bytes", lambda path: 5_000_000)
    tmp = str(tmp_path / "ckpt" / ".tmp_iter_0000006.a-1")
    with pytest.raises(TrainingExit) as stop:
        guard.before_save(GLOBAL, 6, estimate=0, tmp=tmp)
    assert stop.value.exit_code == FULL
    assert stop.value.reason == (
        f"checkpoint.save={tmp_path / 'ckpt'}: not enough free space for the global checkpoint of iteration 6: "
        "5,000,000 bytes (4.8 MiB) free (seen by rank 0 on " + os.uname().nodename + "), about 12,048,576 bytes "
        "(11.5 MiB) needed (the last global checkpoint was 10,000,000 bytes (9.5 MiB); plus 10% and 1,048,576 bytes "
        "(1.0 MiB)). Nothing was written. The tracker still names iteration 3, the newest committed checkpoint, which "
        f"a restart loads. Fix: free space in {tmp_path / 'ckpt'} or raise its quota (checkpoint.most_recent_k keeps "
        "fewer checkpoints), then requeue the job (or, with a local tier, checkpoint.global_save_failure_policy="
        '"continue_local" trains on through it).'
    )
    assert not os.path.exists(tmp)
    [event] = events()
    assert (event.kind, event.mechanism, event.tier, event.iteration, event.rank) == (
        EventKind.FAULT_DETECTED, Mechanism.STORAGE_FULL, "global", 6, 0,
    )  # fmt: skip
    monkeypatch.setattr(storage, "free_bytes", lambda path: 13_000_000)
    assert guard.before_save(GLOBAL, 6, estimate=0, tmp=tmp) and os.path.isdir(tmp)


@pytest.mark.timeout(30)
def test_before_the_first_save_the_tensors_it_writes_are_the_size(tmp_path, monkeypatch):
    guard = _guard(tmp_path)
    monkeypatch.setattr(storage, "free_bytes", lambda path: 2_100_000)
    assert guard.before_save(GLOBAL, 3, estimate=900_000)  # 900 kB * 1.1 + 1 MiB fits in 2.1 MB
    with pytest.raises(TrainingExit, match=r"the tensors this save writes are 1,000,000 bytes"):
        guard.before_save(GLOBAL, 3, estimate=1_000_000)
    guard.check_start(0, None, None)  # nothing known at start: nothing to check


@pytest.mark.timeout(30)
def test_continue_local_warns_each_time_and_goes_on(tmp_path, monkeypatch, caplog, events):
    guard = _guard(tmp_path, global_save_failure_policy="continue_local")
    guard.sizes[GLOBAL] = 10_000_000
    monkeypatch.setattr(storage, "free_bytes", lambda path: 1_000)
    with caplog.at_level(logging.WARNING):
        assert guard.before_save(GLOBAL, 6, estimate=0) is False
        assert guard.save_failed(OSError(errno.EROFS, "Read-only file system"), GLOBAL, 9) is True
    warnings = [r.getMessage() for r in caplog.records if "continue_local: training goes on" in r.getMessage()]
    assert len(warnings) == 2 and 'global_save_failure_policy="continue_local" trains on' not in warnings[0]
    assert [(e.mechanism, e.iteration) for e in events()] == [
        (Mechanism.STORAGE_FULL, 6), (Mechanism.STORAGE_UNAVAILABLE, 9),
    ]  # fmt: skip
    local_dir = "exit code 26.: checkpoint.non_persistent_local_ckpt_dir="
    with pytest.raises(TrainingExit, match=local_dir):  # a local save never goes on
        guard.before_save(LOCAL, 6, estimate=10_000_000)


@pytest.mark.timeout(30)
def test_a_failed_save_removes_its_partial_files_and_names_the_fault(tmp_path):
    guard = _guard(tmp_path)
    tmp = tmp_path / "ckpt" / ".tmp_iter_0000006.a-2"
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(b"partial")
    assert guard.save_failed(ValueError("a bug, not storage"), GLOBAL, 6, str(tmp)) is False
    assert tmp.exists(), "only a storage fault removes the save"
    with pytest.raises(TrainingExit) as stop:
        guard.save_failed(OSError(errno.ENOSPC, "No space left on device", str(tmp / "x")), GLOBAL, 6, str(tmp))
    assert stop.value.exit_code == FULL and not tmp.exists()
    reason = stop.value.reason
    assert reason.startswith(f"checkpoint.save={tmp_path / 'ckpt'}: the file system is full: the global checkpoint of "
                             f"iteration 6 could not be written ([Errno 28] No space left on device: '{tmp / 'x'}', "
                             "seen by rank 0; ")  # fmt: skip
    assert "Its partial files (.tmp_iter_0000006.a-2) were removed: a loader never sees them." in reason
    assert "holds no committed checkpoint yet" in reason and "Fix: free space in" in reason
    with pytest.raises(TrainingExit) as stop:
        guard.save_failed(OSError(errno.EIO, "Input/output error"), LOCAL, 4)
    assert stop.value.exit_code == UNAVAILABLE and "Fix: make " in stop.value.reason


@pytest.mark.timeout(30)
def test_a_lost_errno_is_diagnosed_from_the_file_system(tmp_path, monkeypatch):
    guard = _guard(tmp_path)
    (tmp_path / "ckpt").mkdir()
    guard._needed[GLOBAL] = 3_000_000
    lost = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(storage, "free_bytes", lambda path: 65_536)
    with pytest.raises(TrainingExit, match=r"a write failed \(RuntimeError: Worker failure: .* with 65,536 bytes"):
        guard.save_failed(lost, GLOBAL, 6)
    monkeypatch.setattr(storage, "free_bytes", lambda path: 10**12)
    assert guard.save_failed(lost, GLOBAL, 6) is False  # plenty of space, writable: not a storage fault


@pytest.mark.timeout(30)
def test_a_removed_save_dir_is_reported_and_created_again(tmp_path, caplog, events):
    root = tmp_path / "ckpt"
    root.mkdir()
    guard = _guard(tmp_path)
    root.rename(tmp_path / "gone")
    tmp = root / ".tmp_iter_0000006.a-1"
    with caplog.at_level(logging.ERROR):
        assert guard.before_save(GLOBAL, 6, estimate=1, tmp=str(tmp))
    assert tmp.is_dir()
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.getMessage().startswith(f"checkpoint.save={root} was removed: it no longer exists, since the start")
    assert "the training state in memory is the best copy left" in record.getMessage().lower()
    [event] = events()
    assert (event.mechanism, event.iteration, event.rank) == (Mechanism.SAVE_DIR_CHANGED, 6, None)
    assert guard.before_save(GLOBAL, 9, estimate=1) and len(events()) == 1  # the new one is remembered
    tmp.rmdir()
    root.rename(tmp_path / "gone2")
    root.mkdir()
    with caplog.at_level(logging.ERROR):
        guard.before_save(GLOBAL, 12, estimate=1)
    assert (
        "was replaced: device" in caplog.records[-1].getMessage()
        and "since iteration 6" in caplog.records[-1].getMessage()
    )


@pytest.mark.timeout(30)
def test_an_unreadable_directory_at_start_is_storage_unavailable(tmp_path):
    guard = StorageGuard(CheckpointConfig(save=str(tmp_path / "s"), load=str(tmp_path / "l")))
    with pytest.raises(TrainingExit) as stop:
        with guard.reading("choosing the checkpoint"):
            raise RankZeroError(
                f"listing failed on rank 0: PermissionError: [Errno 13] Permission denied: '{tmp_path}/l'"
            )
    assert stop.value.exit_code == UNAVAILABLE
    assert stop.value.reason.startswith(
        f"cannot read the checkpoint directory while choosing the checkpoint: [Errno 13] Permission denied: "
        f"'{tmp_path}/l' (checkpoint.load={tmp_path / 'l'}, checkpoint.save={tmp_path / 's'}). Nothing was loaded"
    )
    with pytest.raises(RankZeroError):  # not a storage error: as it was
        with guard.reading("x"):
            raise RankZeroError("listing failed on rank 0: ValueError: bad")
    assert missing_checkpoint("checkpoint.load", "/x", False).startswith(
        "checkpoint.load=/x does not exist, and checkpoint.exit_on_missing_checkpoint forbids starting from iteration 0"
    )
    assert "holds no committed checkpoint" in missing_checkpoint("checkpoint.load", "/x", True)


# ------------------------------------------------------------------------------------------------ local tier


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_a_full_local_disk_leaves_no_partial_file_and_reports_the_error(tmp_path, one_rank_group):
    from megatron.bridge.training.checkpoint import local_tier

    storage.receive_writer_errors()
    storage.take_writer_errors()
    with tmpfs(tmp_path / "local", "size=64k") as local:
        manager = local_tier._manager_class()(str(local), session_id="s", repl_strategy=None)
        manager._save({"w": torch.zeros(100_000)}, (4, 0, "s"))  # does not raise: the save fails on every rank later
        assert [p.name for p in local.rglob("*") if p.is_file()] == []
        [fault] = storage.take_writer_errors()
        assert (fault.code, fault.rank) == (FULL, 0)


@pytest.mark.timeout(30)
def test_the_local_tier_measures_its_newest_checkpoint_on_this_node(tmp_path):
    from megatron.bridge.training.checkpoint.local_tier import LocalTier

    tier = SimpleNamespace(manager=SimpleNamespace(root_local_ckpt_dir=str(tmp_path), session_id="s"))
    assert LocalTier.node_bytes(tier) is None
    for rank, iteration, size in ((0, 4, 100), (1, 4, 30), (0, 6, 7), (1, 6, 5)):
        (tmp_path / "s" / str(rank)).mkdir(parents=True, exist_ok=True)
        (tmp_path / "s" / str(rank) / f"iter_{iteration:07d}_{rank}_local.pt").write_bytes(b"x" * size)
    (tmp_path / "s" / "0" / "iter_0000008_0_local.pt.dirty").write_bytes(b"x" * 1000)  # never counted
    assert (LocalTier.node_bytes(tier), LocalTier.node_bytes(tier, 4), LocalTier.node_bytes(tier, 5)) == (12, 130, None)


# ------------------------------------------------------------------------------------------------ fill fault, docs


@pytest.mark.timeout(60)
def test_the_fill_fault_fills_the_file_system_at_a_save(tmp_path, monkeypatch):
    assert parse("fill@6:0") == [Fault("fill", 6, 0, phase="global_save")]
    assert parse("fill@4:1:local_save") == [Fault("fill", 4, 1, phase="local_save")]
    with pytest.raises(ValueError, match="fill cannot strike in phase 'step'"):
        parse("fill@4:1:step")
    monkeypatch.setenv(fault_injection.ENV, "fill@6:0:global_save")
    fault_injection.install(SimpleNamespace(faults="", ledger=None))
    with tmpfs(tmp_path / "fs", "size=4m") as fs:
        fault_injection.fill_storage(fault_injection.GLOBAL_SAVE, 0, 5, str(fs))  # not due
        assert not (fs / fault_injection.FILL_FILE).exists()
        fault_injection.fill_storage(fault_injection.GLOBAL_SAVE, 0, 6, str(fs))
        assert 4096 <= storage.free_bytes(fs) <= fault_injection.FILL_LEAVES
    monkeypatch.delenv(fault_injection.ENV)
    fault_injection.install(SimpleNamespace(faults="", ledger=None))


@pytest.mark.timeout(30)
def test_every_mechanism_is_in_the_events_doc():
    text = (REPO / "docs" / "training" / "events.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", text, re.M))
    assert {m.value for m in Mechanism} <= documented, {m.value for m in Mechanism} - documented
