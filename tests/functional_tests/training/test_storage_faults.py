"""Storage fault drills: checkpoint storage that fills up, turns read-only or unreadable, or vanishes mid-run.

Every fault is real: a size-limited tmpfs (``mount -t tmpfs -o size=...``), one filled up during a save by the
``fill`` fault (``faults/injection.py``), a read-only tmpfs, a directory the job's processes may not read (their
``CAP_DAC_OVERRIDE`` dropped with ``setpriv``, so that root obeys the mode bits), a save directory deleted while
the run is stopped. Each drill checks that the fault is detected (exit code and ``fault_detected`` event), attributed
(the message names the directory), that nothing is lost (the tracker names the last good iteration, which verifies,
and no temporary directory is left), and that the next start resumes.
"""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tests.capabilities import unavailable
from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.env_report import record
from tests.functional_tests.harness import (
    KEEP_SCHEDULE,
    assert_same_state,
    checkpoint_state,
    ft_launcher,
    launch,
    tail,
    torchrun,
)
from tests.mounts import slow_disk, tmpfs
from tests.resources import free_port

from megatron.bridge.training.checkpoint import layout, manifest, storage
from megatron.bridge.training.events.stream import EventKind, Mechanism
from megatron.bridge.training.faults.injection import FILL_FILE

FT = "ft.enable_ft_package=true"
# Sections without timeouts: the ranks report them and can ask ft_launcher not to restart, but the rank monitor
# times none of them. The full-disk drill under ft_launcher drills that request, not hang detection (its own drills
# do). With the harness's drill timeouts (step:6) a step that a loaded machine slowed past 6 s was taken for a hang:
# the rank monitor killed the rank and ft_launcher restarted the workers, one more attempt and load than the drill's.
SECTIONS_UNTIMED = [
    "--ft-rank-section-timeouts=setup:none,step:none,checkpointing:none", "--ft-workload-check-interval=1",
]  # fmt: skip
LOCAL = ["checkpoint.non_persistent_ckpt_type=local", "checkpoint.non_persistent_save_interval=2"]


def _remount(path: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)


def _nothing_lost(ckpt: Path, tracked: int) -> None:
    """The tracker names ``tracked``, that checkpoint verifies, and no save is left half-done where a loader looks."""
    assert layout.read_tracker(str(ckpt)) == tracked
    assert manifest.verify_dir(str(layout.iter_dir(str(ckpt), tracked))) == []
    leftovers = [p.name for p in ckpt.iterdir() if p.name.startswith((".tmp_iter", ".replaced", ".deleting"))]
    assert not leftovers, leftovers
    assert max(layout.committed_iterations(str(ckpt))) == tracked


def _resumes_exactly(reference_tp1, ckpt: Path, resumed, start: int) -> None:
    reference, reference_ckpt = reference_tp1
    assert resumed.exit_code == 0, tail(resumed)
    assert resumed.loaded() == [start]
    ref_losses = reference.losses()
    assert resumed.losses() == {i: ref_losses[i] for i in range(start + 1, 13)}
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


