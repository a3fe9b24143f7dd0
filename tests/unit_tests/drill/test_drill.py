"""The drill's own logic: schedules are checked, event files written by the real writers are read into strike,
detection, restart phases and recovery, and the report tells the truth."""

import datetime
import json
from types import SimpleNamespace

import pytest
import torch

from megatron.bridge.drill import events, report, schedule
from megatron.bridge.drill.schedule import Plan
from megatron.bridge.training.checkpoint import compare
from megatron.bridge.training.checkpoint.compare import PartCount
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind, EventWriter, Mechanism, Process, RestartLayer
from megatron.bridge.training.faults import spec as fault_spec
from megatron.bridge.training.faults.spec import Fault
from megatron.bridge.utils import provenance

PLAN = Plan(train_iters=100, nproc=2, save_interval=20, local_interval=5, max_restarts=6)
T0 = datetime.datetime(2026, 1, 1, 12, 0, 0).timestamp()


class Run:
    """A drill's event directory written by real writers, on a clock the test sets (seconds after T0)."""

    def __init__(self, directory, monkeypatch):
        self.dir, self.now = directory, T0
        fake = SimpleNamespace(time=lambda: self.now, monotonic=lambda: self.now - T0)
        monkeypatch.setattr(event_stream, "time", fake)
        self.launcher = EventWriter(str(directory), event_stream.launcher_file("vm"), Process.LAUNCHER)
        self.ranks = {
            r: EventWriter(str(directory), event_stream.worker_file(r), Process.WORKER, rank=r) for r in (0, 1)
        }
        self.restart_count, self.inprocess = 0, 0

    def at(self, when, who, kind, **fields):
        self.now = T0 + when
        writer = self.launcher if who == "launcher" else self.ranks[who]
        if who != "launcher":
            fields = {"restart_count": self.restart_count, "inprocess_iteration": self.inprocess, **fields}
        assert writer.emit(kind, **fields) is not None
        return self

    def attempt(self, seconds, restart_count=0, inprocess=0):
        self.restart_count, self.inprocess = restart_count, inprocess
        for rank in (0, 1):
            self.at(seconds, rank, EventKind.ATTEMPT_STARTED, process_start=T0 + seconds - 0.5,
                    attempt_start=T0 + seconds - (0.5 if inprocess == 0 else 0.0))  # fmt: skip
        return self

    def step(self, seconds, iteration):
        return self.at(seconds, 0, EventKind.STEP_COMPLETED, iteration=iteration, seconds=0.2, applied=True)

    def load(self, seconds, iteration, tier="global", took=0.5):
        return self.at(seconds, 0, EventKind.CHECKPOINT_LOADED, iteration=iteration, tier=tier, seconds=took)

    def strike(self, seconds, fault):
        return self.at(seconds, fault.rank, EventKind.FAULT_INJECTED, rank=fault.rank, fault_kind=fault.kind,
                       iteration=fault.iteration, phase=fault.phase)  # fmt: skip

    def detect(self, when, mechanism, who=0, **fields):
        return self.at(when, who, EventKind.FAULT_DETECTED, mechanism=mechanism, **fields)

    def worker_died(self, seconds, rank, exit_code=-9):
        signal = -exit_code if exit_code < 0 else None
        self.at(seconds, "launcher", EventKind.WORKER_EXITED, rank=rank, local_rank=rank, exit_code=exit_code,
                signal=signal)  # fmt: skip
        return self.detect(seconds, Mechanism.LAUNCHER_WORKER_EXIT, "launcher", rank=rank, local_rank=rank,
                           exit_code=exit_code, signal=signal)  # fmt: skip

    def relaunch(self, seconds, count, stopped=0.3, started=1.0):
        self.at(seconds, "launcher", EventKind.RESTART_BEGUN, layer=RestartLayer.IN_JOB, restart_count=count)
        self.at(seconds + stopped, "launcher", EventKind.WORKERS_STOPPED, layer=RestartLayer.IN_JOB,
                restart_count=count)  # fmt: skip
        return self.at(seconds + started, "launcher", EventKind.RESTART_ENDED, layer=RestartLayer.IN_JOB,
                       restart_count=count)  # fmt: skip

    def timeline(self):
        return events.read_run(self.dir)


