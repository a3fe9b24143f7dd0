"""Every environment fault the drills try, with what detected it, how fast, the exit code, and what was lost.

Runs the environment-fault drills of the functional tier (storage, host and launch, device: real full and read-only
tmpfs mounts, a directory deleted mid-run, a held rendezvous port, a kernel OOM kill in a memory cgroup, a wall-clock
jump, a GPU job on a node without one) with ``MBRIDGE_ENV_FAULT_REPORT`` set, so that each drill, once its
assertions passed, records its outcome (``tests/functional_tests/env_report.py``). "Lost" is what the drill asserted
(the last good checkpoint verified, no temporary save visible, the next start resumed), not a claim of this script.

One result line per fault: the ratio is the detection time against the bound the drill holds it to, measured in
this run (the launch, a save's step, the fault's own strike); a fault that must fire nothing has no ratio. Needs
root (mount, cgroups); the drills skip, and their rows are missing, where that is not allowed.

    python benchmarks/environment_faults.py [--keep]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _result import NO_TARGET, emit_result

REPO = Path(__file__).resolve().parents[1]
NAME = "environment_faults"
DRILLS = (
    "tests/functional_tests/training/test_storage_faults.py",
    "tests/functional_tests/training/test_host_faults.py",
    "tests/functional_tests/training/test_device.py",
)
BOUND_S = 60.0
"""What each drill allows between the fault and its detection (a launch fault: between the launch and the exit)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the records file")
    args = parser.parse_args()
    records = Path(tempfile.mkdtemp(prefix="mbridge-env-faults-")) / "records.jsonl"
    env = {
        **os.environ,
        "MBRIDGE_ENV_FAULT_REPORT": str(records),
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *DRILLS]
    print(f"[{NAME}] {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    print(proc.stdout[-3000:], file=sys.stderr)
    rows = [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []
    print("| fault | detected by | after (s) | from | exit code | lost | resumed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        seconds = "—" if r["seconds"] is None else f"{r['seconds']:.2f}"
        print(
            f"| {r['fault']} | {r['detected_by']} | {seconds} | {r['from']} | {r['exit_code']} | {r['lost']} | "
            f"{r['resumed'] or '—'} |"
        )
    for r in rows:
        measured = f"exit {r['exit_code']}, {r['detected_by']}" + (
            "" if r["seconds"] is None else f" {r['seconds']:.2f} s after {r['from']}"
        )
        fired_nothing = r["seconds"] is None
        emit_result(
            NAME,
            f"{r['fault']}: detection / {BOUND_S:g} s",
            None if fired_nothing else r["seconds"] / BOUND_S,
            measured,
            f"lost: {r['lost']}",
            NO_TARGET if fired_nothing else "<= 1.0",
        )
    if not args.keep:
        records.unlink(missing_ok=True)
        records.parent.rmdir()
    if proc.returncode != 0:
        print(f"[{NAME}] the drills failed (pytest exit {proc.returncode})", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
