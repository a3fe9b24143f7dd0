"""The drill's own logic: schedules are checked, logs are read into detection/recovery, the report tells the truth."""

import datetime

import pytest
import torch

from megatron.bridge.drill import events, report, schedule
from megatron.bridge.drill.schedule import DrillFault, Plan
from megatron.bridge.training.checkpoint import compare

PLAN = Plan(train_iters=100, nproc=2, save_interval=20, local_interval=5, max_restarts=6)
T0 = datetime.datetime(2026, 1, 1, 12, 0, 0).timestamp()


def _w(seconds: float, rank: int, text: str) -> str:
    stamp = datetime.datetime.fromtimestamp(T0 + seconds).strftime("%Y-%m-%d %H:%M:%S,%f")[:23]
    return f"{stamp} [rank{rank}] {text}"


def _l(seconds: float, text: str) -> str:
    stamp = datetime.datetime.fromtimestamp(T0 + seconds).strftime("%Y-%m-%d %H:%M:%S,%f")[:23]
    return f"[{stamp}] [INFO] [ft_launcher1@vm] {text}"


def _step(seconds: float, it: int) -> str:
    return _w(seconds, 0, f"INFO megatron.bridge.training.metrics: iteration {it}/100 | consumed samples 8 | "
                          f"lm loss 4.5 | grad norm 1.0 | lr 1e-3 | step time 0.2000 s")  # fmt: skip


def test_default_schedule_has_one_fault_of_each_kind_and_plays_out():
    faults = schedule.parse("default")  # a stopped rank (hang) only shows the layer under stall's: left to --faults
    assert sorted(f.kind for f in faults) == sorted(set(schedule.KINDS) - {"hang"})
    assert [f.iteration for f in faults] == sorted(f.iteration for f in faults)
    schedule.check(faults, PLAN)
    assert schedule.worker_faults(faults) == "nan@12:1,kill@27:1,sigterm@38:0,corrupt@45:1,stall@47:1,slow@48:1:x20"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("melt@3:0", "bad item"),
        ("kill@0:1", "bad item"),
        ("kill@3", "bad item"),
        ("kill@3:1:x2", "bad item"),
        ("slow@3:1:x200", "bad item"),
        ("kill@5:1,hang@5:0", "same iteration"),
    ],
)
def test_bad_schedules_are_rejected_when_parsed(spec, message):
    with pytest.raises(ValueError, match=message):
        schedule.parse(spec)


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


def _kill_log() -> str:
    return "\n".join(
        [
            _l(0.0, "[default] starting workers for entrypoint: python"),
            _w(
                10.0,
                0,
                "WARNING megatron.bridge.training.checkpointing: no checkpoint found in x; training starts "
                "at iteration 0",
            ),  # fmt: skip
            *[_step(10.0 + i, i) for i in range(1, 6)],
            _w(15.5, 1, "ERROR megatron.bridge.training.fault_injection: fault injection: kill at iteration 6"),
            _l(15.6, "failed (exitcode: -9) local_rank: 1 (pid: 9) of binary: python"),
            _l(15.7, "[default] Worker group UNHEALTHY. 3/3 attempts left; will restart worker group"),
            _w(
                30.0,
                0,
                "INFO megatron.bridge.training.checkpoint.local_tier: loaded verified local checkpoint at "
                "iteration 4 from /l (0 of 2 ranks' shards fetched from replicas)",
            ),  # fmt: skip
            _step(30.5, 5),
            _step(31.0, 6),
        ]
    )


def test_a_killed_rank_is_matched_with_its_detection_restart_and_recovery():
    timeline = events.parse_log(_kill_log())
    ledger = [{"kind": "kill", "iteration": 6, "rank": 1, "time": T0 + 15.5}]
    (outcome,) = events.outcomes(timeline, schedule.parse("kill@6:1"), ledger)
    assert outcome.ok
    assert outcome.detection_s == pytest.approx(0.1, abs=1e-3)
    assert outcome.recovery_s == pytest.approx(30.5 - 15.6, abs=1e-3)
    assert (outcome.resumed_from, outcome.steps_lost) == (4, 1)  # iteration 5 was done, then redone
    assert timeline.resumes == [(pytest.approx(T0 + 10.0), 0), (pytest.approx(T0 + 30.0), 4)]
    assert events.unexplained_restarts(timeline, [outcome]) == []