@pytest.mark.timeout(300)
def test_too_little_space_stops_before_writing_at_a_save_and_at_start(reference_tp1, tmp_path):
    size = sum(e.size for e in manifest.read_manifest(str(reference_tp1[1] / "iter_0000003")).values())
    # Room for the first save (checked against the tensors it writes), not for a second one next to it.
    with tmpfs(tmp_path / "fs", f"size={int(size * 1.6) + storage.SLACK_BYTES}") as fs:
        ckpt = fs / "ckpt"
        run = torchrun(ckpt)
        assert run.exit_code == 26, tail(run)
        assert "STORAGE_FULL (exit code 26)" in run.output
        assert f"checkpoint.save={ckpt}: not enough free space for the global checkpoint of iteration 6" in run.output
        assert "needed (the last global checkpoint was" in run.output and "Fix: free space in" in run.output
        [seen] = {(e.tier, e.iteration) for e in run.detected(Mechanism.STORAGE_FULL)}
        assert seen == ("global", 6)
        assert max(run.losses()) == 6
        _nothing_lost(ckpt, 3)

        again = torchrun(ckpt)  # nothing freed: the start's check refuses before a step is taken
        assert again.exit_code == 26, tail(again)
        assert_doc_log_lines(run.output + again.output)
        assert "not enough free space for the next global checkpoint (checked at start)" in again.output
        assert f"successfully loaded verified checkpoint {ckpt / 'iter_0000003'}" in again.output
        assert again.losses() == {}
        assert again.detected(Mechanism.STORAGE_FULL)
        _nothing_lost(ckpt, 3)

        _remount(fs, "size=64m")
        _resumes_exactly(reference_tp1, ckpt, torchrun(ckpt), 3)
        record("too little free space for the next global save (preflight)", run, Mechanism.STORAGE_FULL,
               resumed="from 3, bit-exact, once space was freed")  # fmt: skip
        record("too little free space at start (preflight)", again, Mechanism.STORAGE_FULL,
               resumed="from 3, bit-exact, once space was freed")  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_disk_full_during_a_global_save(reference_tp1, tmp_path, mode):
    extra = ["checkpoint.async_save=true"] if mode == "async" else []
    with tmpfs(tmp_path / "fs", "size=64m") as fs:
        ckpt = fs / "ckpt"
        run = torchrun(ckpt, *extra, env={"MBRIDGE_FAULTS": "fill@6:0:global_save"})
        assert run.exit_code == 26, tail(run)
        message = f"checkpoint.save={ckpt}: the file system is full: the global checkpoint of iteration 6 could not"
        assert message in run.output, tail(run)
        assert "were removed: a loader never sees them" in run.output
        assert_doc_log_lines(run.output)
        # The async writer's failure reached the training thread: it stopped the run, every rank with the event.
        detected = run.detected(Mechanism.STORAGE_FULL)
        assert {(e.tier, e.iteration) for e in detected} == {("global", 6)}
        assert {e.pid for e in detected} == {e.pid for e in run.events(EventKind.EXIT) if e.exit_code == 26}
        _nothing_lost(ckpt, 3)

        (ckpt / FILL_FILE).unlink()  # space freed
        _resumes_exactly(reference_tp1, ckpt, torchrun(ckpt, *extra), 3)
        article = "an" if mode == "async" else "a"
        record(
            f"disk full during {article} {mode} global save", run, Mechanism.STORAGE_FULL, resumed="from 3, bit-exact"
        )


@pytest.mark.timeout(300)
def test_a_full_disk_under_ft_launcher_is_not_restarted_and_the_job_exits_26(reference_tp1, tmp_path):
    # Before: ft_launcher restarted its workers into the same full disk until its restarts ran out, then exited 1.
    with tmpfs(tmp_path / "fs", "size=64m") as fs:
        ckpt = fs / "ckpt"
        fill = {"MBRIDGE_FAULTS": "fill@6:0:global_save"}
        run = ft_launcher(ckpt, FT, max_restarts=3, env=fill, ft_flags=SECTIONS_UNTIMED)
        assert run.exit_code == 26, tail(run)
        assert "asked ft_launcher not to restart the workers: exit code 26 (STORAGE_FULL)" in run.output, tail(run)
        assert "the workers failed with exit code 26 (STORAGE_FULL)" in run.output
        assert {e.restart_count for e in run.events(EventKind.ATTEMPT_STARTED)} == {0}  # one attempt, no restart
        assert run.events(EventKind.EXIT)[-1].exit_code == 26  # the launcher's exit event says the same
        _nothing_lost(ckpt, 3)

        (ckpt / FILL_FILE).unlink()  # space freed: the next job resumes
        _resumes_exactly(reference_tp1, ckpt, ft_launcher(ckpt, FT, max_restarts=3, ft_flags=SECTIONS_UNTIMED), 3)
        record("disk full during a global save under ft_launcher (--max-restarts=3)", run, Mechanism.STORAGE_FULL,
               resumed="from 3, bit-exact; not restarted into the full disk")  # fmt: skip


@pytest.mark.timeout(300)
def test_disk_full_during_an_async_local_save(reference_tp1, tmp_path):
    ckpt = tmp_path / "ckpt"
    with tmpfs(tmp_path / "local", "size=64m") as local:
        tier = [*LOCAL, f"checkpoint.non_persistent_local_ckpt_dir={local}", "checkpoint.async_save=true"]
        run = torchrun(ckpt, *tier, env={"MBRIDGE_FAULTS": "fill@4:1:local_save"})
        assert run.exit_code == 26, tail(run)
        assert f"checkpoint.non_persistent_local_ckpt_dir={local}: the file system is full: the local checkpoint " in (
            run.output
        )
        detected = run.detected(Mechanism.STORAGE_FULL)
        assert {(e.tier, e.iteration) for e in detected} == {("local", 4)}  # and the rank whose write failed:
        assert {e.rank for e in detected} <= {0, 1}  # 1 filled the node's disk; 0 may have been writing then too
        # No file of the failed save is left for a loader (nor a half-written .dirty one), the older one is intact.
        files = sorted(p.name for p in local.rglob("iter_*"))
        assert files == ["iter_0000002_0_local.pt", "iter_0000002_1_local.pt"], files
        _nothing_lost(ckpt, 3)

        (local / FILL_FILE).unlink()
        resumed = torchrun(ckpt, *tier)
        assert resumed.loads() == [("global", 3)]  # newer than the local tier's 2
        _resumes_exactly(reference_tp1, ckpt, resumed, 3)
    record("disk full during an async local save", run, Mechanism.STORAGE_FULL, resumed="from global 3, bit-exact")


