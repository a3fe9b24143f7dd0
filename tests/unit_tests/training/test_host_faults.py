"""Host and launch faults, our logic alone: the rendezvous-port probe and its message, the mapping of the store's own
errors to exit 28, the OOM verdict from the kernel's records, the ``out_of_memory`` event, the ``oom`` and
``clock-jump`` fault kinds. The real things (a held port, a kernel OOM kill, a clock jump) are drilled in
``tests/functional_tests/training/test_host_faults.py``."""

import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from torch.distributed import DistNetworkError
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.run import parse_args

from megatron.bridge import ft_launch, launch
from megatron.bridge.training.events import launcher as launcher_events
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.goodput import GoodputTracker
from megatron.bridge.training.events.reader import read_events
from megatron.bridge.training.events.stream import EventKind, EventWriter, Mechanism, Process
from megatron.bridge.training.exit_codes import ExitCode
from megatron.bridge.training.faults import effects as fault_effects
from megatron.bridge.training.faults import injection as fault_injection
from megatron.bridge.training.faults.injection import Fault, parse
from megatron.bridge.utils import oom, rendezvous_port
from megatron.bridge.utils.rendezvous_port import StorePort, hosted_store

SCRIPT = ["train.py", "train.train_iters=2"]


@pytest.fixture
def listening():
    """A socket listening on a free port (the squatter); yields the port."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------- the port probe


@pytest.mark.timeout(30)
def test_the_store_a_torchrun_launcher_hosts_comes_from_its_arguments():
    def store(*flags):
        return hosted_store(parse_args([*flags, *SCRIPT]))

    assert store("--master-port=29777") == StorePort("127.0.0.1", 29777, "--master-port")
    assert store("--nnodes=2", "--node-rank=0") == StorePort("127.0.0.1", 29500, "--master-port")  # the default
    assert store("--nnodes=2", "--node-rank=1", "--master-port=29777") is None  # node rank 0 hosts it
    assert store("--nproc-per-node=2") is None  # one node, no port: torchrun picks a free one
    assert store("--standalone") is None
    assert store("--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29401") == StorePort(
        "127.0.0.1", 29401, "--rdzv-endpoint"
    )
    assert store("--rdzv-backend=c10d", "--rdzv-endpoint=localhost") == StorePort(
        "localhost", rendezvous_port.C10D_DEFAULT_PORT, "--rdzv-endpoint"
    )
    assert store("--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0") is None
    assert store("--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29401") == StorePort(
        "127.0.0.1", 29401, "--rdzv-endpoint", shared=True
    )  # another node's launcher on this host may host it first
    assert store("--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29401", "--rdzv-conf=is_host=false") is None
    assert store("--rdzv-backend=c10d", "--rdzv-endpoint=192.0.2.1:29401") is None  # another host's store
    assert store("--rdzv-backend=c10d", "--rdzv-endpoint=192.0.2.1:29401", "--rdzv-conf=timeout=5,is_host=1") == (
        StorePort("192.0.2.1", 29401, "--rdzv-endpoint")
    )


@pytest.mark.timeout(30)
def test_ft_launchers_arguments_are_read_without_importing_it():
    argv = ["--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29401", "--max-restarts=1",
            "--ft-rank-section-timeouts", "setup:90,step:6", "--ft-rank-out-of-section-timeout=30",
            "--ignore-missing-fault-tol-cfg", "-m", "megatron.bridge.recipes.tiny_gpt",
            "--rdzv-endpoint=x:1"]  # fmt: skip
    args = rendezvous_port.parse_ft_launcher_args(argv)
    assert args is not None and args.training_script == "megatron.bridge.recipes.tiny_gpt"
    assert hosted_store(args) == StorePort("127.0.0.1", 29401, "--rdzv-endpoint")
    assert rendezvous_port.parse_ft_launcher_args(["--an-option-nobody-knows=1", *SCRIPT]) is None  # no probe


@pytest.mark.timeout(30)
def test_the_installed_ft_launchers_options_are_all_recognised_as_its_own():
    from nvidia_resiliency_ext.fault_tolerance.launcher import get_args_parser as ft_parser
    from torch.distributed.run import get_args_parser as torch_parser

    torchrun = {s for action in torch_parser()._actions for s in action.option_strings}
    extra = [a for a in ft_parser()._actions if a.option_strings and not set(a.option_strings) & torchrun]
    assert extra, "ft_launcher adds no option to torchrun's: is it the launcher?"
    for action in extra:
        for name in action.option_strings:
            if action.nargs == 0:
                assert name in rendezvous_port.FT_LAUNCHER_FLAGS, f"{name} takes no value: list it as a flag"
            else:
                assert name.startswith(rendezvous_port.FT_LAUNCHER_PREFIXES) or name in (
                    rendezvous_port.FT_LAUNCHER_OPTIONS
                ), f"{name} is not recognised as ft_launcher's"
                assert name not in rendezvous_port.FT_LAUNCHER_FLAGS, f"{name} takes a value"


def test_every_releases_spellings_are_read_and_a_missing_value_refused():
    for options in (
        ["--ft-param-rank_heartbeat_timeout", "30", "--fault-tol-cfg-path", "a.yaml", "--ignore-missing-fault-tol-cfg"],
        ["--ft-rank-heartbeat-timeout=30", "--ft-rdzv-impl", "barrier", "--ft-ignore-missing-cfg"],
        ["--ft-a-future-option", "7", "--restart-policy", "min-healthy"],
    ):
        args = rendezvous_port.parse_ft_launcher_args(["--nproc-per-node=2", *options, "train.py", "--ft-x", "1"])
        assert args is not None and args.training_script == "train.py", options
        assert args.training_script_args == ["--ft-x", "1"] and args.nproc_per_node == "2"
    assert rendezvous_port.parse_ft_launcher_args(["--nproc-per-node=2", "--ft-rank-heartbeat-timeout"]) is None


@pytest.mark.timeout(30)
def test_a_port_someone_listens_on_is_in_use_and_its_holder_named(listening):
    assert rendezvous_port.in_use(listening)
    assert rendezvous_port.holder(listening).startswith(f"pid {os.getpid()} (")
    message = rendezvous_port.port_taken(StorePort("127.0.0.1", listening, "--master-port"), "torchrun")
    assert f"the rendezvous port 127.0.0.1:{listening} (--master-port) is already in use" in message
    assert f"by pid {os.getpid()}" in message and "no worker was started" in message
    assert "--master-port=<a free port>" in message and "Exit code 28 (LAUNCH_FAILED)" in message
    ft = rendezvous_port.port_taken(StorePort("127.0.0.1", listening, "--rdzv-endpoint"), "ft_launcher")
    assert "--rdzv-endpoint=127.0.0.1:0" in ft and "--rdzv-conf=is_host=false" in ft


@pytest.mark.timeout(60)
def test_a_shared_port_a_launcher_holds_is_joined_and_one_anything_else_holds_is_refused(listening):
    # Several "nodes" on one host: the first agent hosts the c10d store, the next ones join it as clients.
    holder = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1); "
    holder += "print(s.getsockname()[1], flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", holder, "torchrun"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        assert rendezvous_port.port_taken(StorePort("127.0.0.1", port, "--rdzv-endpoint", shared=True), "x") is None
        assert rendezvous_port.port_taken(StorePort("127.0.0.1", port, "--rdzv-endpoint"), "x") is not None
    finally:
        proc.kill()
        proc.wait()
    squatted = rendezvous_port.port_taken(StorePort("127.0.0.1", listening, "--rdzv-endpoint", shared=True), "x")
    assert squatted is not None and "already in use" in squatted


@pytest.mark.timeout(30)
def test_a_launcher_is_told_by_a_whole_argument_not_by_part_of_one(monkeypatch):
    def listening(argv):
        monkeypatch.setattr(rendezvous_port, "listener", lambda port: (1, argv))
        return rendezvous_port.peer_launcher(29400)

    assert listening(["/venv/bin/python", "-m", "megatron.bridge.ft_launch", "--nproc-per-node=2"])
    assert listening(["/venv/bin/python", "/venv/bin/ft_launcher", "--rdzv-backend=c10d"])
    assert listening(["/usr/bin/torchrun", "train.py"])
    # a test run, an editor, a tail of a log: the name inside an argument is not a launcher
    assert not listening(["/venv/bin/python", "-m", "pytest", "tests/unit_tests/test_ft_launch.py"])
    assert not listening(["vim", "src/megatron/bridge/ft_launch.py"])


@pytest.mark.timeout(30)
def test_a_free_port_or_nothing_to_probe_gives_no_message():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert not rendezvous_port.in_use(port)
    assert rendezvous_port.port_taken(StorePort("127.0.0.1", port, "--master-port"), "torchrun") is None
    assert rendezvous_port.port_taken(None, "torchrun") is None


@pytest.mark.timeout(30)
def test_the_stores_own_errors_map_to_the_launch_failure_paragraph():
    store = StorePort("127.0.0.1", 29777, "--master-port")
    bind = DistNetworkError("The server socket has failed to listen on any local network address. port: 29777, "
                            "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")  # fmt: skip
    assert "127.0.0.1:29777 (--master-port) is already in use" in rendezvous_port.launch_error(
        bind, store, "127.0.0.1:29777", "torchrun"
    )
    assert ":29777 (--rdzv-endpoint) is already in use" in rendezvous_port.launch_error(
        bind, None, "127.0.0.1:29777", "ft_launcher"
    )
    try:
        try:
            raise TimeoutError("connect timed out")
        except TimeoutError as inner:
            raise RendezvousConnectionError("The connection to the C10d store has failed.") from inner
    except RendezvousConnectionError as err:
        unreachable = rendezvous_port.launch_error(err, None, "node7:29400", "ft_launcher")
    assert unreachable.startswith("launch failed: the rendezvous store at node7:29400 cannot be reached")
    assert "Exit code 28" in unreachable
    assert rendezvous_port.launch_error(ValueError("bad config"), store, "x:1", "torchrun") is None


# ---------------------------------------------------------------------------------------------- the launchers


@pytest.mark.timeout(30)
def test_torchrun_launch_exits_28_before_starting_anything_when_the_port_is_held(listening, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(launch.standby, "install", lambda launcher, argv: started.append(launcher) or argv)
    monkeypatch.setattr(launch, "run", lambda args: started.append("run"))
    assert launch.main([f"--master-port={listening}", *SCRIPT]) == ExitCode.LAUNCH_FAILED == 28
    assert started == []  # neither the standby nor the workers
    assert f"127.0.0.1:{listening} (--master-port) is already in use" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_torchrun_launch_maps_a_rendezvous_error_to_28_and_passes_others(monkeypatch, capsys):
    monkeypatch.setattr(launch.standby, "install", lambda launcher, argv: argv)

    def unreachable(args):
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    monkeypatch.setattr(launch, "run", unreachable)
    assert launch.main(["--nproc-per-node=2", *SCRIPT]) == 28
    assert "cannot be reached" in capsys.readouterr().err

    def broken(args):
        raise KeyError("not ours")

    monkeypatch.setattr(launch, "run", broken)
    with pytest.raises(KeyError):
        launch.main(["--nproc-per-node=2", *SCRIPT])


@pytest.mark.timeout(30)
def test_torchrun_launch_names_a_worker_the_oom_killer_killed(monkeypatch, capsys):
    monkeypatch.setattr(launch.standby, "install", lambda launcher, argv: argv)
    verdict = oom.OomVerdict(4321, True, "the kernel log: Killed process 4321 (python)", "/job", 256 << 20, 1000)

    class Watch:
        def verdict(self, pid):
            return verdict if pid == 4321 else None

    monkeypatch.setattr(launch.oom, "OomWatch", Watch)

    def killed(args):  # rank 1 killed by SIGKILL (first), rank 0 then stopped with SIGTERM
        failures = {1: ProcessFailure(1, 4321, -signal.SIGKILL, ""), 0: ProcessFailure(0, 4320, -signal.SIGTERM, "")}
        raise ChildFailedError("train.py", failures)

    monkeypatch.setattr(launch, "run", killed)
    assert launch.main(["--nproc-per-node=2", *SCRIPT]) == 128 + 9  # the first failure's code, as before
    lines = [line for line in capsys.readouterr().err.splitlines() if "out-of-memory" in line]
    assert len(lines) == 1 and lines[0].startswith("rank 1 (pid 4321) was killed by the kernel's out-of-memory")
    assert "memory cgroup /job, limit 256 MiB" in lines[0] and "train.micro_batch_size" in lines[0]


@pytest.mark.timeout(30)
def test_ft_launchers_run_ends_with_28_on_a_rendezvous_error_only(capsys):
    def fails(error):
        def run(args):
            raise error

        return ft_launch._rendezvous_errors_exit_28(run, StorePort("127.0.0.1", 29401, "--rdzv-endpoint"), None)

    with pytest.raises(SystemExit) as stop:
        fails(DistNetworkError("port: 29401, code: -98, name: EADDRINUSE"))(None)
    assert stop.value.code == 28 and "127.0.0.1:29401 (--rdzv-endpoint) is already in use" in capsys.readouterr().err
    with pytest.raises(RuntimeError):
        fails(RuntimeError("a worker's crash is not a launch failure"))(None)


# ---------------------------------------------------------------------------------------------- OOM verdict


def _kmsg(tmp_path, *records):
    path = tmp_path / "kmsg"
    path.write_text("".join(f"6,{i},{int(stamp * 1e6)},-;{text}\n SUBSYSTEM=x\n" for i, (stamp, text) in
                            enumerate(records)))  # fmt: skip
    return str(path)


def _vmstat(tmp_path, count):
    path = tmp_path / "vmstat"
    path.write_text(f"pgfault 12\noom_kill {count}\nother 1\n")
    return str(path)


@pytest.mark.timeout(30)
def test_the_kernel_logs_record_of_the_pid_is_proof_with_its_cgroup_and_limit(tmp_path):
    (tmp_path / "cg" / "memory" / "job" / "rank1").mkdir(parents=True)
    (tmp_path / "cg" / "memory" / "job" / "rank1" / "memory.limit_in_bytes").write_text(f"{256 << 20}\n")
    now = time.monotonic()
    kmsg = _kmsg(
        tmp_path,
        (now - 3600, "Memory cgroup out of memory: Killed process 4321 (python) total-vm:1kB, anon-rss:5kB"),  # old
        (now + 1, "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/job/"
                  "rank1,task_memcg=/job/rank1,task=python,pid=4321,uid=0"),
        (now + 1, "Memory cgroup out of memory: Killed process 4321 (python) total-vm:81924kB, anon-rss:71788kB, "
                  "file-rss:6488kB"),
    )  # fmt: skip
    watch = oom.OomWatch(_vmstat(tmp_path, 3), kmsg, str(tmp_path / "cg"))
    verdict = watch.verdict(4321)
    assert (verdict.certain, verdict.memcg, verdict.limit_bytes, verdict.anon_rss_kb) == (
        True, "/job/rank1", 256 << 20, 71788)  # fmt: skip
    line = oom.message(1, verdict)
    assert line.startswith("rank 1 (pid 4321) was killed by the kernel's out-of-memory killer (SIGKILL; the kernel ")
    assert "It reached the limit of its memory cgroup /job/rank1, limit 256 MiB." in line
    assert "train.micro_batch_size" in line and "model.recompute_granularity" in line and "more" in line
    assert watch.verdict(999) is None  # the log names another pid only: something else killed 999


@pytest.mark.timeout(30)
def test_a_machine_wide_oom_is_named_so(tmp_path):
    now = time.monotonic()
    kmsg = _kmsg(tmp_path, (now, "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,"
                                 "global_oom,task_memcg=/,task=python,pid=77,uid=0"),
                 (now, "Out of memory: Killed process 77 (python) total-vm:1kB, anon-rss:2kB"))  # fmt: skip
    verdict = oom.OomWatch(_vmstat(tmp_path, 0), kmsg, str(tmp_path)).verdict(77)
    assert verdict.memcg == "/" and "The machine ran out of memory" in oom.message(0, verdict)


@pytest.mark.timeout(30)
def test_without_the_kernel_log_a_rise_of_the_counter_is_likely_not_certain(tmp_path):
    vmstat = _vmstat(tmp_path, 5)
    watch = oom.OomWatch(vmstat, str(tmp_path / "no-kmsg"), str(tmp_path))
    assert watch.count == 5 and watch.verdict(4321) is None  # nothing since the workers started
    _vmstat(tmp_path, 6)
    verdict = watch.verdict(4321)
    assert verdict is not None and not verdict.certain and "rose by 1" in verdict.evidence
    assert oom.message(None, verdict).startswith("worker pid 4321 was most likely killed by the kernel's")
    assert oom.OomWatch(str(tmp_path / "none"), str(tmp_path / "no-kmsg")).verdict(1) is None  # nothing to read


@pytest.mark.timeout(30)
def test_the_limit_that_applies_to_a_process_v1_and_v2(tmp_path):
    v1 = tmp_path / "v1"
    (v1 / "memory" / "job").mkdir(parents=True)
    (v1 / "memory" / "job" / "memory.stat").write_text(f"cache 0\nhierarchical_memory_limit {128 << 20}\n")
    (tmp_path / "cg1").write_text("4:memory:/job\n0::/\n")
    assert oom.own_memory_limit(str(v1), str(tmp_path / "cg1")) == 128 << 20
    (v1 / "memory" / "job" / "memory.stat").write_text("hierarchical_memory_limit 9223372036854771712\n")
    assert oom.own_memory_limit(str(v1), str(tmp_path / "cg1")) is None
    v2 = tmp_path / "v2"
    (v2 / "job" / "step").mkdir(parents=True)
    (v2 / "job" / "memory.max").write_text(f"{64 << 20}\n")
    (v2 / "job" / "step" / "memory.max").write_text("max\n")
    (tmp_path / "cg2").write_text("0::/job/step\n")
    assert oom.own_memory_limit(str(v2), str(tmp_path / "cg2")) == 64 << 20


@pytest.mark.timeout(30)
def test_the_launcher_writes_out_of_memory_after_the_worker_exit(tmp_path):
    name = event_stream.launcher_file("vm")
    events = launcher_events.LauncherEvents(
        EventWriter(str(tmp_path), name, Process.LAUNCHER), EventWriter(str(tmp_path), name, Process.RANK_MONITOR)
    )
    asked = []

    class Watch:
        def verdict(self, pid):
            asked.append(pid)
            return oom.OomVerdict(pid, True, "the kernel log: Killed process 4242 (python)") if pid == 4242 else None

    events.memory = Watch()
    group = SimpleNamespace(workers=[])
    failures = {1: SimpleNamespace(local_rank=1, pid=4242, exitcode=-9),
                0: SimpleNamespace(local_rank=0, pid=4241, exitcode=-15)}  # fmt: skip
    events.monitored(group, SimpleNamespace(failures=failures, return_values={}))
    found, problems = read_events(str(tmp_path))
    assert problems == [] and asked == [4242]  # only a SIGKILL is looked up
    detected = [(e.mechanism, e.rank, e.worker_pid) for e in found if e.kind == EventKind.FAULT_DETECTED]
    assert detected == [(Mechanism.LAUNCHER_WORKER_EXIT, 1, 4242), (Mechanism.OUT_OF_MEMORY, 1, 4242),
                        (Mechanism.LAUNCHER_WORKER_EXIT, 0, 4241)]  # fmt: skip
    memory = [e for e in found if e.mechanism == Mechanism.OUT_OF_MEMORY][0]
    assert memory.signal == 9 and memory.detail == "the kernel log: Killed process 4242 (python)"
    events.workers_starting()  # a (re)start: a new watch, from now
    assert isinstance(events.memory, oom.OomWatch)


@pytest.mark.timeout(30)
def test_a_verdict_that_fails_never_fails_the_launcher(tmp_path):
    name = event_stream.launcher_file("vm")
    events = launcher_events.LauncherEvents(
        EventWriter(str(tmp_path), name, Process.LAUNCHER), EventWriter(str(tmp_path), name, Process.RANK_MONITOR)
    )
    events.memory = SimpleNamespace(verdict=lambda pid: 1 / 0)
    events.monitored(SimpleNamespace(workers=[]), SimpleNamespace(failures={
        0: SimpleNamespace(local_rank=0, pid=5, exitcode=-9)}, return_values={}))  # fmt: skip
    assert [e.mechanism for e in read_events(str(tmp_path))[0] if e.mechanism] == [Mechanism.LAUNCHER_WORKER_EXIT]


# ---------------------------------------------------------------------------------------------- fault kinds


@pytest.mark.timeout(30)
def test_the_oom_and_clock_jump_kinds_parse_and_round_trip():
    assert parse("oom@3:1") == [Fault("oom", 3, 1, phase="step")]
    assert parse("clock-jump@4:0:x3") == [Fault("clock-jump", 4, 0, factor=3.0)]
    for spec in ("oom@3:1", "clock-jump@4:0:x3", "clock-jump@2:1:x-2.5", "clock-jump@5:0"):
        [fault] = parse(spec)
        assert str(fault) == spec and parse(str(fault)) == [fault]
    for bad in ("oom@3:1:x2", "clock-jump@4:0:x0", "clock-jump@4:0:x20000", "oom@3:1:forward"):
        with pytest.raises(ValueError, match="bad item"):
            parse(bad)


@pytest.mark.timeout(30)
def test_a_clock_jump_moves_the_wall_clock_only(monkeypatch):
    monkeypatch.setattr(time, "time", time.time)  # restored after the test
    monkeypatch.setattr(time, "time_ns", time.time_ns)
    wall, mono = time.time(), time.monotonic()
    fault_injection.strike("clock-jump", "iteration 4", factor=2.0)
    assert 2 * 3600 - 5 < time.time() - wall < 2 * 3600 + 5
    assert abs(time.time_ns() / 1e9 - time.time()) < 1
    assert time.monotonic() - mono < 5
    fault_effects.jump_clock(-3.0)
    assert -3600 - 5 < time.time() - wall < -3600 + 5


@pytest.mark.timeout(30)
def test_goodputs_default_clock_is_read_once_from_the_wall_then_from_the_monotonic_clock(monkeypatch):
    now = {"wall": 1_000_000.0, "mono": 50.0}
    monkeypatch.setattr(time, "time", lambda: now["wall"])
    monkeypatch.setattr(time, "monotonic", lambda: now["mono"])
    tracker = GoodputTracker("job", "a0", now["wall"], None, 0, process_start=now["wall"], env={})  # default clock
    tracker.resume(None, 0, loaded=False)
    tracker.save_started(3)
    now["wall"] += 3 * 3600  # the system clock steps 3 hours ahead while the save runs 2 s
    now["mono"] += 2
    tracker.save_ended(3)
    summary = tracker.finish(3, "FINISHED (exit code 0)")
    assert tracker.ledger["lost_s"]["checkpoint_save"] == 2.0 and summary["wall_s"] == 2.0, summary


@pytest.mark.timeout(30)
def test_the_oom_kind_gives_up_past_its_limit_with_a_clear_error(monkeypatch):
    monkeypatch.setattr(fault_effects, "OOM_CHUNK", 1 << 20)
    monkeypatch.setattr(fault_effects, "OOM_MARGIN", 2 << 20)
    monkeypatch.setattr(fault_effects.oom, "own_memory_limit", lambda: 4 << 20)
    with pytest.raises(RuntimeError, match="oom allocated 6 MiB and the kernel did not kill the rank"):
        fault_injection.strike("oom", "iteration 3")
    monkeypatch.setattr(fault_effects.oom, "own_memory_limit", lambda: None)
    monkeypatch.setattr(fault_effects, "OOM_WITHOUT_LIMIT", 3 << 20)
    with pytest.raises(RuntimeError, match="no memory limit.*Slurm's --mem"):
        fault_injection.strike("oom", "iteration 3")
