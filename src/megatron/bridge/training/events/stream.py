"""The structured event stream: what happened in a job, as typed JSON lines, instead of log text to grep.

The failure it handles: a drill report, a goodput review or a test that reconstructs a job from its logs depends on
the wording, the timestamp format and the interleaving of log lines from several processes; a reworded message
silently hides a fault, and a line cut by a SIGKILL can break the parser. Here every process appends typed events
(a fault injected, a fault detected with its mechanism and rank, a restart begun and ended with its layer, a
checkpoint saved or loaded with bytes and seconds, a step completed, a set-up phase with its start and end, an exit
with its code) to its own file, and readers get :class:`Event` objects back. ``docs/training/events.md`` documents
schema version :data:`SCHEMA_VERSION`.

How:

* One directory per job; one file per writer: ``events-rank<R>.jsonl`` for a training rank (a restarted rank appends
  to its predecessor's file), ``events-launcher-<host>.jsonl`` for a node's launcher and its rank monitors.
* Each write is whole lines in a single ``os.write`` on an ``O_APPEND`` descriptor: on a local file system a line is
  never interleaved with another writer's and never half visible. Nothing is fsynced (a machine crash may lose the
  last lines: this is observation, not state).
* Step events are the one kind written every step, so a training rank's writer keeps them in memory
  (``buffered``) and writes them with the next event of another kind, at :func:`flush` (the loop calls it at its
  log interval), when the writer is closed or reconfigured, and at interpreter exit: a step costs no system call,
  and a SIGKILLed rank loses at most the step events since its last flush, never a fault, restart, checkpoint or exit
  event (those are written at once, after the buffered steps, in the same ``os.write``). Each event keeps the time
  it was emitted, so readers see the same order either way.
* Writing never raises into the caller: an unwritable directory or a bad field is logged once and the event dropped.
* Reading is ``events/reader.py``: ``read_events`` returns ``(events, problems)``; a truncated line, a line that
  is not JSON, an unknown version ``v``, an unknown kind, mechanism or layer, a field of the wrong type is a
  ``Problem`` naming the file and the line number, and the line is skipped; reading never raises on bad content.

This module is the bottom layer of the training package: it imports nothing but the standard library, so that every
feature module (fault injection, re-run, straggler detection, local checkpoints, in-process restart) and the
launcher can emit events without importing each other. Emit through :func:`emit` once :func:`configure` named the
directory (``pretrain`` does, from ``health.event_dir``); before that, and with no directory, :func:`emit` does
nothing. ``docs/training/events.md`` shows both in use.
"""

import atexit
import dataclasses
import enum
import json
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""The version every line carries as ``v``. Adding a field, a kind, a mechanism or a layer keeps it (readers ignore
fields they do not know and report-and-skip values they do not know); changing or removing one bumps it."""
FILE_GLOB = "events-*.jsonl"
"""The files of one event directory."""
DIRECTORY_NAME = "events"
"""The default directory's name, under ``checkpoint.save``."""