def test_a_fault_that_never_struck_or_was_never_detected_is_not_ok():
    timeline = events.parse_log(_kill_log())
    never = events.outcomes(timeline, schedule.parse("kill@6:1"), ledger=[])
    assert not never[0].ok and never[0].struck is None
    undetected = events.outcomes(timeline, schedule.parse("hang@3:1"), [{"kind": "hang", "iteration": 3, "rank": 1,
                                                                          "time": T0 + 16.0}])  # fmt: skip
    assert undetected[0].detected is None and not undetected[0].ok
    # The kill's restart is then unexplained: it is reported, not hidden.
    assert len(events.unexplained_restarts(timeline, undetected)) == 1


def test_a_transient_nan_is_recovered_in_place():
    log = "\n".join(
        [
            _step(1.0, 11),
            _w(1.2, 1, "ERROR megatron.bridge.training.fault_injection: fault injection: nan forward output"),
            _w(1.25, 1, "ERROR megatron.core.rerun_state_machine: Unexpected result nan on rank 1 at iteration #12"),
            _step(1.6, 12),
        ]
    )
    ledger = [{"kind": "nan", "iteration": 12, "rank": 1, "time": T0 + 1.2}]
    (outcome,) = events.outcomes(events.parse_log(log), schedule.parse("nan@12:1"), ledger)
    assert outcome.ok and outcome.restart is None and outcome.steps_lost == 0
    assert outcome.recovery_s == pytest.approx(0.35, abs=1e-3)


def test_a_corrupted_local_checkpoint_counts_the_steps_the_fallback_lost():
    log = "\n".join(
        [
            _step(1.0, 47),
            _l(3.0, "[default] Worker group UNHEALTHY. 3/3 attempts left; will restart worker group"),
            _w(
                20.0,
                0,
                "ERROR megatron.bridge.training.checkpoint.local_tier: local checkpoint at iteration 45 "
                "failed verification (1 problem(s)): bad hash",
            ),  # fmt: skip
            _w(
                20.5,
                0,
                "INFO megatron.bridge.training.checkpointing: successfully loaded verified checkpoint "
                "/c/iter_0000040 at iteration 40",
            ),  # fmt: skip
            _step(21.0, 41),
        ]
    )
    ledger = [{"kind": "corrupt", "iteration": 45, "rank": 1, "time": T0 + 0.5}]
    (outcome,) = events.outcomes(events.parse_log(log), schedule.parse("corrupt-local@45:1"), ledger)
    assert outcome.ok and (outcome.resumed_from, outcome.steps_lost) == (40, 5)
    assert outcome.detection_s == pytest.approx(19.5, abs=1e-3)


def test_the_report_says_failed_when_a_fault_was_missed_or_the_state_differs():
    timeline = events.parse_log(_kill_log())
    found = events.outcomes(timeline, schedule.parse("kill@6:1"), [{"kind": "kill", "iteration": 6, "rank": 1,
                                                                     "time": T0 + 15.5}])  # fmt: skip
    good = report.DrillResult(found, timeline, 0, 40.0, 20.0, None, equal=True, tensors_compared=12)
    assert good.passed
    table = report.fault_table(good)
    assert "kill@6:1" in table and "iteration 4" in table and "not detected" not in table
    assert report.to_json(good)["faults"][0]["steps_lost"] == 1
    assert not report.DrillResult(found, timeline, 0, 40.0, 20.0, None, equal=False, differences=["x"]).passed
    assert not report.DrillResult(found, timeline, 1, 40.0, 20.0, None, equal=True).passed
    spurious = report.DrillResult(found, timeline, 0, 40.0, 20.0, None, equal=True, unexplained_restarts=[T0 + 30])
    assert not spurious.passed and "restarts no scheduled fault explains" in report.goodput_lines(spurious)[-1]
    missed = events.outcomes(timeline, [DrillFault("hang", 3, 1)], [])
    failed = report.DrillResult(missed, timeline, 0, 40.0, 20.0, None, equal=True)
    assert not failed.passed and "**not detected**" in report.fault_table(failed)
    lines = report.goodput_lines(good)
    assert "no goodput summary" in lines[0] and "2.00x" in lines[1]


