"""Host and launch faults, each for real in a 2-rank run: a rendezvous port another process holds, a rank the
kernel's out-of-memory killer kills, a wall clock that jumps while training runs.

- Port: the test listens on the port itself, then launches on it (torchrun path and ft_launcher path): exit 28 with
  the paragraph naming host:port and the fix, within seconds (not the rendezvous's 600 s), no worker started.
- OOM: rank 1 is moved into a child memory cgroup (of the test's own) with a small limit as soon as it starts; the
  ``oom`` fault makes it allocate until the kernel kills it. The kill is the kernel's (the cgroup counts it); the
  launcher names it (log line and ``fault_detected``/``out_of_memory``). The cgroup is removed afterwards.
- Clock: ``clock-jump`` moves rank 0's wall clock 3 hours ahead and rank 1's 3 hours back, inside those two
  processes only (a real step of the system clock needs CAP_SYS_TIME and would move every test's clock on the
  machine; ``unshare --time`` offsets only the monotonic and boot clocks). With ``train.exit_duration_in_mins``, the
  liveness ping and hang attribution on, none of the ranks' own deadlines fires, training finishes, and goodput and
  event durations stay sane. ft_launcher and its rank monitors run under ft_launcher's section timeouts here, but
  their clocks do not move: that no section timeout fires shows only that the ranks kept reporting their sections
  through the jump. The monitors' own timing is immune by construction, not by this drill: nvidia-resiliency-ext's
  rank monitor and the ranks' timeout calculator read ``time.monotonic()``, which a step of the wall clock never
  moves (libfaketime would not drill it either: by default it fakes the monotonic clock too, which an NTP step does
  not, and without that it leaves the monitor's only clock alone).
"""

import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from tests.capabilities import unavailable
from tests.functional_tests.env_report import record
from tests.functional_tests.harness import FT_FLAGS, Run, ft_launcher, launch, tail
from tests.resources import free_port

from megatron.bridge.training.events.reader import read_events, read_file
from megatron.bridge.training.events.stream import EventKind, Mechanism, worker_file

PORT_LIMIT_S = 60
"""Far under the rendezvous timeouts a held port used to cost (600 s read, 900 s join under ft_launcher)."""


