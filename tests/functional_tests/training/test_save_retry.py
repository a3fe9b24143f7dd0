"""Save retry drills: a global save whose storage fails with an I/O error is tried again (``checkpoint.save_retries``).

The error is real to the save path: the ``io-error`` fault (``faults/spec.py``) cuts the rank's first shard file in
half and reports ``EIO`` the way megatron-core's writer reports a failed write (every rank sees it at the write's
finalize), or fails rank 0's rename of the commit. A transient error (the first two attempts fail) must cost only
the retries: the run finishes with the state of an uninterrupted run, bit for bit. A persistent one must stop the
run with ``STORAGE_UNAVAILABLE`` (27) once the budget is spent, leaving the newest committed checkpoint loadable and
nothing half-written where a loader looks. An async save is retried the same way inside its background writer (the
``io-error`` strikes there), while training goes on; a failed commit of its written files is tried again alone.
"""

import json

import pytest
from tests.functional_tests.harness import assert_same_state, checkpoint_state, tail, torchrun

from megatron.bridge.training.checkpoint import layout, manifest
from megatron.bridge.training.events.stream import EventKind, Mechanism

FAST_BACKOFF = "checkpoint.save_retry_backoff=0.1"


def _nothing_half_written(ckpt, tracked: int) -> None:
    """The tracker names ``tracked``; every committed checkpoint verifies; no attempt is left where a loader looks."""
    assert layout.read_tracker(str(ckpt)) == tracked
    for iteration in layout.committed_iterations(str(ckpt)):
        assert manifest.verify_dir(str(layout.iter_dir(str(ckpt), iteration))) == [], iteration
    leftovers = [p.name for p in ckpt.iterdir() if p.name.startswith((".tmp_iter", ".replaced", ".deleting"))]
    assert not leftovers, leftovers
    assert max(layout.committed_iterations(str(ckpt))) == tracked


def _ended_as_the_reference(run, ckpt, reference_tp1) -> dict:
    """Nothing half-written, every save committed, the end bit-identical to the uninterrupted run; its goodput."""
    _nothing_half_written(ckpt, 12)
    assert layout.committed_iterations(str(ckpt)) == [12, 9, 6, 3]
    reference, reference_ckpt = reference_tp1
    assert run.losses() == reference.losses()
    for iteration in (6, 12):
        name = f"iter_{iteration:07d}"
        assert_same_state(checkpoint_state(ckpt / name), checkpoint_state(reference_ckpt / name))
    return json.loads((ckpt / "goodput" / "summary.json").read_text())


@pytest.mark.timeout(240)
def test_save_retry_survives_a_transient_write_error_bit_exactly(reference_tp1, tmp_path):
    ckpt = tmp_path / "ckpt"
    run = torchrun(ckpt, FAST_BACKOFF, env={"MBRIDGE_FAULTS": "io-error@6:1:write:x2"})
    assert run.exit_code == 0, tail(run)
    failed = [e for e in run.events(EventKind.SAVE_ATTEMPT_FAILED) if e.rank == 0]
    assert [(e.iteration, e.save_attempt, e.retrying) for e in failed] == [(6, 1, True), (6, 2, True)], failed
    assert all(e.exit_code == 27 and "Input/output error" in e.detail for e in failed)
    assert [e.seconds for e in failed] == [0.1, 0.2]  # the backoff doubles
    struck = run.events(EventKind.FAULT_INJECTED)
    assert [(e.fault_kind, e.rank, e.phase) for e in struck] == [("io-error", 1, "write")] * 2
    assert not run.detected(Mechanism.STORAGE_UNAVAILABLE)
    assert "attempt 1 of the global checkpoint of iteration 6 failed" in run.output
    summary = _ended_as_the_reference(run, ckpt, reference_tp1)
    assert summary["lost_s"]["save_retry"] >= 0.3  # both backoffs, at least


