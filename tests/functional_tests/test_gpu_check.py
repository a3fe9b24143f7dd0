"""The GPU check's dry run: every step of ``scripts/gpu_check.sh`` on CPU (tiny Llama, gloo), as CI runs it.

The kill and bit-equal resume, the in-process restart, the straggler detector on a slowed rank, throughput against
the plain megatron-core loop and async against sync save blocking all run for real; the GPU memory check and MFU
are rows saying they are not measured on CPU. The report's JSON must say every part passed, with its figures.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FIGURES = {
    "a": ("command", "passed", "failed"),
    "b": ("resumed_from", "newest_committed_before_fault", "final_state_equal", "compared", "worker_exit"),
    "c": ("attempts", "resumed_from", "final_state_equal", "fault_to_restarted_s", "gpu_memory"),
    "d": ("score_source", "healthy_scores", "slowed_scores", "flagged_at", "report_every_steps"),
    "e": (
        "framework_tokens_per_s", "plain_tokens_per_s", "framework_overhead", "framework_mfu", "plain_mfu",
        "async_save_blocking_s", "sync_save_blocking_s", "async_over_sync", "first_global_save_async_over_sync",
    ),
}  # fmt: skip


@pytest.mark.timeout(600)
def test_the_dry_run_passes_every_part_with_its_figures(tmp_path):
    outdir = tmp_path / "report"
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(outdir), "--dry-run", "--scratch", str(tmp_path / "scratch")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=560,
    )  # fmt: skip
    assert (outdir / "gpu_check.json").exists(), (out.returncode, out.stdout[-5000:], out.stderr[-3000:])
    report = json.loads((outdir / "gpu_check.json").read_text())
    failed = {p["key"]: p["problems"] for p in report["parts"] if not p["passed"]}
    assert out.returncode == 0 and report["passed"], (failed, out.stdout[-5000:], out.stderr[-3000:])
    assert report["mode"] == "dry-run" and report["provenance"]["commit"]
    assert sorted(p["key"] for p in report["parts"]) == list("abcde")
    for part in report["parts"]:
        missing = [name for name in FIGURES[part["key"]] if part["figures"].get(name) in (None, "", [])]
        assert not missing, (part["key"], missing, part["figures"])
    figures = {p["key"]: p["figures"] for p in report["parts"]}
    assert figures["a"]["passed"] > 0 and figures["a"]["failed"] == 0
    assert figures["b"]["final_state_equal"] is True and figures["c"]["final_state_equal"] is True
    assert figures["b"]["worker_exit"] == "signal 9"
    assert figures["c"]["gpu_memory"] == "not measured on CPU"
    assert figures["e"]["framework_mfu"] == figures["e"]["plain_mfu"] == "not measured on CPU"
    assert "wall time" in figures["d"]["score_source"]
    assert max(figures["d"]["flagged_at"]) >= figures["d"]["slowed_from"]
    assert figures["e"]["framework_tokens_per_s"] > 0 and figures["e"]["plain_tokens_per_s"] > 0
    assert (outdir / "gpu_check.md").read_text().startswith("# GPU check (dry-run): PASSED")
    assert (outdir / "gpu_check_logs.tar.gz").stat().st_size > 0
