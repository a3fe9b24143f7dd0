"""Goodput accounting with a fake clock: resume with and without a progress record, another job, persistence."""

import json
import logging
import os
import re

import pytest
import torch

from megatron.bridge.training.events import goodput
from megatron.bridge.training.events.goodput import CAUSES, GoodputTracker

LINE_RE = re.compile(r"^goodput: (\d\.\d{3}) \(productive ([\d.]+) s of ([\d.]+) s wall\) \| lost: (.*)$")


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def _tracker(tmp_path, clock, job="42", attempt_start=None, rank=0, env=None, process_start=None):
    start = clock.t if attempt_start is None else attempt_start
    return GoodputTracker(
        job, f"attempt_{job}_{clock.t}", start, str(tmp_path), rank, process_start=process_start or start, clock=clock,
        env=env or {},
    )  # fmt: skip


def _train(tracker, clock, steps, step_s=1.0, gap_s=0.1, save_every=None, save_s=0.5, first=0):
    """Run ``steps`` steps (each ``gap_s`` of loop overhead, then ``step_s`` of step); return the saved entries."""
    entries = {}
    for it in range(first + 1, first + steps + 1):
        tracker.step_start()
        clock.advance(gap_s)
        clock.advance(step_s)
        tracker.step_end(step_s, kept=True)
        tracker.progress(it)
        if save_every and it % save_every == 0:
            with tracker.saving(it):
                clock.advance(save_s / 2)
                entries[it] = tracker.snapshot()  # taken while the save runs, as CheckpointManager does
                clock.advance(save_s / 2)
    return entries


def _assert_scheduled(summary, productive, wall, other):
    """The parts as the test's own clock schedule made them: ``other`` (what the named causes leave) is exactly the
    loop overhead the test put between steps, so a cause that books too little or too much shows here."""
    assert summary["productive_s"] == pytest.approx(productive)
    assert summary["wall_s"] == pytest.approx(wall)
    assert summary["lost_s"]["other"] == pytest.approx(other, abs=1e-9)
    assert summary["goodput"] == pytest.approx(productive / wall)


def test_first_attempt_counts_startup_steps_saves_and_adds_up(tmp_path, caplog):
    clock = Clock(1000.0)
    tracker = _tracker(tmp_path, clock, env={goodput.JOB_START_ENV: "990"})  # the driver launched 10 s earlier
    clock.advance(5)  # model build, checkpoint load
    tracker.resume(None, 0, loaded=False)
    _train(tracker, clock, 6, save_every=3)
    with caplog.at_level(logging.INFO, logger="megatron.bridge.training.events.goodput"):
        summary = tracker.finish(6, "FINISHED (exit code 0)")
    assert summary["job_start"] == 990 and summary["attempts"] == 1 and summary["iteration"] == 6
    assert summary["productive_s"] == pytest.approx(6.0)
    assert summary["lost_s"]["startup"] == pytest.approx(15.0)  # launch -> process (10 s) + process -> first step
    assert summary["lost_s"]["checkpoint_save"] == pytest.approx(1.0)
    assert summary["lost_s"]["rollback"] == summary["lost_s"]["restart"] == summary["lost_s"]["rerun"] == 0
    # 10 s before the process, 5 s of set-up, 6 steps of 1 s after 0.1 s of loop overhead each, 2 saves of 0.5 s.
    _assert_scheduled(summary, productive=6.0, wall=10 + 5 + 6 * 1.1 + 2 * 0.5, other=6 * 0.1)
    on_disk = json.loads((tmp_path / "goodput" / "summary.json").read_text())
    assert on_disk["goodput"] == pytest.approx(summary["goodput"]) and on_disk["ended"] == "FINISHED (exit code 0)"
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("goodput:")]
    match = LINE_RE.match(line)
    assert match, line
    causes = [part.split(" ")[0] for part in match.group(4).split(", ")]
    assert causes == [*CAUSES, "other"]
    assert float(match.group(1)) == pytest.approx(summary["goodput"], abs=5e-4)