class EventKind(enum.StrEnum):
    """What an event records (``kind`` in the JSON line)."""

    ATTEMPT_STARTED = "attempt_started"
    """A training attempt began: a worker process started, or an in-process restart iteration."""
    STEP_COMPLETED = "step_completed"
    """A training step ran to its end (``applied``: its update was kept)."""
    CHECKPOINT_SAVED = "checkpoint_saved"
    """A checkpoint was committed (global or local tier)."""
    CHECKPOINT_LOADED = "checkpoint_loaded"
    """The attempt resumed from a checkpoint."""
    FAULT_INJECTED = "fault_injected"
    """Fault injection is about to make ``rank`` fail (written before the strike)."""
    FAULT_DETECTED = "fault_detected"
    """A detection mechanism noticed a fault (``mechanism``; ``rank``: the rank it blames, when it knows)."""
    RESTART_BEGUN = "restart_begun"
    """A restart of ``layer`` began (the failure was seen and the restart decided)."""
    WORKERS_STOPPED = "workers_stopped"
    """The launcher stopped its workers (the end of an in-job restart's teardown)."""
    RESTART_ENDED = "restart_ended"
    """A restart of ``layer`` ended: the new workers (or the new in-process iteration) are running."""
    WORKER_EXITED = "worker_exited"
    """The launcher saw a worker process end (``exit_code``, or ``signal`` when a signal killed it)."""
    STRAGGLER_REPORT = "straggler_report"
    """Straggler detection scored every rank (rank 0 writes it)."""
    EXIT = "exit"
    """A training attempt (or the launcher) ended with ``exit_code``."""
    LAUNCHER_STARTED = "launcher_started"
    """A node's launcher began (``process_start``: when its process started): the job's time zero for reports."""
    PHASE = "phase"
    """A phase of a training attempt's set-up ended: ``cycle_phase`` (a :class:`CyclePhase`) ran from ``start`` to
    ``end`` (unix times)."""
    SAVE_ATTEMPT_FAILED = "save_attempt_failed"
    """Attempt ``save_attempt`` (1-based) of the ``tier`` checkpoint of ``iteration`` failed with a storage error
    (``detail``; ``exit_code``: the code it would stop with); ``retrying``: it is tried again after ``seconds``
    (``checkpoint.save_retries``), else the run stops."""


class Mechanism(enum.StrEnum):
    """What detected a fault (``mechanism`` of ``fault_detected``)."""

    LAUNCHER_WORKER_EXIT = "launcher_worker_exit"
    """The launcher saw a worker exit with a non-zero code or a signal."""
    RANK_MONITOR_SECTION_TIMEOUT = "rank_monitor_section_timeout"
    """ft_launcher's rank monitor: a section (``section``; ``out_of_section`` for the time between sections) stayed
    open past its timeout."""
    RANK_MONITOR_HEARTBEAT_TIMEOUT = "rank_monitor_heartbeat_timeout"
    """ft_launcher's rank monitor: no heartbeat within the timeout."""
    INPROCESS_EXCEPTION = "inprocess_exception"
    """In-process restart: an exception left the training function on ``rank``."""
    INPROCESS_SOFT_TIMEOUT = "inprocess_soft_timeout"
    """In-process restart: no progress on ``rank`` within ``inprocess_restart.soft_timeout``."""
    INPROCESS_HARD_TIMEOUT = "inprocess_hard_timeout"
    """In-process restart: no progress within ``inprocess_restart.hard_timeout``; the rank is terminated."""
    INPROCESS_DEAD_PEER = "inprocess_dead_peer"
    """In-process restart: ``rank``'s monitor stopped sending heartbeats (the process or node is gone)."""
    RERUN_NAN = "rerun_nan"
    """The re-run state machine: a NaN/Inf loss on ``rank`` at ``iteration``."""
    RERUN_SPIKE = "rerun_spike"
    """The re-run state machine: a loss far above the largest seen, on ``rank`` at ``iteration``."""
    NAN_GUARD = "nan_guard"
    """The loss guard (re-runs off, or a process's first step): a NaN/Inf loss on ``rank``."""
    PREEMPTION_SIGNAL = "preemption_signal"
    """``train.exit_signal`` reached a rank; every rank agreed to save and stop."""
    STRAGGLER_SCORE = "straggler_score"
    """Straggler detection: ``rank`` scored ``score`` below ``threshold``."""
    LOCAL_CHECKPOINT_HASH = "local_checkpoint_hash"
    """A local-tier checkpoint failed its content hashes at load and was discarded."""
    CHECKPOINT_VERIFICATION = "checkpoint_verification"
    """A global checkpoint failed verification against its manifest at load; an older one is tried."""
    LIVENESS_PING = "liveness_ping"
    """The liveness ping lost ``rank``."""
    OUT_OF_MEMORY = "out_of_memory"
    """The launcher: the worker of ``rank`` (``worker_pid``), dead by SIGKILL, was killed by the kernel's
    out-of-memory killer (``utils/oom.py``: the kernel log names its pid, or the host's OOM-kill counter rose since
    the workers started; ``detail`` says which). Written after that worker's ``launcher_worker_exit``."""
    STORAGE_FULL = "storage_full"
    """A checkpoint directory (``tier``) had too little free space for the save of ``iteration``, or filled up
    during it (``ENOSPC``/``EDQUOT``); ``rank``: the rank that saw it. The run stops with exit code 26 (or goes on
    under ``checkpoint.global_save_failure_policy="continue_local"``)."""
    STORAGE_UNAVAILABLE = "storage_unavailable"
    """A checkpoint directory (``tier``) could not be written or read (read-only, no permission, I/O error); exit
    code 27 (or training goes on under ``continue_local``)."""
    SAVE_DIR_CHANGED = "save_dir_changed"
    """``checkpoint.save`` was removed or replaced while the run was going (seen at the save of ``iteration``); it is
    created again and saving goes on."""
    WEIGHT_HASH = "weight_hash"
    """The weight-hash check (``train.check_weight_hash_across_dp_replicas_interval``): ``rank`` holds weights that
    differ from its data-parallel group's majority (with two replicas, both are named) after ``iteration``; exit
    code 31 (roll back to the newest checkpoint) or 30 (the rank was named before)."""
    NO_PROGRESS = "no_progress"
    """The no-progress guard (``health/no_progress.py``), rank 0 at a restart's set-up: the last
    ``ft.max_no_progress_restarts`` attempts failed without progress; ``rank``, ``iteration`` and ``signal`` name the
    failure they repeated (unset when they differ), ``detail`` is the report; the job stops with exit code 29."""


