"""Restart cycles phase by phase, from synthetic event streams written by the real writers: the drill's assembly,
its report (markdown and JSON) and the projection that reads the phases back."""

import json

import pytest
from tests.unit_tests.drill.test_drill import T0, Run

from megatron.bridge.drill import events, report, schedule
from megatron.bridge.drill import projection as projection_cli
from megatron.bridge.drill.projection_model import RESTART_PHASES, phase_costs, read_costs
from megatron.bridge.training.events.stream import CyclePhase, EventKind, Mechanism, RestartLayer
from megatron.bridge.training.faults.spec import Fault

SETUP = [(CyclePhase.PROCESS_START, 0.8), (CyclePhase.PROCESS_GROUP, 0.5), (CyclePhase.HEALTH_CHECKS, 0.3),
         (CyclePhase.MODEL_BUILD, 0.7), (CyclePhase.CHECKPOINT_LOAD, 1.0), (CyclePhase.DATA_BUILD, 0.2)]  # fmt: skip
"""The set-up phases an attempt writes, with the seconds each takes here."""


def _set_up(run: Run, start: float, phases=SETUP, slower_rank1: float = 0.25) -> float:
    """Both ranks write their set-up phases back to back from ``start``; rank 1's are slower. Rank 0's end."""
    for rank, scale in ((0, 1.0), (1, 1.0 + slower_rank1)):
        t = start
        for phase, seconds in phases:
            run.at(t + seconds * scale, rank, EventKind.PHASE, cycle_phase=phase, start=T0 + t,
                   end=T0 + t + seconds * scale)  # fmt: skip
            t += seconds * scale
        if rank == 0:
            end = t
    return end


def _killed(tmp_path, monkeypatch, phases=SETUP) -> Run:
    """A rank killed at iteration 6, the launcher's restart, the new attempt's set-up and its first step."""
    run = Run(tmp_path, monkeypatch).attempt(9.5)
    _set_up(run, 9.0)
    for i in range(1, 6):
        run.step(12.0 + i, i)
    run.strike(17.5, Fault("kill", 6, 1)).worker_died(17.6, 1).relaunch(17.7, 1, stopped=0.3, started=1.2)
    run.restart_count = 1
    set_up = _set_up(run, 18.2, phases)  # forked 0.2 s after the workers stopped (18.0)
    run.attempt(set_up, restart_count=1).load(set_up, 4, tier="local", took=1.0)
    return run.step(set_up + 0.6, 5)


def test_an_in_job_cycle_is_split_into_every_phase_back_to_back(tmp_path, monkeypatch):
    timeline = _killed(tmp_path, monkeypatch).timeline()
    found = events.outcomes(timeline, schedule.parse("kill@6:1"))
    (cycle,) = events.cycles(timeline, found)
    assert (cycle.cause, cycle.layer) == ("kill@6:1", RestartLayer.IN_JOB)
    expected = {"detection": 0.1, "teardown": 0.4, "rendezvous": 0.2, **{p.value: s for p, s in SETUP},
                "first_step": 0.6}  # fmt: skip
    assert list(cycle.phases()) == [p.value for p in CyclePhase]  # every phase, in order
    assert cycle.phases() == {k: pytest.approx(v, abs=1e-5) for k, v in expected.items()}
    spans = [span for span in cycle.spans().values()]
    assert all(a[1] == pytest.approx(b[0], abs=1e-5) for a, b in zip(spans, spans[1:]))  # rank 0's, no gap
    assert cycle.seconds == pytest.approx(sum(expected.values()) - 0.1, abs=1e-5)  # detection precedes the cycle
    assert cycle.unaccounted_s == pytest.approx(0.0, abs=1e-5)
    assert cycle.seconds == pytest.approx(found[0].recovery_s, abs=1e-5)  # the fault table's recovery time


def test_an_in_process_cycle_has_no_rendezvous_or_process_start(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch).attempt(0.5)
    _set_up(run, 0.0)
    run.step(4.0, 46).strike(4.5, Fault("stall", 47, 1))
    run.detect(7.5, Mechanism.INPROCESS_SOFT_TIMEOUT, rank=1)
    for rank, at in ((0, 7.6), (1, 7.7)):
        run.at(at, rank, EventKind.RESTART_BEGUN, layer=RestartLayer.IN_PROCESS, inprocess_iteration=1)
    run.inprocess = 1
    set_up = _set_up(run, 8.0, SETUP[1:])  # no new process: its first phase starts with the new iteration
    run.at(8.01, 0, EventKind.RESTART_ENDED, layer=RestartLayer.IN_PROCESS, inprocess_iteration=1)
    run.attempt(set_up, inprocess=1).load(set_up, 40)
    run.step(set_up + 0.4, 41)
    timeline = run.timeline()
    (cycle,) = events.cycles(timeline, events.outcomes(timeline, schedule.parse("stall@47:1")))
    phases = cycle.phases()
    assert cycle.layer == RestartLayer.IN_PROCESS and phases["rendezvous"] is None and phases["process_start"] is None
    assert phases["detection"] == pytest.approx(3.0) and phases["teardown"] == pytest.approx(0.5)
    assert phases["first_step"] == pytest.approx(0.4) and cycle.unaccounted_s == pytest.approx(0.0, abs=1e-5)


