"""Ports and shared set-up for tests (tests/resources.py): nothing handed to two test processes at once."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests import resources

REPO = Path(__file__).resolve().parents[2]


def _in_child(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def test_another_process_holding_ports_is_never_given_the_same_blocks(monkeypatch):
    # Both processes start their search at the same block: without the locks they would get the same ports.
    child = _in_child(
        """
        import random, sys
        random.randrange = lambda *a: 0
        from tests.resources import free_port
        print(" ".join(str(free_port()) for _ in range(3)), flush=True)
        sys.stdin.read()  # hold the ports until the parent is done
        """
    )
    try:
        theirs = [int(p) for p in child.stdout.readline().split()]
        monkeypatch.setattr(resources.random, "randrange", lambda *a: 0)
        mine = [resources.free_port() for _ in range(3)]
    finally:
        child.communicate("")
    blocks = lambda ports: {range(p, p + resources.PORT_BLOCK) for p in ports}  # noqa: E731
    assert len(theirs) == 3 and not blocks(theirs) & blocks(mine), (theirs, mine)
    assert all(p % resources.PORT_BLOCK == 0 and resources.PORT_RANGE[0] <= p < resources.PORT_RANGE[1] for p in mine)


class _Factory:
    """The part of pytest's tmp_path_factory that once_per_run uses."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def getbasetemp(self) -> Path:
        return self.base


def test_once_per_run_makes_it_once_for_every_worker_and_hands_everyone_the_result(tmp_path):
    code = f"""
        import os, sys, time
        from pathlib import Path
        from tests.resources import once_per_run
        class F:
            def getbasetemp(self):
                return Path({str(tmp_path)!r}) / os.environ["PYTEST_XDIST_WORKER"]
        def make(directory):
            with open({str(tmp_path / "made")!r}, "a") as f:
                f.write("x")
            time.sleep(1.0)  # the other worker asks meanwhile
            (directory / "ckpt").write_text("state")
            return str(directory)
        print(once_per_run(F(), "reference", make), flush=True)
        """
    workers = [_in_child(code, env={"PYTEST_XDIST_WORKER": f"gw{i}", "PYTHONPATH": str(REPO)}) for i in range(2)]
    results = [w.communicate("")[0].strip() for w in workers]
    assert [w.returncode for w in workers] == [0, 0]
    assert (tmp_path / "made").read_text() == "x", "made exactly once"
    assert results[0] == results[1] and Path(results[0], "ckpt").read_text() == "state"


def test_a_failed_make_leaves_no_result_and_the_next_caller_makes_it_again(tmp_path):
    factory, calls = _Factory(tmp_path), []

    def failing(directory: Path) -> str:
        calls.append("fail")
        (directory / "half").write_text("written before the failure")
        raise RuntimeError("set-up failed")

    try:
        resources.once_per_run(factory, "base", failing)
    except RuntimeError:
        pass
    assert resources.once_per_run(factory, "base", lambda d: (calls.append("ok"), sorted(os.listdir(d)))[1]) == []
    assert calls == ["fail", "ok"]