_INPROCESS_INTERRUPTIONS = {
    "EXCEPTION": Mechanism.INPROCESS_EXCEPTION,
    "BASE_EXCEPTION": Mechanism.INPROCESS_EXCEPTION,
    "MONITOR_PROCESS_EXCEPTION": Mechanism.INPROCESS_EXCEPTION,
    "SOFT_TIMEOUT": Mechanism.INPROCESS_SOFT_TIMEOUT,
    "HARD_TIMEOUT": Mechanism.INPROCESS_HARD_TIMEOUT,
    "TERMINATED": Mechanism.INPROCESS_DEAD_PEER,
    "UNRESPONSIVE": Mechanism.INPROCESS_DEAD_PEER,
}


def inprocess_mechanism(interruption: Any) -> Mechanism:
    """The mechanism of an in-process restart interruption (nvidia-resiliency-ext's ``Interruption`` or its name)."""
    name = getattr(interruption, "name", str(interruption)).rsplit(".", 1)[-1]
    return _INPROCESS_INTERRUPTIONS.get(name, Mechanism.INPROCESS_EXCEPTION)


class RestartLayer(enum.StrEnum):
    """Which layer restarted (``layer`` of ``restart_begun``/``restart_ended``/``workers_stopped``)."""

    IN_PROCESS = "in_process"
    """The training function ran again in the same processes (nvidia-resiliency-ext's ``inprocess.Wrapper``)."""
    IN_JOB = "in_job"
    """The launcher stopped and restarted its worker processes."""
    REQUEUE = "requeue"
    """The scheduler started the job again."""


class CyclePhase(enum.StrEnum):
    """A phase of a restart cycle, in their order (``cycle_phase`` of ``phase``; ``docs/training/events.md``).

    A training attempt writes a ``phase`` event for each of its own (process start to data build); the drill derives
    the others from the launcher's, the restart layers' and the steps' events.
    """

    DETECTION = "detection"
    """From the fault to its detection (``fault_injected`` to ``fault_detected``)."""
    TEARDOWN = "teardown"
    """From the detection until the failed attempt is gone (``workers_stopped``; in-process: the new iteration)."""
    RENDEZVOUS = "rendezvous"
    """In-job: from ``workers_stopped`` to the new worker's fork (the launcher's rendezvous and spawn)."""
    PROCESS_START = "process_start"
    """From the worker's fork to the training function's start (interpreter, imports, the in-process wrapper)."""
    PROCESS_GROUP = "process_group"
    """The attempt's components built, its process group initialized (every rank joins)."""
    HEALTH_CHECKS = "health_checks"
    """The components' ``setup``: device health, the rank monitor's connection, the no-progress guard..."""
    MODEL_BUILD = "model_build"
    """The checkpoint manager, the model and its optimizer built."""
    CHECKPOINT_LOAD = "checkpoint_load"
    """The newest valid checkpoint loaded (or found absent: a fresh start)."""
    DATA_BUILD = "data_build"
    """The data iterators built."""
    FIRST_STEP = "first_step"
    """From the end of set-up to the first ``step_completed`` (the features' ``ready``, the step itself)."""