def test_an_undetected_slow_rank_is_reported_with_the_scores_it_got():
    from megatron.bridge.training import nvrx_straggler as straggler

    def report_at(seconds: float, iteration: int, score: float) -> str:
        block = straggler.ScoreBlock("GPU relative performance", "t", {0: 1.0, 1: score}, 0.3)
        text = straggler.StragglerReport(iteration, straggler.WALL_TIME_SOURCE, [block], {0: "vm", 1: "vm"}).format(5)
        return _w(seconds, 0, f"INFO megatron.bridge.training.nvrx_straggler: {text}")

    log = "\n".join([report_at(1.0, 56, 1.0), _step(1.5, 60), report_at(3.0, 70, 0.92), report_at(5.0, 84, 0.41)])
    timeline = events.parse_log(log)
    assert [(it, scores) for _, it, scores in timeline.straggler_reports] == [
        (56, {0: 1.0, 1: 1.0}),
        (70, {0: 1.0, 1: 0.92}),
        (84, {0: 1.0, 1: 0.41}),
    ]
    ledger = [{"kind": "slow", "iteration": 60, "rank": 1, "time": T0 + 1.5}]
    found = events.outcomes(timeline, schedule.parse("slow@60:1:x6"), ledger)
    table = report.fault_table(report.DrillResult(found, timeline, 0, 40.0, 20.0, None, equal=True))
    assert "**not detected**" in table
    assert "slow@60:1:x6: rank 1's relative scores in the straggler reports after it: it 70 0.92, it 84 0.41" in table


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


def _restart_log(*middle: str) -> str:
    return "\n".join([*[_step(1.0 + i * 0.1, 60 + i) for i in range(10)], *middle])


def test_a_restart_is_claimed_by_one_fault_only_and_within_its_window():
    # The straggler is reported but never stops the job; the kill's restart must not be credited to it.
    log = _restart_log(
        _w(2.0, 0, "WARNING x: Straggler detected: Rank=1 Node=vm GPU relative performance Score=0.1 < 0.3"),
        _l(3.05, "failed (exitcode: -9) local_rank: 0 (pid: 9) of binary: python"),
        _l(3.1, "[default] Worker group UNHEALTHY. 3/3 attempts left; will restart worker group"),
        _w(9.0, 0, "INFO x: successfully loaded verified checkpoint /c/iter_0000060 at iteration 60"),
        _step(9.5, 61),
    )
    ledger = [
        {"kind": "slow", "iteration": 60, "rank": 1, "time": T0 + 1.0},
        {"kind": "kill", "iteration": 70, "rank": 0, "time": T0 + 3.0},
    ]
    slow, kill = events.outcomes(events.parse_log(log), schedule.parse("slow@60:1:x6,kill@70:0"), ledger)
    assert slow.detected is not None and slow.restart is None and not slow.ok
    assert kill.ok and kill.restart is not None and kill.steps_lost == 69 - 60


def test_another_ranks_exit_is_not_the_detection_of_a_kill():
    log = _restart_log(_l(3.05, "failed (exitcode: 1) local_rank: 0 (pid: 9) of binary: python"))
    (kill,) = events.outcomes(events.parse_log(log), schedule.parse("kill@70:1"),
                              [{"kind": "kill", "iteration": 70, "rank": 1, "time": T0 + 3.0}])  # fmt: skip
    assert kill.detected is None and not kill.ok


def test_a_nan_followed_by_a_restart_was_not_recovered_in_place():
    log = "\n".join(
        [
            _w(1.25, 1, "ERROR m: Unexpected result nan on rank 1 at iteration #12 invocation #1"),
            _l(2.0, "[default] Worker group FAILED. 3/3 attempts left; will restart worker group"),
            _step(9.0, 12),
        ]
    )
    (nan,) = events.outcomes(events.parse_log(log), schedule.parse("nan@12:1"),
                             [{"kind": "nan", "iteration": 12, "rank": 1, "time": T0 + 1.2}])  # fmt: skip
    assert nan.detected is not None and nan.recovered is None and not nan.ok


