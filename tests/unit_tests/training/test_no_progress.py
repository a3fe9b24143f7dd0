"""The no-progress guard's decision on synthetic event streams, its reading of an event directory, its config."""

import itertools
import time
from types import SimpleNamespace
from typing import Any, Optional

import pytest
from tests.unit_tests.configs import base_config

from megatron.bridge.training.components import Run
from megatron.bridge.training.config import FaultToleranceConfig
from megatron.bridge.training.events import reader as event_reader
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import Event, EventKind, EventWriter, Mechanism, Process
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.training.health import no_progress
from megatron.bridge.training.health.no_progress import Failure, NoProgressGuard, decide, read_history
from megatron.bridge.training.utils.overrides import apply_overrides

_clock = itertools.count(1000)


def _event(kind: EventKind, process: Process = Process.WORKER, **fields: Any) -> Event:
    return Event(kind=kind, time=float(next(_clock)), process=process, **fields)


def attempt(
    restart: int,
    resumed: Optional[int] = None,
    steps: int = 0,
    saves: tuple = (),
    job: str = "job1",
    killed: Optional[int] = 1,
    raised: Optional[tuple[int, str]] = None,
    exit_code: Optional[int] = None,
) -> list[Event]:
    """One attempt's events on 2 ranks: start, load, steps, saves, then how it ended.

    ``killed``: the rank SIGKILLed at the next step (its peer then fails in the collective); ``raised``: (rank,
    text) of an exception; ``exit_code``: every rank exits with it instead.
    """
    out = [_event(EventKind.ATTEMPT_STARTED, rank=r, restart_count=restart, job_id=job) for r in (0, 1)]
    if resumed is not None:
        out += [_event(EventKind.CHECKPOINT_LOADED, rank=r, iteration=resumed) for r in (0, 1)]
    for step in range((resumed or 0) + 1, (resumed or 0) + steps + 1):
        out += [_event(EventKind.STEP_COMPLETED, rank=r, iteration=step) for r in (0, 1)]
        if step in saves:
            out += [_event(EventKind.CHECKPOINT_SAVED, rank=r, iteration=step, tier="global") for r in (0, 1)]
    if exit_code is not None:
        return out + [_event(EventKind.EXIT, rank=r, exit_code=exit_code) for r in (0, 1)]
    if raised is not None:
        rank, text = raised
        out.append(_event(EventKind.EXIT, rank=rank, detail=text))
        out.append(_event(EventKind.EXIT, rank=1 - rank, detail="RuntimeError: Connection closed by peer"))
        return out + [_event(EventKind.WORKER_EXITED, Process.LAUNCHER, rank=r, exit_code=1) for r in (rank, 1 - rank)]
    if killed is not None:
        # The peer's broken collective is written first: the launcher sees the kill at its next look.
        out.append(_event(EventKind.EXIT, rank=1 - killed, detail="RuntimeError: Connection closed by peer"))
        out.append(_event(EventKind.WORKER_EXITED, Process.LAUNCHER, rank=killed, exit_code=-9, signal=9))
        out.append(_event(EventKind.WORKER_EXITED, Process.LAUNCHER, rank=1 - killed, exit_code=1))
    return out


def crash_loop(no_progress_attempts: int, job: str = "job1") -> list[Event]:
    """A fresh start that commits 3 and dies at 5, then restarts that resume from 3 and die at 5 again."""
    events = attempt(0, steps=4, saves=(3,), job=job)
    for restart in range(1, no_progress_attempts + 1):
        events += attempt(restart, resumed=3, steps=1, job=job)
    return events


def test_a_crash_loop_trips_after_the_limit_and_names_the_repeated_failure():
    assert decide(crash_loop(2), "job1", limit=3) is None
    verdict = decide(crash_loop(3), "job1", limit=3)
    assert verdict is not None and len(verdict.attempts) == 3
    # The killed rank is blamed, not its peer, although the peer's exit was written first.
    assert verdict.repeated == Failure(1, "killed by signal 9 (SIGKILL)", 5, signal=9)
    assert "the same failure each time: rank 1 at iteration 5: killed by signal 9 (SIGKILL)" in verdict.report
    assert "each resumed from iteration 3" in verdict.report and "past iteration 4" in verdict.report
    assert [a.start.restart_count for a in decide(crash_loop(5), "job1", limit=3).attempts] == [3, 4, 5]