class Process(enum.StrEnum):
    """Which kind of process wrote an event (``process``)."""

    WORKER = "worker"
    LAUNCHER = "launcher"
    RANK_MONITOR = "rank_monitor"


@dataclass(frozen=True)
class Event:
    """One event: common fields, then the fields of its kind (``None``: not applicable or unknown).

    ``docs/training/events.md`` lists which fields each kind carries.
    """

    kind: EventKind
    time: float
    """Wall-clock unix seconds when it was written."""
    mono: Optional[float] = None
    """``time.monotonic()`` of the writer (Linux: seconds since boot, comparable between processes of one host)."""
    process: Optional[Process] = None
    host: Optional[str] = None
    pid: Optional[int] = None
    """The writing process."""
    rank: Optional[int] = None
    """The global rank the event is about: the writer's for a training process's own events; the worker's for the
    launcher's; the blamed rank for ``fault_detected``; the target for ``fault_injected``."""
    local_rank: Optional[int] = None
    restart_count: Optional[int] = None
    """In-job restarts before the attempt concerned (``TORCHELASTIC_RESTART_COUNT``); for ``restart_begun`` and
    ``restart_ended``, the count the restart leads to."""
    inprocess_iteration: Optional[int] = None
    """The in-process restart iteration of the attempt (0: the first)."""
    iteration: Optional[int] = None
    """The training iteration concerned (1-based: the step that ran, was saved or struck)."""
    mechanism: Optional[Mechanism] = None
    layer: Optional[RestartLayer] = None
    tier: Optional[str] = None
    """Checkpoint tier: ``"global"`` or ``"local"``."""
    bytes: Optional[int] = None
    """Checkpoint size in bytes (rank 0's view: the committed directory, or its node's files of a local one)."""
    seconds: Optional[float] = None
    """A duration: the step time; the loop's blocking time of a save; a load; a section's open time at a timeout;
    a teardown."""
    commit_seconds: Optional[float] = None
    """``checkpoint_saved``: seconds from the start of the save to its commit (an async save's background write)."""
    finalize_seconds: Optional[float] = None
    """``checkpoint_saved`` of an async save: the loop's time in the finalize that committed it (``seconds`` is the
    save call's); ``seconds + finalize_seconds`` is what the save blocked the loop. When the next save had to wait
    for it, that wait is also in the next save's ``seconds``."""
    timeout: Optional[float] = None
    """``fault_detected``: the timeout that expired."""
    section: Optional[str] = None
    """``fault_detected`` by the rank monitor: the section that timed out."""
    exit_code: Optional[int] = None
    signal: Optional[int] = None
    """A signal number: what killed a worker, or the signal a fault or a preemption used."""
    worker_pid: Optional[int] = None
    """``worker_exited``: the worker's process id."""
    applied: Optional[bool] = None
    """``step_completed``: the step's update was applied (``False``: skipped, e.g. a NaN step)."""
    fault: Optional[str] = None
    """``fault_injected``: the fault's spec (``kill@27:1``); ``fault_kind`` and ``phase`` are its parts."""
    fault_kind: Optional[str] = None
    phase: Optional[str] = None
    process_start: Optional[float] = None
    """``attempt_started``: unix time the process started (a forked worker: the fork)."""
    attempt_start: Optional[float] = None
    """``attempt_started``: unix time the attempt started (the process start, or an in-process iteration's start)."""
    attempt: Optional[str] = None
    job_id: Optional[str] = None
    score: Optional[float] = None
    threshold: Optional[float] = None
    relative_scores: Optional[dict[int, float]] = None
    """``straggler_report``: rank -> relative score (``None`` where a rank had no timing)."""
    individual_scores: Optional[dict[int, float]] = None
    flagged: Optional[list[int]] = None
    """``straggler_report``: the ranks below a threshold."""
    save_attempt: Optional[int] = None
    """``save_attempt_failed``: which attempt of the save failed (1: the first)."""
    retrying: Optional[bool] = None
    """``save_attempt_failed``: the save is tried again."""
    cycle_phase: Optional[CyclePhase] = None
    """``phase``: which phase of the attempt's set-up ended."""
    start: Optional[float] = None
    end: Optional[float] = None
    """``phase``: unix times the phase began and ended (``time.time()``, as ``time``: comparable across processes)."""
    detail: Optional[str] = None
    """Free text for people (never parse it)."""


