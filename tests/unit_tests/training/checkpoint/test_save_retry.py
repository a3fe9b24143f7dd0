"""Save retries: the backoff, which failures are retried, the final note, the io-error fault, goodput and the config.

Async saves: the background writer's retry loop, its attempts carried back with the results, their report.
"""

import dataclasses
import errno
import os
import pickle
import time
from types import SimpleNamespace
from typing import Optional

import pytest
from tests.unit_tests.configs import base_config

from megatron.bridge.training.checkpoint import async_writer, save_retry, saving
from megatron.bridge.training.checkpoint.storage import StorageFault
from megatron.bridge.training.events.goodput import GoodputTracker
from megatron.bridge.training.events.stream import EventKind
from megatron.bridge.training.exit_codes import ExitCode
from megatron.bridge.training.faults import injection as fault_injection
from megatron.bridge.training.faults.injection import Fault, FaultRegistry, parse
from megatron.bridge.training.utils.overrides import apply_overrides
from megatron.bridge.utils import upstream

UNAVAILABLE = StorageFault(ExitCode.STORAGE_UNAVAILABLE, errno.EIO, "[Errno 5] Input/output error", 1)
FULL = StorageFault(ExitCode.STORAGE_FULL, errno.ENOSPC, "[Errno 28] No space left on device", 0)


