"""Goodput drill: a rank SIGKILLed one step past a checkpoint, restarted by ft_launcher; the job's time accounted."""

import json
import re
import time

import pytest
import torch
from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.goodput_evidence import FLOAT_S, assert_goodput_agrees_with_events
from tests.functional_tests.harness import assert_same_state, checkpoint_state, ft_launcher, tail

from megatron.bridge.training.events.goodput import CAUSES, GoodputTracker
from megatron.bridge.training.events.stream import EventKind

_LINE_RE = re.compile(
    r"\[rank0\].* goodput: (\d\.\d{3}) \(productive ([\d.]+) s of ([\d.]+) s wall\) \| lost: (.*)$", re.M
)


def test_goodput_of_a_job_with_a_killed_rank(reference_tp1, tmp_path):
    _, reference_ckpt = reference_tp1
    ckpt = tmp_path / "ckpt"
    launched = time.time()
    run = ft_launcher(ckpt, "ft.enable_ft_package=true", max_restarts=1, env={"MBRIDGE_FAULTS": "kill@8:1"})
    launcher_wall = time.time() - launched
    assert run.exit_code == 0, tail(run, 120)
    assert "fault injection: kill at iteration 8" in run.output and "will restart worker group" in run.output

    summary = json.loads((ckpt / "goodput" / "summary.json").read_text())
    lost = summary["lost_s"]
    assert summary["ended"] == "FINISHED (exit code 0)" and summary["iteration"] == 12, summary
    assert summary["attempts"] == 2, summary
    assert set(lost) == {*CAUSES, "other"}
    # The job starts with its first worker's process (no MBRIDGE_JOB_START_TIME here), after the launch, and spans
    # every attempt up to rank 0's final exit, before the launcher's. What the workers cannot see of the launcher's
    # wall time (its start-up, noticing the exits) follows the machine's load and is not bounded here.
    first = next(e for e in run.events(EventKind.ATTEMPT_STARTED) if e.rank == 0)
    ended = summary["job_start"] + summary["wall_s"]
    assert summary["job_start"] == pytest.approx(min(first.process_start, first.attempt_start), abs=1e-3), first
    assert launched < summary["job_start"] and ended < launched + launcher_wall

    # Each part against the events and the processes' starts (goodput_evidence.py): the steps the final model
    # contains (1-12, step 7 as the second attempt ran it), the first attempt's step 7 as rollback, the gap from the
    # checkpoint of 6 to the second worker's start as rollback and restart, each attempt's start-up up to its first
    # step, the saves' commits, and what is left for ``other``.
    ev = assert_goodput_agrees_with_events(summary, run.events())
    assert [a.key for a in ev.attempts] == [(0, 0), (1, 0)], ev.attempts
    assert [s.iteration for s in ev.attempts[0].steps] == list(range(1, 8)), ev.attempts[0]
    assert [s.iteration for s in ev.attempts[1].steps] == list(range(7, 13)), ev.attempts[1]
    assert ev.attempts[1].load.iteration == 6 and ev.recomputed_steps_s > 0 and ev.respawn_s > 0, ev
    assert lost["rerun"] == 0 and summary["productive_s"] == pytest.approx(ev.kept_steps_s, abs=FLOAT_S)
    print(f"goodput parts: {summary['productive_s']:.3f} s productive of {summary['wall_s']:.3f} s, lost {lost}")
    print(f"from the events: {ev.kept_steps_s:.3f} s kept steps, rollback >= {ev.recomputed_steps_s:.3f}, restart "
          f">= {ev.respawn_s:.3f}, both <= {ev.resume_gaps_s:.3f}, startup in {ev.startup_s}, checkpoint_save >= "
          f"{ev.sync_commits_s:.3f}, startup + other <= {ev.startup_and_other_s:.3f}")  # fmt: skip

    # The log line of the finished attempt says the same as summary.json.
    ratio, productive, wall, causes = _LINE_RE.findall(run.output)[-1]
    logged = {name: float(value) for name, value in (part.rsplit(" ", 2)[:2] for part in causes.split(", "))}
    assert float(ratio) == pytest.approx(summary["goodput"], abs=5e-4)
    assert (float(productive), float(wall)) == pytest.approx((summary["productive_s"], summary["wall_s"]), abs=0.05)
    assert logged == pytest.approx(lost, abs=0.05) and list(logged) == [*CAUSES, "other"]
    assert_doc_log_lines(run.output)

    # The final checkpoint carries the ledger as of its save; a tracker resumed from it continues it unchanged.
    entry = torch.load(ckpt / "iter_0000012" / "common.pt", weights_only=True)["goodput"]
    assert (entry["job_id"], entry["job_start"], entry["attempts"]) == (
        summary["job_id"], summary["job_start"], 2,
    )  # fmt: skip
    assert entry["iteration"] == 12 and entry["productive_s"] == pytest.approx(summary["productive_s"])
    resumed = GoodputTracker(entry["job_id"], "check", entry["at"], None, 0, clock=lambda: entry["at"])
    resumed.resume(entry, 12, loaded=True)
    again = resumed.snapshot()
    assert again["attempts"] == 3
    assert {**again, "attempts": 2, "attempt": ""} == {**entry, "attempt": ""}

    # Accounting lives outside train_state: the model state equals an uninterrupted run's, bit for bit.
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))