_FIELDS = {f.name: f for f in dataclasses.fields(Event)}
_ENUMS: dict[str, type] = {"kind": EventKind, "mechanism": Mechanism, "layer": RestartLayer, "process": Process,
                           "cycle_phase": CyclePhase}  # fmt: skip
_INTS = ("pid", "rank", "local_rank", "restart_count", "inprocess_iteration", "iteration", "bytes", "exit_code",
         "signal", "worker_pid", "save_attempt")  # fmt: skip
_FLOATS = ("time", "mono", "seconds", "commit_seconds", "finalize_seconds", "timeout", "process_start",
           "attempt_start", "score", "threshold", "start", "end")  # fmt: skip
_STRS = ("host", "tier", "section", "fault", "fault_kind", "phase", "attempt", "job_id", "detail")
_SCORES = ("relative_scores", "individual_scores")


# ------------------------------------------------------------------------------------------ JSON form


def to_json(event: Event) -> dict[str, Any]:
    """The JSON object of ``event``: ``v`` first, then every field that is set (enums as their values)."""
    out: dict[str, Any] = {"v": SCHEMA_VERSION}
    for name in _FIELDS:
        value = getattr(event, name)
        if value is None:
            continue
        if isinstance(value, enum.Enum):
            value = value.value
        elif name in _SCORES:
            value = {str(r): (None if s is None or math.isnan(s) else s) for r, s in value.items()}
        elif isinstance(value, float) and not math.isfinite(value):
            value = None
        out[name] = value
    return out


_TYPED = frozenset(f.name for f in dataclasses.fields(Event)) - {"kind", "time", "mono", "process", "host", "pid"}
"""The fields an emitter sets, checked as the reader checks them (the writer sets the others itself)."""


def _coerce(name: str, value: Any) -> Any:
    """``value`` of field ``name`` as its type; ``ValueError`` naming the problem."""
    if value is None:
        return None
    if name in _ENUMS:
        try:
            return _ENUMS[name](value)
        except ValueError:
            raise ValueError(f"unknown {name} {value!r}") from None
    if name in _INTS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"field {name} is not an integer: {value!r}")
        return value
    if name in _FLOATS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"field {name} is not a number: {value!r}")
        return float(value)
    if name in _STRS:
        if not isinstance(value, str):
            raise ValueError(f"field {name} is not a string: {value!r}")
        return value
    if name in ("applied", "retrying"):
        if not isinstance(value, bool):
            raise ValueError(f"field {name} is not true/false: {value!r}")
        return value
    if name in _SCORES:
        if not isinstance(value, dict):
            raise ValueError(f"field {name} is not an object of rank -> score")
        try:
            return {int(r): (float("nan") if s is None else float(s)) for r, s in value.items()}
        except (TypeError, ValueError):
            raise ValueError(f"field {name} is not an object of rank -> score") from None
    if name == "flagged":
        if not isinstance(value, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in value):
            raise ValueError("field flagged is not a list of ranks")
        return list(value)
    raise AssertionError(f"no type for field {name}")  # every field of Event is in one of the tables above