def test_progress_made_resets_the_count():
    # Restart 2 gets past the furthest step before it (7 > 4) without a new checkpoint: progress. Then two restarts
    # that die earlier again: only those count.
    events = crash_loop(1) + attempt(2, resumed=3, steps=4) + attempt(3, resumed=3, steps=1) + attempt(4, 3, 1)
    assert decide(events, "job1", limit=3) is None
    verdict = decide(events, "job1", limit=2)
    assert [a.start.restart_count for a in verdict.attempts] == [3, 4]


def test_a_newer_commit_counts_as_progress_even_when_the_steps_were_lost():
    # Restart 1 reached step 8 (its last step events lost with it); restart 2 reaches only 6 but commits 6, newer
    # than any commit before (3): progress. Without that commit it would be the third attempt without progress.
    base = crash_loop(0) + attempt(1, resumed=3, steps=5)
    with_commit = base + attempt(2, resumed=3, steps=3, saves=(6,)) + attempt(3, resumed=6, steps=0)
    without = base + attempt(2, resumed=3, steps=3) + attempt(3, resumed=3, steps=0) + attempt(4, resumed=3)
    assert decide(with_commit, "job1", limit=1) is not None  # restart 3 made none
    assert len(decide(with_commit, "job1", limit=1).attempts) == 1
    assert decide(with_commit, "job1", limit=2) is None
    assert [a.start.restart_count for a in decide(without, "job1", limit=3).attempts] == [2, 3, 4]


def test_an_older_jobs_history_does_not_count():
    events = crash_loop(5, job="old") + crash_loop(1, job="job1")
    assert decide(events, "job1", limit=2) is None  # the new job's first attempt made progress from its resume
    assert decide(events, "job1", limit=1) is not None
    assert decide(crash_loop(5, job="old"), "job1", limit=1) is None


def test_an_attempt_that_ended_on_purpose_breaks_the_chain():
    events = crash_loop(2)
    events += attempt(3, resumed=3, exit_code=int(ExitCode.NO_PROGRESS))  # the guard stopped the job here
    events += attempt(4, resumed=3, steps=1) + attempt(5, resumed=3, steps=1)
    assert decide(events, "job1", limit=3) is None  # a relaunch after the guard's stop starts counting again
    assert len(decide(events, "job1", limit=2).attempts) == 2
    preempted = crash_loop(2) + attempt(3, resumed=3, steps=1, exit_code=int(ExitCode.PREEMPTED))
    assert decide(preempted, "job1", limit=2) is None


def test_the_rank_that_raised_is_blamed_not_the_peer_whose_collective_broke():
    events = attempt(0, steps=4, saves=(3,), raised=(1, "RuntimeError: bad batch"))
    for restart in (1, 2):
        events += attempt(restart, resumed=3, steps=1, raised=(1, "RuntimeError: bad batch"))
    verdict = decide(events, "job1", limit=2)
    assert verdict.repeated == Failure(1, "RuntimeError: bad batch", 5)
    assert "rank 1 at iteration 5: RuntimeError: bad batch" in verdict.report


def test_a_hang_the_rank_monitor_found_comes_before_the_kill_it_caused():
    events = crash_loop(0)
    for restart in (1, 2):
        hung = attempt(restart, resumed=3, steps=1, killed=None)
        hung.append(_event(EventKind.FAULT_DETECTED, Process.RANK_MONITOR, rank=0, section="step", timeout=6.0,
                           mechanism=Mechanism.RANK_MONITOR_SECTION_TIMEOUT))  # fmt: skip
        hung.append(_event(EventKind.WORKER_EXITED, Process.LAUNCHER, rank=0, exit_code=-9, signal=9))
        events += hung
    verdict = decide(events, "job1", limit=2)
    assert verdict.repeated == Failure(0, "hung: the rank monitor's section 'step' timeout (6 s) expired", 5)


def test_different_failures_are_each_named():
    events = crash_loop(1) + attempt(2, resumed=3, steps=1, killed=0)
    verdict = decide(events, "job1", limit=2)
    assert verdict.repeated is None
    assert "rank 1 at iteration 5: killed by signal 9" in verdict.report
    assert "rank 0 at iteration 5: killed by signal 9" in verdict.report


# --------------------------------------------------------------------------- reading and acting, on files


