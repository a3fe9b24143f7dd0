"""The goodput projection: its formulas against numbers worked out by hand, its inputs read from the files the drill and
a training run really write, and every bad input rejected with a message naming the fix."""

import json
import math
import subprocess
import sys

import pytest

from megatron.bridge.drill import projection as projection_cli
from megatron.bridge.drill import report
from megatron.bridge.drill.events import Outcome, Timeline
from megatron.bridge.drill.projection_model import (
    LLAMA3_405B,
    MeasuredCosts,
    daly,
    goodput,
    project,
    read_costs,
    to_steps,
    validate,
    waste,
    young,
)
from megatron.bridge.training.events.goodput import GoodputTracker
from megatron.bridge.training.faults.spec import Fault

T0 = 1_700_000_000.0

# A case whose numbers come out round (rule "young"): M = 20000 / 4 = 5000 s; half the failures roll back to the
# local tier, so each tier sees an MTBF of 10000 s: tau_g = sqrt(2 * 50 * 10000) = 1000 s = 100 steps,
# tau_l = sqrt(2 * 2 * 10000) = 200 s = 20 steps.
ROUND = MeasuredCosts(
    step_s=10.0,
    global_save_s=50.0,
    local_save_s=2.0,
    global_load_s=60.0,
    local_load_s=20.0,
    injob_detect_s=10.0,
    injob_restart_s=30.0,
    injob_fraction=0.5,
    requeue_s=290.0,
)


def test_young_and_daly_by_hand():
    # C = 60 s, M = 3600 s: Young sqrt(2 * 60 * 3600) = sqrt(432000) = 657.267 s.
    assert young(60.0, 3600.0) == pytest.approx(657.2671, abs=1e-4)
    # Daly: C/2M = 1/120; 657.267 * (1 + sqrt(1/120)/3 + (1/120)/9) - 60 = 657.267 * 1.031355 - 60 = 617.876 s.
    assert daly(60.0, 3600.0) == pytest.approx(617.8756, abs=1e-4)
    # C >= 2M: the interval is M itself.
    assert daly(8000.0, 3600.0) == 3600.0
    assert daly(7200.0, 3600.0) == 3600.0
    # Free checkpoints: checkpoint all the time.
    assert young(0.0, 3600.0) == 0.0 and daly(0.0, 3600.0) == 0.0


def test_waste_and_goodput_by_hand():
    # One tier: C = 60, tau = 600, R = 120, M = 3600: 60/600 + (600/2 + 120)/3600 = 0.1 + 0.116667 = 0.216667.
    w = waste([(60.0, 600.0, 1.0)], 120.0, 3600.0)
    assert w == pytest.approx(0.216667, abs=1e-6)
    assert goodput(w) == pytest.approx(0.783333, abs=1e-6)
    # Two tiers, 25% of failures to global (C 60, tau 1200), 75% to local (C 5, tau 300), R = 100, M = 3600:
    # 60/1200 + 0.25*1200/7200 + 5/300 + 0.75*300/7200 + 100/3600 = 0.05 + 0.041667 + 0.016667 + 0.03125 + 0.027778.
    assert waste([(60.0, 1200.0, 0.25), (5.0, 300.0, 0.75)], 100.0, 3600.0) == pytest.approx(0.167361, abs=1e-6)
    # Waste past 1 is no goodput at all, never a negative one.
    assert goodput(waste([(60.0, 60.0, 1.0)], 7200.0, 3600.0)) == 0.0


def test_llama3_preset_and_its_scaling_with_gpus():
    # 419 unexpected interruptions in 54 days on 16,384 GPUs: 54 * 86400 / 419 = 11135.08 s between them.
    assert LLAMA3_405B.job_mtbf_s == pytest.approx(11135.08, abs=0.01)
    assert LLAMA3_405B.mtbf_gpu_s / 3600 == pytest.approx(50677.0, abs=0.1)  # 11135.08 * 16384 s per GPU
    at = {n: project(MeasuredCosts(), n, LLAMA3_405B.mtbf_gpu_s) for n in (1024, 16384, 100000)}
    assert at[16384].mtbf_s == pytest.approx(11135.08, abs=0.01)
    assert at[16384].failures_per_day == pytest.approx(419 / 54)  # 7.76
    assert at[1024].mtbf_s == pytest.approx(178161.3, abs=0.1)  # 16 times longer
    assert at[100000].mtbf_s == pytest.approx(1824.37, abs=0.01)  # 182437208.6 s / 100000