def _kill_run(tmp_path, monkeypatch) -> Run:
    run = Run(tmp_path, monkeypatch).attempt(9.5)
    for i in range(1, 6):
        run.step(10.0 + i, i)
    run.strike(15.5, Fault("kill", 6, 1)).worker_died(15.6, 1).relaunch(15.7, 1)
    run.attempt(18.0, restart_count=1).load(30.0, 4, tier="local", took=1.0)
    return run.step(30.5, 5).step(31.0, 6)


def test_default_schedule_has_one_fault_of_each_kind_and_plays_out():
    faults = schedule.parse("default")  # a stopped rank (hang) only shows the layer under stall's: left to --faults
    assert sorted(f.kind for f in faults) == sorted(set(schedule.KINDS) - {"hang"})
    assert [f.iteration for f in faults] == sorted(f.iteration for f in faults)
    schedule.check(faults, PLAN)
    assert schedule.worker_faults(faults) == schedule.DEFAULT  # the schedule is the training processes' fault spec
    assert faults == fault_spec.parse(schedule.DEFAULT)  # read by the one parser, kinds and all
    assert [f.factor for f in faults if f.kind == "slow"] == [6.0]  # the drill's straggler: six times slower


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("melt@3:0", "bad item"),
        ("kill@0:1", "bad item"),
        ("kill@3", "bad item"),
        ("kill@3:1:x2", "bad item"),
        ("slow@3:1:x200", r"bad item 'slow@3:1:x200': x200 is outside the drill's x4 to x100"),
        ("slow@3:1", r"x2 is outside .*\. Fix: give a factor, e.g. slow@3:1:x6"),  # the registry's default x2
        ("kill@5:1,hang@5:0", "same iteration"),
        ("sigterm@5:0", "unknown kind 'sigterm'"),  # one name per kind, in the drill as everywhere: preempt
        ("exception@5:0", "the drill cannot tell what detects and recovers 'exception'"),
        ("kill@5s:0", "at an iteration, not after a time"),
        ("kill@5:0:always", r"in its kind's phase \(step\): no options"),
        ("kill@5:0:save.during_write", "no options"),
    ],
)
def test_bad_schedules_are_rejected_when_parsed(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        schedule.parse(spec)
    assert str(err.value).startswith("--faults: "), str(err.value)
    if "bad item" in str(err.value) and "slow" not in spec:  # the fix names the kinds a drill takes
        assert "corrupt-local" in str(err.value) and "no-rng-restore" in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("kill@100:1", "outside 1..99"),
        ("kill@10:2", "runs 2 ranks"),
        ("corrupt-local@40:1,kill@42:1", "has no local checkpoint"),
        ("corrupt-local@45:1,kill@51:1", "no restart follows"),
        ("corrupt-local@45:1", "no restart follows"),
        ("corrupt-local@45:1,preempt@47:0", "saves a newer checkpoint"),
        ("kill@3:1,kill@4:1,kill@5:1,kill@6:1,kill@7:1,kill@8:1,kill@9:1", "--max-restarts=6"),
    ],
)
def test_schedules_that_cannot_play_out_are_rejected(spec, message):
    with pytest.raises(ValueError, match=message):
        schedule.check(schedule.parse(spec), PLAN)


def test_none_is_an_empty_schedule():
    assert schedule.parse("none") == [] and schedule.worker_faults([]) == ""