@pytest.fixture(autouse=True)
def _fresh_process(monkeypatch):
    monkeypatch.delenv(fault_injection.ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(fault_injection, "_active", None)


@pytest.mark.timeout(10)
def test_the_backoff_doubles_from_the_configured_wait_and_is_capped():
    assert save_retry.schedule(4, 1.0) == [1.0, 2.0, 4.0, 8.0]
    assert save_retry.schedule(3, 0.0) == [0.0, 0.0, 0.0]
    assert save_retry.schedule(0, 1.0) == []
    assert save_retry.wait_before(10, 1.0) == save_retry.MAX_WAIT_SECONDS
    with pytest.raises(ValueError, match="retry 0 is not >= 1"):
        save_retry.wait_before(0, 1.0)


@pytest.mark.timeout(10)
def test_only_an_unavailable_file_system_is_retried_never_a_full_one_nor_another_error():
    assert save_retry.retry_fault([None, UNAVAILABLE]) == UNAVAILABLE  # the rank that saw it, whichever it is
    assert save_retry.retry_fault([UNAVAILABLE, FULL]) is None  # a full disk is the storage guard's (exit 26)
    assert save_retry.retry_fault([FULL]) is None
    assert save_retry.retry_fault([None, None]) is None  # no storage error: raised as before
    lower = StorageFault(ExitCode.STORAGE_UNAVAILABLE, errno.ESTALE, "[Errno 116] Stale file handle", 0)
    assert save_retry.retry_fault([UNAVAILABLE, lower]) == lower


@pytest.mark.timeout(10)
def test_the_final_note_names_the_attempts_the_waits_and_the_fix():
    note = save_retry.exhausted_note(4, 3, 0.5)
    assert "tried 4 times (checkpoint.save_retries=3, waiting 0.5, 1, 2 s between attempts)" in note
    assert "raise checkpoint.save_retries or checkpoint.save_retry_backoff" in note
    assert "waiting no s" in save_retry.exhausted_note(1, 0, 1.0)


@pytest.mark.timeout(10)
def test_io_error_parses_in_the_one_grammar_and_round_trips():
    assert parse("io-error@6:1") == [Fault("io-error", 6, 1, "write")]
    assert parse("io-error@6:1:fsync:x2") == [Fault("io-error", 6, 1, "fsync", factor=2.0)]
    for spec in ("io-error@6:1:x2", "io-error@6:0:rename:always", "io-error@6:0:fsync:x3"):
        assert str(parse(spec)[0]) == spec
    for bad, needle in [
        ("io-error@6:1:rename", "only rank 0 renames"),
        ("io-error@6:0:x1.5", "a whole number of attempts"),
        ("io-error@6:0:x0", "a whole number of attempts"),
        ("io-error@6:0:step", "io-error cannot strike in phase 'step'"),
    ]:
        with pytest.raises(ValueError, match=needle):
            parse(bad)


@pytest.mark.timeout(10)
def test_io_error_fails_the_first_n_attempts_then_none_and_always_fails_every_one(monkeypatch):
    monkeypatch.setattr(
        fault_injection, "_active", FaultRegistry(parse("io-error@6:1:write:x2,io-error@9:0:rename:always"))
    )
    outcomes = [fault_injection.io_error("write", 1, 6, "/ckpt/tmp") for _ in range(3)]
    assert [type(e) for e in outcomes] == [OSError, OSError, type(None)]
    assert outcomes[0].errno == errno.EIO and outcomes[0].filename == "/ckpt/tmp"
    assert "attempt 2" in str(outcomes[1])
    assert fault_injection.io_error("write", 0, 6, "x") is None  # another rank
    assert fault_injection.io_error("fsync", 1, 6, "x") is None  # another phase
    assert fault_injection.io_error("write", 1, 7, "x") is None  # another save
    assert all(fault_injection.io_error("rename", 0, 9, "x") is not None for _ in range(5))


@pytest.mark.timeout(10)
def test_goodput_counts_a_retry_as_save_retry_not_as_checkpoint_save(tmp_path):
    now = [1000.0]
    tracker = GoodputTracker("job", "a0", now[0], str(tmp_path), 0, process_start=now[0], clock=lambda: now[0], env={})
    tracker.resume(None, 0, loaded=False)
    tracker.save_started(3)
    now[0] += 5.0  # a failed attempt and its backoff ...
    tracker.add_save_retry(5.0)
    now[0] += 1.0  # ... then the attempt that worked
    tracker.save_ended(3)
    lost = tracker.snapshot()["lost_s"]
    assert lost["save_retry"] == pytest.approx(5.0)
    assert lost["checkpoint_save"] == pytest.approx(1.0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "override, needle",
    [
        ("checkpoint.save_retries=-1", "checkpoint.save_retries: must be a whole number >= 0, got -1"),
        ("checkpoint.save_retry_backoff=-0.5", "checkpoint.save_retry_backoff: must be seconds >= 0, got -0.5"),
    ],
)
def test_the_retry_budget_and_backoff_are_validated(tmp_path, override, needle):
    base = [f"checkpoint.save={tmp_path}", "checkpoint.save_interval=100"]
    with pytest.raises(ValueError, match=needle):
        apply_overrides(base_config(), [*base, override]).validate(world_size=1)
    cfg = apply_overrides(base_config(), [*base, "checkpoint.save_retries=0", "checkpoint.save_retry_backoff=0"])
    cfg.validate(world_size=1)
    assert (cfg.checkpoint.save_retries, cfg.checkpoint.save_retry_backoff) == (0, 0)


# ------------------------------------------------------------------ async saves: the background writer retries


class _Storage:
    """The bucket writer of megatron-core (same call), on a storage whose first ``failing`` writes fail.

    Each write writes half its file, then fails with ``error`` while failures are left, else writes it whole. It
    records whether each bucket's file already existed when its write began (a failed attempt's files must be gone).
    """

    def __init__(self, failing: Optional[int], error: Optional[BaseException] = None) -> None:
        self.failing, self.error = failing, error or OSError(errno.EIO, "Input/output error")
        self.existed: list[bool] = []

    def __call__(self, transform_list, index, bucket, local_results, finished, use_fsync, **kwargs) -> None:
        path = bucket[0]
        self.existed.append(os.path.exists(path))
        failing = self.failing is None or self.failing > 0
        with open(path, "wb") as f:
            f.write(b"x" * (4 if failing else 8))
        if self.failing is not None and failing:
            self.failing -= 1
        finished.get()
        finished.task_done()
        local_results.put((index, self.error if failing else [f"results of {os.path.basename(path)}"]))


def _write(monkeypatch, tmp_path, bucket_writer, retry=None, fail=None, buckets=2) -> list:
    """Run the writer's bucket loop on ``buckets`` buckets with ``bucket_writer``; what it put on the results queue."""
    real_get = upstream.get
    monkeypatch.setattr(
        upstream, "get", lambda key: bucket_writer if key.endswith(".write_preloaded_data") else real_get(key)
    )
    monkeypatch.setattr(async_writer.time, "sleep", lambda seconds: None)
    results = []

    class Queue:
        put = results.append

    write_buckets = [(str(tmp_path / f"__0_{i}.distcp"), "key", ([], [])) for i in range(buckets)]
    async_writer._write_buckets_here([], False, 3, write_buckets, Queue, fail=fail, retry=retry)
    return results


@pytest.mark.timeout(10)
def test_the_async_writer_retries_a_transient_error_from_a_clean_slate_and_reports_its_attempts(monkeypatch, tmp_path):
    storage_ = _Storage(failing=2)
    [outcome] = _write(monkeypatch, tmp_path, storage_, retry=save_retry.RetryPolicy(3, 0.5))
    assert isinstance(outcome, async_writer.WriteOutcome) and isinstance(outcome, dict)
    assert outcome == {0: ["results of __0_0.distcp"], 1: ["results of __0_1.distcp"]}  # what megatron-core reads
    attempts = async_writer.failed_attempts(outcome)
    assert [(a.number, a.wait, a.fault.code, a.fault.errno, a.fault.rank) for a in attempts] == [
        (1, 0.5, ExitCode.STORAGE_UNAVAILABLE, errno.EIO, 3),
        (2, 1.0, ExitCode.STORAGE_UNAVAILABLE, errno.EIO, 3),
    ]
    assert all(a.seconds >= 0 and "Input/output error" in a.fault.text for a in attempts)
    # Attempts 1 and 2 broke off at bucket 0; before attempts 2 and 3, the files of the one before were removed.
    assert storage_.existed == [False, False, False, False]
    assert [p.stat().st_size for p in sorted(tmp_path.iterdir())] == [8, 8]  # written whole


@pytest.mark.timeout(10)
def test_the_async_writer_gives_up_after_the_budget_and_the_error_carries_every_attempt(monkeypatch, tmp_path):
    [outcome] = _write(monkeypatch, tmp_path, _Storage(failing=None), retry=save_retry.RetryPolicy(2, 0.1))
    assert isinstance(outcome, OSError) and outcome.errno == errno.EIO  # as megatron-core reports a failed write
    attempts = async_writer.failed_attempts(pickle.loads(pickle.dumps(outcome)))  # as the training process reads it
    assert [(a.number, a.wait) for a in attempts] == [(1, 0.1), (2, 0.2), (3, None)]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "error, code",
    [(OSError(errno.ENOSPC, "No space left on device"), ExitCode.STORAGE_FULL), (ValueError("a bug"), None)],
    ids=["full disk", "no storage error"],
)
def test_the_async_writer_retries_neither_a_full_disk_nor_another_error(monkeypatch, tmp_path, error, code):
    storage_ = _Storage(failing=None, error=error)
    [outcome] = _write(monkeypatch, tmp_path, storage_, retry=save_retry.RetryPolicy(3, 0.1))
    assert outcome is error and len(storage_.existed) == 1  # one attempt
    attempts = async_writer.failed_attempts(outcome)
    assert [(a.number, a.wait, a.fault.code) for a in attempts] == ([(1, None, code)] if code else [])


