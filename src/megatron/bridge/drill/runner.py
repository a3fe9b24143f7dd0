"""Launch a training job, keep its whole log, and show progress while it runs.

The run's facts (faults, detections, restarts, checkpoints, steps) go to its event stream (the directory the
command names), not to its log: the progress lines shown while it runs are for people only; nothing is read back
from them.
"""

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from megatron.bridge.training.faults.effects import descendants

logger = logging.getLogger(__name__)

_STEP = re.compile(r"\[rank0\] INFO \S+: iteration (\d+)/(\d+) ")
_PROGRESS = re.compile(
    r"fault injection|will restart worker group|Section '\w+' has been open|Preemption detected|Straggler detected"
    r"|Unexpected result|failed verification|fell back|loaded verified|successfully loaded|training stopped"
    r"|Agent exits|PEER_UNRESPONSIVE|transient"
)


def launch_and_watch(
    cmd: list[str],
    env: dict[str, str],
    log_path: Path,
    timeout: float,
    label: str,
    out: TextIO = sys.stdout,
) -> int:
    """Run ``cmd`` to the end (or ``timeout`` seconds), writing its output to ``log_path``; return its exit code.

    ``out`` gets a progress line every 10 iterations and each line that marks a fault, a detection, a restart
    or a resume, prefixed with ``label`` and the seconds since start.
    """
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=env,
        start_new_session=True,
        bufsize=1,
    )
    timer = threading.Timer(timeout, _kill_group, args=(proc,))
    timer.daemon = True
    timer.start()
    try:
        with open(log_path, "w") as log:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                _show(line, label, time.monotonic() - start, out)
        return proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
        if time.monotonic() - start >= timeout:
            print(f"[{label}] timed out after {timeout:.0f} s: the run was killed", file=out, flush=True)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process below it.

    ft_launcher starts its workers in sessions of their own, and a stopped worker would keep the output pipe open.
    """
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _show(line: str, label: str, elapsed: float, out: TextIO) -> None:
    step = _STEP.search(line)
    if step is not None:
        if int(step.group(1)) % 10 == 0:
            print(f"[{label} {elapsed:6.1f} s] iteration {step.group(1)}/{step.group(2)}", file=out, flush=True)
        return
    if _PROGRESS.search(line):
        text = line.strip()
        print(f"[{label} {elapsed:6.1f} s]   {text[:220]}", file=out, flush=True)