def test_a_killed_rank_is_matched_with_its_detection_restart_and_recovery(tmp_path, monkeypatch):
    timeline = _kill_run(tmp_path, monkeypatch).timeline()
    (outcome,) = events.outcomes(timeline, schedule.parse("kill@6:1"))
    assert outcome.ok and outcome.relaunched
    assert outcome.detection_s == pytest.approx(0.1, abs=1e-5)
    assert outcome.recovery_s == pytest.approx(30.5 - 15.6, abs=1e-5)
    assert (outcome.resumed_from, outcome.steps_lost) == (4, 1)  # iteration 5 was done, then redone
    assert "local_rank: 1 (exitcode: -9)" in outcome.detection_line
    assert timeline.resumes == [(pytest.approx(T0 + 9.5), 0), (pytest.approx(T0 + 30.0), 4)]
    assert events.unexplained_restarts(timeline, [outcome]) == []
    (restart,) = timeline.restarts
    phases = restart.phases()
    expected = {"teardown": 0.3, "spawn": 17.5 - 16.0, "setup": 29.0 - 17.5, "load": 1.0, "first_step": 0.5,
                "total": 30.5 - 15.7}  # fmt: skip
    assert phases == {k: pytest.approx(v, abs=1e-5) for k, v in expected.items()}
    assert (restart.layer, restart.resumed_from, restart.tier) == (RestartLayer.IN_JOB, 4, "local")


def test_a_fault_that_never_struck_or_was_never_detected_is_not_ok(tmp_path, monkeypatch):
    run = _kill_run(tmp_path, monkeypatch)
    never = events.outcomes(run.timeline(), schedule.parse("kill@7:1"))
    assert not never[0].ok and never[0].struck is None
    run.strike(16.0, Fault("hang", 3, 1))
    timeline = run.timeline()
    undetected = events.outcomes(timeline, schedule.parse("hang@3:1"))
    assert undetected[0].struck is not None and undetected[0].detected is None and not undetected[0].ok
    # The kill's restart is then unexplained: it is reported, not hidden.
    assert events.unexplained_restarts(timeline, undetected) == [pytest.approx(T0 + 15.7)]


def test_a_transient_nan_is_recovered_in_place(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch).attempt(0.5).step(1.0, 11).strike(1.2, Fault("nan", 12, 1))
    run.detect(1.25, Mechanism.RERUN_NAN, who=1, rank=1, iteration=12).step(1.6, 12)
    (outcome,) = events.outcomes(run.timeline(), schedule.parse("nan@12:1"))
    assert outcome.ok and outcome.restart is None and outcome.steps_lost == 0
    assert outcome.recovery_s == pytest.approx(0.35, abs=1e-5)


def test_a_corrupted_local_checkpoint_counts_the_steps_the_fallback_lost(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch).attempt(0.2).strike(0.5, Fault("corrupt-local", 45, 1)).step(1.0, 47)
    run.worker_died(2.9, 1).relaunch(3.0, 1).attempt(15.0, restart_count=1)
    run.detect(20.0, Mechanism.LOCAL_CHECKPOINT_HASH, rank=None, iteration=45, tier="local")
    run.load(20.5, 40).step(21.0, 41)
    (outcome,) = events.outcomes(run.timeline(), schedule.parse("corrupt-local@45:1"))
    assert outcome.ok and (outcome.resumed_from, outcome.steps_lost) == (40, 5)
    assert outcome.detection_s == pytest.approx(19.5, abs=1e-5)


