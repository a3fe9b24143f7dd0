"""Goodput drill: a rank SIGKILLed one step past a checkpoint, restarted by ft_launcher; the job's time accounted."""

import json
import re
import time

import pytest
import torch
from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.harness import assert_same_state, checkpoint_state, ft_launcher, tail

from megatron.bridge.training.event_stream import EventKind
from megatron.bridge.training.goodput import CAUSES, GoodputTracker

_LINE_RE = re.compile(
    r"\[rank0\].* goodput: (\d\.\d{3}) \(productive ([\d.]+) s of ([\d.]+) s wall\) \| lost: (.*)$", re.M
)
_STEP_RE = re.compile(r"\[rank0\].* iteration (\d+)/\d+ \|.*\| step time ([\d.]+) s$", re.M)
SUMMARY_TO_EXIT_S = 5.0
"""What lies between the final summary and rank 0's exit event: writing summary.json (milliseconds here)."""


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
    assert lost["rollback"] > 0 and lost["restart"] > 0, summary
    assert set(lost) == {*CAUSES, "other"}
    assert summary["productive_s"] + sum(lost.values()) == pytest.approx(summary["wall_s"], abs=1e-6)
    assert summary["goodput"] == pytest.approx(summary["productive_s"] / summary["wall_s"])
    # The job starts with its first worker's process (no MBRIDGE_JOB_START_TIME here), after the launch, and spans
    # every attempt up to rank 0's final exit, before the launcher's. What the workers cannot see of the launcher's
    # wall time (its start-up, noticing the exits) follows the machine's load and is not bounded here.
    first = next(e for e in run.events(EventKind.ATTEMPT_STARTED) if e.rank == 0)
    final = [e for e in run.events(EventKind.EXIT) if e.rank == 0][-1]
    ended = summary["job_start"] + summary["wall_s"]
    assert summary["job_start"] == pytest.approx(min(first.process_start, first.attempt_start), abs=1e-3), first
    assert launched < summary["job_start"] and ended < launched + launcher_wall
    assert 0 <= final.time - ended < SUMMARY_TO_EXIT_S, (final, summary)

    # Productive: the step times of the steps the final model contains (a step re-done after the restart counts
    # once, as the second attempt logged it; the first attempt's step 7 is rollback).
    kept: dict[int, float] = {}
    first_attempt: dict[int, float] = {}
    for match in _STEP_RE.finditer(run.output):
        iteration, seconds = int(match.group(1)), float(match.group(2))
        if iteration in kept:
            first_attempt[iteration] = kept[iteration]
        kept[iteration] = seconds
    assert sorted(kept) == list(range(1, 13)) and sorted(first_attempt) == [7], (kept, first_attempt)
    assert summary["productive_s"] == pytest.approx(sum(kept.values()), abs=0.01)
    assert lost["rollback"] >= first_attempt[7]

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
