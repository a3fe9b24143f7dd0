"""Tests for benchmarks/report.py, benchmarks/_result.py and the parts of benchmark scripts that need no run: result
lines (ratios, fixed goals in seconds, what was not tried), failure rows, discovery, the table, the JUnit outcomes
of environment_faults."""

import importlib.util
import io
import json
import sys
import textwrap
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def result():
    return _load("_result")


@pytest.fixture(scope="module")
def report():
    sys.path.insert(0, str(BENCH_DIR))  # report.py imports its sibling `_result`, as when run as a script
    try:
        return _load("report")
    finally:
        sys.path.remove(str(BENCH_DIR))


def _run(report, stdout="", stderr="", returncode=0, name="bench", seconds=1.0):
    return report.ScriptRun(name, returncode, stdout, stderr, seconds)


# --- result lines ---------------------------------------------------------------------------------------------


def test_format_then_parse_round_trips(result):
    line = result.format_result("save_blocking", "async / sync", 0.0712345, "0.012 s", "0.171 s (sync)", "<= 0.10")
    assert line.startswith("BENCHMARK_RESULT {")
    assert "\n" not in line
    record = result.parse_result(line)
    assert record == {
        "benchmark": "save_blocking",
        "metric": "async / sync",
        "ratio": 0.07123,  # four significant digits
        "measured": "0.012 s",
        "baseline": "0.171 s (sync)",
        "target": "<= 0.10",
        "met": True,
        "tried": True,
        "spread": None,
    }


@pytest.mark.parametrize(
    ("ratio", "target", "met"),
    [
        (0.05, "<= 0.10", True),
        (0.10, "<= 0.10", True),
        (0.11, "<= 0.10", False),
        (7.0, ">= 5", True),
        (4.9, ">= 5", False),
        (0.5, "< 1e-2", False),
        (None, "<= 1.0", False),
        (float("nan"), "<= 1.0", False),
        (3.0, "n/a", None),
        (None, "n/a", None),
    ],
)
def test_met_is_computed_from_the_target(result, ratio, target, met):
    assert result.target_met(ratio, target) is met
    assert result.parse_result(result.format_result("b", "m", ratio, "x", "y", target))["met"] is met


def test_explicit_met_overrides_the_target(result):
    line = result.format_result("b", "m", 0.5, "x", "y", "<= 0.1", met=True)
    assert result.parse_result(line)["met"] is True


def test_non_finite_ratio_becomes_null(result):
    line = result.format_result("b", "m", float("inf"), "x", "y")
    assert json.loads(line.split(" ", 1)[1])["ratio"] is None


def test_parse_ignores_other_lines(result):
    assert result.parse_result("RATIO async/sync blocking = 0.070 (target <= 0.10)") is None
    assert result.parse_result("") is None
    assert result.parse_result("  | mode | us/step |") is None
    assert result.parse_result("BENCHMARK_RESULTS are below") is None


def test_parse_fills_optional_fields_and_tolerates_whitespace(result):
    record = result.parse_result('  BENCHMARK_RESULT   {"benchmark": "b", "metric": "m", "ratio": 2}  \n')
    assert record == {
        "benchmark": "b",
        "metric": "m",
        "ratio": 2,
        "measured": "",
        "baseline": "",
        "target": "n/a",
        "met": None,
        "tried": True,
        "spread": None,
    }


@pytest.mark.parametrize(
    "line",
    [
        "BENCHMARK_RESULT {not json",
        'BENCHMARK_RESULT {"metric": "m", "ratio": 1}',
        'BENCHMARK_RESULT {"benchmark": "b", "ratio": 1}',
        'BENCHMARK_RESULT {"benchmark": "b", "metric": "m", "ratio": "fast"}',
        'BENCHMARK_RESULT ["b", "m"]',
        'BENCHMARK_RESULT {"benchmark": "b", "metric": "m", "ratio": 1, "tried": "no"}',
    ],
)
def test_parse_rejects_malformed_result_lines(result, line):
    with pytest.raises(ValueError):
        result.parse_result(line)


@pytest.mark.parametrize(("seconds", "met"), [(2.4, True), (3.0, True), (3.1, False), (None, False)])
def test_a_fixed_goal_is_reported_in_seconds_not_as_a_ratio(result, seconds, met):
    record = result.parse_result(result.format_goal("layered_recovery", "kill recovery", seconds, 3.0, "exit -> step"))
    assert record["ratio"] is None  # a goal is not a measured baseline: nothing is divided by it
    assert record["metric"] == "kill recovery (s)"
    assert record["baseline"] == result.FIXED_GOAL and "not measured" in record["baseline"]
    assert record["target"] == "<= 3 s"
    assert record["met"] is met
    assert record["measured"] == ("not measured" if seconds is None else f"{seconds:.2f} s") + " (exit -> step)"