def test_the_report_says_failed_when_a_fault_was_missed_or_the_state_differs(tmp_path, monkeypatch):
    timeline = _kill_run(tmp_path, monkeypatch).timeline()
    found = events.outcomes(timeline, schedule.parse("kill@6:1"))
    good = report.DrillResult(found, timeline, 0, 40.0, 20.0, None, equal=True, compared=[PartCount("model", 12, 0)])
    assert good.passed
    table = report.fault_table(good)
    assert "kill@6:1" in table and "iteration 4" in table and "not detected" not in table
    assert "ft_launcher: worker exited (signal 9), rank 1" in table and "in-job restart" in table
    row = "| 1 | 6.7 s | in_job | kill@6:1 | 0.30 s | 1.50 s | 11.50 s | 1.00 s (it 4, local) | 0.50 s | 14.80 s |"
    assert row in table
    as_json = report.to_json(good)
    assert as_json["faults"][0]["steps_lost"] == 1 and as_json["faults"][0]["restart_layers"] == ["in_job"]
    assert as_json["faults"][0]["detection"]["mechanism"] == "launcher_worker_exit"
    assert as_json["restarts_s"] == [pytest.approx(6.7)] and as_json["inprocess_restarts_s"] == []
    assert as_json["restart_phases"][0]["load_s"] == pytest.approx(1.0)
    assert as_json["restart_phases"][0]["teardown_s"] == pytest.approx(0.3)
    assert as_json["provenance"] is None  # not measured: nothing claims a machine
    measured = provenance.collect()
    good.provenance = measured
    assert provenance.Provenance.from_json(json.loads(json.dumps(report.to_json(good)))["provenance"]) == measured
    assert not report.DrillResult(found, timeline, 0, 40.0, 20.0, None, equal=False, differences=["x"]).passed
    assert not report.DrillResult(found, timeline, 1, 40.0, 20.0, None, equal=True).passed
    spurious = report.DrillResult(found, timeline, 0, 40.0, 20.0, None, equal=True, unexplained_restarts=[T0 + 30])
    assert not spurious.passed and "restarts no scheduled fault explains" in report.goodput_lines(spurious)[-1]
    missed = events.outcomes(timeline, [Fault("hang", 3, 1)])
    failed = report.DrillResult(missed, timeline, 0, 40.0, 20.0, None, equal=True)
    assert not failed.passed and "**not detected**" in report.fault_table(failed)
    assert "**unexplained**" in report.fault_table(failed)
    lines = report.goodput_lines(good)
    assert "no goodput summary" in lines[0] and "2.00x" in lines[1] and "1 restart(s) (1 in_job)" in lines[1]


def test_an_undetected_slow_rank_is_reported_with_the_scores_it_got(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch).attempt(0.5)
    for seconds, iteration, score in ((1.0, 56, 1.0), (3.0, 70, 0.92), (5.0, 84, 0.41)):
        run.at(seconds, 0, EventKind.STRAGGLER_REPORT, iteration=iteration, relative_scores={0: 1.0, 1: score})
    run.strike(1.5, Fault("slow", 60, 1, factor=6.0)).step(1.5, 60)
    timeline = run.timeline()
    assert [(it, scores) for _, it, scores in timeline.straggler_reports] == [
        (56, {0: 1.0, 1: 1.0}),
        (70, {0: 1.0, 1: 0.92}),
        (84, {0: 1.0, 1: 0.41}),
    ]
    found = events.outcomes(timeline, schedule.parse("slow@60:1:x6"))
    table = report.fault_table(report.DrillResult(found, timeline, 0, 40.0, 20.0, None, equal=True))
    assert "**not detected**" in table
    assert "slow@60:1:x6: rank 1's relative scores in the straggler reports after it: it 70 0.92, it 84 0.41" in table


def test_skipped_event_lines_are_reported_and_the_rest_is_read(tmp_path, monkeypatch):
    run = _kill_run(tmp_path, monkeypatch)
    with open(tmp_path / event_stream.worker_file(0), "a") as f:
        f.write('{"v": 2, "kind": "step_completed"}\n{"v": 1, "kind": "step_comp')
    timeline = run.timeline()
    assert [p.line for p in timeline.problems] == [11, 12]
    (outcome,) = events.outcomes(timeline, schedule.parse("kill@6:1"))
    assert outcome.ok
    text = report.fault_table(report.DrillResult([outcome], timeline, 0, 40.0, 20.0, None, equal=True))
    assert "event stream: 2 line(s) skipped:" in text and "events-rank0.jsonl:11: unknown version v=2" in text
    assert "events-rank0.jsonl:12: truncated line" in text


def test_the_launchers_start_is_the_runs_time_zero(tmp_path, monkeypatch):
    run = _kill_run(tmp_path, monkeypatch)
    run.at(40.0, "launcher", EventKind.LAUNCHER_STARTED, process_start=T0 + 2.0)
    assert run.timeline().start == pytest.approx(T0 + 2.0)


