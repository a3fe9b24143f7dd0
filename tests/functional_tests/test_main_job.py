"""The README's first command runs the whole resiliency drill and every fault in it is detected and recovered.

This runs ``bash scripts/run_main_job.sh`` exactly as documented (the default schedule: a NaN loss, a killed rank,
a preemption signal, a corrupted local checkpoint, a stalled rank and a slowed rank, with in-process restart
inside ft_launcher's in-job restart and every other feature on), then the documented checkpoint verification, and
checks what the drill claims against the files it left behind.
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.goodput_evidence import SLEW, TICK_S, assert_goodput_agrees_with_events

from megatron.bridge.drill import events, schedule
from megatron.bridge.training.events.stream import EventKind

REPO = Path(__file__).resolve().parents[2]
DOC_COMMANDS = ("bash scripts/run_main_job.sh", "mbridge-verify-checkpoint runs/main_job/checkpoints --all")


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    work = tmp_path_factory.mktemp("main_job")
    run_dir = work / "runs" / "main_job"
    env = {**os.environ, "RUN_DIR": str(run_dir), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(shlex.split(DOC_COMMANDS[0]), cwd=REPO, env=env, capture_output=True, text=True, timeout=2400)
    return work, run_dir, out


def test_the_drill_passes_and_prints_the_table(main_job):
    _, run_dir, out = main_job
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    for fault in schedule.parse("default"):
        assert f"| {fault.label} |" in out.stdout
    assert "final state EQUAL to the fault-free run" in out.stdout
    assert "goodput: 0." in out.stdout
    assert "iteration 50/100" in out.stdout, "progress is shown while it runs"
    # The CPU Llama recipe on a corpus the job made itself, with two pipeline stages.
    assert "[drill] corpus: " in out.stdout and "byte-level tokens" in out.stdout
    log = (run_dir / "train.log").read_text()
    assert "tensor parallel 1, pipeline parallel 2, data parallel 1" in log


def test_every_fault_was_detected_and_recovered(main_job):
    _, run_dir, _ = main_job
    result = json.loads((run_dir / "drill_report.json").read_text())
    assert result["passed"] and result["equal"] is True and result["tensors_compared"] > 0
    assert result["final_iteration"] == 100
    by_kind = {f["kind"]: f for f in result["faults"]}
    default = schedule.parse("default")
    assert set(by_kind) == {f.kind for f in default}
    for fault in result["faults"]:
        assert fault["detected"] and fault["recovered"], fault
        assert fault["detection_latency_s"] >= 0 and fault["recovery_time_s"] > 0, fault
    restarting = [f.kind for f in default if f.kind in schedule.RESTARTING]
    for kind in restarting:
        assert by_kind[kind]["restarted"], kind
    assert not by_kind["nan"]["restarted"] and by_kind["nan"]["steps_lost"] == 0
    # A preemption and a straggler stop save before exiting: nothing is recomputed.
    assert by_kind["preempt"]["steps_lost"] == 0 and by_kind["slow"]["steps_lost"] == 0
    # The kill strikes at 27: the newest checkpoint is resumed (the local one at 25 once its async write is done).
    assert (
        by_kind["kill"]["resumed_from"] in (20, 25)
        and by_kind["kill"]["steps_lost"] == 26 - by_kind["kill"]["resumed_from"]
    )
    # The local checkpoint at 45 was corrupted: the stall's restart discards it and falls back to a global one.
    fallback = by_kind["corrupt-local"]["resumed_from"]
    assert fallback in (38, 40) and by_kind["corrupt-local"]["steps_lost"] == 45 - fallback
    # The stall (at 47) is recovered in the same processes, without the launcher; it loses only its own step: 46,
    # past the local checkpoint its restart tried; the rest is the corruption's.
    stall = by_kind["stall"]
    assert not stall["restarted"] and stall["restart_layers"] == ["in_process"]
    assert stall["resumed_from"] == fallback and stall["steps_lost"] == 1
    assert stall["detection"]["mechanism"] == "inprocess_soft_timeout"
    # The layers as the event stream records them: the stall restarted in the same processes (the same pid before
    # and after on each rank), every other restart was the launcher's. (A survivor may also begin an in-process
    # restart when its peer is killed, which the launcher's stop cuts short: it never ends, and the kill claims it.)
    timeline = events.read_run(run_dir / "events")
    assert timeline.problems == []
    in_process = [r for r in timeline.restarts if r.layer.value == "in_process" and r.ended is not None]
    assert len(in_process) == 1 and [r.layer.value for r in timeline.restarts].count("in_job") == len(restarting)
    started = {(e.rank, e.restart_count, e.inprocess_iteration): e.pid
               for e in timeline.events if e.kind == EventKind.ATTEMPT_STARTED}  # fmt: skip
    count = in_process[0].restart_count
    for rank in (0, 1):
        assert started[(rank, count, 1)] == started[(rank, count, 0)], started
    # One launcher restart per restarting fault, none unexplained (a false alarm fails the drill).
    assert len(result["restarts_s"]) == len(restarting) and result["unexplained_restarts_s"] == []
    assert "local_rank: 1" in by_kind["kill"]["detection_line"] and "exitcode: -9" in by_kind["kill"]["detection_line"]
    # The ledger written by the ranks says when each fault struck.
    ledger = [json.loads(x) for x in (run_dir / "fault_ledger.jsonl").read_text().splitlines()]
    assert sorted(r["kind"] for r in ledger) == sorted(f.kind for f in schedule.parse("default"))  # one name per kind


def test_goodput_is_accounted_across_restarts(main_job):
    _, run_dir, _ = main_job
    result = json.loads((run_dir / "drill_report.json").read_text())
    g = result["goodput"]
    assert g is not None
    # Each part against the event stream and the processes' starts (goodput_evidence.py), not against the other
    # parts: the kept steps' time, the recomputed steps, each resume's gap, start-ups, what is left for ``other``.
    timeline = events.read_run(run_dir / "events")
    ev = assert_goodput_agrees_with_events(g, timeline.events)
    assert ev.recomputed_steps_s > 0 and ev.respawn_s > 0 and g["lost_s"]["rerun"] > 0, ev  # rollbacks, NaN re-run
    # The job's clock starts with the drill's launch (MBRIDGE_JOB_START_TIME, to the millisecond) before the
    # launcher's process, and ends inside the drill's wall time (measured on the drill's monotonic clock).
    tol = TICK_S + SLEW * result["wall_s"]
    launcher = [e.process_start for e in timeline.events if e.kind == EventKind.LAUNCHER_STARTED]
    assert launcher and g["job_start"] <= min(launcher) + tol and g["wall_s"] <= result["wall_s"] + tol, g
    # Every phase of every restart, in-process ones included, is a span inside the drill's wall time.
    phases = [(r["layer"], key, s) for r in result["restart_phases"] for key, s in r.items() if key.endswith("_s")]
    assert {layer for layer, _, _ in phases} == {"in_job", "in_process"}
    assert all(s is None or -0.02 <= s <= result["wall_s"] for _, _, s in phases), phases  # /proc: 10 ms ticks
    # Each restarting fault's cycle, phase by phase: every phase of its layer measured, none negative, and together
    # they cover the cycle (detection to first step) but for clock reads.
    cycles = {c["kind"]: c for c in result["cycles"]}
    for kind in (f.kind for f in schedule.parse("default") if f.kind in schedule.RELOADING):
        c = cycles[kind]
        skipped = {"rendezvous", "process_start"} if c["layer"] == "in_process" else set()
        assert all((s is None) == (name in skipped) for name, s in c["phases_s"].items()), c
        assert all(s is None or s >= -0.02 for s in c["phases_s"].values()) and abs(c["unaccounted_s"]) < 0.05, c


def test_the_plot_tensorboard_and_checkpoints_are_written(main_job):
    work, run_dir, _ = main_job
    assert (run_dir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("drill", "reference", "drill_summary"):
        assert list((run_dir / "tensorboard" / name).glob("events.out.tfevents.*")), name
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    verify = subprocess.run(shlex.split(DOC_COMMANDS[1]), cwd=work, env=env, capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "iter_0000100" in verify.stdout + verify.stderr
    assert_doc_log_lines(verify.stdout)


@pytest.mark.timeout(600)
def test_the_log_lines_the_docs_quote_are_in_its_output(main_job):
    # What the drill printed (its own report, and the ranks' lines it echoes) and both runs' whole logs.
    _, run_dir, out = main_job
    logs = [(run_dir / "train.log").read_text(), (run_dir / "reference" / "train.log").read_text()]
    assert_doc_log_lines("\n".join([out.stdout, out.stderr, *logs]))