def test_what_was_not_tried_is_a_line_with_its_reason(result):
    line = result.format_not_tried("environment_faults", "test_host_faults.py::test_oom", "skipped: needs root")
    record = result.parse_result(line)
    assert record["tried"] is False and record["met"] is False and record["ratio"] is None
    assert record["metric"] == "test_host_faults.py::test_oom"
    assert record["measured"] == "skipped: needs root"


# --- rows of a run --------------------------------------------------------------------------------------------


def test_rows_come_from_the_result_lines_only(report, result):
    stdout = "\n".join(
        [
            "model hidden=512 layers=4",
            result.format_result("bench", "first", 0.07, "1 s", "2 s", "<= 0.10"),
            "RATIO something = 0.5",
            result.format_result("bench", "second", 3.0, "3 s", "1 s"),
        ]
    )
    rows = report.rows_for(_run(report, stdout))
    assert [row["metric"] for row in rows] == ["first", "second"]
    assert [row["met"] for row in rows] == [True, None]
    assert not any(row.get("failed") for row in rows)


def test_a_failed_script_gets_a_failure_row_with_its_last_error_line(report):
    stderr = "Traceback (most recent call last):\n  ...\nRuntimeError: training failed (1)\n\n"
    rows = report.rows_for(_run(report, "partial human output\n", stderr, returncode=1, name="save_blocking"))
    assert len(rows) == 1
    assert rows[0]["failed"] is True
    assert rows[0]["benchmark"] == "save_blocking"
    assert rows[0]["met"] is False
    assert "exit code 1" in rows[0]["metric"]
    assert "RuntimeError: training failed (1)" in rows[0]["metric"]


def test_a_failed_script_keeps_the_results_it_printed(report, result):
    stdout = result.format_result("bench", "measured before the crash", 0.2, "x", "y") + "\n"
    rows = report.rows_for(_run(report, stdout, "boom", returncode=3))
    assert [row.get("failed", False) for row in rows] == [False, True]
    assert "exit code 3: boom" in rows[1]["metric"]


def test_a_script_without_result_lines_gets_a_failure_row(report):
    rows = report.rows_for(_run(report, "only free-form text\nRATIO x = 1\n", returncode=0, name="quiet"))
    assert len(rows) == 1 and rows[0]["failed"] is True
    assert rows[0]["benchmark"] == "quiet"
    assert "no BENCHMARK_RESULT line" in rows[0]["metric"]


def test_a_timed_out_script_gets_a_failure_row(report):
    rows = report.rows_for(_run(report, "", "", returncode=None, name="slow", seconds=1800.4))
    assert len(rows) == 1 and rows[0]["failed"] is True
    assert "timed out after 1800 s" in rows[0]["metric"]


def test_a_malformed_result_line_gets_a_failure_row(report, result):
    stdout = "BENCHMARK_RESULT {broken\n" + result.format_result("bench", "ok", 1.0, "x", "y") + "\n"
    rows = report.rows_for(_run(report, stdout))
    assert rows[0]["failed"] is True and "invalid JSON" in rows[0]["metric"]
    assert rows[1]["metric"] == "ok" and not rows[1].get("failed")


# --- table ----------------------------------------------------------------------------------------------------


def test_table_has_one_line_per_row_in_column_order(report, result):
    rows = [
        result.parse_result(result.format_result("save_blocking", "async / sync", 0.0712, "0.012 s", "0.171 s")),
        result.parse_result(result.format_result("local", "global / local", 4.0, "a", "b", ">= 5")),
        report.failure_row("hang_detection", "exit code 1: boom"),
    ]
    lines = report.format_table(rows).splitlines()
    assert lines[0] == "| benchmark | metric | measured | baseline | ratio | target | met | vs last recorded |"
    assert lines[1] == "|---|---|---|---|---|---|---|---|"
    assert len(lines) == 5
    assert lines[2] == "| save_blocking | async / sync | 0.012 s | 0.171 s | 0.0712 | n/a | n/a |  |"
    assert lines[3] == "| local | global / local | a | b | 4 | >= 5 | **no** |  |"
    assert lines[4].startswith("| hang_detection | FAILED: exit code 1: boom |")
    assert lines[4].endswith("| n/a |  | **FAILED** |  |")


def test_what_was_not_tried_is_marked_in_the_table_and_listed_under_it(report, result):
    tried = result.format_goal("environment_faults", "held port: detection", 0.8, 60.0)
    untried = result.format_not_tried("environment_faults", "test_host_faults::test_oom", "skipped: needs root")
    rows = report.rows_for(_run(report, f"{tried}\n{untried}\n", name="environment_faults"))
    assert not any(row.get("failed") for row in rows)
    table = report.format_table(rows).splitlines()
    assert table[2].endswith("| n/a | <= 60 s | yes |  |")
    assert table[3].endswith("| **not tried** |  |")
    text = report.format_report(rows, [_run(report, name="environment_faults")], [("hostname", "h1")])
    assert "Not tried here, or failed (1):" in text
    assert "- environment_faults: test_host_faults::test_oom: skipped: needs root" in text
    assert "Not tried" not in report.format_report(rows[:1], [], [])