def test_checkpoint_differences_name_what_differs():
    a = {"sharded.model.w": torch.ones(3), "common.train_state.step": 5}
    assert compare.differences(a, dict(a)) == []
    b = {"sharded.model.w": torch.tensor([1.0, 1.0, 1.5]), "common.train_state.step": 6}
    found = compare.differences(a, b)
    assert any("sharded.model.w: values differ (max abs difference 0.5)" in d for d in found)
    assert any("step: 5 != 6" in d for d in found)
    assert compare.differences(a, {"sharded.model.w": torch.ones(3)}) == [
        "common.train_state.step: only in one of the two"
    ]


def _steps_60_to_69(run: Run) -> Run:
    run.attempt(0.5)
    for i in range(10):
        run.step(1.0 + i * 0.1, 60 + i)
    return run


def test_a_restart_is_claimed_by_one_fault_only_and_within_its_window(tmp_path, monkeypatch):
    # The straggler is reported but never stops the job; the kill's restart must not be credited to it.
    run = _steps_60_to_69(Run(tmp_path, monkeypatch))
    run.strike(1.0, Fault("slow", 60, 1, factor=6.0)).detect(
        2.0, Mechanism.STRAGGLER_SCORE, rank=1, score=0.1, threshold=0.3
    )
    run.strike(3.0, Fault("kill", 70, 0)).worker_died(3.05, 0).relaunch(3.1, 1)
    run.attempt(8.0, restart_count=1).load(9.0, 60).step(9.5, 61)
    slow, kill = events.outcomes(run.timeline(), schedule.parse("slow@60:1:x6,kill@70:0"))
    assert slow.detected is not None and slow.restart is None and not slow.ok
    assert kill.ok and kill.restart is not None and kill.steps_lost == 69 - 60


def test_another_ranks_exit_or_a_planned_exit_is_not_the_detection_of_a_kill_or_a_hang(tmp_path, monkeypatch):
    run = _steps_60_to_69(Run(tmp_path, monkeypatch))
    run.strike(3.0, Fault("kill", 70, 1)).worker_died(3.05, 0, exit_code=-9)
    run.strike(3.1, Fault("stall", 71, 1)).worker_died(3.2, 1, exit_code=21)  # a straggler stop: exit 21
    kill, stall = events.outcomes(run.timeline(), schedule.parse("kill@70:1,stall@71:1"))
    assert kill.detected is None and stall.detected is None


def test_a_nan_followed_by_a_restart_was_not_recovered_in_place(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch).attempt(0.5).strike(1.2, Fault("nan", 12, 1))
    run.detect(1.25, Mechanism.RERUN_NAN, who=1, rank=1, iteration=12).relaunch(2.0, 1)
    run.attempt(8.0, restart_count=1).step(9.0, 12)
    (nan,) = events.outcomes(run.timeline(), schedule.parse("nan@12:1"))
    assert nan.detected is not None and nan.recovered is None and not nan.ok


def test_a_hang_after_a_corrupted_local_checkpoint_loses_only_its_own_steps(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch).attempt(0.5)
    for i in range(8):  # up to iteration 47
        run.step(1.0 + 0.1 * i, 40 + i)
    run.strike(1.55, Fault("corrupt-local", 45, 1)).strike(2.0, Fault("hang", 48, 1))
    run.detect(3.0, Mechanism.RANK_MONITOR_SECTION_TIMEOUT, "launcher", rank=1, section="step", seconds=1.71,
               timeout=0.9)  # fmt: skip
    run.worker_died(3.1, 1).relaunch(3.2, 1).attempt(8.0, restart_count=1)
    run.detect(9.0, Mechanism.LOCAL_CHECKPOINT_HASH, rank=None, iteration=45).load(9.5, 38).step(10.0, 39)
    corrupt, hang = events.outcomes(run.timeline(), schedule.parse("corrupt-local@45:1,hang@48:1"))
    assert (corrupt.resumed_from, corrupt.steps_lost) == (38, 7)
    assert (hang.resumed_from, hang.steps_lost) == (38, 47 - 45)  # 46 and 47; 39..45 are the corruption's
    assert hang.detection_s == pytest.approx(1.0, abs=1e-5)
    assert "section 'step' open 1.71 s > 0.90 s" in hang.detection_line


