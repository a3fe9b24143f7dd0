"""Hang attribution: where each rank was when a hang timeout struck, written before the rank is killed.

While a section (``setup``, ``step``, ``checkpointing``) is open, a watchdog thread of this rank waits for its
deadline; when the section stays open ``health.stack_dump_after`` seconds, every thread's Python stack is written
(by ``faulthandler``) to ``<checkpoint.save>/attribution/<attempt>/rank<N>.stacks`` and one line naming the main
thread's innermost frame is logged. The delay is derived from the hang timeouts in force (see
``HealthConfig.stack_dump_after``), so the stacks are on disk before the monitor kills the rank. Opening and closing a
section only sets a deadline (no thread start, no I/O); the watchdog runs whenever the main thread waits with the GIL
released, as torch does in collectives and device syncs.

An attempt is one start of the training function: ``attempt_<job>_<requeue>_<in-job restart>_<in-process iteration>``.
At the next start, rank 0 summarizes every earlier attempt that left stack files: one log line per attempt naming each
rank with its innermost frame (and whether it was waiting in a collective, a pipeline send/receive counting as one),
also written to that attempt's ``summary.txt``; the latest dump of a rank is the one named. A rank stopped with
SIGSTOP, or killed before the delay, writes nothing but its header line. Files are appended to, never overwritten; a
file holding only this start's header is removed when the rank shuts down normally.
"""

import faulthandler
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import IO, Any, Optional

from megatron.bridge.training.components import Component, Run
from megatron.bridge.training.config import is_enabled as enabled
from megatron.bridge.utils import launch_env
from megatron.bridge.utils.fs import atomic_write

logger = logging.getLogger(__name__)

SUMMARY = "summary.txt"
_FRAME_RE = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_THREAD_RE = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_COLLECTIVE_PATHS = (
    "torch/distributed/",
    "megatron/core/distributed/",
    "megatron/core/parallel_state",
    "megatron/core/pipeline_parallel/p2p_communication",  # a pipeline send/receive waits in ``req.wait()`` (C++)
)
"""Code a rank waits in for its peers: collectives, and pipeline sends and receives."""
_POLL_S = 0.25
"""How often the watchdog looks at the deadline."""
_COLLECTIVE_DEPTH = 2
"""A rank waits in a collective when one of its innermost frames is in collective code (not merely below it)."""


def attempt_name(env: Optional[dict[str, str]] = None, inprocess_iteration: int = 0) -> str:
    """The attempt's name, the same on every rank: job, requeue count, in-job restart count, in-process iteration.

    The job is the Slurm job id, else the launcher's run id (torchrun's ``--standalone`` draws a new one per launch),
    else ``local``: chained jobs that share a save directory get attempts of their own.
    """
    launch = launch_env.current(env)
    job = re.sub(r"[^\w.-]", "_", launch.job_id)
    return f"attempt_{job}_{launch.requeue_count}_{launch.restart_count}_{inprocess_iteration}"