def test_resume_with_progress_record_splits_rollback_and_restart(tmp_path):
    clock = Clock(1000.0)
    first = _tracker(tmp_path, clock)
    clock.advance(4)
    first.resume(None, 0, loaded=False)
    entries = _train(first, clock, 8, save_every=3)  # saves at 3 and 6; steps 7 and 8 are lost with the process
    last_sign_of_life = json.loads((tmp_path / "goodput" / "progress.json").read_text())["at"]
    assert last_sign_of_life == clock.t
    clock.advance(7)  # the failure is detected, the job torn down and relaunched
    second = _tracker(tmp_path, clock)
    clock.advance(3)
    second.resume(entries[6], 6, loaded=True)
    ckpt = entries[6]
    rollback = second.ledger["lost_s"]["rollback"]
    assert second.ledger["lost_s"]["restart"] == pytest.approx(7.0)
    # Past the checkpoint: the rest of the save of 6 (still checkpoint_save), then 2 steps and their overhead.
    assert rollback == pytest.approx(last_sign_of_life - ckpt["at"] - 0.25)
    assert rollback == pytest.approx(2 * 1.1)
    assert second.ledger["productive_s"] == pytest.approx(6.0)  # the steps up to the checkpoint only
    assert second.ledger["attempts"] == 2
    _train(second, clock, 6, save_every=3, first=6)
    summary = second.finish(12, "FINISHED (exit code 0)")
    assert summary["productive_s"] == pytest.approx(12.0)
    assert summary["lost_s"]["startup"] == pytest.approx(4 + 3)
    assert summary["lost_s"]["checkpoint_save"] == pytest.approx(4 * 0.5)
    # Set-up 4 s, 8 steps and 2 saves; 7 s to relaunch, set-up 3 s, 6 steps and 2 saves. The overhead of the two
    # lost steps is rollback: ``other`` holds only that of the 12 kept ones.
    _assert_scheduled(summary, productive=12.0, wall=4 + 8 * 1.1 + 1.0 + 7 + 3 + 6 * 1.1 + 1.0, other=12 * 0.1)


def test_resume_without_progress_record_counts_the_whole_gap_as_restart(tmp_path):
    clock = Clock(1000.0)
    first = _tracker(tmp_path, clock)
    first.resume(None, 0, loaded=False)
    entries = _train(first, clock, 4, save_every=3)
    os.remove(tmp_path / "goodput" / "progress.json")
    clock.advance(20)
    second = _tracker(tmp_path, clock)
    second.resume(entries[3], 3, loaded=True)
    assert second.ledger["lost_s"]["restart"] == pytest.approx(clock.t - entries[3]["at"])
    assert second.ledger["lost_s"]["rollback"] == 0
    assert second.ledger["attempts"] == 2


def test_progress_record_not_newer_than_the_checkpoint_is_ignored(tmp_path):
    clock = Clock(1000.0)
    first = _tracker(tmp_path, clock)
    first.resume(None, 0, loaded=False)
    entries = _train(first, clock, 3, save_every=3)
    clock.advance(10)
    late = dict(entries[3], at=clock.t - 5)  # a newer checkpoint than the record (e.g. saved by another tier)
    second = _tracker(tmp_path, clock)
    second.resume(late, 3, loaded=True)
    assert second.ledger["lost_s"]["restart"] == pytest.approx(5.0)
    assert second.ledger["lost_s"]["rollback"] == 0


def test_progress_record_of_this_attempt_or_another_job_is_not_an_earlier_attempt(tmp_path):
    clock = Clock(1000.0)
    first = _tracker(tmp_path, clock, job="A")
    first.resume(None, 0, loaded=False)
    _train(first, clock, 2)
    assert _tracker(tmp_path, clock, job="B")._earlier_progress is None
    assert _tracker(tmp_path, clock, job="A", attempt_start=clock.t - 1)._earlier_progress is None
    assert _tracker(tmp_path, clock, job="A")._earlier_progress is not None


def test_no_checkpoint_but_an_earlier_attempt_keeps_the_job_start(tmp_path):
    clock = Clock(1000.0)
    first = _tracker(tmp_path, clock)
    clock.advance(4)
    first.resume(None, 0, loaded=False)
    _train(first, clock, 2)  # dies before its first checkpoint
    clock.advance(6)
    second = _tracker(tmp_path, clock)
    second.resume(None, 0, loaded=False)
    lost = second.ledger["lost_s"]
    assert second.ledger["job_start"] == 1000.0 and second.ledger["attempts"] == 2
    assert lost["startup"] == pytest.approx(4.0) and lost["restart"] == pytest.approx(6.0)
    assert lost["rollback"] == pytest.approx(2 * 1.1)
    assert second.ledger["productive_s"] == 0


def test_checkpoint_of_another_job_starts_a_new_ledger_and_keeps_its_totals(tmp_path):
    clock = Clock(1000.0)
    old = _tracker(tmp_path, clock, job="41")
    old.resume(None, 0, loaded=False)
    entries = _train(old, clock, 3, save_every=3)
    clock.advance(3600)  # queued
    new = _tracker(tmp_path, clock, job="42", process_start=clock.t - 2)
    clock.advance(5)
    new.resume(entries[3], 3, loaded=True)
    assert new.ledger["job_start"] == pytest.approx(clock.t - 7)  # this process's start: no job-start variable
    assert new.ledger["productive_s"] == 0 and new.ledger["attempts"] == 1
    assert new.ledger["lost_s"]["restart"] == 0 and new.ledger["lost_s"]["rollback"] == 0
    earlier = new.ledger["earlier_jobs"]["41"]
    assert earlier["productive_s"] == pytest.approx(3.0) and earlier["iteration"] == 3 and earlier["attempts"] == 1
    _train(new, clock, 3, first=3)
    summary = new.finish(6, "FINISHED (exit code 0)")
    assert summary["earlier_jobs"]["41"]["goodput"] == pytest.approx(earlier["goodput"])
    assert summary["lost_s"]["startup"] == pytest.approx(2 + 5)  # from this job's process start
    _assert_scheduled(summary, productive=3.0, wall=2 + 5 + 3 * 1.1, other=3 * 0.1)