def test_intervals_round_to_whole_steps_at_least_one():
    assert to_steps(657.267, 10.0) == 66
    assert to_steps(25.0, 10.0) == 3  # 2.5 rounds half up
    assert to_steps(24.9, 10.0) == 2
    assert to_steps(4.0, 10.0) == 1  # 0.4 step: still one
    assert to_steps(0.0, 10.0) == 1


def test_two_tier_projection_by_hand():
    p = project(ROUND, 4, 20000.0, rule="young")
    assert p.mtbf_s == 5000.0
    assert (p.global_s, p.global_steps) == (pytest.approx(1000.0), 100)
    assert (p.local_s, p.local_steps) == (pytest.approx(200.0), 20)
    # R = 0.5 (10 + 30) + 0.5 (10 + 290) + 0.5 * 20 + 0.5 * 60 = 210 s;
    # W = 50/1000 + 0.5*1000/10000 + 2/200 + 0.5*200/10000 + 210/5000 = 0.05 + 0.05 + 0.01 + 0.01 + 0.042 = 0.162.
    assert p.goodput == pytest.approx(0.838)
    # Baseline: tau = sqrt(2 * 50 * 5000) = 707.1 s -> 71 steps = 710 s; R_b = 10 + 290 + 60 = 360 s;
    # W_b = 50/710 + 710/10000 + 360/5000 = 0.070423 + 0.071 + 0.072 = 0.213423.
    assert (p.baseline_s, p.baseline_steps) == (pytest.approx(707.107, abs=1e-3), 71)
    assert p.baseline_goodput == pytest.approx(0.786577, abs=1e-6)
    # Its global tier alone (the local one off) would give W = 50/710 + 710/10000 + (170 + 60)/5000 = 0.187423:
    # worse than 0.162, so the local tier stays on.
    fixed = project(ROUND, 4, 20000.0, rule="young", baseline_steps=50)  # 500 s: 0.1 + 0.05 + 0.072
    assert (fixed.baseline_s, fixed.baseline_goodput) == (500.0, pytest.approx(0.778))


def test_daly_rule_gives_daly_intervals():
    p = project(ROUND, 4, 20000.0)
    assert p.global_s == pytest.approx(daly(50.0, 10000.0)) and p.local_s == pytest.approx(daly(2.0, 10000.0))
    assert p.global_steps == to_steps(daly(50.0, 10000.0), 10.0)