class HangWatch:
    """Dumps this rank's stacks when a section stays open past its delay; every method is a no-op when disabled.

    Args:
        directory: ``<checkpoint.save>/attribution`` (``None``: disabled).
        attempt: :func:`attempt_name` of this start.
        rank: this rank.
        delay: seconds for a section, given its name (``None`` or 0: no dump for it); called at every
            :meth:`open`, so learned timeouts are picked up.
    """

    def __init__(
        self, directory: Optional[str], attempt: str, rank: int, delay: Callable[[str], Optional[float]]
    ) -> None:
        self._delay = delay
        self._file: Optional[IO[str]] = None
        self.path: Optional[str] = None
        self._section: Optional[str] = None
        self._opened = 0.0
        self._armed: Optional[tuple[str, float, float]] = None
        """(section, opened at, deadline) of the open section; replaced as a whole, so the watchdog reads one."""
        self._last: dict[str, float] = {}
        self._stop = threading.Event()
        if directory is None:
            return
        self.path = os.path.join(directory, attempt, f"rank{rank}.stacks")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        try:  # an attempt of the same name summarized before (a run id reused): summarize again, with this one
            os.remove(os.path.join(os.path.dirname(self.path), SUMMARY))
        except FileNotFoundError:
            pass
        self._file = open(self.path, "a")  # noqa: SIM115 - held open for the watchdog's dumps; never wipe evidence
        self._header = f"rank {rank} pid {os.getpid()} main thread {_thread_id()}\n"  # found by summaries
        self._file.write(self._header)
        self._file.flush()
        self._header_end = self._file.tell()
        self._thread = threading.Thread(target=self._watch, name="mbridge-hang-watch", daemon=True)
        self._thread.start()

    def open(self, section: str) -> None:
        """A section starts: dump the stacks if it is still open after its delay."""
        if self._file is None:
            return
        delay = self._delay(section)
        self._section, self._opened = section, time.monotonic()
        self._armed = (section, self._opened, self._opened + delay) if delay else None

    def close(self) -> None:
        """The open section ended in time."""
        if self._file is None:
            return
        self._armed = None
        if self._section is not None:
            self._last[self._section] = time.monotonic() - self._opened

    def last_duration(self, section: str) -> float:
        """Seconds the last closed ``section`` took (0 before the first one)."""
        return self._last.get(section, 0.0)

    def shutdown(self) -> None:
        """Stop watching; remove this rank's file when nothing was dumped into it."""
        if self._file is None:
            return
        self._armed = None
        self._stop.set()
        self._thread.join()
        self._file.close()
        self._file = None
        if (
            self.path is not None
            and os.path.getsize(self.path) <= self._header_end
            and self._header_end == len(self._header)
        ):  # only this start's header: nothing was dumped, and no earlier start wrote here
            os.remove(self.path)
            for folder in (os.path.dirname(self.path), os.path.dirname(os.path.dirname(self.path))):
                try:
                    os.rmdir(folder)  # the last rank out removes the empty attempt and attribution directories
                except OSError:
                    break

    def where_is(self, rank: int) -> Optional[str]:
        """Where ``rank`` was stuck in this attempt, if its stack file holds a dump (the file system is shared)."""
        if self.path is None:
            return None
        path = os.path.join(os.path.dirname(self.path), f"rank{rank}.stacks")
        return summarize_stack_file(path) if os.path.exists(path) else None

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S):
            armed = self._armed
            if armed is None or time.monotonic() < armed[2]:
                continue
            if self._armed is armed:
                self._armed = None  # one dump per open section; a section opened meanwhile keeps its deadline
            self._dump(armed[0], time.monotonic() - armed[1])

    def _dump(self, section: str, waited: float) -> None:
        assert self._file is not None and self.path is not None
        self._file.write(f"--- {section} open for {waited:.1f} s\n")
        self._file.flush()
        faulthandler.dump_traceback(file=self._file, all_threads=True)
        self._file.flush()
        logger.warning("[attribution] %s; all stacks in %s", summarize_stack_file(self.path), self.path)


class HangWatchCallback(Component):
    """Hang attribution as a run's component: watches set-up, each step and each save.

    Built before the process group exists, it watches the ``setup`` section until training is :meth:`ready`; then
    the ``step`` section of each step and the ``checkpointing`` section of each save. It offers
    :attr:`Run.where_is` to the liveness ping (a dead peer's report names where this rank is) and reads
    :attr:`Run.section_timeout` (fault tolerance's, declared before it) for its dump delay.
    """

    def __init__(self, watch: HangWatch, directory: Optional[str] = None) -> None:
        self.watch = watch
        self.directory = directory

    @classmethod
    def build(cls, run: Run) -> "HangWatchCallback":
        """Watch this attempt's ``setup`` section; stacks go to ``<checkpoint.save>/attribution`` when configured."""
        directory = attribution_dir(run.cfg)
        watch = HangWatch(
            directory,
            run.attempt,
            run.rank,
            lambda section: stack_dump_delay(run.cfg, run.section_timeout, watch, section),
        )
        if directory is not None:
            run.where_is = watch.where_is
        watch.open("setup")
        return cls(watch, directory)

    def setup(self, run: Run) -> None:
        """Rank 0 summarizes the attempts before this one that left stacks."""
        if run.rank == 0 and self.directory is not None:
            summarize_earlier_attempts(self.directory, run.attempt)

    def ready(self, run: Run) -> None:
        """Set-up is over: fault tolerance's ``setup`` section ends with the first step's start."""
        self.watch.close()

    def on_train_step_start(self, context: Any) -> None:
        """Watch the ``step`` section."""
        self.watch.open("step")

    def on_train_step_end(self, context: Any) -> None:
        """The step finished: stop watching it."""
        self.watch.close()

    def on_checkpoint_save_start(self, context: Any) -> None:
        """Watch the ``checkpointing`` section."""
        self.watch.open("checkpointing")

    def on_checkpoint_save_end(self, context: Any) -> None:
        """The save returned: stop watching it."""
        self.watch.close()

    def close(self) -> None:
        """Stop the watchdog thread (a file holding only this start's header is removed)."""
        self.watch.shutdown()