@pytest.mark.timeout(300)
def test_continue_local_trains_on_when_global_saves_fail(tmp_path):
    local = tmp_path / "local"
    policy = "checkpoint.global_save_failure_policy=continue_local"
    with tmpfs(tmp_path / "fs", "size=64m") as fs:
        ckpt = fs / "ckpt"
        tier = [*LOCAL, f"checkpoint.non_persistent_local_ckpt_dir={local}", policy]
        run = torchrun(ckpt, *tier, env={"MBRIDGE_FAULTS": "fill@6:0:global_save"})
        assert run.exit_code == 0, tail(run)
        detected = run.detected(Mechanism.STORAGE_FULL)
        assert sorted({e.iteration for e in detected}) == [6, 9, 12]  # every global save after the disk filled
        lines = run.output.splitlines()
        warnings = [line for line in lines if "[rank0] WARNING" in line and "continue_local: training goes on" in line]
        assert len(warnings) == 3, tail(run)
        _nothing_lost(ckpt, 3)
        assert sorted({p.name.split("_")[1] for p in local.rglob("iter_*_local.pt")}) == ["0000012"]

        (ckpt / FILL_FILE).unlink()
        resumed = torchrun(ckpt, *tier)  # the state the failed global save could not keep is in the local tier
        assert resumed.exit_code == 0, tail(resumed)
        assert resumed.loads() == [("local", 12)]
        record("disk full, global_save_failure_policy=continue_local", run, Mechanism.STORAGE_FULL,
               lost="nothing (iterations 6-12 kept in the local tier)", resumed="from local 12")  # fmt: skip


@pytest.mark.timeout(300)
def test_read_only_save_dir_is_refused_at_validation(tmp_path):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        run = torchrun(ro / "ckpt")
        assert run.exit_code == 2, tail(run)
        expected = f"checkpoint.save: '{ro / 'ckpt'}' cannot be created: creating a file in its parent {ro} failed"
        assert expected in run.output and "Read-only file system" in run.output, tail(run)
        assert "Fix: remount it read-write" in run.output
    record("read-only save directory", run, lost="nothing (refused before start)")


def _wait_until(condition, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)
    return found


def _stopped_rank0(events: Path):
    """The pid of rank 0 once it stopped itself (its ``hang`` fault's event is written just before)."""
    try:
        lines = (events / "events-rank0.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        event = json.loads(line)
        if event.get("kind") == "fault_injected" and event.get("fault_kind") == "hang":
            with open(f"/proc/{event['pid']}/stat") as f:
                return event["pid"] if f.read().rsplit(")", 1)[1].split()[0] == "T" else None
    return None


@pytest.mark.timeout(300)
def test_save_dir_deleted_mid_run_is_recreated_and_a_restart_resumes_from_it(reference_tp1, tmp_path):
    ckpt = tmp_path / "ckpt"
    outcome = []
    training = threading.Thread(target=lambda: outcome.append(torchrun(ckpt, env={"MBRIDGE_FAULTS": "hang@5:0"})))
    training.start()
    try:
        pid = _wait_until(lambda: _stopped_rank0(ckpt / "events"), "stopped rank 0")
        assert layout.read_tracker(str(ckpt)) == 3
        os.rename(ckpt, tmp_path / "gone")  # the whole directory goes, while rank 0 is stopped at step 5
        shutil.rmtree(tmp_path / "gone", ignore_errors=True)
        os.kill(pid, signal.SIGCONT)
    finally:
        training.join()
    [run] = outcome
    assert run.exit_code == 0, tail(run)
    # Removed, or already created again by this run's own writes (goodput's record) when the save looks at it.
    assert re.search(rf"checkpoint\.save={re.escape(str(ckpt))} was (removed|replaced): ", run.output), tail(run)
    assert_doc_log_lines(run.output)
    detected = run.detected(Mechanism.SAVE_DIR_CHANGED)
    assert {e.iteration for e in detected} == {6}
    assert layout.committed_iterations(str(ckpt)) == [12, 9, 6]
    _nothing_lost(ckpt, 12)
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_tp1[1] / "iter_0000012"))

    resumed = torchrun(ckpt, "train.train_iters=13", KEEP_SCHEDULE)
    assert resumed.exit_code == 0, tail(resumed)
    assert resumed.loaded() == [12] and sorted(resumed.losses()) == [13]
    record("save directory deleted mid-run", run, Mechanism.SAVE_DIR_CHANGED,
           lost="the deleted checkpoints (3); later saves kept", resumed="from 12")  # fmt: skip