def test_a_hang_is_detected_by_whichever_rank_monitor_fires_first(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch).attempt(0.5).step(1.0, 46).strike(1.1, Fault("hang", 47, 1))
    run.detect(6.6, Mechanism.RANK_MONITOR_SECTION_TIMEOUT, "launcher", rank=0, section="step")
    run.worker_died(6.65, 0).relaunch(6.7, 1).attempt(9.0, restart_count=1).load(9.5, 40).step(10.0, 41)
    timeline = run.timeline()
    (hang,) = events.outcomes(timeline, schedule.parse("hang@47:1"))
    assert hang.ok and hang.detection_s == pytest.approx(5.5, abs=1e-5) and hang.resumed_from == 40
    assert events.unexplained_restarts(timeline, [hang]) == []


def test_a_stall_is_recovered_by_an_in_process_restart_in_the_same_processes(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch).attempt(0.5)
    for i in range(7):  # up to iteration 46
        run.step(1.0 + 0.1 * i, 40 + i)
    run.strike(1.55, Fault("corrupt-local", 45, 1)).strike(1.8, Fault("stall", 47, 1))
    run.detect(7.8, Mechanism.INPROCESS_SOFT_TIMEOUT, who=1, rank=1, detail="Interruption.SOFT_TIMEOUT")
    for rank, at in ((1, 7.9), (0, 8.0)):  # every rank reports the restart: one restart
        run.at(at, rank, EventKind.RESTART_BEGUN, layer=RestartLayer.IN_PROCESS, inprocess_iteration=1)
    run.at(8.8, 0, EventKind.RESTART_ENDED, layer=RestartLayer.IN_PROCESS, inprocess_iteration=1)
    run.attempt(9.0, inprocess=1)
    run.detect(9.5, Mechanism.LOCAL_CHECKPOINT_HASH, rank=None, iteration=45).load(10.0, 40).step(10.5, 41)
    timeline = run.timeline()
    corrupt, stall = events.outcomes(timeline, schedule.parse("corrupt-local@45:1,stall@47:1"))
    assert stall.ok and not stall.relaunched and [r.layer for r in stall.restarts] == [RestartLayer.IN_PROCESS]
    assert (stall.resumed_from, stall.steps_lost) == (40, 1)  # 46, past the local checkpoint its restart tried
    assert stall.detection_s == pytest.approx(6.0, abs=1e-5) and "SOFT_TIMEOUT" in stall.detection_line
    assert (corrupt.resumed_from, corrupt.steps_lost) == (40, 5)
    (restart,) = timeline.restarts
    phases = restart.phases()
    expected = {"teardown": 0.9, "spawn": 0.2, "setup": 0.5, "load": 0.5, "first_step": 0.5, "total": 2.6}
    assert phases == {k: pytest.approx(v, abs=1e-5) for k, v in expected.items()}
    result = report.DrillResult([corrupt, stall], timeline, 0, 20.0, 10.0, None, equal=True)
    assert "in-process restart in the same processes" in report.fault_table(result)
    assert report.to_json(result)["inprocess_restarts_s"] and not report.to_json(result)["restarts_s"]


def test_without_a_reference_the_drill_cannot_pass(tmp_path, monkeypatch):
    timeline = _kill_run(tmp_path, monkeypatch).timeline()
    found = events.outcomes(timeline, schedule.parse("kill@6:1"))
    unverified = report.DrillResult(found, timeline, 0, 40.0, None, None, equal=None)
    assert not unverified.passed and "NOT COMPARED" in report.equality_line(unverified)


def test_the_drill_refuses_overrides_it_controls_and_a_folder_that_is_not_its_own(tmp_path, capsys):
    from megatron.bridge.drill import cli

    assert cli.main(["--run-dir", str(tmp_path / "a"), "--", "logger.log_interval=5"]) == 2
    assert "logger.log_interval" in capsys.readouterr().err
    precious = tmp_path / "b" / "notes.txt"
    precious.parent.mkdir()
    precious.write_text("keep")
    assert cli.main(["--run-dir", str(precious.parent)]) == 2
    assert precious.read_text() == "keep" and "not an earlier drill's" in capsys.readouterr().err
    assert cli.main(["--run-dir", str(tmp_path / "c"), "--faults", "melt@3:0"]) == 2