def from_json(obj: Any) -> Event:
    """The :class:`Event` of a parsed JSON line; ``ValueError`` naming what is wrong (version, kind, a field)."""
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    version = obj.get("v")
    if version != SCHEMA_VERSION:
        raise ValueError(f"unknown version v={version!r} (this reader knows v={SCHEMA_VERSION})")
    if "kind" not in obj or "time" not in obj:
        raise ValueError("no kind or no time")
    values = {name: _coerce(name, value) for name, value in obj.items() if name in _FIELDS}
    return Event(**values)  # fields a newer writer added are ignored: additive fields keep the version


# ------------------------------------------------------------------------------------------ writing


def resolve_directory(configured: Optional[str], save_dir: Optional[str]) -> Optional[str]:
    """The event directory of a run: ``configured`` (``""``: off), else ``<save_dir>/events``, else ``None`` (off)."""
    if configured is None:
        return os.path.join(save_dir, DIRECTORY_NAME) if save_dir else None
    return configured or None


def directory_problem(directory: str) -> Optional[str]:
    """Why ``directory`` cannot be used as an event directory (``None``: it exists or can be created and written).

    Nothing is created: the nearest existing ancestor must be a directory this process may write into.
    """
    path = os.path.abspath(directory)
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} exists and is not a directory"
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is not a directory, so {path} cannot be created"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this process" + ("" if existing == path else f" ({path} is under it)")
    return None


def worker_file(rank: int) -> str:
    """The file of a training rank's events."""
    return f"events-rank{rank}.jsonl"


def launcher_file(host: Optional[str] = None) -> str:
    """The file of a node's launcher (and its rank monitors): several nodes' launchers share a directory."""
    return f"events-launcher-{host or socket.gethostname()}.jsonl"