def test_local_tier_is_left_off_when_it_does_not_pay():
    # Local saves as dear as global ones: tau_l = tau_g, so local saves would come no more often than global ones.
    same = MeasuredCosts(**{**ROUND.__dict__, "local_save_s": 50.0})
    p = project(same, 4, 20000.0, rule="young")
    assert (p.local_s, p.local_steps) == (None, None)
    # Every failure then rolls back to the global tier at its single-tier optimum, sqrt(2 * 50 * 5000) = 707 s.
    assert p.global_steps == 71
    assert "local tier off" in projection_cli.overrides(p)
    # Every failure caught by the local tier: no global save is needed against failures.
    local_only = project(MeasuredCosts(**{**ROUND.__dict__, "local_fraction": 1.0}), 4, 20000.0, rule="young")
    assert local_only.global_steps is None and local_only.local_steps == 14  # sqrt(2 * 2 * 5000) = 141 s
    assert projection_cli.overrides(local_only).startswith("(no global save needed)")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"step_s": 0.0}, "--step-s: 0.0 s"),
        ({"step_s": -1.0}, "--step-s"),
        ({"global_save_s": -1.0}, "--global-save-s: -1.0 is negative"),
        ({"requeue_s": -5.0}, "--requeue-s"),
        ({"local_load_s": math.nan}, "--local-load-s: nan is not a finite number"),
        ({"injob_fraction": 1.5}, "--injob-fraction: 1.5 is a share of failures, outside"),
        ({"local_fraction": -0.1}, "--local-fraction"),
        ({"inproc_fraction": 0.6, "injob_fraction": 0.6}, "exceeds 1"),
    ],
)
def test_bad_costs_are_rejected(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as err:
        validate(MeasuredCosts(**change))
    assert "Fix:" in str(err.value)


@pytest.mark.parametrize(
    ("gpus", "mtbf", "baseline", "message"),
    [
        (0, 1e6, None, "--gpus: 0"),
        (-8, 1e6, None, "--gpus"),
        (8, 0.0, None, "--mtbf-gpu-hours"),
        (8, -3600.0, None, "--mtbf-gpu-hours"),
        (8, 1e6, 0, "--baseline-interval-steps"),
    ],
)
def test_bad_job_sizes_and_rates_are_rejected(gpus, mtbf, baseline, message):
    with pytest.raises(ValueError, match=message):
        project(MeasuredCosts(), gpus, mtbf, baseline_steps=baseline)


def _summary(tmp_path, attempts: int) -> dict:
    """A goodput summary.json as a training job writes it: 10 steps of 0.5 s, then (attempts=2) a restart."""
    now = [T0]
    save_dir = str(tmp_path / "ckpt")
    tracker = GoodputTracker("job", "a0", T0, save_dir, rank=0, process_start=T0, clock=lambda: now[0], env={})
    tracker.resume(None, 0, loaded=False)
    now[0] += 2.0
    tracker.step_start()
    for _ in range(10):
        now[0] += 0.5
        tracker.step_end(0.5, kept=True)
    with tracker.saving(10):
        now[0] += 1.0
    entry = tracker.snapshot()
    if attempts == 2:  # dies 3 s later; the next attempt starts 4 s after that and resumes the save of 10
        now[0] += 3.0
        tracker.finish(None, "FAILED", failed=True)
        now[0] += 4.0
        tracker = GoodputTracker("job", "a1", now[0], save_dir, rank=0, process_start=now[0], clock=lambda: now[0])
        tracker.resume(entry, 10, loaded=True)
        now[0] += 1.5
        tracker.step_start()
    tracker.finish(10, "FINISHED (exit code 0)")
    return json.loads((tmp_path / "ckpt" / "goodput" / "summary.json").read_text())


def _drill_report(tmp_path, goodput_summary):
    """A drill_report.json written by the drill's own report module."""
    outcomes = [
        Outcome(Fault("nan", 12, 1), struck=T0 + 4.3, detected=T0 + 4.3, recovered=T0 + 4.5, steps_lost=0),
        Outcome(Fault("kill", 27, 1), T0 + 6.6, T0 + 6.7, T0 + 7.74, resumed_from=25, steps_lost=1),
        Outcome(Fault("preempt", 38, 0), T0 + 9.5, T0 + 9.63, T0 + 11.46, resumed_from=38, steps_lost=0),
        Outcome(Fault("hang", 47, 1), T0 + 12.7, T0 + 18.28, T0 + 19.80, resumed_from=40, steps_lost=1),
        Outcome(Fault("stall", 52, 1), T0 + 21.0, T0 + 23.5, T0 + 24.25, resumed_from=50, steps_lost=2),
        Outcome(Fault("hang", 60, 0), T0 + 30.0),  # never detected: no figure to average
    ]
    result = report.DrillResult(outcomes, Timeline(start=T0), 0, 60.8, 28.9, goodput_summary, True)
    path = tmp_path / "drill_report.json"
    report.save_json(result, path)
    return path


def test_costs_are_read_from_a_drill_report_as_the_drill_writes_it(tmp_path):
    path = _drill_report(tmp_path, _summary(tmp_path, attempts=1))
    values, sources = read_costs(path)
    # The in-job layer: the kill (0.10 s, 1.04 s) and the detected hang (5.58 s, 1.52 s), averaged.
    assert values["injob_detect_s"] == pytest.approx((0.10 + 5.58) / 2, abs=1e-6)
    assert values["injob_restart_s"] == pytest.approx((1.04 + 1.52) / 2, abs=1e-6)
    # The in-process layer: the stall, detected in 2.5 s and recovered in place 0.75 s later.
    assert values["inproc_detect_s"] == pytest.approx(2.5, abs=1e-6)
    assert values["inproc_restart_s"] == pytest.approx(0.75, abs=1e-6)
    assert values["step_s"] == pytest.approx(0.5)  # productive 5.0 s over 10 iterations
    assert set(values) == {"step_s", "injob_detect_s", "injob_restart_s", "inproc_detect_s", "inproc_restart_s"}
    assert "2 hang/kill fault(s)" in sources["injob_detect_s"] and str(path) in sources["step_s"]


def test_costs_are_read_from_a_goodput_summary(tmp_path):
    summary = _summary(tmp_path, attempts=2)
    assert summary["attempts"] == 2 and summary["lost_s"]["restart"] > 0
    values, sources = read_costs(tmp_path / "ckpt" / "goodput" / "summary.json")
    assert values["step_s"] == pytest.approx(0.5)
    assert values["injob_detect_s"] == pytest.approx(summary["lost_s"]["restart"])  # one restart
    assert values["injob_restart_s"] == pytest.approx(summary["lost_s"]["startup"] / 2)  # 2.0 + 1.5 over 2 starts
    assert values["injob_restart_s"] == pytest.approx(1.75)
    assert "lost_s.restart" in sources["injob_detect_s"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        ('{"faults": [', "is not valid JSON"),
        (b"\xff\xfe\x00garbage", "cannot be read"),
        ("[1, 2]", "neither a drill report nor a goodput summary"),
        ('{"faults": [{"kind": "kill"}], "goodput": null}', "lacks a field"),
        ('{"productive_s": 3.0}', "lacks a field"),
    ],
)
def test_a_bad_report_file_is_named_with_the_fix(tmp_path, content, message):
    path = tmp_path / "drill_report.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        read_costs(path)
    assert str(path) in str(err.value) and "python -m megatron.bridge.drill" in str(err.value)