def _write(directory: str, events: list[Event]) -> None:
    """Each event into the file its writer would have used (the launcher's, or its rank's)."""
    writers: dict[tuple[str, Process], EventWriter] = {}
    skip = ("kind", "time", "mono", "host", "pid", "process")
    for e in events:
        launcher = e.process in (Process.LAUNCHER, Process.RANK_MONITOR)
        name = event_stream.launcher_file("host") if launcher else event_stream.worker_file(e.rank)
        writer = writers.setdefault((name, e.process), EventWriter(directory, name, e.process))
        fields = {k: v for k, v in vars(e).items() if v is not None and k not in skip}
        written = writer.emit(e.kind, **fields)
        assert written is not None
    for writer in writers.values():
        writer.close()


def _run(cfg: Any, rank: int = 0, job: str = "job1", started: float = 1e12) -> Run:
    return Run(
        cfg=cfg,
        global_state=None,
        rank=rank,
        attempt="a",
        inprocess_iteration=0,
        job_id=job,
        start_time=0.0,
        process_start=started,
        attempt_start=started,
    )


def _cfg(directory: Optional[str], limit: int = 3, enabled: bool = True) -> Any:
    ft = FaultToleranceConfig(enable_ft_package=enabled, max_no_progress_restarts=limit)
    return SimpleNamespace(ft=ft, health=SimpleNamespace(event_dir=directory), checkpoint=SimpleNamespace(save=None))


def test_the_guard_reads_the_directory_stops_every_rank_and_writes_its_event(tmp_path, monkeypatch):
    directory = str(tmp_path / "events")
    _write(directory, crash_loop(3))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "4")
    guard = NoProgressGuard.build(_run(_cfg(directory)))
    assert guard is not None
    event_stream.configure(directory, rank=0, restart_count=4)
    try:
        with pytest.raises(TrainingExit) as stop:
            guard.setup(_run(_cfg(directory)))
    finally:
        event_stream.configure(None, rank=0)
    assert stop.value.exit_code == ExitCode.NO_PROGRESS and int(ExitCode.NO_PROGRESS) == 29
    assert "rank 1 at iteration 5: killed by signal 9 (SIGKILL)" in stop.value.reason
    found, problems = event_reader.read_events(directory)
    (event,) = [e for e in found if e.mechanism == Mechanism.NO_PROGRESS]
    assert (event.rank, event.iteration, event.signal, event.exit_code) == (1, 5, 9, 29)
    assert event.detail == stop.value.reason and not problems
    # Its own event is this attempt's: a later reading before this attempt's start sees the same history.
    assert decide(read_history(directory, before=event.time), "job1", 3) is not None


def test_only_events_before_the_attempt_and_only_the_failed_ranks_files_are_read(tmp_path):
    directory = str(tmp_path / "events")
    _write(directory, crash_loop(3))
    (tmp_path / "events" / event_stream.worker_file(7)).write_text("not json\n")  # a rank no launcher named
    started = time.time()
    _write(directory, attempt(4, resumed=3, steps=1))  # this attempt's own events (another rank's clock ahead)
    history = read_history(directory, before=started)
    assert {e.rank for e in history} == {0, 1} and {e.restart_count for e in history} == {None, 0, 1, 2, 3}
    assert decide(history, "job1", limit=3) is not None


@pytest.mark.parametrize(
    "restart,limit,enabled,directory",
    [(0, 3, True, "dir"), (2, 0, True, "dir"), (2, 3, False, "dir"), (2, 3, True, "")],
    ids=["not-a-restart", "limit-0", "ft-off", "no-event-stream"],
)
def test_the_guard_is_off(monkeypatch, restart, limit, enabled, directory):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert NoProgressGuard.build(_run(_cfg(directory, limit, enabled))) is None


def test_a_slurm_requeue_is_a_restart(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert NoProgressGuard.build(_run(_cfg("dir"))) is not None


@pytest.mark.parametrize("value", ["-1", "true"])
def test_a_bad_limit_is_refused(value, monkeypatch):
    monkeypatch.setenv("FT_RANK_MONITOR_IPC_SOCKET", "/tmp/x")
    with pytest.raises(ValueError, match=no_progress.FIELD.replace(".", r"\.")):
        apply_overrides(base_config(), [f"{no_progress.FIELD}={value}"]).validate(world_size=1)
    apply_overrides(base_config(), [f"{no_progress.FIELD}=0"]).validate(world_size=1)