def test_table_cells_escape_pipes_and_newlines(report):
    row = report.failure_row("b", "exit code 1: a | b\nsecond line")
    cells = report.format_table([row]).splitlines()[2]
    assert "a \\| b second line" in cells
    assert cells.count(" | ") == 7  # eight cells: the escaped pipe does not split a cell


def test_report_has_table_wall_time_and_machine_section(report, result):
    rows = report.rows_for(_run(report, result.format_result("bench", "m", 1.5, "x", "y"), name="bench"))
    text = report.format_report(rows, [_run(report, name="bench", seconds=12.3)], [("hostname", "h1"), ("GPU", "none")])
    assert text.index("| benchmark |") < text.index("## Machine")
    assert "Wall time: 12 s for 1 benchmark(s) (bench 12 s)." in text
    assert "- hostname: h1\n- GPU: none\n" in text


def test_machine_info_names_every_required_field(report):
    names = [name for name, _ in report.machine_info()]
    for required in ("CPU", "RAM", "GPU", "python", "torch", "megatron-core", "nvidia-resiliency-ext", "git commit"):
        assert required in names
    assert names[-1] == "date"


# --- environment_faults: the drills that were not tried ------------------------------------------------------

_JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.functional_tests.training.test_host_faults" name="test_port" time="3.1"/>
<testcase classname="tests.functional_tests.training.test_host_faults" name="test_oom" time="0.01">
<skipped type="pytest.skip" message="needs root and the cgroup v1 memory controller">skip text</skipped></testcase>
<testcase classname="tests.functional_tests.training.test_storage_faults" name="test_full[async]" time="9">
<failure message="AssertionError: exit 1&#10;second line">traceback</failure></testcase>
<testcase classname="tests.functional_tests.training.test_storage_faults" name="test_slow" time="1">
<error message="failed on setup with &quot;Failed: CI must run this drill: no losetup&quot;">x</error></testcase>
</testsuite></testsuites>"""


def test_environment_faults_lists_every_drill_that_skipped_or_failed_with_its_reason():
    sys.path.insert(0, str(BENCH_DIR))
    try:
        environment_faults = _load("environment_faults")
    finally:
        sys.path.remove(str(BENCH_DIR))
    found = environment_faults.untried(_JUNIT)
    assert [(u.test, u.outcome) for u in found] == [
        ("test_host_faults::test_oom", "skipped"),
        ("test_storage_faults::test_full[async]", "failed"),
        ("test_storage_faults::test_slow", "failed"),
    ]
    assert found[0].reason == "needs root and the cgroup v1 memory controller"
    assert found[1].reason == "AssertionError: exit 1"  # the first line
    assert "CI must run this drill" in found[2].reason


# --- discovery and selection ----------------------------------------------------------------------------------


def test_discovery_excludes_private_modules_and_the_report(report, tmp_path):
    for name in ("b_bench.py", "a_bench.py", "_result.py", "__init__.py", "report.py", "notes.txt"):
        (tmp_path / name).write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "nested.py").write_text("")
    assert [p.name for p in report.discover(tmp_path)] == ["a_bench.py", "b_bench.py"]


def test_discovery_of_the_real_folder_finds_the_benchmarks(report):
    names = [p.stem for p in report.discover()]
    assert "save_blocking" in names and "hang_detection" in names
    assert "report" not in names and not any(name.startswith("_") for name in names)


def test_select_by_comma_separated_or_repeated_names(report, tmp_path):
    scripts = [tmp_path / f"{name}.py" for name in ("a", "b", "c")]
    assert report.select(scripts, None) == scripts
    assert [p.stem for p in report.select(scripts, ["c,a"])] == ["a", "c"]
    assert [p.stem for p in report.select(scripts, ["b.py", "c"])] == ["b", "c"]
    with pytest.raises(ValueError, match="unknown benchmark"):
        report.select(scripts, ["a,zzz"])


# --- a real subprocess ----------------------------------------------------------------------------------------


def test_run_script_captures_output_exit_code_and_progress(report, tmp_path):
    script = tmp_path / "fake_bench.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            print("human line")
            print('BENCHMARK_RESULT {"benchmark": "fake_bench", "metric": "m", "ratio": 0.5}')
            print("bad news", file=sys.stderr)
            sys.exit(4)
            """
        )
    )
    log = io.StringIO()
    run = report.run_script(script, "[1/1] fake_bench", timeout=60, log=log)
    assert run.name == "fake_bench" and run.returncode == 4
    assert "human line" in run.stdout and run.stderr.strip() == "bad news"
    assert "[1/1] fake_bench: done in" in log.getvalue() and "(exit 4)" in log.getvalue()
    rows = report.rows_for(run)
    assert rows[0]["ratio"] == 0.5 and rows[1]["failed"] is True


