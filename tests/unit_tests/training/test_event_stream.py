"""The event stream: typed events survive the round trip, concurrent writers never tear a line, bad lines are
reported with their line number and skipped, writing never raises, and the producers (recorder, launcher hooks,
ft_launch's flag, the drill runner) write what the schema says."""

import dataclasses
import json
import math
import multiprocessing
import os
import time
from types import SimpleNamespace

import pytest
from tests.unit_tests.configs import base_config

from megatron.bridge import ft_launch
from megatron.bridge.training.callbacks import CallbackContext, CheckpointCallbackContext
from megatron.bridge.training.checkpointing import CheckpointType
from megatron.bridge.training.events import launcher as launcher_events
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.reader import read_events, read_file
from megatron.bridge.training.events.recorder import EventRecorder
from megatron.bridge.training.events.stream import (
    SCHEMA_VERSION,
    Event,
    EventKind,
    EventWriter,
    Mechanism,
    Process,
    RestartLayer,
    worker_file,
)


def _writer(tmp_path, rank=0, **context):
    return EventWriter(str(tmp_path), worker_file(rank), Process.WORKER, rank=rank, **context)


def test_every_kind_round_trips_with_its_typed_fields(tmp_path):
    w = _writer(tmp_path, restart_count=2, inprocess_iteration=1)
    written = [
        w.emit(EventKind.ATTEMPT_STARTED, process_start=10.5, attempt_start=11.0, attempt="r2-i1", job_id="local"),
        w.emit(EventKind.STEP_COMPLETED, iteration=7, seconds=0.25, applied=True),
        w.emit(EventKind.CHECKPOINT_SAVED, tier="global", iteration=20, bytes=123456, seconds=0.4, commit_seconds=2.5),
        w.emit(EventKind.CHECKPOINT_LOADED, tier="local", iteration=25, bytes=99, seconds=1.5),
        w.emit(
            EventKind.FAULT_INJECTED, rank=1, fault="kill@27:1", fault_kind="kill", iteration=27, phase="step", signal=9
        ),  # fmt: skip
        w.emit(
            EventKind.FAULT_DETECTED,
            mechanism=Mechanism.RANK_MONITOR_SECTION_TIMEOUT,
            rank=1,
            section="step",
            seconds=5.5,
            timeout=5.0,
        ),  # fmt: skip
        w.emit(EventKind.FAULT_DETECTED, mechanism="inprocess_soft_timeout", rank=1, detail="no progress"),
        w.emit(EventKind.RESTART_BEGUN, layer=RestartLayer.IN_PROCESS, inprocess_iteration=2),
        w.emit(EventKind.RESTART_ENDED, layer="in_process", inprocess_iteration=2, seconds=1.25),
        w.emit(EventKind.WORKERS_STOPPED, layer=RestartLayer.IN_JOB, restart_count=3, seconds=0.5),
        w.emit(EventKind.WORKER_EXITED, rank=1, local_rank=1, exit_code=-9, signal=9, worker_pid=4242),
        w.emit(
            EventKind.STRAGGLER_REPORT,
            iteration=60,
            relative_scores={0: 1.0, 1: 0.07},
            flagged=[1],
            individual_scores={0: float("nan"), 1: 0.5},
        ),  # fmt: skip
        w.emit(EventKind.EXIT, exit_code=18, detail="PREEMPTED"),
    ]
    assert all(isinstance(e, Event) for e in written)
    events, problems = read_file(w.path)
    assert problems == []
    assert len(events) == len(written)
    for got, want in zip(events, written):
        nan_free = {k: v for k, v in vars(want).items() if k != "individual_scores"}
        assert {k: v for k, v in vars(got).items() if k != "individual_scores"} == nan_free
    report = events[11]
    assert report.relative_scores == {0: 1.0, 1: 0.07} and math.isnan(report.individual_scores[0])
    assert events[6].mechanism is Mechanism.INPROCESS_SOFT_TIMEOUT  # strings given to emit become the enums
    assert events[0].restart_count == 2 and events[0].inprocess_iteration == 1 and events[0].rank == 0
    assert events[4].rank == 1  # an event's own rank wins over the writer's
    line = json.loads(open(w.path).readline())
    assert line["v"] == SCHEMA_VERSION and line["kind"] == "attempt_started" and "mechanism" not in line
    assert {"time", "mono", "pid", "host", "process"} <= set(line)