@pytest.mark.parametrize("spec", ["slow@90:1:x6", "slow@81:1:x4"])
def test_a_slow_rank_needs_room_to_be_found(spec):
    with pytest.raises(ValueError, match="at most iteration 80"):
        schedule.check(schedule.parse(spec), PLAN)
    with pytest.raises(ValueError, match="2 or more ranks"):
        schedule.check(schedule.parse("slow@20:0:x6"), Plan(100, 1, 20, 5, 6))


def test_a_survivors_in_process_restart_cut_short_by_the_launchers_stop_belongs_to_the_kill(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch).attempt(9.5)
    for i in range(1, 6):
        run.step(10.0 + i, i)
    run.strike(15.5, Fault("kill", 6, 1)).worker_died(15.6, 1)
    run.at(15.7, "launcher", EventKind.RESTART_BEGUN, layer=RestartLayer.IN_JOB, restart_count=1)
    # Rank 0's wrapper saw its peer die and began restarting in place; the launcher's stop ended it (no end event).
    run.detect(15.8, Mechanism.INPROCESS_DEAD_PEER, 0, rank=1)
    run.at(15.9, 0, EventKind.RESTART_BEGUN, layer=RestartLayer.IN_PROCESS, inprocess_iteration=1)
    run.at(16.2, "launcher", EventKind.WORKERS_STOPPED, layer=RestartLayer.IN_JOB, restart_count=1)
    run.at(16.7, "launcher", EventKind.RESTART_ENDED, layer=RestartLayer.IN_JOB, restart_count=1)
    run.attempt(17.0, restart_count=1).load(17.5, 4, took=0.3).step(17.6, 5)
    timeline = run.timeline()
    (outcome,) = events.outcomes(timeline, schedule.parse("kill@6:1"))
    assert [r.layer for r in outcome.restarts] == [RestartLayer.IN_JOB, RestartLayer.IN_PROCESS]
    assert events.unexplained_restarts(timeline, [outcome]) == []
    assert outcome.resumed_from == 4 and outcome.steps_lost == 1 and outcome.recovered == pytest.approx(T0 + 17.6)

    # One that began after the workers were stopped is another matter: reported, never hidden.
    run.at(16.3, 0, EventKind.RESTART_BEGUN, layer=RestartLayer.IN_PROCESS, inprocess_iteration=2)
    later = run.timeline()
    (outcome,) = events.outcomes(later, schedule.parse("kill@6:1"))
    assert events.unexplained_restarts(later, [outcome]) == [pytest.approx(T0 + 16.3)]


def test_a_mutation_is_a_skipped_restore_at_a_checkpoint_a_restart_loads():
    faults = schedule.parse("preempt@38:0,no-rng-restore@38:1,no-data-restore@38:0")  # a preemption's own save
    schedule.check(faults, PLAN)
    assert schedule.worker_faults(faults) == "preempt@38:0,no-rng-restore@38:1,no-data-restore@38:0"
    schedule.check(schedule.parse("no-optimizer-restore@25:1,kill@27:1"), PLAN)  # the local save of 25, then a kill
    with pytest.raises(ValueError, match="none would: schedule preempt@26"):
        schedule.check(schedule.parse("no-optimizer-restore@26:1,kill@27:1"), PLAN)  # no checkpoint of 26
    with pytest.raises(ValueError, match="strikes when a restart loads the checkpoint of iteration 25"):
        schedule.check(schedule.parse("no-optimizer-restore@25:1,kill@31:1"), PLAN)  # 30 is saved first
    with pytest.raises(ValueError, match="there twice"):
        schedule.parse("preempt@38:0,no-rng-restore@38:1,no-rng-restore@38:1")