def _held(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def _assert_port_failure(run: Run, port: int, seconds: float) -> None:
    assert run.exit_code == 28, tail(run)
    assert f"launch failed: the rendezvous port 127.0.0.1:{port}" in run.output, tail(run)
    assert f"is already in use on this host by pid {os.getpid()} (" in run.output
    assert "no worker was started" in run.output and "Exit code 28 (LAUNCH_FAILED)" in run.output
    assert "Traceback" not in run.output, tail(run)
    assert seconds < PORT_LIMIT_S
    print(f"held port {port}: exit 28 after {seconds:.2f} s")


@pytest.mark.timeout(120)
def test_torchrun_on_a_held_master_port_exits_28_at_once(tmp_path):
    port = free_port()
    with _held(port):
        began = time.monotonic()
        launcher = [sys.executable, "-m", "megatron.bridge.launch", "--nproc-per-node=2", f"--master-port={port}"]
        run = launch(launcher, tmp_path / "ckpt", timeout=PORT_LIMIT_S + 30)
        seconds = time.monotonic() - began
    _assert_port_failure(run, port, seconds)
    assert "--master-port=<a free port>" in run.output
    assert not (tmp_path / "ckpt").exists()  # no rank ran
    record("rendezvous port in use (torchrun --master-port)", run, seconds=seconds, lost="nothing (nothing started)")


@pytest.mark.timeout(120)
def test_ft_launch_on_a_held_rdzv_endpoint_exits_28_at_once(tmp_path):
    port = free_port()
    event_dir = tmp_path / "ckpt" / "events"
    with _held(port):
        began = time.monotonic()
        launcher = [sys.executable, "-m", "megatron.bridge.ft_launch", f"--event-dir={event_dir}",
                    "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                    "--max-restarts=1", *FT_FLAGS]  # fmt: skip
        run = launch(launcher, tmp_path / "ckpt", timeout=PORT_LIMIT_S + 30)
        seconds = time.monotonic() - began
    _assert_port_failure(run, port, seconds)
    assert "--rdzv-endpoint=127.0.0.1:0" in run.output
    [end] = run.events()
    assert (end.kind, end.exit_code, end.detail.startswith("launch failed: the rendezvous port")) == (
        EventKind.EXIT, 28, True)  # fmt: skip
    assert sorted(p.name for p in event_dir.iterdir()) == [f"events-launcher-{socket.gethostname()}.jsonl"]
    record("rendezvous port in use (ft_launch --rdzv-endpoint)", run, seconds=seconds,
           lost="nothing (nothing started)")  # fmt: skip


# ------------------------------------------------------------------------------------------------------ OOM

_CGROUP_V1 = "/sys/fs/cgroup/memory"
OOM_LIMIT = 512 << 20
"""The child cgroup's limit: what rank 1 allocates after its move (set-up, two steps) fits; the fault's does not."""


def _own_memory_cgroup() -> Path:
    with open("/proc/self/cgroup") as f:
        path = next(line.strip().split(":", 2)[2] for line in f if "memory" in line.split(":")[1].split(","))
    return Path(_CGROUP_V1 + path)


def _remove_cgroup(cgroup: Path) -> None:
    """Move what is left to the parent, then remove the cgroup (a process that just died may take a moment)."""
    for _ in range(100):
        try:
            for pid in (cgroup / "cgroup.procs").read_text().split():
                try:
                    (cgroup.parent / "cgroup.procs").write_text(pid)
                except OSError:  # exited meanwhile
                    pass
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"could not remove {cgroup}")


def _first_attempt_pid(event_dir: Path, rank: int) -> int | None:
    found, _ = read_events(str(event_dir))
    return next((e.pid for e in found if e.kind == EventKind.ATTEMPT_STARTED and e.rank == rank), None)


@pytest.fixture
def memory_cgroup():
    """A child memory cgroup (cgroup v1) of this test's own, with a limit and no swap; removed afterwards.

    Where there is none to make (not root, no cgroup v1 memory controller): skipped, and failed in CI
    (``tests/capabilities.py``).
    """
    if not os.path.isdir(_CGROUP_V1) or os.geteuid() != 0:
        unavailable("needs root and the cgroup v1 memory controller")
    cgroup = _own_memory_cgroup() / f"mbridge-oom-{uuid.uuid4().hex[:8]}"
    cgroup.mkdir()
    try:
        (cgroup / "memory.limit_in_bytes").write_text(str(OOM_LIMIT))
        (cgroup / "memory.swappiness").write_text("0")
        yield cgroup
    finally:
        _remove_cgroup(cgroup)


@pytest.mark.timeout(240)
def test_a_rank_the_kernel_kills_for_memory_is_named_by_the_launcher(tmp_path, memory_cgroup):
    ckpt = tmp_path / "ckpt"
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(
            run=ft_launcher(ckpt, max_restarts=0, env={"MBRIDGE_FAULTS": "oom@2:1"}, timeout=180)
        ),  # fmt: skip
        daemon=True,
    )
    worker.start()
    pid = None
    while worker.is_alive() and pid is None:  # rank 1 into the limited cgroup as soon as it starts
        pid = _first_attempt_pid(ckpt / "events", 1)
        if pid is None:
            time.sleep(0.05)
            continue
        (memory_cgroup / "cgroup.procs").write_text(str(pid))
    worker.join(200)
    oom_control = (memory_cgroup / "memory.oom_control").read_text()
    failcnt = int((memory_cgroup / "memory.failcnt").read_text())
    run = result["run"]
    assert pid is not None, tail(run)
    assert "oom_kill 1" in oom_control.splitlines() and failcnt > 0, oom_control  # the kernel killed it
    assert run.exit_code == 128 + 9, tail(run)  # the killed rank's code: ft_launch passes it through
    [injected] = run.events(EventKind.FAULT_INJECTED)
    assert (injected.fault_kind, injected.rank, injected.signal) == ("oom", 1, None)  # no signal of ours
    [exited] = [e for e in run.events(EventKind.WORKER_EXITED) if e.worker_pid == pid]
    assert (exited.rank, exited.signal) == (1, 9)
    [detected] = run.detected(Mechanism.OUT_OF_MEMORY)
    assert (detected.rank, detected.worker_pid, detected.signal) == (1, pid, 9)
    if os.access("/dev/kmsg", os.R_OK):  # the kernel log names the pid: proof, not likelihood
        assert detected.detail.startswith(f"the kernel log: Memory cgroup out of memory: Killed process {pid} ")
    line = f"rank 1 (pid {pid}) was killed by the kernel's out-of-memory killer"
    assert line in run.output and "lower train.micro_batch_size" in run.output, tail(run)
    assert f"It reached the limit of its memory cgroup /{memory_cgroup.relative_to(_CGROUP_V1)}, limit 512 MiB" in (
        run.output
    )
    seconds = detected.time - injected.time
    assert 0 < seconds < 60
    print(f"OOM: the kernel killed rank 1 (pid {pid}); the launcher named it {seconds:.2f} s after the fault struck")
    record("a rank killed by the kernel's OOM killer", run, Mechanism.OUT_OF_MEMORY, seconds=seconds,
           lost="the steps since the last checkpoint", resumed="the launcher's restart policy decides")  # fmt: skip