@pytest.mark.timeout(10)
def test_a_synchronous_write_is_tried_once_here_and_its_results_are_as_upstream_makes_them(monkeypatch, tmp_path):
    [outcome] = _write(monkeypatch, tmp_path, _Storage(failing=0), retry=None)
    assert type(outcome) is dict and async_writer.failed_attempts(outcome) == ()
    [outcome] = _write(monkeypatch, tmp_path, _Storage(failing=1), retry=None)  # SavePath.save retries a sync save
    assert isinstance(outcome, OSError) and async_writer.failed_attempts(outcome) == ()


@pytest.mark.timeout(10)
def test_an_injected_io_error_fails_the_writers_first_n_attempts(monkeypatch, tmp_path):
    error = OSError(errno.EIO, "Input/output error (injected io-error at write)", str(tmp_path))
    fail = async_writer.InjectedIoError("write", error, attempts=2)
    storage_ = _Storage(failing=0)
    [outcome] = _write(monkeypatch, tmp_path, storage_, retry=save_retry.RetryPolicy(3, 0.1), fail=fail)
    assert [(a.number, a.fault.text) for a in async_writer.failed_attempts(outcome)] == [
        (1, f"[Errno 5] Input/output error (injected io-error at write): {str(tmp_path)!r}"),
        (2, f"[Errno 5] Input/output error (injected io-error at write): {str(tmp_path)!r}"),
    ]
    assert storage_.existed == [False, False, False, False]  # the cut file of each failed attempt was removed
    always = async_writer.InjectedIoError("fsync", error, attempts=None)
    [outcome] = _write(monkeypatch, tmp_path, _Storage(failing=0), retry=save_retry.RetryPolicy(1, 0.1), fail=always)
    assert outcome is error and [a.number for a in async_writer.failed_attempts(outcome)] == [1, 2]