def test_entry_round_trips_through_a_checkpoint_file(tmp_path):
    clock = Clock(1000.0)
    tracker = _tracker(tmp_path, clock)
    tracker.resume(None, 0, loaded=False)
    entries = _train(tracker, clock, 3, save_every=3)
    path = tmp_path / "common.pt"
    torch.save({"goodput": entries[3]}, path)
    loaded = torch.load(path, weights_only=True)["goodput"]  # plain values only: loads without unpickling code
    assert loaded == entries[3]
    clock.t = loaded["at"]  # resumed the instant it was saved, with no progress record past it
    os.remove(tmp_path / "goodput" / "progress.json")
    again = _tracker(tmp_path, clock, attempt_start=loaded["at"])
    again.resume(loaded, 3, loaded=True)
    snap = again.snapshot()
    assert snap["attempts"] == loaded["attempts"] + 1
    assert {**snap, "attempts": 0, "attempt": ""} == {**loaded, "attempts": 0, "attempt": ""}


def test_old_checkpoint_without_the_entry_starts_afresh_and_warns_once(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(goodput, "_warned_missing", False)
    clock = Clock(1000.0)
    with caplog.at_level(logging.WARNING, logger="megatron.bridge.training.events.goodput"):
        for job in ("a", "b"):
            tracker = _tracker(tmp_path, clock, job=job)
            tracker.resume(None, 6, loaded=True)
    assert sum("holds no goodput entry" in r.getMessage() for r in caplog.records) == 1
    assert tracker.ledger["productive_s"] == 0 and tracker.ledger["attempts"] == 1 and tracker.ledger["iteration"] == 6
    assert goodput._ledger({"job_id": "x"}) is None  # a malformed entry counts as none


def test_rerun_passes_and_skipped_steps_are_not_productive(tmp_path):
    clock = Clock(1000.0)
    tracker = _tracker(tmp_path, clock)
    tracker.resume(None, 0, loaded=False)
    tracker.step_start()
    clock.advance(2.0)
    tracker.add_rerun(1.0)  # the second of two passes
    tracker.step_end(2.0, kept=True)
    tracker.step_start()
    clock.advance(1.0)
    tracker.step_end(1.0, kept=False)  # NaN: update skipped
    summary = tracker.finish(2, "FINISHED (exit code 0)")
    assert summary["lost_s"]["rerun"] == pytest.approx(2.0)
    _assert_scheduled(summary, productive=1.0, wall=3.0, other=0.0)  # no time between the steps


def test_snapshot_counts_open_intervals_and_scalars_name_every_cause(tmp_path):
    clock = Clock(1000.0)
    tracker = _tracker(tmp_path, clock)
    tracker.resume(None, 0, loaded=False)
    clock.advance(2)
    assert tracker.snapshot()["lost_s"]["startup"] == pytest.approx(2.0)  # no step yet: start-up still runs
    tracker.step_start()
    with tracker.saving():
        clock.advance(1)
        assert tracker.snapshot()["lost_s"]["checkpoint_save"] == pytest.approx(1.0)
    scalars = tracker.progress(1)
    expected = {"goodput/ratio", "goodput/productive_s", "goodput/wall_s"}
    expected |= {f"goodput/lost_{c}_s" for c in (*CAUSES, "other")}
    assert set(scalars) == expected
    assert scalars["goodput/wall_s"] == pytest.approx(3.0)


def test_only_rank0_writes_files(tmp_path):
    clock = Clock(1000.0)
    tracker = _tracker(tmp_path, clock, rank=1)
    tracker.resume(None, 0, loaded=False)
    _train(tracker, clock, 3, save_every=3)
    assert tracker.finish(3, "FINISHED (exit code 0)") is not None
    assert not (tmp_path / "goodput").exists()
    assert _tracker(tmp_path, clock).finish(None, "RuntimeError") is None  # ended before its checkpoint load


def test_an_exception_keeps_the_last_step_as_the_last_sign_of_life(tmp_path):
    clock = Clock(1000.0)
    tracker = _tracker(tmp_path, clock)
    tracker.resume(None, 0, loaded=False)
    _train(tracker, clock, 2)
    progress = tmp_path / "goodput" / "progress.json"
    last_step = json.loads(progress.read_text())["at"]
    clock.advance(30)  # stuck until a hang timeout raises: the next attempt counts this as restart
    summary = tracker.finish(None, "RuntimeError", failed=True)
    assert summary["ended"] == "RuntimeError" and summary["iteration"] == 2
    assert summary["wall_s"] == pytest.approx(32.2)
    assert json.loads(progress.read_text())["at"] == last_step
    assert json.loads((tmp_path / "goodput" / "summary.json").read_text())["ended"] == "RuntimeError"