class EventWriter:
    """Appends events to one file, one ``os.write`` per line; never raises into the caller.

    Args:
        directory: the event directory (created on the first event).
        name: the file name in it (:func:`worker_file`, :func:`launcher_file`).
        process: the kind of process writing.
        buffered: kinds kept in memory until the next event of another kind or :meth:`flush` (see the module doc).
        context: fields added to every event unless the event sets them (the writer's rank, restart count, ...).
    """

    def __init__(
        self, directory: str, name: str, process: Process, buffered: frozenset = frozenset(), **context: Any
    ) -> None:
        unknown = set(context) - set(_FIELDS)
        if unknown:
            raise TypeError(f"EventWriter: unknown context fields {sorted(unknown)}")
        self.directory = directory
        self.path = os.path.join(directory, name)
        self.process = process
        self.context = context
        self._host = socket.gethostname()
        self._fd: Optional[int] = None
        self._fd_pid: Optional[int] = None
        self._lock = threading.Lock()
        self._failed = False
        self._torn = False
        """A write failed: the file may end in a cut line, which the next line must not be glued onto."""
        self.buffered = frozenset(EventKind(k) for k in buffered)
        self._pending: list[bytes] = []
        """Lines of buffered kinds not written yet (this process's: a forked child drops its parent's)."""
        self._pending_pid = os.getpid()

    def emit(self, kind: Union[EventKind, str], **fields: Any) -> Optional[Event]:
        """Append one event of ``kind`` with ``fields`` (names of :class:`Event`); the event, or ``None`` if dropped.

        A kind in :attr:`buffered` is only kept in memory here: its write happens at the next :meth:`flush` or event of
        another kind (a failure then is logged, as for any write).
        """
        try:
            values = {**self.context, **fields}
            # The reader's rules on every known field (an unknown name fails in Event below).
            values = {name: _coerce(name, v) if name in _TYPED else v for name, v in values.items()}
            event = Event(
                kind=EventKind(kind),
                time=time.time(),
                mono=time.monotonic(),
                process=self.process,
                host=self._host,
                pid=os.getpid(),
                **values,
            )
            line = (json.dumps(to_json(event), separators=(",", ":")) + "\n").encode()
        except (TypeError, ValueError) as err:  # a programming error in the caller: say so, never stop training
            logger.error("event stream: dropped a %s event with bad fields %s: %s", kind, sorted(fields), err)
            return None
        if event.kind in self.buffered:
            with self._lock:
                self._own_pending().append(line)
            return event
        return event if self._write(line) else None

    def flush(self) -> None:
        """Write the buffered events now (nothing to do when none are buffered); never raises."""
        if self._pending:
            self._write(b"")

    def _own_pending(self) -> list[bytes]:
        if self._pending_pid != os.getpid():  # a forked child: the parent's lines are the parent's to write
            self._pending, self._pending_pid = [], os.getpid()
        return self._pending

    def _write(self, line: bytes) -> bool:
        """Write the buffered lines and then ``line``, in one ``os.write``; ``False`` if it failed (logged once)."""
        with self._lock:
            pending = self._own_pending()
            data = b"".join(pending) + line if pending else line
            self._pending = []
            if not data:
                return True
            try:
                if self._fd is None or self._fd_pid != os.getpid():  # a forked child opens its own descriptor
                    os.makedirs(self.directory, exist_ok=True)
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
                    self._fd_pid = os.getpid()
                if self._torn and not _ends_a_line(self.path):  # a full disk cut the last line: start a new one
                    data = b"\n" + data
                self._torn = False
                written = os.write(self._fd, data)
                if written < len(data):  # only on a full disk or a signal mid-write: finish the lines
                    os.write(self._fd, data[written:])
            except OSError as err:
                self._torn = True
                if not self._failed:
                    self._failed = True
                    logger.warning("event stream: cannot append to %s (%s); events are dropped", self.path, err)
                return False
        return True

    def close(self) -> None:
        """Write the buffered events and close the file (the next event opens it again)."""
        self.flush()
        with self._lock:
            if self._fd is not None and self._fd_pid == os.getpid():
                os.close(self._fd)
            self._fd = None


def _ends_a_line(path: str) -> bool:
    """Whether the file at ``path`` is empty or ends with a newline (a cut last line does not)."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


_writer: Optional[EventWriter] = None


def configure(
    directory: Optional[str],
    *,
    rank: int,
    local_rank: Optional[int] = None,
    restart_count: Optional[int] = None,
    inprocess_iteration: Optional[int] = None,
) -> Optional[EventWriter]:
    """Make this training process's events go to ``<directory>/events-rank<rank>.jsonl`` (``None``: nowhere).

    Called at the start of every attempt (an in-process restart iteration may change the rank); the other fields
    are added to every event this process writes.
    """
    global _writer
    if _writer is not None:
        _writer.close()
    _writer = None
    if directory:
        context = {"rank": rank, "local_rank": local_rank, "restart_count": restart_count}
        context["inprocess_iteration"] = inprocess_iteration
        _writer = EventWriter(directory, worker_file(rank), Process.WORKER, BUFFERED_KINDS, **context)
    return _writer


BUFFERED_KINDS = frozenset({EventKind.STEP_COMPLETED})
"""The kinds a training rank's writer buffers: the one written every step."""


def flush() -> None:
    """Write this process's buffered events (the loop calls it at its log interval); never raises."""
    current = _writer
    if current is not None:
        current.flush()


atexit.register(flush)  # an exit without an exception handler's close (sys.exit in user code) loses nothing


def writer() -> Optional[EventWriter]:
    """The writer of this process (``None`` until :func:`configure` named a directory)."""
    return _writer


def emit(kind: Union[EventKind, str], **fields: Any) -> Optional[Event]:
    """Append an event of ``kind`` to this process's stream (nothing when none is configured); never raises.

    ``fields`` are :class:`Event` field names; ``rank`` defaults to this process's rank. Returns the event written.
    """
    current = _writer
    return current.emit(kind, **fields) if current is not None else None