@pytest.mark.timeout(240)
def test_save_retry_gives_up_on_a_persistent_error_with_exit_27(tmp_path):
    ckpt = tmp_path / "ckpt"
    faults = {"MBRIDGE_FAULTS": "io-error@6:0:rename:always"}
    run = torchrun(ckpt, FAST_BACKOFF, "checkpoint.save_retries=2", env=faults)
    assert run.exit_code == 27, tail(run)
    assert "STORAGE_UNAVAILABLE (exit code 27)" in run.output
    assert f"checkpoint.save={ckpt}: the file system is unavailable: the global checkpoint of iteration 6" in (
        run.output
    )
    assert "Input/output error" in run.output and "Fix: make" in run.output
    assert "The save was tried 3 times (checkpoint.save_retries=2, waiting 0.1, 0.2 s between attempts)" in run.output
    failed = [e for e in run.events(EventKind.SAVE_ATTEMPT_FAILED) if e.rank == 0]
    assert [(e.save_attempt, e.retrying) for e in failed] == [(1, True), (2, True), (3, False)], failed
    assert {e.iteration for e in run.detected(Mechanism.STORAGE_UNAVAILABLE)} == {6}
    assert max(run.losses()) == 6
    _nothing_half_written(ckpt, 3)  # the newest committed checkpoint is whole and is what a restart loads


ASYNC = "checkpoint.async_save=true"


@pytest.mark.timeout(240)
def test_save_retry_async_writer_survives_a_transient_write_error_bit_exactly(reference_tp1, tmp_path):
    ckpt = tmp_path / "ckpt"
    faults = "io-error@6:1:write:x2,io-error@9:0:rename:x2"  # and at 9, the commit's rename fails twice
    run = torchrun(ckpt, ASYNC, FAST_BACKOFF, env={"MBRIDGE_FAULTS": faults})
    assert run.exit_code == 0, tail(run)
    # Rank 1's background writer failed twice and wrote again; the finalize reported both attempts on every rank.
    # At 9 the files were written and kept: the finalize tried the commit again, twice, on every rank together.
    for rank in (0, 1):
        failed = [e for e in run.events(EventKind.SAVE_ATTEMPT_FAILED) if e.rank == rank]
        assert [(e.iteration, e.save_attempt, e.retrying, e.seconds) for e in failed] == [
            (6, 1, True, 0.1),
            (6, 2, True, 0.2),
            (9, 1, True, 0.1),
            (9, 2, True, 0.2),
        ], failed
        assert all(e.exit_code == 27 and "injected io-error at write" in e.detail for e in failed[:2])
        assert all(e.exit_code == 27 and "injected io-error at rename" in e.detail for e in failed[2:]), failed
    struck = {(e.fault_kind, e.rank, e.phase) for e in run.events(EventKind.FAULT_INJECTED)}
    assert struck == {("io-error", 1, "write"), ("io-error", 0, "rename")}, struck
    assert "only the commit is tried again" in run.output
    assert "rank 1: attempt 1 of the background write into" in run.output  # the writer's own retry line
    assert "2 attempt(s) of the background write of the global checkpoint of iteration 6 failed" in run.output
    assert not run.detected(Mechanism.STORAGE_UNAVAILABLE)
    summary = _ended_as_the_reference(run, ckpt, reference_tp1)
    # Training went on while the writer retried: only a finalize's wait for the write counts, at most the retries.
    assert 0.0 <= summary["lost_s"]["save_retry"] <= 5.0


@pytest.mark.timeout(240)
def test_save_retry_async_writer_gives_up_on_a_persistent_error_with_exit_27(tmp_path):
    ckpt = tmp_path / "ckpt"
    faults = {"MBRIDGE_FAULTS": "io-error@6:1:write:always"}
    run = torchrun(ckpt, ASYNC, FAST_BACKOFF, "checkpoint.save_retries=2", env=faults)
    assert run.exit_code == 27, tail(run)
    assert "STORAGE_UNAVAILABLE (exit code 27)" in run.output
    assert f"checkpoint.save={ckpt}: the file system is unavailable: the global checkpoint of iteration 6" in (
        run.output
    )
    assert "The save was tried 3 times (checkpoint.save_retries=2, waiting 0.1, 0.2 s between attempts)" in run.output
    for rank in (0, 1):  # every rank agreed at the finalize
        failed = [e for e in run.events(EventKind.SAVE_ATTEMPT_FAILED) if e.rank == rank]
        assert [(e.save_attempt, e.retrying) for e in failed] == [(1, True), (2, True), (3, False)], failed
    detected = run.detected(Mechanism.STORAGE_UNAVAILABLE)
    assert {e.iteration for e in detected} == {6} and len({e.pid for e in detected}) == 2
    assert 6 <= max(run.losses()) < 12  # training went on while the writer retried, until the finalize
    _nothing_half_written(ckpt, 3)  # the newest committed checkpoint is whole and is what a restart loads