def test_a_mutation_is_matched_by_its_part_and_left_out_of_the_fault_table(tmp_path, monkeypatch):
    run = _kill_run(tmp_path, monkeypatch)
    faults = schedule.parse("kill@6:1,no-rng-restore@4:1,no-data-restore@4:1")
    run.strike(18.5, Fault("no-rng-restore", 4, 1))  # only the RNG one struck (at the load of 4, rank 1)
    timeline = run.timeline()
    found, mutations = events.outcomes(timeline, faults), events.mutation_outcomes(timeline, faults)
    assert [o.fault.label for o in found] == ["kill@6:1"] and found[0].ok
    assert [(m.fault.label, m.struck) for m in mutations] == [
        ("no-rng-restore@4:1", pytest.approx(T0 + 18.5, abs=0.01)), ("no-data-restore@4:1", None)
    ]  # fmt: skip
    differs = report.DrillResult(found, timeline, 0, 40.0, 20.0, None, equal=False, differences=["x: differ"],
                                 compared=[PartCount("RNG", 1, 2, "2 ranks")], mutations=mutations[:1])  # fmt: skip
    assert not differs.passed and "kill@6:1" in report.fault_table(differs)
    assert "no-rng-restore" not in report.fault_table(differs)
    t0 = timeline.start
    assert report.mutation_lines(differs) == [
        f"mutation no-rng-restore@4:1: struck at {T0 + 18.5 - t0:.1f} s; the final state differs"
    ]
    assert report.equality_line(differs).splitlines() == [
        "final state DIFFERS from the fault-free run (compared 1 tensors and 2 entries: RNG 1 tensor, 2 entries "
        "(2 ranks)):",
        "  - x: differ",
    ]
    missed = report.DrillResult(found, timeline, 0, 40.0, 20.0, None, equal=True, mutations=mutations)
    assert not missed.passed  # the data mutation never struck: the schedule did not play out
    assert "mutation no-data-restore@4:1: never struck" in report.mutation_lines(missed)[1]
    assert "yet the final state is EQUAL: the comparison missed it" in report.mutation_lines(missed)[0]
    as_json = report.to_json(differs)
    assert as_json["mutations"][0]["mutation"] == "no-rng-restore@4:1" and as_json["tensors_compared"] == 1
    assert as_json["compared"] == [{"part": "RNG", "tensors": 1, "entries": 2, "detail": "2 ranks"}]


def test_the_equal_verdict_says_what_was_compared_part_by_part(tmp_path, monkeypatch):
    timeline = _kill_run(tmp_path, monkeypatch).timeline()
    found = events.outcomes(timeline, schedule.parse("kill@6:1"))
    parts = [PartCount("model", 9, 16, "262,720 values"), PartCount("data position", 0, 2)]
    equal = report.DrillResult(found, timeline, 0, 40.0, 20.0, None, equal=True, compared=parts, final_iteration=6)
    assert report.equality_line(equal) == (
        "final state EQUAL to the fault-free run with the same seed: 9 tensors and 18 entries: model 9 tensors, "
        "16 entries (262,720 values); data position 2 entries; bit for bit, at iteration 6"
    )


def test_a_reference_run_is_reused_only_with_the_same_settings(tmp_path, capsys):
    from megatron.bridge.drill import cli

    earlier = tmp_path / "earlier"
    (earlier / "reference").mkdir(parents=True)
    base = ["--train-iters", "10", "--faults", "none", "--data", str(tmp_path / "corpus")]
    assert cli.main([*base, "--run-dir", str(tmp_path / "a"), "--reference-run", str(earlier)]) == 2
    assert "no finished fault-free run there" in capsys.readouterr().err
    args, overrides = cli._args([*base, "--run-dir", str(tmp_path / "a"), "--", "model.hidden_dropout=0.2"])
    settings = {**cli._settings(args, overrides), "wall_s": 12.5}
    (earlier / "reference" / cli.REFERENCE_SETTINGS).write_text(json.dumps(settings))
    assert cli.main([*base, "--run-dir", str(tmp_path / "b"), "--reference-run", str(earlier)]) == 2
    assert "overrides ['model.hidden_dropout=0.2'] there, [] here" in capsys.readouterr().err
    args.reference_run = earlier
    reference_dir, wall, _ = cli._earlier_reference(args, overrides)
    assert (reference_dir, wall) == (earlier / "reference", 12.5)