def test_run_script_kills_a_script_past_its_timeout(report, tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    log = io.StringIO()
    run = report.run_script(script, "hangs", timeout=2, log=log)
    assert run.returncode is None
    assert run.seconds < 30
    assert "started" in run.stdout
    assert "timed out" in report.rows_for(run)[0]["metric"]
    assert "hangs: done in" in log.getvalue() and "(timed out)" in log.getvalue()


def test_main_reports_every_script_and_exits_non_zero_when_one_fails(report, tmp_path, monkeypatch, capsys):
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text('print(\'BENCHMARK_RESULT {"benchmark": "good", "metric": "m", "ratio": 0.5}\')\n')
    bad.write_text("raise SystemExit('training failed (1)')\n")
    monkeypatch.setattr(report, "discover", lambda: [bad, good])
    monkeypatch.setattr(report, "machine_info", lambda: [("hostname", "test-host")])
    output = tmp_path / "report.md"
    history = tmp_path / "history.jsonl"
    assert report.main(["--output", str(output), "--history", str(history)]) == 1
    captured = capsys.readouterr()
    assert captured.out == output.read_text()
    table = [line for line in captured.out.splitlines() if line.startswith("| bad") or line.startswith("| good")]
    assert table[0].startswith("| bad | FAILED: exit code 1: training failed (1) |")
    assert table[1] == "| good | m |  |  | 0.5 | n/a | n/a | first record |"
    assert "- hostname: test-host" in captured.out
    assert "1 benchmark(s) failed or printed no result: bad" in captured.err
    assert report.main(["--only", "good", "--history", str(history), "--no-record"]) == 0
    assert [json.loads(line)["benchmark"] for line in history.read_text().splitlines()] == ["good"]  # bad: no figure


# --- history --------------------------------------------------------------------------------------------------


@pytest.fixture
def history():
    return _load("_history")


def _row(result, ratio, target="<= 0.1", spread=None, metric="m"):
    return result.parse_result(result.format_result("b", metric, ratio, "x", "y", target, spread=spread))


def test_a_figure_worse_than_the_last_by_more_than_its_spread_is_marked(history, result, tmp_path):
    path = tmp_path / "history.jsonl"
    assert history.compare(_row(result, 0.05), history.load(path), "cpu") == "first record"
    history.record([_row(result, 0.05)], "cpu", "aaaaaaaa1", "d1", path)
    assert "spread unknown" in history.compare(_row(result, 0.09), history.load(path), "cpu")
    assert history.compare(_row(result, 0.09, spread=0.01), history.load(path), "cpu").startswith("**WORSE**")
    assert history.compare(_row(result, 0.055, spread=0.01), history.load(path), "cpu").startswith("same")
    assert history.compare(_row(result, 0.01, spread=0.01), history.load(path), "cpu").startswith("better")
    history.record([_row(result, 0.06)], "cpu", "bbbbbbbb2", "d2", path)  # two records: their range is the spread
    verdict = history.compare(_row(result, 0.08), history.load(path), "cpu")
    assert verdict.startswith("**WORSE**") and "last 0.06 (bbbbbbbb)" in verdict and "spread 0.01" in verdict
    assert history.compare(_row(result, 0.065), history.load(path), "cpu").startswith("same")
    assert history.compare(_row(result, 0.5), history.load(path), "another machine") == "first record"
    higher_better = _row(result, 3.0, target=">= 5", spread=0.1, metric="speed")
    history.record([_row(result, 4.0, target=">= 5", metric="speed")], "cpu", "c", "d", path)
    assert history.compare(higher_better, history.load(path), "cpu").startswith("**WORSE**")
    assert "not judged" in history.compare(_row(result, 1.0, target="n/a"), history.load(path), "cpu")


def test_fixed_goal_times_are_recorded_and_untried_rows_are_not(history, result, tmp_path):
    path = tmp_path / "history.jsonl"
    goal = result.parse_result(result.format_goal("env", "held port: detection", 0.8, 60.0))
    untried = result.parse_result(result.format_not_tried("env", "oom", "skipped: needs root"))
    assert history.value_of(goal) == 0.8 and history.value_of(untried) is None
    assert history.record([goal, untried], "cpu", "c", "d", path) == 1
    assert [r["metric"] for r in history.load(path)] == [goal["metric"]]
    path.write_text("{broken\n")
    with pytest.raises(ValueError, match="history.jsonl:1 is not a JSON line"):
        history.load(path)