def test_cli_prints_the_table_recommendations_and_sources(tmp_path, capsys):
    path = _drill_report(tmp_path, _summary(tmp_path, attempts=1))
    assert projection_cli.main(["--from", str(path), "--global-save-s", "60", "--local-save-s", "5"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| GPUs | job MTBF") and [r.split(" | ")[0] for r in rows[1:]] == [
        "| 1,024",
        "| 4,096",
        "| 16,384",
        "| 100,000",
    ]
    assert "| 3.09 h | 7.8 |" in rows[3]  # 16,384 GPUs: 11135 s, 419/54 failures a day
    assert "16,384 GPUs: checkpoint.save_interval=" in out and "checkpoint.non_persistent_save_interval=" in out
    assert "global_save_s = 60  (flag --global-save-s)" in out
    assert f"injob_detect_s = 2.84  ({path}: mean detection latency" in out
    assert f"{path} lacks global_load_s, local_load_s, inproc_fraction, injob_fraction" in out


def test_cli_json_output(capsys):
    argv = ["--json", "--gpus", "16384", "--rule", "young", "--step-s", "10", "--global-save-s", "50"]
    assert projection_cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = out["projections"]
    assert row["gpus"] == 16384 and row["mtbf_s"] == pytest.approx(11135.08, abs=0.01)
    assert out["inputs"]["step_s"] == 10.0 and out["sources"]["step_s"] == "flag --step-s"
    assert out["rule"] == "young" and out["mtbf_gpu_hours"] == pytest.approx(50677.0, abs=0.1)
    assert row["baseline_steps"] == to_steps(young(50.0, 11135.0835), 10.0)


def test_mtbf_override_scales_the_job_mtbf(capsys):
    assert projection_cli.main(["--json", "--gpus", "1000", "--mtbf-gpu-hours", "10000"]) == 0
    assert json.loads(capsys.readouterr().out)["projections"][0]["mtbf_s"] == pytest.approx(36000.0)  # 10 h


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--step-s", "0"], "--step-s"),
        (["--injob-fraction", "2"], "--injob-fraction"),
        (["--gpus", "0"], "--gpus"),
        (["--gpus", "1k"], "--gpus"),
        (["--mtbf-gpu-hours", "0"], "--mtbf-gpu-hours"),
        (["--mtbf-gpu-hours", "-2"], "--mtbf-gpu-hours"),
        (["--from", "/nonexistent/drill_report.json"], "/nonexistent/drill_report.json: does not exist"),
    ],
)
def test_cli_bad_input_exits_2_with_one_message(argv, message, capsys):
    assert projection_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Fix:" in err and "Traceback" not in err
    assert err.count("\n") == 1  # one paragraph


def test_module_runs_as_a_command(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "megatron.bridge.drill.projection", "--gpus", "16384"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ok.returncode == 0, ok.stderr
    assert "| 16,384 | 3.09 h |" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "megatron.bridge.drill.projection", "--from", str(tmp_path / "none.json")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr
