"""The main job's recovery figures: ratios against its fault-free reference run in the same invocation, and times
held to the fixed goals of layered recovery (in seconds, not as ratios: a goal is not a measurement).

Runs the resiliency drill (``python -m megatron.bridge.drill``, the default schedule: NaN, kill, preemption,
corrupted local checkpoint, stall, straggler) with its fault-free reference in the same run, and reads its report:

- ratios against the reference, measured in this run: the drill's wall time / the reference's (no target; the cost
  per fault in seconds is held to its goal below), the drill's goodput / the reference's (target >= 0.6), and the
  kill's recovery / the reference's start-up (its attempt start to first step: a cold start of the same job; no
  target);
- fixed goals, in seconds: cost per injected fault ((drill wall - reference wall) / faults, goal 2 s), kill recovery
  (ft_launcher: worker exit -> first step after the restart, 3 s), stall recovery (in-process restart: detection ->
  first step in the same processes, 1.5 s) and the restarts' teardown (the launcher's stop of the survivors; the
  in-process abort to the next iteration: 0.5 s each).

    python benchmarks/layered_recovery.py [--run-dir DIR] [--keep]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from _result import NO_TARGET, emit_goal, emit_result

REPO = Path(__file__).resolve().parents[1]
NAME = "layered_recovery"
GOAL_COST_PER_FAULT_S = 2.0
GOALS_S = {
    "kill recovery": 3.0,
    "in-process (stall) recovery": 1.5,
    "in-job restart teardown": 0.5,
    "in-process restart teardown": 0.5,
}
"""Fixed goals of layered recovery on this machine (issue 21), in seconds."""


def _run_drill(run_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    cmd = [sys.executable, "-m", "megatron.bridge.drill", "--run-dir", str(run_dir)]
    print(f"[{NAME}] {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    report = run_dir / "drill_report.json"
    if not report.exists():
        tail = proc.stdout[-3000:] + proc.stderr[-2000:]
        raise SystemExit(f"the drill wrote no report (exit {proc.returncode}):\n{tail}")
    print(proc.stdout[-2500:], file=sys.stderr)
    return json.loads(report.read_text())


def _fault(report: dict[str, Any], kind: str, field: str) -> Optional[float]:
    return next((f[field] for f in report["faults"] if f["kind"] == kind), None)


def _teardown_s(report: dict[str, Any], layer: str) -> Optional[float]:
    """The longest teardown of the run's restarts of ``layer`` (``in_job``: the launcher's stop of the workers;
    ``in_process``: the abort to the next iteration's start)."""
    phases = [p.get("teardown_s") for p in report.get("restart_phases") or [] if p.get("layer") == layer]
    phases = [p for p in phases if p is not None]
    return max(phases) if phases else None


def _shown(value: Optional[float]) -> str:
    return "not measured" if value is None else f"{value:.3f}"


def _ratio(measured: Optional[float], baseline: Optional[float]) -> Optional[float]:
    return None if measured is None or not baseline else measured / baseline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument("--keep", action="store_true", help="keep the temporary run directory")
    args = parser.parse_args()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="layered_recovery_")) / "main_job"
    try:
        report = _run_drill(run_dir)
    finally:
        if args.run_dir is None and not args.keep:
            shutil.rmtree(run_dir.parent, ignore_errors=True)
    if not report["passed"]:
        print(f"[{NAME}] the drill FAILED: its figures are reported anyway", file=sys.stderr)
    wall, reference = report["wall_s"], report["reference_wall_s"]
    faults = len(report["faults"])
    cost = (wall - reference) / faults
    emit_result(
        NAME, "drill wall / fault-free wall", wall / reference, f"{wall:.1f} s ({faults} faults)",
        f"{reference:.1f} s (fault-free reference, same run)", NO_TARGET,
    )  # fmt: skip
    g, g_ref = (report.get("goodput") or {}).get("goodput"), (report.get("reference_goodput") or {}).get("goodput")
    emit_result(
        NAME, "drill goodput / fault-free goodput", _ratio(g, g_ref), _shown(g),
        f"{_shown(g_ref)} (fault-free reference, same run)", ">= 0.6",
    )  # fmt: skip
    kill = _fault(report, "kill", "recovery_time_s")
    startup = ((report.get("reference_goodput") or {}).get("lost_s") or {}).get("startup")
    emit_result(
        NAME, "kill recovery / fault-free start-up", _ratio(kill, startup),
        "not measured" if kill is None else f"{kill:.2f} s (worker exit -> first step after the restart)",
        "not measured" if startup is None else f"{startup:.2f} s (reference: attempt start -> first step, same run)",
        NO_TARGET,
    )  # fmt: skip
    emit_goal(NAME, "cost per fault", cost, GOAL_COST_PER_FAULT_S, f"{wall - reference:.1f} s over {faults} faults")
    emit_goal(NAME, "kill recovery", kill, GOALS_S["kill recovery"])
    emit_goal(NAME, "in-process (stall) recovery", _fault(report, "stall", "recovery_time_s"),
              GOALS_S["in-process (stall) recovery"])  # fmt: skip
    for layer, metric in (("in_job", "in-job restart teardown"), ("in_process", "in-process restart teardown")):
        emit_goal(NAME, metric, _teardown_s(report, layer), GOALS_S[metric])


if __name__ == "__main__":
    main()
