"""Every environment fault the drills try (detected by what, how fast, exit code, loss) and every one not tried.

What detected each fault, how fast, the exit code and what was lost; and every drill that could not try its fault
here, with why.

Runs the environment-fault drills of the functional tier (storage, host and launch, device: real full and read-only
tmpfs mounts, a slow disk, an unreadable directory, a directory deleted mid-run, a held rendezvous port, a kernel OOM
kill in a memory cgroup, a wall-clock jump, a GPU job on a node without one) with ``MBRIDGE_ENV_FAULT_REPORT`` set, so
that each drill, once its assertions passed, records its outcome (``tests/functional_tests/env_report.py``). "Lost"
is what the drill asserted (the last good checkpoint verified, no temporary save visible, the next start resumed),
not a claim of this script.

One result line per fault. Its detection time is held to the drill's own bound (:data:`BOUND_S`, a fixed goal, not a
measurement), so it is reported in seconds, not as a ratio; a fault that must fire nothing has neither. The outcome
of every drill comes from pytest's JUnit XML: a drill that skipped (it could not set up its fault: not root, no mount,
no cgroup controller, no tool; or it does not apply here) or failed gets a "not tried" line with the reason, so the
report says what it is missing. With ``CI=true`` a drill that cannot set up its fault fails instead of skipping
(``tests/capabilities.py``).

    python benchmarks/environment_faults.py [--keep]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from _result import NO_TARGET, emit_goal, emit_not_tried, emit_result

REPO = Path(__file__).resolve().parents[1]
NAME = "environment_faults"
DRILLS = (
    "tests/functional_tests/training/test_storage_faults.py",
    "tests/functional_tests/training/test_host_faults.py",
    "tests/functional_tests/training/test_device.py",
)
BOUND_S = 60.0
"""What each drill allows between the fault and its detection (a launch fault: between the launch and the exit)."""


@dataclass(frozen=True)
class Untried:
    """A drill whose fault was not tried to the end in this run.

    Attributes:
        test: ``module::test`` (with its parameters).
        outcome: ``"skipped"`` (it could not set up its fault, or does not apply here) or ``"failed"``.
        reason: pytest's message: the skip reason, or the first line of the failure.
    """

    test: str
    outcome: str
    reason: str


def untried(junit_xml: str) -> list[Untried]:
    """The drills of a pytest JUnit XML report that skipped or failed (errors in set-up count as failed).

    Args:
        junit_xml: The report's text (``pytest --junitxml``).

    Returns:
        One entry per such test case, in the report's order.
    """
    found = []
    for case in ET.fromstring(junit_xml).iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        test = f"{module}::{case.get('name', '?')}" if module else case.get("name", "?")
        for tag, outcome in (("skipped", "skipped"), ("failure", "failed"), ("error", "failed")):
            element = case.find(tag)
            if element is not None:
                message = element.get("message") or (element.text or "").strip() or "no message"
                found.append(Untried(test, outcome, message.strip().splitlines()[0]))
                break
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the records file and the JUnit XML")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mbridge-env-faults-"))
    records, junit = work / "records.jsonl", work / "junit.xml"
    env = {
        **os.environ,
        "MBRIDGE_ENV_FAULT_REPORT": str(records),
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rsfE", f"--junitxml={junit}", *DRILLS]
    print(f"[{NAME}] {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    print(proc.stdout[-3000:], file=sys.stderr)
    rows = [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []
    missing = untried(junit.read_text()) if junit.exists() else [Untried(" ".join(DRILLS), "failed", "no JUnit XML")]
    print("| fault | detected by | after (s) | from | exit code | lost | resumed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        seconds = "—" if r["seconds"] is None else f"{r['seconds']:.2f}"
        print(
            f"| {r['fault']} | {r['detected_by']} | {seconds} | {r['from']} | {r['exit_code']} | {r['lost']} | "
            f"{r['resumed'] or '—'} |"
        )
    if missing:
        print(f"\nnot tried here, or failed ({len(missing)}):")
        for m in missing:
            print(f"- {m.test}: {m.outcome}: {m.reason}")
    for r in rows:
        what = f"exit {r['exit_code']}, {r['detected_by']}; lost: {r['lost']}"
        if r["seconds"] is None:  # a fault that must fire nothing
            emit_result(NAME, f"{r['fault']}: nothing fires", None, what, "", NO_TARGET)
        else:
            emit_goal(NAME, f"{r['fault']}: detection", r["seconds"], BOUND_S, f"after {r['from']}; {what}")
    for m in missing:
        emit_not_tried(NAME, m.test, f"{m.outcome}: {m.reason}")
    if not args.keep:
        records.unlink(missing_ok=True)
        junit.unlink(missing_ok=True)
        work.rmdir()
    else:
        print(f"[{NAME}] kept {records} and {junit}", file=sys.stderr)
    if proc.returncode != 0:
        print(f"[{NAME}] the drills failed (pytest exit {proc.returncode})", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