@pytest.mark.timeout(300)
def test_missing_or_unreadable_checkpoint_dir_on_resume(reference_tp1, tmp_path):
    ckpt, missing = tmp_path / "ckpt", tmp_path / "missing"
    run = torchrun(ckpt, f"checkpoint.load={missing}", "checkpoint.exit_on_missing_checkpoint=true")
    assert run.exit_code == 3, tail(run)
    assert f"checkpoint.load={missing} does not exist, and checkpoint.exit_on_missing_checkpoint" in run.output
    assert run.losses() == {}
    record("missing checkpoint.load with exit_on_missing_checkpoint", run, lost="nothing (nothing started)")

    if shutil.which("setpriv") is None:
        unavailable("setpriv (util-linux) is needed to make root obey a directory's mode bits")
    locked = tmp_path / "locked"
    shutil.copytree(reference_tp1[1], locked, ignore=shutil.ignore_patterns("events"))
    locked.chmod(0)
    try:
        # The launcher and the ranks run without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH: root obeys the mode bits.
        without_override = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
        launcher = [*without_override, sys.executable, "-m", "megatron.bridge.launch", "--nproc-per-node=2"]
        run = launch([*launcher, f"--master-port={free_port()}"], ckpt, f"checkpoint.load={locked}")
        assert run.exit_code == 27, tail(run)
        assert "STORAGE_UNAVAILABLE (exit code 27): cannot read the checkpoint directory" in run.output, tail(run)
        assert "Permission denied" in run.output and f"checkpoint.load={locked}" in run.output
        assert run.detected(Mechanism.STORAGE_UNAVAILABLE) and run.losses() == {}
    finally:
        locked.chmod(0o755)
    resumed = torchrun(ckpt, f"checkpoint.load={locked}")
    assert resumed.exit_code == 0, tail(resumed)
    assert resumed.loaded() == [12]
    record("unreadable checkpoint directory on resume", run, Mechanism.STORAGE_UNAVAILABLE,
           resumed="from 12 once readable")  # fmt: skip


# ------------------------------------------------------------------------------------------ slow storage

CHECKPOINTING_TIMEOUT_S = 3


def _detections(events: Path) -> list[dict]:
    found = []
    for path in events.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:  # a line being written
                continue
            if event.get("kind") == "fault_detected":
                found.append(event)
    return found


@pytest.mark.timeout(300)
def test_a_save_slower_than_its_section_timeout_is_a_slow_save_not_a_hung_step(reference_tp1, tmp_path):
    events = tmp_path / "events"  # off the slow disk: the drill watches them
    with slow_disk(tmp_path) as (mount, procs, lift):
        ckpt = mount / "ckpt"
        sections = f"setup:120,step:60,checkpointing:{CHECKPOINTING_TIMEOUT_S}"
        launcher = [
            "sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh",  # every process of the job in the throttled cgroup
            sys.executable, "-m", "megatron.bridge.ft_launch", f"--event-dir={events}", "--nproc-per-node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=1",
            f"--ft-rank-section-timeouts={sections}", "--ft-rank-out-of-section-timeout=120",
            "--ft-workload-check-interval=0.5",
        ]  # fmt: skip
        outcome = []
        overrides = ("ft.enable_ft_package=true", f"health.event_dir={events}")
        training = threading.Thread(target=lambda: outcome.append(launch(launcher, ckpt, *overrides, timeout=240)))
        training.start()
        try:
            _wait_until(lambda: _detections(events), "detection of the slow save", timeout=180)
        finally:
            lift()  # the storage recovers: the restarted job saves at full speed
            training.join()
        [run] = outcome
        run = dataclasses.replace(run, event_dir=events)
        assert run.exit_code == 0, tail(run)
        detected = run.detected(Mechanism.RANK_MONITOR_SECTION_TIMEOUT)
        assert detected and {e.section for e in detected} == {"checkpointing"}, tail(run)  # never "step"
        assert all(e.seconds > CHECKPOINTING_TIMEOUT_S for e in detected)
        assert_doc_log_lines(run.output)  # the launcher's "slow checkpoint save, not a hung step" line
        assert run.loads() == [], "the first save never committed: the restart starts over, nothing was half-loaded"
        assert sorted(run.losses())[-1] == 12
        assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_tp1[1] / "iter_0000012"))
    record(
        "storage slower than the checkpointing section timeout", run, Mechanism.RANK_MONITOR_SECTION_TIMEOUT,
        lost="the steps since the last checkpoint (none committed yet)", resumed="from scratch, bit-exact",
    )  # fmt: skip
