"""What each environment-fault drill saw, for ``benchmarks/environment_faults.py``'s report.

A drill calls :func:`record` once its assertions passed (so "nothing lost" is what it asserted, not a claim). The
records go, one JSON line each, to the file the benchmark names in ``MBRIDGE_ENV_FAULT_REPORT``; without it nothing
is written. Test tooling only: the package reads no such variable.
"""

import json
import os
from typing import Optional

from tests.functional_tests.harness import Run

from megatron.bridge.training.events.stream import EventKind, Mechanism

REPORT_ENV = "MBRIDGE_ENV_FAULT_REPORT"


def record(
    fault: str,
    run: Run,
    mechanism: Optional[Mechanism] = None,
    lost: str = "nothing",
    resumed: str = "",
    seconds: Optional[float] = None,
    detected_by: Optional[str] = None,
) -> None:
    """Append the outcome of ``run`` for ``fault``: exit code, what detected it and how long after it struck.

    ``mechanism``: the ``fault_detected`` mechanism expected (``None``: the fault is seen by the exit, as a launch or
    configuration fault is). The delay runs from the fault's ``fault_injected`` event, else from the launch, to the
    first such detection, else to the first exit event, else to the launcher's end; ``seconds`` and
    ``detected_by`` replace what the events say (a drill that measured it itself, or one where nothing must fire).
    """
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    nothing_fires = detected_by is not None and mechanism is None and seconds is None  # a fault nothing may notice
    events = run.events() if run.event_dir is not None and run.event_dir.is_dir() else []
    injected = [e.time for e in events if e.kind == EventKind.FAULT_INJECTED]
    seen = [e for e in events if e.kind == EventKind.FAULT_DETECTED and e.mechanism == mechanism] if mechanism else []
    exits = [e.time for e in events if e.kind == EventKind.EXIT]
    start = injected[0] if injected else run.started
    end = seen[0].time if seen else exits[0] if exits else run.finished
    row = {
        "fault": fault,
        "detected_by": detected_by or (str(mechanism) if seen else f"exit code {run.exit_code}"),
        "from": "the fault" if injected else "the launch",
        "seconds": None if nothing_fires else round(seconds if seconds is not None else end - start, 2),
        "exit_code": run.exit_code,
        "lost": lost,
        "resumed": resumed,
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