def test_every_field_has_a_type_the_reader_checks():
    typed = {*event_stream._ENUMS, *event_stream._INTS, *event_stream._FLOATS, *event_stream._STRS}
    typed |= {*event_stream._SCORES, "applied", "retrying", "flagged"}
    assert {f.name for f in dataclasses.fields(Event)} == typed


def _append_many(path_dir: str, writer_id: int, count: int, buffered: bool) -> None:
    kinds = event_stream.BUFFERED_KINDS if buffered else frozenset()
    w = EventWriter(path_dir, "events-shared.jsonl", Process.WORKER, kinds, rank=writer_id)
    for i in range(count):
        w.emit(EventKind.STEP_COMPLETED, iteration=i, detail=f"{writer_id}:{i}:" + "x" * 16000)
        if i % 7 == 6:
            w.flush()
    w.close()


@pytest.mark.parametrize("buffered", [False, True], ids=["line-by-line", "buffered"])
def test_concurrent_appends_from_several_processes_are_whole_lines(tmp_path, buffered):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path), n, 300, buffered)) for n in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    events, problems = read_events(str(tmp_path))
    assert problems == []
    assert len(events) == 4 * 300
    seen = {e.detail.split(":", 2)[0] + ":" + e.detail.split(":", 2)[1] for e in events}
    assert len(seen) == 1200 and all(e.detail.endswith("x" * 16000) for e in events)
    per_writer = {}
    for e in read_file(str(tmp_path / "events-shared.jsonl"))[0]:  # file order: each writer's lines in its order
        per_writer.setdefault(e.rank, []).append(e.iteration)
    assert per_writer == {n: list(range(300)) for n in range(4)}


def _buffered(tmp_path, rank=0):
    return EventWriter(str(tmp_path), worker_file(rank), Process.WORKER, event_stream.BUFFERED_KINDS, rank=rank)


def test_step_events_wait_in_memory_until_a_flush_or_the_next_event_of_another_kind(tmp_path):
    w = _buffered(tmp_path)
    assert w.emit(EventKind.STEP_COMPLETED, iteration=1, seconds=0.1) is not None
    w.emit(EventKind.STEP_COMPLETED, iteration=2, seconds=0.1)
    assert read_file(w.path)[0] == []  # no system call per step
    w.flush()
    assert [e.iteration for e in read_file(w.path)[0]] == [1, 2]
    w.emit(EventKind.STEP_COMPLETED, iteration=3, seconds=0.1)
    w.emit(EventKind.FAULT_INJECTED, fault="kill@4:0", fault_kind="kill", iteration=4)  # written at once, after step 3
    w.emit(EventKind.STEP_COMPLETED, iteration=4, seconds=0.1)
    events = read_file(w.path)[0]
    assert [(e.kind, e.iteration) for e in events[2:]] == [(EventKind.STEP_COMPLETED, 3), (EventKind.FAULT_INJECTED, 4)]
    w.close()  # closing writes the rest
    events = read_file(w.path)[0]
    assert [e.iteration for e in events] == [1, 2, 3, 4, 4]
    assert [e.time for e in events] == sorted(e.time for e in events)  # each kept the time it was emitted
    w.emit(EventKind.EXIT, exit_code=0)  # the next event opens the file again
    assert read_file(w.path)[0][-1].kind == EventKind.EXIT


def _child_emits_a_fault(w: EventWriter) -> None:
    w.emit(EventKind.FAULT_DETECTED, mechanism=Mechanism.LAUNCHER_WORKER_EXIT, rank=1)
    w.close()