@pytest.mark.timeout(30)
def test_the_attempts_travel_with_the_results_from_a_forked_writer_to_the_training_process(tmp_path):
    import multiprocessing

    attempt = save_retry.FailedAttempt(1, UNAVAILABLE, 0.5, 0.7)
    results = async_writer.FileResultsQueue(str(tmp_path))
    outcome = async_writer.WriteOutcome({0: ["bucket 0 results"]}, (attempt,))
    writer = multiprocessing.get_context("fork").Process(target=results.put, args=(outcome,))
    writer.start()
    writer.join(timeout=20)
    assert writer.exitcode == 0
    async_writer.take_failed_attempts()  # nothing left over from another test
    assert results.get_nowait() == {0: ["bucket 0 results"]}
    assert async_writer.take_failed_attempts() == [attempt]
    assert async_writer.take_failed_attempts() == []  # taken once
    results.put(async_writer._with_attempts(OSError(errno.EIO, "Input/output error"), (attempt,)))
    assert isinstance(results.get_nowait(), OSError) and async_writer.take_failed_attempts() == [attempt]


@pytest.mark.timeout(10)
def test_every_ranks_attempts_merge_per_attempt_number_and_the_slowest_ranks_retries_are_the_delay():
    def failed(number, rank, wait, seconds=1.0):
        return save_retry.FailedAttempt(number, dataclasses.replace(UNAVAILABLE, rank=rank), wait, seconds)

    views = [[], [failed(1, 1, 0.5, 2.0), failed(2, 1, 1.0, 3.0)], [failed(1, 2, 0.5, 4.0)]]
    merged = save_retry.merged_attempts(views)
    assert [(a.number, a.fault.rank) for a in merged] == [(1, 1), (2, 1)]
    assert save_retry.retry_seconds(views) == 5.0  # rank 1: two retried attempts, 2 s and 3 s
    assert save_retry.retry_seconds([[failed(1, 0, None, 9.0)]]) == 0.0  # the last attempt delayed no success
    assert save_retry.merged_attempts([[], []]) == [] and save_retry.retry_seconds([]) == 0.0
    policy = save_retry.RetryPolicy(2, 1.0)
    assert save_retry.writer_retries(UNAVAILABLE, 2, policy) and not save_retry.writer_retries(UNAVAILABLE, 3, policy)
    assert not save_retry.writer_retries(FULL, 1, policy) and not save_retry.writer_retries(None, 1, policy)


@pytest.mark.timeout(10)
def test_an_io_error_for_the_background_writer_counts_its_attempts_and_strikes_once(monkeypatch):
    monkeypatch.setattr(
        fault_injection, "_active", FaultRegistry(parse("io-error@6:1:write:x2,io-error@9:0:fsync:always"))
    )
    error, attempts = fault_injection.io_errors_in_writer("write", 1, 6, "/ckpt/tmp")
    assert (error.errno, error.filename, attempts) == (errno.EIO, "/ckpt/tmp", 2)
    assert fault_injection.io_errors_in_writer("write", 1, 6, "/ckpt/tmp") is None  # struck: its save had them all
    assert fault_injection.io_errors_in_writer("write", 0, 9, "x") is None  # another rank, phase
    assert fault_injection.io_errors_in_writer("fsync", 0, 9, "x")[1] is None  # every attempt
    assert fault_injection.io_errors_in_writer("fsync", 0, 9, "x") is not None  # and in every save of it


@pytest.mark.timeout(10)
def test_the_finalize_reports_the_writers_attempts_and_counts_only_the_wait_they_caused(monkeypatch):
    emitted = []
    monkeypatch.setattr(saving.event_stream, "emit", lambda kind, **fields: emitted.append((kind, fields)))
    path = saving.SavePath()
    path.cfg = SimpleNamespace(save="/ckpt", save_retries=3)
    counted = []
    path.on_save_retry = counted.append
    first = save_retry.FailedAttempt(1, dataclasses.replace(UNAVAILABLE, rank=1), 0.5, 2.0)
    second = save_retry.FailedAttempt(2, dataclasses.replace(UNAVAILABLE, rank=1), 1.0, 3.0)
    path._writer_retried(6, [[], [first, second]], path._waited(time.perf_counter()))  # a poll: nothing waited
    assert [(f["save_attempt"], f["retrying"], f["seconds"], f["exit_code"]) for _, f in emitted] == [
        (1, True, 0.5, 27),
        (2, True, 1.0, 27),
    ]
    assert {kind for kind, _ in emitted} == {EventKind.SAVE_ATTEMPT_FAILED} and counted == []
    path._blocked_since = 100.0  # a blocking finalize waited 60 s: 5 s of it were the retries
    path._writer_retried(6, [[], [first, second]], path._waited(160.0))
    assert counted == [5.0]
    path._writer_retried(6, [[], [first, second]], path._waited(101.0))  # it waited 1 s: at most that was lost
    assert counted[1] == 1.0
    emitted.clear()
    path._writer_retried(6, [[], []], 60.0)  # no attempt failed
    assert emitted == [] and len(counted) == 2
