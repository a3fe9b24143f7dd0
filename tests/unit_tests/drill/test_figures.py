"""The drill figures in the README and the docs are rendered from the committed drill report, never typed in."""

import json

import pytest

from megatron.bridge.drill import figures
from megatron.bridge.utils import provenance


def _report(**over):
    prov = provenance.Provenance(
        date="2026-11-27T06:30:00+00:00", cpu="Test CPU x 2 logical CPUs", ram="23.4 GiB", gpu="none", os="Linux",
        python="3.11.2", packages={"torch": "2.13.0"}, commit="abc1234",
    )  # fmt: skip
    report = {
        "passed": True, "equal": True, "wall_s": 18.25, "reference_wall_s": 9.5,
        "goodput": {"goodput": 0.5123}, "reference_goodput": {"goodput": 0.6011},
        "faults": [
            {"kind": "kill", "detected": True, "recovered": True, "recovery_time_s": 0.812,
             "detection_latency_s": 0.05},
            {"kind": "stall", "detected": True, "recovered": True, "recovery_time_s": 0.31,
             "detection_latency_s": 2.91},
        ],
        "provenance": prov.to_json(),
    }  # fmt: skip
    report.update(over)
    return report


def _snapshot(tmp_path, report, text="| fault | ... |\ndrill PASSED\n"):
    (tmp_path / "drill_report.json").write_text(json.dumps(report))
    (tmp_path / "drill_report.md").write_text(text)
    return figures.Snapshot.load(tmp_path)


def test_the_pages_quote_the_committed_report():
    snap = figures.Snapshot.load(figures.REPO / figures.MEASURED)
    assert snap.provenance.commit != "unknown" and snap.report["faults"]
    assert figures.stale_pages() == [], "run: python -m megatron.bridge.drill.figures"
    for page, name in zip(figures.PAGES, ("drill-summary", "drill-report")):
        assert name in figures.blocks((figures.REPO / page).read_text()), page


def test_the_summary_is_made_of_the_report_and_names_its_source(tmp_path):
    text = figures.drill_summary(_snapshot(tmp_path, _report()))
    assert "measured 2026-11-27 on Test CPU x 2 logical CPUs, 23.4 GiB, no GPU, commit abc1234" in text
    assert "passed; 2 of 2 faults detected and recovered; final state equal" in text
    assert "the kill recovered by the launcher in 0.81 s" in text
    assert "the stall detected in 2.91 s and recovered in place 0.31 s later" in text
    assert "18.2 s against 9.5 s fault-free (4.4 s per fault)" in text and "goodput 0.512 against 0.601" in text
    failed = figures.drill_summary(_snapshot(tmp_path, _report(passed=False, equal=False)))
    assert "FAILED" in failed and "NOT equal" in failed


def test_a_stale_block_is_rewritten_and_an_unknown_one_refused(tmp_path):
    snap = _snapshot(tmp_path, _report())
    page = "intro\n<!-- BEGIN FIGURES: drill-report -->\nold figures 21.4 s\n<!-- END FIGURES -->\nafter\n"
    new = figures.render_page(page, snap)
    assert "old figures" not in new and "drill PASSED" in new and new.startswith("intro\n") and new.endswith("after\n")
    assert figures.render_page(new, snap) == new
    with pytest.raises(ValueError, match="unknown figures block 'speed'"):
        figures.render_page("<!-- BEGIN FIGURES: speed -->\n<!-- END FIGURES -->", snap)


def test_a_report_without_provenance_is_refused(tmp_path):
    report = _report()
    del report["provenance"]
    with pytest.raises(ValueError, match="has no provenance"):
        _snapshot(tmp_path, report)
    report = _report()
    del report["provenance"]["commit"]
    with pytest.raises(KeyError, match="commit"):
        _snapshot(tmp_path, report)


def test_a_committed_report_names_no_path_of_the_machine_it_ran_on(tmp_path):
    run_dir = tmp_path / "somewhere" / "run"
    text = f"rank 1's shard {run_dir.resolve()}/local/iter_0000045_1_local.pt failed"
    assert figures.scrub_paths(text, run_dir) == "rank 1's shard runs/main_job/local/iter_0000045_1_local.pt failed"
    committed = (figures.REPO / figures.MEASURED / "drill_report.json").read_text()
    assert "/tmp/" not in committed and "/work/" not in committed and "/home/" not in committed
