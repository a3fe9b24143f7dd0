"""Elastic node ranges: what each launcher can honour, refused before anything starts, and what workers are told."""

import pytest
from torch.distributed.run import parse_args

from megatron.bridge import ft_launch, launch
from megatron.bridge.training.exit_codes import ExitCode
from megatron.bridge.utils import elastic, launch_env

pytestmark = pytest.mark.timeout(60)

ENTRY = ["train.py"]


@pytest.fixture(autouse=True)
def no_range(monkeypatch):
    """No range set, and whatever a test exports is undone after it."""
    monkeypatch.setenv(elastic.NNODES_ENV, "")  # records the original value, restored at teardown
    monkeypatch.delenv(elastic.NNODES_ENV)


@pytest.mark.parametrize(("text", "expected"), [("2", (2, 2)), ("1:4", (1, 4)), (" 3:3 ", (3, 3))])
def test_a_node_range_is_read(text, expected):
    assert elastic.node_range(text) == expected


@pytest.mark.parametrize("text", ["0", "3:2", "a:2", "1:2:3", ""])
def test_a_bad_node_range_is_named(text):
    with pytest.raises(ValueError, match="is not N or MIN:MAX with 1 <= MIN <= MAX"):
        elastic.node_range(text)


def test_a_range_on_torchruns_static_rendezvous_is_refused_with_the_fix():
    refused = elastic.refusal(parse_args(["--nnodes=1:2", *ENTRY]), "megatron.bridge.launch")
    assert refused is not None
    assert "--nnodes=1:2 with --rdzv-backend=static" in refused and "never re-forms with fewer" in refused
    assert "Fix: --rdzv-backend=c10d" in refused and "or --nnodes=2" in refused


def test_a_range_with_standalone_is_refused_with_the_fix():
    refused = elastic.refusal(parse_args(["--standalone", "--nnodes=1:2", *ENTRY]), "ft_launch")
    assert refused is not None and refused.startswith("ft_launch: --nnodes=1:2 with --standalone")
    assert "no other node can join" in refused and "Fix: drop --standalone" in refused


@pytest.mark.parametrize(
    "argv",
    [
        ["--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400", *ENTRY],
        ["--nnodes=2", *ENTRY],
        ["--standalone", *ENTRY],
    ],
)
def test_an_elastic_rendezvous_or_a_fixed_count_is_accepted(argv):
    assert elastic.refusal(parse_args(argv), "megatron.bridge.launch") is None


def test_the_launcher_refuses_at_start_with_a_stop_code(capsys):
    assert launch.main(["--nnodes=1:2", "--nproc-per-node=1", *ENTRY]) == int(ExitCode.CONFIG_ERROR)
    assert "--rdzv-backend=static" in capsys.readouterr().err


def test_a_malformed_node_range_is_refused_at_start_naming_the_fix(capsys):
    assert launch.main(["--nnodes=1:2:3", "--nproc-per-node=1", *ENTRY]) == int(ExitCode.CONFIG_ERROR)
    assert "--nnodes=1:2:3 is not N or MIN:MAX" in capsys.readouterr().err


def test_ft_launch_refuses_at_start_with_a_stop_code_and_an_exit_event(tmp_path, capsys):
    from megatron.bridge.training.events.reader import read_events

    argv = ["--event-dir", str(tmp_path), "--standalone", "--nnodes=1:2", "--nproc-per-node=1", *ENTRY]
    assert ft_launch.main(argv) == int(ExitCode.CONFIG_ERROR)
    assert "with --standalone" in capsys.readouterr().err
    events, problems = read_events(str(tmp_path))
    assert not problems and [(e.kind, e.exit_code) for e in events] == [("exit", 2)], events
    assert "--standalone" in events[0].detail


def test_the_barrier_rendezvous_keeps_min_nodes_and_spares(monkeypatch):
    args = parse_args(["--nnodes=1:3", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400", *ENTRY])
    monkeypatch.setattr(elastic, "_BARRIER", "json")  # an importable module: "this release has the barrier one"
    assert elastic.barrier_rendezvous([]) and elastic.barrier_rendezvous(["--ft-rdzv-impl", "barrier"])
    assert not elastic.barrier_rendezvous(["--ft-rdzv-impl=legacy"])
    assert not elastic.barrier_rendezvous(["--ft-rdzv-impl", "legacy"])
    assert elastic.barrier_rendezvous(["-m", "recipe", "--ft-rdzv-impl=legacy"])  # the script's own arguments
    notice = elastic.notice(args, [])
    assert notice is not None and "trains on 1 node(s) and keeps up to 2 more as hot spares" in notice
    assert elastic.workers_range(args, []) == (1, 1)
    assert elastic.notice(args, ["--ft-rdzv-impl=legacy"]) is None
    assert elastic.workers_range(args, ["--ft-rdzv-impl=legacy"]) == (1, 3)
    monkeypatch.setattr(elastic, "_BARRIER", "no_such_module_here")  # nvidia-resiliency-ext 0.4: elastic
    assert not elastic.barrier_rendezvous([]) and elastic.notice(args, []) is None


def test_the_workers_read_the_range_the_launcher_exported(monkeypatch):
    assert launch_env.current().node_range is None and not launch_env.current().elastic
    elastic.export((1, 2))
    env = launch_env.current()
    assert env.node_range == (1, 2) and env.elastic
    monkeypatch.setenv(elastic.NNODES_ENV, "2:2")
    assert not launch_env.current().elastic
    monkeypatch.setenv(elastic.NNODES_ENV, "2:1")
    with pytest.raises(ValueError, match="^MBRIDGE_NNODES='2:1' is not N or MIN:MAX .* fix: unset it"):
        launch_env.current()
