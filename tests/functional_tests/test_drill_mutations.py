"""The drill's equality verdict can fail: a resume that leaves one part of the state unrestored fails the drill.

Each mutation is a fault kind of the one fault grammar (``no-rng-restore``, ``no-optimizer-restore``,
``no-data-restore``, the same in the drill's schedule as in ``fault_injection.faults``): as a rank loads the
checkpoint of its iteration, it leaves its generators, its optimizer state or its data position as its fresh start
made them. Short drills keep this cheap: 10 iterations with one restart, a preemption at 6 (its own save is the
checkpoint the restart loads: no race with an async save), the corpus made once, and one fault-free run (the control
drill's) that every mutation drill compares with.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.bridge.training.checkpoint.compare import part_of

REPO = Path(__file__).resolve().parents[2]
SHORT = ("--train-iters", "10", "--save-interval", "10", "--local-interval", "5")
RESTART = "preempt@6:0"
"""The restart every drill here has: rank 0 is preempted at 6, saves there, and the job resumes from 6."""


def _drill(run_dir: Path, faults: str, *more: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron.bridge.drill", "--faults", faults, *SHORT, "--run-dir", str(run_dir), *more]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=540)


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    """The same short drill without a mutation: its fault-free run is every mutation drill's reference."""
    run_dir = tmp_path_factory.mktemp("mutations") / "control"
    return run_dir, _drill(run_dir, RESTART)


def _mutated(control, tmp_path: Path, mutation: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The control's drill with ``mutation`` added, compared with the control's fault-free run."""
    run_dir, out = control
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    data = str(run_dir / "data" / "stdlib_text_document")
    out = _drill(tmp_path / "drill", f"{RESTART},{mutation}", "--data", data, "--reference-run", str(run_dir))
    report = json.loads((tmp_path / "drill" / "drill_report.json").read_text())
    # It fails for the comparison alone: the restart was detected and recovered, nothing else restarted, and the
    # mutation struck.
    assert [(f["fault"], f["detected"], f["recovered"]) for f in report["faults"]] == [(RESTART, True, True)], report
    assert report["exit_code"] == 0 and report["unexplained_restarts_s"] == [], report
    assert [m["mutation"] for m in report["mutations"] if m["struck_s"] is not None] == [mutation], report
    assert f"mutation {mutation}: struck at" in out.stdout and "the final state differs" in out.stdout, out.stdout
    assert out.returncode == 1 and "drill FAILED" in out.stdout, out.stdout[-4000:] + out.stderr[-2000:]
    assert not report["passed"] and report["equal"] is False
    assert "final state DIFFERS from the fault-free run (compared 24 tensors and" in out.stdout, out.stdout[-4000:]
    return out, report


def _parts(report: dict) -> set[str]:
    """The parts of the training state the report's differences name."""
    return {part_of(line.split(": ")[0]) for line in report["differences"]}


def test_without_a_mutation_the_short_drill_passes_and_counts_each_part(control):
    run_dir, out = control
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    report = json.loads((run_dir / "drill_report.json").read_text())
    assert report["passed"] and report["equal"] is True and report["differences"] == []
    compared = {p["part"]: p for p in report["compared"]}
    assert {"model", "optimizer", "scheduler", "train state", "data position", "RNG"} <= set(compared), compared
    assert compared["optimizer"]["detail"].startswith("2 pipeline stage(s): 4 moments, 2 master weights")
    assert compared["RNG"]["detail"] == "2 ranks" and compared["data position"]["tensors"] == 2
    line = next(x for x in out.stdout.splitlines() if x.startswith("final state EQUAL"))
    assert "24 tensors and" in line and "; RNG 1 tensor, 2 entries (2 ranks)" in line and "at iteration 10" in line


def test_mutation_no_rng_restore_fails_the_drill(control, tmp_path):
    out, report = _mutated(control, tmp_path, "no-rng-restore@6:1")
    # Dropout drew other masks on rank 1 from 7 on: its generators end elsewhere, and so do the weights.
    assert "sharded.rng_state: the generators of rank 1 (torch, tracker) differ" in report["differences"], report
    assert _parts(report) == {"RNG", "optimizer", "model"}, report["differences"]
    assert "  - sharded.rng_state: the generators of rank 1 (torch, tracker) differ" in out.stdout


def test_mutation_no_optimizer_restore_fails_the_drill(control, tmp_path):
    _, report = _mutated(control, tmp_path, "no-optimizer-restore@6:0")
    # Rank 0's Adam moments started from zero at 7; the generators drew as many numbers as in the reference.
    assert any("exp_avg_sq: values differ" in line for line in report["differences"]), report["differences"]
    assert _parts(report) == {"optimizer", "model"}, report["differences"]


def test_mutation_no_data_restore_fails_the_drill(control, tmp_path):
    _, report = _mutated(control, tmp_path, "no-data-restore@6:0")
    # Rank 0 read the first batches again; the consumed-sample count was restored, so only the weights show it.
    assert _parts(report) == {"optimizer", "model"}, report["differences"]
    assert any(line.startswith("sharded.embedding.word_embeddings.weight") for line in report["differences"])