def test_a_forked_child_never_writes_its_parents_buffered_steps(tmp_path):
    w = _buffered(tmp_path)
    w.emit(EventKind.STEP_COMPLETED, iteration=1, seconds=0.1)
    child = multiprocessing.get_context("fork").Process(target=_child_emits_a_fault, args=(w,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert [e.kind for e in read_file(w.path)[0]] == [EventKind.FAULT_DETECTED]
    w.flush()
    assert [e.kind for e in read_file(w.path)[0]] == [EventKind.FAULT_DETECTED, EventKind.STEP_COMPLETED]


_RANK_SCRIPT = """
import os, signal, sys
from types import SimpleNamespace
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.callbacks import CallbackContext
from megatron.bridge.training.events.recorder import EventRecorder
from megatron.bridge.training.events.stream import EventKind
event_stream.configure(sys.argv[1], rank=0)
recorder = EventRecorder(0, flush_interval=5)
for step in range(7):  # iterations 1..7: flushed after 5
    state = SimpleNamespace(train_state=SimpleNamespace(step=step))
    recorder.on_train_step_end(CallbackContext(state=state, model=[], step_time=0.01, skipped_iter=False))
if sys.argv[2] == "fault":
    event_stream.emit(EventKind.FAULT_INJECTED, fault="kill@8:0", fault_kind="kill", iteration=8)
    for step in range(7, 9):
        state = SimpleNamespace(train_state=SimpleNamespace(step=step))
        recorder.on_train_step_end(CallbackContext(state=state, model=[], step_time=0.01, skipped_iter=False))
if sys.argv[2] in ("kill", "fault"):
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(3)  # no close: the interpreter's exit writes the buffered steps
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "ending, iterations",
    [("kill", [1, 2, 3, 4, 5]), ("fault", [1, 2, 3, 4, 5, 6, 7, "fault"]), ("exit", [1, 2, 3, 4, 5, 6, 7])],
)
def test_a_sigkill_loses_at_most_the_steps_since_the_last_flush_and_never_another_event(tmp_path, ending, iterations):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _RANK_SCRIPT, str(tmp_path), ending], capture_output=True, timeout=50)
    assert run.returncode == (-9 if ending != "exit" else 3), run.stderr.decode()[-2000:]
    events, problems = read_events(str(tmp_path))
    assert problems == []
    assert [e.iteration if e.kind == EventKind.STEP_COMPLETED else "fault" for e in events] == iterations


def test_bad_lines_are_reported_with_their_line_number_and_skipped(tmp_path):
    w = _writer(tmp_path, rank=3)
    w.emit(EventKind.STEP_COMPLETED, iteration=1, seconds=0.1)
    good = open(w.path).read()
    lines = [
        good.strip(),
        "this is not json",
        json.dumps({"v": 99, "kind": "step_completed", "time": 1.0}),
        json.dumps({"v": SCHEMA_VERSION, "kind": "meteor_strike", "time": 1.0}),
        json.dumps({"v": SCHEMA_VERSION, "kind": "fault_detected", "time": 1.0, "mechanism": "telepathy"}),
        json.dumps({"v": SCHEMA_VERSION, "kind": "step_completed", "time": 1.0, "iteration": "seven"}),
        json.dumps({"v": SCHEMA_VERSION, "kind": "step_completed", "time": 2.0, "iteration": 2, "new_field": 1}),
        good.strip()[: len(good) // 2],  # the writer was killed mid-line (no newline)
    ]
    (tmp_path / worker_file(3)).write_text("\n".join(lines))
    (tmp_path / "events-rank4.jsonl").write_bytes(b"\xff\xfe\n")
    events, problems = read_events(str(tmp_path))
    assert sorted(e.iteration for e in events) == [1, 2]  # an unknown field is additive: the event is kept
    reasons = {(os.path.basename(p.path), p.line): p.reason for p in problems}
    assert set(reasons) == {("events-rank3.jsonl", n) for n in (2, 3, 4, 5, 6, 8)} | {("events-rank4.jsonl", 1)}
    assert "not JSON" in reasons[("events-rank3.jsonl", 2)]
    assert "unknown version v=99" in reasons[("events-rank3.jsonl", 3)]
    assert "unknown kind 'meteor_strike'" in reasons[("events-rank3.jsonl", 4)]
    assert "unknown mechanism 'telepathy'" in reasons[("events-rank3.jsonl", 5)]
    assert "iteration is not an integer" in reasons[("events-rank3.jsonl", 6)]
    assert "truncated" in reasons[("events-rank3.jsonl", 8)]
    assert str(problems[0]).startswith(str(tmp_path / "events-rank3.jsonl") + ":2: ")
    assert read_events(str(tmp_path / "missing")) == ([], [])


def test_writing_never_raises_and_nothing_is_written_without_a_directory(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    w = EventWriter(str(blocker / "events"), worker_file(0), Process.WORKER)
    assert w.emit(EventKind.EXIT, exit_code=0) is None
    assert w.emit(EventKind.EXIT, exit_code=0) is None
    assert sum("cannot append" in r.message for r in caplog.records) == 1  # said once
    ok = _writer(tmp_path)
    assert ok.emit(EventKind.EXIT, no_such_field=1) is None
    assert ok.emit(EventKind.FAULT_DETECTED, mechanism="telepathy") is None
    # What the reader would skip is refused at the writer, where the mistake is made (a rank as the launcher's string).
    assert ok.emit(EventKind.FAULT_DETECTED, mechanism=Mechanism.LAUNCHER_WORKER_EXIT, rank="1") is None
    assert "bad fields" in caplog.text
    event_stream.configure(None, rank=0)
    assert event_stream.writer() is None and event_stream.emit(EventKind.EXIT, exit_code=0) is None
    try:
        event_stream.configure(str(tmp_path / "ev"), rank=5, restart_count=1)
        assert event_stream.emit(EventKind.EXIT, exit_code=0).rank == 5
    finally:
        event_stream.configure(None, rank=0)
    (event,), _ = read_events(str(tmp_path / "ev"))
    assert (event.kind, event.rank, event.restart_count, event.process) == (EventKind.EXIT, 5, 1, Process.WORKER)


def test_in_process_interruptions_map_to_mechanisms():
    from nvidia_resiliency_ext.inprocess.attribution import Interruption

    assert event_stream.inprocess_mechanism(Interruption.SOFT_TIMEOUT) is Mechanism.INPROCESS_SOFT_TIMEOUT
    assert event_stream.inprocess_mechanism("Interruption.HARD_TIMEOUT") is Mechanism.INPROCESS_HARD_TIMEOUT
    assert event_stream.inprocess_mechanism(Interruption.UNRESPONSIVE) is Mechanism.INPROCESS_DEAD_PEER
    for interruption in Interruption:  # every upstream interruption has a mechanism
        assert event_stream.inprocess_mechanism(interruption).value.startswith("inprocess_")


def test_the_directory_comes_from_the_config_and_must_be_creatable(tmp_path):
    assert event_stream.resolve_directory(None, "/ckpt") == "/ckpt/events"
    assert event_stream.resolve_directory(None, None) is None
    assert event_stream.resolve_directory("", "/ckpt") is None
    assert event_stream.resolve_directory("/ev", None) == "/ev"
    assert event_stream.directory_problem(str(tmp_path / "a" / "b")) is None
    (tmp_path / "f").write_text("")
    assert "not a directory" in event_stream.directory_problem(str(tmp_path / "f" / "events"))
    cfg = base_config()
    cfg.health.event_dir = str(tmp_path / "f" / "events")
    with pytest.raises(ValueError, match=r"health\.event_dir: cannot write events to .*not a directory"):
        cfg.validate(world_size=1)
    cfg = base_config()
    (tmp_path / "ckpt").mkdir()  # a writable save directory (validate() probes it) whose events/ is a file
    (tmp_path / "ckpt" / "events").write_text("")
    cfg.checkpoint.save = str(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"health\.event_dir \(default: <checkpoint.save>/events\)"):
        cfg.validate(world_size=1)
    cfg.health.event_dir = ""  # off: nothing to check
    cfg.validate(world_size=1)


def _ctx(step, **fields):
    return CallbackContext(state=SimpleNamespace(train_state=SimpleNamespace(step=step)), model=[], **fields)


def test_the_recorder_writes_steps_saves_sync_and_async_loads_and_the_exit(tmp_path):
    w = _writer(tmp_path)
    run = SimpleNamespace(load_started=None)
    rec = EventRecorder(0, writer=w, run=run)
    ckpt = tmp_path / "ckpt" / "iter_0000010"
    ckpt.mkdir(parents=True)
    (ckpt / "a.distcp").write_bytes(b"x" * 1000)
    (ckpt / "common.pt").write_bytes(b"y" * 24)
    rec.attempt_started(process_start=1.0, attempt_start=1.0, attempt="a0", job_id="local")
    run.load_started = time.perf_counter()  # as pretrain sets it before the load
    rec.on_checkpoint_load(CheckpointCallbackContext(None, str(ckpt), CheckpointType.GLOBAL, iteration=10))
    rec.on_train_step_end(_ctx(10, step_time=0.2, skipped_iter=False))
    # A synchronous save commits inside the blocking call: written at its end.
    rec.on_checkpoint_save_start(_ctx(10))
    rec.on_checkpoint_save(CheckpointCallbackContext(None, str(ckpt), CheckpointType.GLOBAL, iteration=10))
    assert not any(e.kind == EventKind.CHECKPOINT_SAVED for e in read_file(w.path)[0])
    rec.on_checkpoint_save_end(_ctx(10))
    # An asynchronous local save: the loop goes on, the commit comes steps later.
    local = tmp_path / "local" / "node" / "0"
    local.mkdir(parents=True)
    (local / "iter_0000015_0_local.pt").write_bytes(b"z" * 50)
    (local / "iter_0000010_0_local.pt").write_bytes(b"z" * 7)
    rec.on_checkpoint_save_start(_ctx(15))
    rec.on_checkpoint_save_end(_ctx(15))
    rec.on_train_step_end(_ctx(15, step_time=0.3, skipped_iter=True))
    local_commit = CheckpointCallbackContext(
        None, str(tmp_path / "local"), CheckpointType.LOCAL, iteration=15, finalize_seconds=0.05
    )  # the manager says how long the loop has been in the finalize committing it
    rec.on_checkpoint_save(local_commit)
    rec.exited(0, "reached train.train_iters=16")
    events, problems = read_file(w.path)
    assert problems == []
    kinds = [e.kind for e in events]
    assert kinds == [EventKind.ATTEMPT_STARTED, EventKind.CHECKPOINT_LOADED, EventKind.STEP_COMPLETED,
                     EventKind.CHECKPOINT_SAVED, EventKind.STEP_COMPLETED, EventKind.CHECKPOINT_SAVED,
                     EventKind.EXIT]  # fmt: skip
    load, step, sync, skipped, async_, end = events[1:]
    assert (load.tier, load.iteration, load.bytes) == ("global", 10, 1024) and load.seconds >= 0
    assert (step.iteration, step.seconds, step.applied) == (11, 0.2, True) and skipped.applied is False
    assert (sync.tier, sync.iteration, sync.bytes) == ("global", 10, 1024)
    assert sync.seconds is not None and sync.commit_seconds <= sync.seconds and sync.finalize_seconds is None
    assert (async_.tier, async_.iteration, async_.bytes) == ("local", 15, 50)
    assert async_.commit_seconds >= async_.seconds and async_.finalize_seconds == 0.05
    assert (end.exit_code, end.detail) == (0, "reached train.train_iters=16")
    other = EventRecorder(1, writer=_writer(tmp_path, rank=1))  # only rank 0 measures sizes
    other.on_checkpoint_save(CheckpointCallbackContext(None, str(ckpt), CheckpointType.GLOBAL, iteration=10))
    (saved,) = read_file(str(tmp_path / worker_file(1)))[0]
    assert saved.bytes is None and saved.seconds is None


def _agent(max_restarts=3, remaining=2):
    group = SimpleNamespace(spec=SimpleNamespace(max_restarts=max_restarts), workers=[])
    return SimpleNamespace(get_worker_group=lambda: group, _remaining_restarts=remaining), group


def test_the_launcher_writes_worker_exits_and_each_restart_phase(tmp_path):
    name = event_stream.launcher_file("vm")
    events = launcher_events.LauncherEvents(
        EventWriter(str(tmp_path), name, Process.LAUNCHER), EventWriter(str(tmp_path), name, Process.RANK_MONITOR)
    )
    agent, group = _agent()
    failure = SimpleNamespace(local_rank=1, pid=4242, exitcode=-9)
    events.monitored(group, SimpleNamespace(failures={1: failure}, return_values={}))
    events.monitored(group, SimpleNamespace(failures={1: failure}, return_values={}))  # seen once
    events.restart_begins(agent, group)
    events.stop_begins()
    events.stopped()
    events.started()
    group.workers = [SimpleNamespace(global_rank=r, local_rank=r, id=100 + r) for r in (0, 1)]
    events.monitored(group, SimpleNamespace(failures={}, return_values={0: None, 1: None}))
    events.started()  # not a restart: nothing
    found, problems = read_events(str(tmp_path))
    assert problems == []
    assert [e.kind for e in found] == [EventKind.WORKER_EXITED, EventKind.FAULT_DETECTED, EventKind.RESTART_BEGUN,
                                       EventKind.WORKERS_STOPPED, EventKind.RESTART_ENDED, EventKind.WORKER_EXITED,
                                       EventKind.WORKER_EXITED]  # fmt: skip
    exited, detected, begun, stopped, ended = found[:5]
    assert (exited.rank, exited.local_rank, exited.exit_code, exited.signal, exited.worker_pid) == (1, 1, -9, 9, 4242)
    assert (detected.mechanism, detected.rank, detected.signal) == (Mechanism.LAUNCHER_WORKER_EXIT, 1, 9)
    assert (begun.layer, begun.restart_count) == (RestartLayer.IN_JOB, 1)
    assert (stopped.layer, stopped.restart_count) == (RestartLayer.IN_JOB, 1) and stopped.seconds >= 0
    assert (ended.layer, ended.restart_count, ended.process) == (RestartLayer.IN_JOB, 1, Process.LAUNCHER)
    assert [(e.rank, e.exit_code, e.signal) for e in found[5:]] == [(0, 0, None), (1, 0, None)]


def test_a_rank_monitor_names_the_timeout_it_acts_on_once_per_rank_process(tmp_path):
    cfg = SimpleNamespace(rank_section_timeouts={"step": 5.0, "setup": 300.0}, rank_out_of_section_timeout=120.0,
                          rank_heartbeat_timeout=None, initial_rank_heartbeat_timeout=None)  # fmt: skip
    info = SimpleNamespace(global_rank=1, local_rank=1, pid=77)
    server = SimpleNamespace(cfg=cfg, rank_info=info, open_sections={"step": 100.0}, out_of_section_time=None,
                             last_hb_time=None, start_time=90.0)  # fmt: skip
    assert launcher_events.timed_out(server, 106.0) == (Mechanism.RANK_MONITOR_SECTION_TIMEOUT, "step", 6.0, 5.0)
    server.open_sections, server.out_of_section_time = {}, 10.0
    assert launcher_events.timed_out(server, 131.0)[:2] == (Mechanism.RANK_MONITOR_SECTION_TIMEOUT, "out_of_section")
    server.out_of_section_time, server.last_hb_time, cfg.rank_heartbeat_timeout = 130.0, 100.0, 20.0
    assert launcher_events.timed_out(server, 131.0) == (Mechanism.RANK_MONITOR_HEARTBEAT_TIMEOUT, None, 31.0, 20.0)
    name = event_stream.launcher_file("vm")
    events = launcher_events.LauncherEvents(
        EventWriter(str(tmp_path), name, Process.LAUNCHER), EventWriter(str(tmp_path), name, Process.RANK_MONITOR)
    )
    server.open_sections = {"step": 0.0}
    events.rank_monitor_timeout(server)
    events.rank_monitor_timeout(server)
    (event,), _ = read_events(str(tmp_path))
    assert (event.mechanism, event.rank, event.section, event.worker_pid) == (
        Mechanism.RANK_MONITOR_SECTION_TIMEOUT, 1, "step", 77)  # fmt: skip
    assert event.process == Process.RANK_MONITOR


def test_the_launcher_hooks_wrap_ft_launchers_agent_and_rank_monitor(tmp_path, monkeypatch):
    from megatron.bridge.utils import upstream

    keys = (launcher_events.MONITOR, launcher_events.RESTART, launcher_events.STOP, launcher_events.START,
            launcher_events.RANK_MONITOR_TIMEOUT)  # fmt: skip
    for key in keys:  # restored after the test
        monkeypatch.setattr(upstream.owner(key), key.rsplit(".", 1)[1], upstream.get(key))
    originals = {key: upstream.get(key) for key in keys}
    assert launcher_events.install(str(tmp_path)) is not None
    for key in keys:
        assert upstream.get(key) is not originals[key] and upstream.get(key).__wrapped__ is originals[key]


def test_ft_launch_takes_its_event_dir_flag_before_the_training_command():
    take = ft_launch.take_event_dir
    assert take(["--nproc-per-node=2", "--event-dir", "/ev", "-m", "mod", "--event-dir=/x"]) == (
        "/ev", ["--nproc-per-node=2", "-m", "mod", "--event-dir=/x"])  # fmt: skip
    assert take(["--event-dir=/ev", "--max-restarts", "3", "-m", "mod"]) == (
        "/ev",
        ["--max-restarts", "3", "-m", "mod"],
    )
    assert take(["--nproc-per-node=2", "-m", "mod"]) == (None, ["--nproc-per-node=2", "-m", "mod"])


def test_a_line_a_full_disk_cut_is_not_glued_to_the_next_event(tmp_path, monkeypatch):
    w = _writer(tmp_path)
    w.emit(EventKind.ATTEMPT_STARTED, attempt="a")
    real_write = os.write

    def half_then_full(fd, data):  # the disk fills up in the middle of the line
        real_write(fd, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(event_stream.os, "write", half_then_full)
    assert w.emit(EventKind.FAULT_DETECTED, mechanism=Mechanism.LIVENESS_PING, rank=1) is None
    monkeypatch.setattr(event_stream.os, "write", real_write)
    assert w.emit(EventKind.EXIT, exit_code=0, detail="space freed") is not None  # space came back
    events, problems = read_file(w.path)
    assert [e.kind for e in events] == [EventKind.ATTEMPT_STARTED, EventKind.EXIT]
    assert len(problems) == 1 and "not JSON" in problems[0].reason  # the cut line alone, reported
