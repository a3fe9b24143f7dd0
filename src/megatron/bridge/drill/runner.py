"""Launch a training job, keep its whole log, show progress while it runs, and act on what it prints."""

import glob
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional, TextIO

from megatron.bridge.drill.schedule import DrillFault
from megatron.bridge.training.fault_injection import descendants

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
    on_line: Callable[[str], None],
    timeout: float,
    label: str,
    out: TextIO = sys.stdout,
) -> int:
    """Run ``cmd`` to the end (or ``timeout`` seconds), writing its output to ``log_path``; return its exit code.

    Every line goes to ``on_line`` as it arrives. ``out`` gets a progress line every 10 iterations and each line
    that marks a fault, a detection, a restart or a resume, prefixed with ``label`` and the seconds since start.
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
                on_line(line)
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


class LocalCheckpointCorrupter:
    """Flips bytes in a rank's local checkpoint file once it is written (the ``corrupt-local`` fault).

    Args:
        faults: the ``corrupt-local`` faults of the schedule.
        local_dir: ``checkpoint.non_persistent_local_ckpt_dir`` of the run.
        ledger: the fault ledger, where the corruption is recorded like the faults injected inside the ranks.
    """

    def __init__(self, faults: list[DrillFault], local_dir: Path, ledger: Path) -> None:
        self._pending = {(f.iteration, f.rank): f for f in faults if f.kind == "corrupt-local"}
        self._local_dir = local_dir
        self._ledger = ledger
        self._written = re.compile(r"\[rank(\d+)\] .*(?:finalized async|saved) local checkpoint at iteration (\d+)")

    def __call__(self, line: str) -> None:
        """Look at one log line; corrupt the file when its local save is complete."""
        found = self._written.search(line)
        if found is None:
            return
        fault = self._pending.pop((int(found.group(2)), int(found.group(1))), None)
        if fault is not None:
            self.corrupt(fault)

    def corrupt(self, fault: DrillFault) -> Optional[str]:
        """Flip 64 bytes in the middle of the rank's local checkpoint file of the iteration; return its path."""
        pattern = str(self._local_dir / "**" / f"iter_{fault.iteration:07d}_{fault.rank}_local.pt")
        files = glob.glob(pattern, recursive=True)
        if not files:
            logger.error("corrupt-local: no file matches %s; the fault was not injected", pattern)
            return None
        path = files[0]
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(size // 2)
            chunk = f.read(64)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in chunk))
            f.flush()
            os.fsync(f.fileno())
        record = {"kind": "corrupt-local", "iteration": fault.iteration, "rank": fault.rank, "time": time.time()}
        with open(self._ledger, "a") as ledger:
            ledger.write(json.dumps(record) + "\n")
        return path
