"""ft_launch: the workers' store port comes from outside the kernel's ephemeral range, through ft_launcher itself."""

import sys
import types

import pytest

from megatron.bridge import ft_launch


@pytest.mark.parametrize(
    ("ephemeral", "first", "last"),
    [("32768\t60999\n", 61000, 65533), ("40000 65000", 10000, 39997)],
)
def test_ports_are_taken_outside_the_ephemeral_range_leaving_room_for_derived_ones(tmp_path, ephemeral, first, last):
    path = tmp_path / "ip_local_port_range"
    path.write_text(ephemeral)
    ports = ft_launch.ports_outside_ephemeral_range(str(path))
    assert (ports[0], ports[-1], len(ports)) == (first, last, last - first + 1)


def test_without_a_readable_range_the_launcher_keeps_its_own_choice(tmp_path):
    assert ft_launch.ports_outside_ephemeral_range(str(tmp_path / "missing")) is None
    (tmp_path / "full").write_text("1024 65535")
    assert ft_launch.ports_outside_ephemeral_range(str(tmp_path / "full")) is None


def test_the_launchers_port_pick_is_replaced_for_the_run(monkeypatch):
    import nvidia_resiliency_ext.fault_tolerance.launcher as launcher

    from megatron.bridge.training.events.launcher import MONITOR
    from megatron.bridge.utils import upstream

    pick_port = _installed_port_pick()
    for key in (pick_port, MONITOR):
        _restored(monkeypatch, key)

    low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    picked = []

    def fake_launcher(args):  # what the agent (torch's rendezvous from 0.6) calls at every (re)start for MASTER_PORT
        if pick_port == upstream.PICK_PORT_SOCKET:
            with upstream.get(pick_port)() as sock:
                picked.append(sock.getsockname()[1])
        else:
            picked.append(upstream.get(pick_port)())
        return None

    monkeypatch.setattr(launcher, "main", fake_launcher)
    assert ft_launch.main(["--nproc-per-node=2"]) == 0
    (port,) = picked
    assert not low <= port <= high, f"port {port} is in the ephemeral range {low}-{high}"


def _installed_port_pick():
    """The installed ft_launcher's port pick (its own agent's before nvidia-resiliency-ext 0.6, torch's after)."""
    from megatron.bridge.utils import upstream

    key = upstream.applicable((upstream.PICK_PORT_SOCKET, upstream.PICK_PORT_NUMBER))
    assert key is not None
    return key


def _restored(monkeypatch, key):
    """Put ``key``'s upstream attribute back after the test (``ft_launch.main`` patches it for the process)."""
    import nvidia_resiliency_ext.fault_tolerance.launcher as launcher

    from megatron.bridge.utils import upstream

    monkeypatch.setattr(upstream.owner(key), key.rsplit(":", 1)[1].rsplit(".", 1)[-1], upstream.get(key))
    monkeypatch.setattr(launcher, "run", launcher.run)  # main wraps it too


def test_the_workers_code_replaces_ft_launchers_1_a_stop_code_first(capsys):
    failures = ft_launch.WorkerFailures()
    assert failures.exit_code(1) == 1 and failures.exit_code(0) == 0  # no failure seen: the launcher's own code

    def failure(code, at):
        return types.SimpleNamespace(exitcode=code, timestamp=at)

    failures.seen({1: failure(1, 1000), 0: failure(26, 1001)})  # rank 1 crashed in the collective rank 0 left
    assert failures.exit_code(1) == 26
    assert "the workers failed with exit code 26 (STORAGE_FULL)" in capsys.readouterr().err
    assert failures.exit_code(28) == 28  # a code of the launcher's own (not its "workers failed" 1) stands
    failures.seen({1: failure(-9, 1000)})  # the last failures are the ones that count
    assert failures.exit_code(1) == 128 + 9 and "(killed by a signal)" in capsys.readouterr().err
    failures.seen({0: failure(1, 1000)})
    assert failures.exit_code(1) == 1 and capsys.readouterr().err == ""  # a crash: nothing to say
    failures.seen({0: failure(42, 1000)})
    assert failures.exit_code(1) == 42 and "(not one of ours)" in capsys.readouterr().err
    failures.seen({})  # the restarted workers run healthy: the old failure no longer names the job's end
    assert failures.exit_code(1) == 1 and failures.exit_code(0) == 0


def test_a_launcher_that_exits_0_after_its_workers_failed_exits_with_their_code(capsys):
    failures = ft_launch.WorkerFailures()  # nvrx 0.4 with --max-restarts=0: "Agent .run() is OK", exit 0
    failures.seen({1: types.SimpleNamespace(exitcode=1, timestamp=1000)})
    assert failures.exit_code(0) == 1
    assert "ft_launcher exits 0 though its workers failed (exit code 1)" in capsys.readouterr().err


def test_a_launcher_that_ends_after_a_stop_code_exits_with_it(monkeypatch, capsys):
    import nvidia_resiliency_ext.fault_tolerance.launcher as launcher

    from megatron.bridge.training.events.launcher import MONITOR
    from megatron.bridge.utils import upstream

    for key in (_installed_port_pick(), MONITOR):
        _restored(monkeypatch, key)
    monkeypatch.setattr(ft_launch.standby, "install", lambda launcher_name, argv: argv)
    failed = {0: types.SimpleNamespace(exitcode=17, timestamp=1000)}
    monkeypatch.setattr(upstream.owner(MONITOR), "_monitor_workers", lambda agent, group: types.SimpleNamespace(
        failures=failed))  # fmt: skip

    agent = types.SimpleNamespace(_remaining_restarts=3)

    def upstream_main(args):  # the agent saw rank 0 fail with 17; with no restart left it stops: exit 1
        upstream.get(MONITOR)(agent, None)
        sys.exit(1)

    monkeypatch.setattr(launcher, "main", upstream_main)
    assert ft_launch.main(["--nproc-per-node=2", "train.py"]) == 17
    assert upstream.agent_restarts_left(agent) == 0, "a stop code is not restarted, though restarts were left"
    err = capsys.readouterr().err
    assert "a worker exited with exit code 17 (RERUN_FAILED_VALIDATION), whose action is stop" in err
    assert "the workers failed with exit code 17 (RERUN_FAILED_VALIDATION)" in err


@pytest.mark.parametrize("code,left", [(1, 3), (-9, 3), (2, 0), (26, 0)])
def test_only_a_stop_code_takes_the_agents_restarts_away(monkeypatch, code, left):
    from megatron.bridge.training.events.launcher import MONITOR
    from megatron.bridge.utils import upstream

    _restored(monkeypatch, MONITOR)
    failed = {1: types.SimpleNamespace(exitcode=code, timestamp=1000)}
    monkeypatch.setattr(upstream.owner(MONITOR), "_monitor_workers", lambda agent, group: types.SimpleNamespace(
        failures=failed))  # fmt: skip
    assert ft_launch.WorkerFailures().install()
    agent = types.SimpleNamespace(_remaining_restarts=3)
    closed = []
    group = types.SimpleNamespace(spec=types.SimpleNamespace(rdzv_handler=types.SimpleNamespace(
        set_closed=lambda: closed.append(True))))  # fmt: skip
    upstream.get(MONITOR)(agent, group)
    assert upstream.agent_restarts_left(agent) == left
    assert closed == ([True] if left == 0 else []), "a stop closes the rendezvous: no node starts another round"