def attribution_dir(cfg: Any) -> Optional[str]:
    """Where hang attribution writes stacks: ``<checkpoint.save>/attribution`` when a stack dump can happen."""
    after = cfg.health.stack_dump_after
    watched = enabled(cfg.ft) or enabled(cfg.inprocess_restart) or cfg.health.liveness_ping_interval > 0
    if cfg.checkpoint.save is None or after == 0 or (after is None and not watched):
        return None
    return os.path.join(cfg.checkpoint.save, "attribution")


def stack_dump_delay(
    cfg: Any, section_timeout: Callable[[str], Optional[float]], watch: HangWatch, section: str
) -> Optional[float]:
    """Seconds ``section`` may stay open before the stacks are dumped (evaluated at every section start).

    The configured value, or the earliest of: half of each hang timeout on the section's own length (an ft section
    timeout, learned ones included; ``inprocess_restart.soft_timeout``), and for a step, half of
    ``health.liveness_ping_timeout`` past the last step's length (the ping bounds how far ranks drift apart, not how
    long a step takes, so a long healthy step never dumps; a rank stuck before the ping dumps before its peers give up).
    """
    if cfg.health.stack_dump_after is not None:
        return cfg.health.stack_dump_after or None
    limits = [t / 2 for t in (section_timeout(section),) if t]
    if enabled(cfg.inprocess_restart) and section != "setup":
        limits.append(cfg.inprocess_restart.soft_timeout / 2)
    if section == "step" and cfg.health.liveness_ping_interval:
        limits.append(cfg.health.liveness_ping_timeout / 2 + watch.last_duration("step"))
    return min(limits) if limits else None


def _thread_id() -> str:
    return f"0x{threading.main_thread().ident:016x}"


def summarize_stack_file(path: str) -> Optional[str]:
    """Where the latest dump of a stack file found its rank, or ``None`` if the file holds no dump.

    Returns ``"rank N in func (file:line) [section open for S s]"``, plus ``", waiting in a collective"`` when one of
    the innermost frames is collective code.
    """
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("--- ")]
    if not starts:
        return None
    last = starts[-1]
    headers = [line for line in lines[:last] if line.startswith("rank ")]
    if not headers:
        return None
    header = headers[-1].split()
    rank, main_thread = header[1], header[-1]
    frames: list[re.Match] = []
    in_main = False
    for line in lines[last + 1 :]:
        thread = _THREAD_RE.match(line)
        if thread is not None:
            if in_main and frames:
                break
            in_main = thread.group(1) == main_thread
            continue
        frame = _FRAME_RE.match(line)
        if in_main and frame is not None:
            frames.append(frame)
    if not frames:
        return None
    inner = frames[0]  # faulthandler prints the most recent call first
    where = f"rank {rank} in {inner.group('func')} ({os.path.basename(inner.group('file'))}:{inner.group('line')})"
    where += f" [{lines[last][4:]}]"
    if any(p in f.group("file") for f in frames[:_COLLECTIVE_DEPTH] for p in _COLLECTIVE_PATHS):
        where += ", waiting in a collective"
    return where


def summarize_earlier_attempts(directory: str, current: str) -> list[str]:
    """Log and return one line per earlier attempt in ``directory`` that left stack files (rank 0, at start).

    An attempt is summarized once: the line is written to its ``summary.txt``.
    """
    if not os.path.isdir(directory):
        return []
    lines = []
    for attempt in sorted(os.listdir(directory)):
        folder = os.path.join(directory, attempt)
        if attempt == current or not os.path.isdir(folder) or os.path.exists(os.path.join(folder, SUMMARY)):
            continue
        files = sorted(f for f in os.listdir(folder) if f.endswith(".stacks"))
        if not files:
            continue
        found = [summarize_stack_file(os.path.join(folder, f)) for f in files]
        stuck = [s for s in found if s is not None]
        silent = [f.removesuffix(".stacks") for f, s in zip(files, found) if s is None]
        line = f"[attribution] {attempt}: " + ("; ".join(stuck) if stuck else "no stacks written")
        if silent:
            line += f"; no stack from {', '.join(silent)} (stopped, killed before the dump, or not hung)"
        line += f" — stacks in {folder}"
        atomic_write(os.path.join(folder, SUMMARY), line + "\n", durable=False)  # whole or absent: it marks done
        logger.warning("%s", line)
        lines.append(line)
    return lines