# ------------------------------------------------------------------------------------------------------ clock

HOURS = 3


@pytest.mark.timeout(300)
def test_a_wall_clock_jump_in_the_ranks_fires_none_of_their_timeouts(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = ft_launcher(
        ckpt, "train.train_iters=8", "train.exit_duration_in_mins=30", "health.liveness_ping_interval=1",
        "health.liveness_ping_timeout=20", max_restarts=0,
        env={"MBRIDGE_FAULTS": f"clock-jump@4:0:x{HOURS},clock-jump@4:1:x-{HOURS}"}, timeout=240,
    )  # fmt: skip
    assert run.exit_code == 0, tail(run)  # exit_duration_in_mins against the wall clock would have stopped it (19)
    found, problems = read_events(str(ckpt / "events"))  # Run.events() keeps events after the launch by wall time
    assert problems == []
    assert sorted(e.fault for e in found if e.kind == EventKind.FAULT_INJECTED) == [
        f"clock-jump@4:0:x{HOURS}", f"clock-jump@4:1:x-{HOURS}"]  # fmt: skip
    # Nothing detected, nothing restarted: the ranks' liveness ping and hang watch, and the rank monitors, which saw
    # the ranks open and close their sections as before (the monitors' own clocks were not moved).
    assert [e for e in found if e.kind in (EventKind.FAULT_DETECTED, EventKind.RESTART_BEGUN)] == []
    assert sorted(e.exit_code for e in found if e.kind == EventKind.EXIT) == [0, 0, 0]  # two ranks, the launcher
    assert [e.iteration for e in found if e.kind == EventKind.STEP_COMPLETED and e.rank == 0] == list(range(1, 9))
    for rank, sign in ((0, 1), (1, -1)):
        mine, _ = read_file(str(ckpt / "events" / worker_file(rank)))  # in the order the rank wrote them
        assert all(b.mono >= a.mono for a, b in zip(mine, mine[1:]))  # monotonic, jump or not
        assert all(e.seconds is None or 0 <= e.seconds < 60 for e in mine)  # durations: no hours in them
        # Timestamps are the wall clock's, jump included: after the jump they read 3 hours off.
        before, after = [e for e in mine if e.iteration == 3][-1], [e for e in mine if e.iteration == 8][-1]
        assert abs(after.time - before.time - sign * HOURS * 3600) < 120
    summary = json.loads((ckpt / "goodput" / "summary.json").read_text())  # rank 0's clock jumped forward
    assert 0 < summary["wall_s"] < 600 and 0 < summary["goodput"] <= 1, summary
    assert all(-1 < seconds < 600 for seconds in summary["lost_s"].values()), summary
    print(f"clock jump: finished, goodput {summary['goodput']:.3f} of {summary['wall_s']:.1f} s wall")
    record("wall clock jumps +-3 h in the ranks during the run (injected in-process)", run,
           detected_by="nothing fired (as wanted): exit 0", lost="nothing")  # fmt: skip