def test_a_detection_stamped_in_the_same_millisecond_as_the_strike_counts():
    log = "\n".join([_w(1.2, 1, "ERROR m: Unexpected result nan on rank 1 at iteration #12 invocation #1"),
                     _step(1.6, 12)])  # fmt: skip
    (nan,) = events.outcomes(events.parse_log(log), schedule.parse("nan@12:1"),
                             [{"kind": "nan", "iteration": 12, "rank": 1, "time": T0 + 1.2004}])  # fmt: skip
    assert nan.ok


def test_a_hang_after_a_corrupted_local_checkpoint_loses_only_its_own_steps():
    log = "\n".join(
        [
            *[_step(1.0 + 0.1 * i, 40 + i) for i in range(8)],  # up to iteration 47
            _w(2.0, 0, "ERROR m: fault injection: hang at iteration 48"),
            _l(3.0, "[WARNING] [RankMonServer7@vm:1] Section 'step' has been open for 1.71 seconds. Timeout is 0.9"),
            _l(3.2, "[default] Worker group UNHEALTHY. 3/3 attempts left; will restart worker group"),
            _w(9.0, 0, "ERROR m: local checkpoint at iteration 45 failed verification (1 problem(s)): hash"),
            _w(9.5, 0, "INFO m: successfully loaded verified checkpoint /c/iter_0000038 at iteration 38"),
            _step(10.0, 39),
        ]
    )
    ledger = [
        {"kind": "corrupt", "iteration": 45, "rank": 1, "time": T0 + 1.55},
        {"kind": "hang", "iteration": 48, "rank": 1, "time": T0 + 2.0},
    ]
    corrupt, hang = events.outcomes(events.parse_log(log), schedule.parse("corrupt-local@45:1,hang@48:1"), ledger)
    assert (corrupt.resumed_from, corrupt.steps_lost) == (38, 7)
    assert (hang.resumed_from, hang.steps_lost) == (38, 47 - 45)  # 46 and 47; 39..45 are the corruption's
    assert hang.detection_s == pytest.approx(1.0, abs=1e-3)


def test_a_hang_is_detected_by_whichever_rank_monitor_fires_first():
    log = "\n".join(
        [
            _step(1.0, 46),
            _w(1.1, 1, "ERROR m: fault injection: hang at iteration 47"),
            _l(6.6, "[WARNING] [RankMonServer7@vm:0] Section 'step' has been open for 5.51 seconds. Timeout is 5.08"),
            _l(6.7, "[default] Worker group UNHEALTHY. 3/3 attempts left; will restart worker group"),
            _w(9.5, 0, "INFO m: successfully loaded verified checkpoint /c/iter_0000040 at iteration 40"),
            _step(10.0, 41),
        ]
    )
    ledger = [{"kind": "hang", "iteration": 47, "rank": 1, "time": T0 + 1.1}]
    (hang,) = events.outcomes(events.parse_log(log), schedule.parse("hang@47:1"), ledger)
    assert hang.ok and hang.detection_s == pytest.approx(5.5, abs=1e-3) and hang.resumed_from == 40
    assert events.unexplained_restarts(events.parse_log(log), [hang]) == []


def test_without_a_reference_the_drill_cannot_pass():
    timeline = events.parse_log(_kill_log())
    found = events.outcomes(timeline, schedule.parse("kill@6:1"), [{"kind": "kill", "iteration": 6, "rank": 1,
                                                                     "time": T0 + 15.5}])  # fmt: skip
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


@pytest.mark.parametrize("spec", ["slow@90:1:x6", "slow@81:1"])
def test_a_slow_rank_needs_room_to_be_found(spec):
    with pytest.raises(ValueError, match="at most iteration 80"):
        schedule.check(schedule.parse(spec), PLAN)
    with pytest.raises(ValueError, match="2 or more ranks"):
        schedule.check(schedule.parse("slow@20:0"), Plan(100, 1, 20, 5, 6))
