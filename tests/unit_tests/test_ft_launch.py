"""ft_launch: the workers' store port comes from outside the kernel's ephemeral range, through ft_launcher itself."""

import sys

import pytest

from megatron.bridge import ft_launch


@pytest.mark.parametrize(
    ("ephemeral", "first", "last"),
    [("32768\t60999\n", 61000, 65535), ("40000 65000", 10000, 39999)],
)
def test_ports_are_taken_above_the_ephemeral_range_else_below_it(tmp_path, ephemeral, first, last):
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

    from megatron.bridge.utils import upstream

    pick_port = "nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.agent.server.api:_get_socket_with_port"
    monkeypatch.setattr(upstream.owner(pick_port), pick_port.rsplit(":", 1)[1], upstream.get(pick_port))  # restored

    low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    picked = []

    def fake_launcher(args):
        with upstream.get(pick_port)() as sock:  # what the agent calls at every (re)start for MASTER_PORT
            picked.append(sock.getsockname()[1])
        return None

    monkeypatch.setattr(launcher, "main", fake_launcher)
    assert ft_launch.main(["--nproc-per-node=2"]) == 0
    (port,) = picked
    assert not low <= port <= high, f"port {port} is in the ephemeral range {low}-{high}"


def test_when_ft_launcher_gives_up_the_launcher_exits_with_the_workers_code(monkeypatch, capsys):
    import nvidia_resiliency_ext.fault_tolerance.launcher as launcher

    from megatron.bridge.utils import upstream

    # ft_launcher's own copy of torch elastic's classes: the ones its main catches
    ChildFailedError = launcher.ChildFailedError  # noqa: N806
    ProcessFailure = sys.modules[ChildFailedError.__module__].ProcessFailure  # noqa: N806

    pick_port = "nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.agent.server.api:_get_socket_with_port"
    monkeypatch.setattr(upstream.owner(pick_port), pick_port.rsplit(":", 1)[1], upstream.get(pick_port))  # restored
    monkeypatch.setattr(ft_launch.standby, "install", lambda launcher_name, argv: argv)

    def run(args):  # rank 1 crashed in the collective rank 0 left when it found the disk full
        failures = {0: ProcessFailure(0, 11, 26, ""), 1: ProcessFailure(1, 12, 1, "")}
        failures[1].timestamp, failures[0].timestamp = 1000, 1001
        raise ChildFailedError("train.py", failures)

    def upstream_main(args):  # what ft_launcher's main does with it: log, then exit 1
        try:
            launcher.run(args)
        except ChildFailedError:
            sys.exit(1)
        sys.exit(0)

    monkeypatch.setattr(launcher, "run", run)
    monkeypatch.setattr(launcher, "main", upstream_main)
    assert ft_launch.main(["--nproc-per-node=2", "train.py"]) == 26  # the stop code, not the earlier crash's 1
    assert "the workers failed with exit code 26 (STORAGE_FULL)" in capsys.readouterr().err

    monkeypatch.setattr(launcher, "run", lambda args: None)  # the workers finished: ft_launcher's 0 stands
    assert ft_launch.main(["--nproc-per-node=2", "train.py"]) == 0