def test_a_restart_no_fault_explains_is_a_cycle_of_its_own(tmp_path, monkeypatch):
    timeline = _killed(tmp_path, monkeypatch).timeline()
    (cycle,) = events.cycles(timeline)  # no schedule: the cause is the last detection before the restart
    assert cycle.cause == "unexplained: launcher_worker_exit"
    assert cycle.phases()["detection"] == pytest.approx(0.1, abs=1e-5)  # the strike before it still found


def test_a_stream_without_phase_events_leaves_them_unmeasured(tmp_path, monkeypatch):
    timeline = _killed(tmp_path, monkeypatch, phases=[]).timeline()  # written before the schema had phases
    (cycle,) = events.cycles(timeline)
    phases = cycle.phases()
    assert [name for name, s in phases.items() if s is not None] == ["detection", "teardown"]
    assert cycle.unaccounted_s == pytest.approx(cycle.seconds - 0.4, abs=1e-5)


def _result(timeline, found, goodput=None) -> report.DrillResult:
    return report.DrillResult(found, timeline, 0, 40.0, 20.0, goodput, equal=True)


def test_the_report_has_a_cycle_table_and_cycles_in_its_json(tmp_path, monkeypatch):
    timeline = _killed(tmp_path, monkeypatch).timeline()
    phases_s = {"to_first_step": 3.1, "process_start": 0.8, "model_build": 0.1}  # sorted by name in summary.json
    startups = [{"attempt": "a0", "startup_s": 4.0, "phases_s": phases_s}]
    goodput = {"goodput": 0.5, "productive_s": 1.0, "wall_s": 2.0, "lost_s": {}, "startups": startups}
    result = _result(timeline, events.outcomes(timeline, schedule.parse("kill@6:1")), goodput)
    text = report.fault_table(result)
    header = "| cycle | cause | layer | detection | teardown | rendezvous | process start | process group |"
    assert header in text
    row = ("| 1 | kill@6:1 | in_job | 0.10 s | 0.40 s | 0.20 s | 0.80 s | 0.50 s | 0.30 s | 0.70 s | 1.00 s "
           "| 0.20 s | 0.60 s | 4.70 s | 0.00 s |")  # fmt: skip
    assert row in text
    assert "| attempt | start-up | process start | model build | to first step |" in text  # in the phases' order
    assert "| a0 | 4.00 s | 0.80 s | 0.10 s | 3.10 s |" in text  # the goodput ledger's start-up by phase
    (cycle,) = json.loads(json.dumps(report.to_json(result)))["cycles"]
    assert (cycle["cause"], cycle["layer"], cycle["tier"], cycle["resumed_from"]) == ("kill@6:1", "in_job", "local", 4)
    assert cycle["cycle_s"] == pytest.approx(4.7, abs=1e-5) and cycle["detected_s"] == pytest.approx(
        8.6
    )  # from the first fork
    assert cycle["phases_s"]["rendezvous"] == pytest.approx(0.2, abs=1e-5)
    assert cycle["spans_s"]["teardown"] == [pytest.approx(8.6), pytest.approx(9.0)]


def test_the_projection_reads_the_phases_and_takes_one_from_the_command_line(tmp_path, monkeypatch, capsys):
    timeline = _killed(tmp_path / "events", monkeypatch).timeline()
    path = tmp_path / "drill_report.json"
    report.save_json(_result(timeline, events.outcomes(timeline, schedule.parse("kill@6:1"))), path)
    means = phase_costs(json.loads(path.read_text()))
    assert set(means) == {"injob"} and list(means["injob"]) == list(RESTART_PHASES)
    assert means["injob"]["rendezvous"] == pytest.approx(0.2, abs=1e-5)
    values, sources = read_costs(path)
    assert values["injob_restart_s"] == pytest.approx(4.7, abs=1e-5)  # the phases add up to the cycle
    assert "1 restart cycle(s)" in sources["injob_restart_s"]
    assert projection_cli.main(["--from", str(path), "--phase", "injob.rendezvous=30.2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["injob_restart_s"] == pytest.approx(4.7 + 30.0, abs=1e-5)
    assert out["restart_phases"]["injob"]["rendezvous"] == 30.2
    assert "rendezvous from --phase" in out["sources"]["injob_restart_s"]
    assert projection_cli.main(["--from", str(path)]) == 0
    assert "| injob | 0.40 s | 0.20 s | 0.80 s |" in capsys.readouterr().out


@pytest.mark.parametrize("item", ["injob.detection=3", "requeue.teardown=1", "injob.rendezvous=-1", "injob=4"])
def test_a_bad_phase_flag_exits_2_naming_it(item, capsys):
    assert projection_cli.main(["--phase", item]) == 2
    err = capsys.readouterr().err
    assert "--phase" in err and "injob.rendezvous=40" in err and "Traceback" not in err
