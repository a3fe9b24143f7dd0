"""An attempt's set-up phases: ``phase`` events back to back (``events/phases.py``), and the goodput ledger's start-up
of each attempt split by them."""

import pytest
from tests.unit_tests.training.test_goodput import Clock, _tracker

from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.phases import PhaseClock
from megatron.bridge.training.events.reader import read_events
from megatron.bridge.training.events.stream import CyclePhase, EventKind


@pytest.fixture
def stream(tmp_path):
    event_stream.configure(str(tmp_path), rank=0, restart_count=1, inprocess_iteration=0)
    yield tmp_path
    event_stream.configure(None, rank=0)


def test_phases_are_written_back_to_back_and_ping_the_watchdog(stream):
    clock, pings = Clock(100.0), []
    phases = PhaseClock(100.0, ping=lambda: pings.append(clock.t), clock=clock)
    phases.record(CyclePhase.PROCESS_START, 97.5, 100.0)  # the fork, before the clock's origin
    for phase, seconds in ((CyclePhase.PROCESS_GROUP, 0.5), (CyclePhase.HEALTH_CHECKS, 0.25)):
        clock.advance(seconds)
        phases.lap(phase)
    assert phases.seconds == {"process_start": 2.5, "process_group": 0.5, "health_checks": 0.25}
    assert pings == [100.5, 100.75]  # each phase's end reports progress (a recorded phase does not)
    found, problems = read_events(str(stream))
    assert not problems
    spans = [(e.cycle_phase, e.start, e.end) for e in found if e.kind == EventKind.PHASE]
    assert spans == [(CyclePhase.PROCESS_START, 97.5, 100.0), (CyclePhase.PROCESS_GROUP, 100.0, 100.5),
                     (CyclePhase.HEALTH_CHECKS, 100.5, 100.75)]  # fmt: skip
    assert {(e.rank, e.restart_count) for e in found} == {(0, 1)}  # the attempt's context, as every event


def test_a_phase_event_with_an_unknown_phase_is_reported_not_read(tmp_path):
    (tmp_path / "events-rank0.jsonl").write_text(
        '{"v":1,"kind":"phase","time":1.0,"cycle_phase":"warp_drive","start":0.5,"end":1.0}\n'
        '{"v":1,"kind":"phase","time":2.0,"cycle_phase":"data_build","start":1.0,"end":"late"}\n'
    )
    found, problems = read_events(str(tmp_path))
    assert found == [] and len(problems) == 2
    assert "unknown cycle_phase 'warp_drive'" in str(problems[0]) and "field end is not a number" in str(problems[1])


def test_the_ledger_splits_each_attempts_start_up_by_phase(tmp_path):
    clock = Clock(1000.0)
    first = _tracker(tmp_path, clock)
    first.resume(None, 0, loaded=False)
    first.phases = {"process_group": 1.0, "model_build": 2.0}
    clock.advance(4.0)
    first.step_start()
    (startup,) = first.ledger["startups"]
    assert startup["startup_s"] == pytest.approx(4.0)
    assert startup["phases_s"] == {"process_group": 1.0, "model_build": 2.0, "to_first_step": pytest.approx(1.0)}
    entry = first.snapshot()  # what a checkpoint carries
    clock.advance(10.0)
    second = _tracker(tmp_path, clock)  # the next attempt resumes from that checkpoint
    second.resume(entry, 1, loaded=True)
    second.phases = {"checkpoint_load": 0.5}
    clock.advance(0.75)
    second.step_start()
    summary = second.finish(1, "FINISHED (exit code 0)")
    assert [s["attempt"] for s in summary["startups"]] == [first.attempt, second.attempt]
    assert summary["startups"][1]["phases_s"] == {"checkpoint_load": 0.5, "to_first_step": pytest.approx(0.25)}
