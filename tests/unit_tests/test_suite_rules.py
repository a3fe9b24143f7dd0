"""The suite's own rules (tests/conftest.py): tiers by directory, a time limit on every test, no leftover process."""

import os
import time
from pathlib import Path

from tests import processes

pytest_plugins = ["pytester"]
REPO = Path(__file__).resolve().parents[2]

_STUCK = '''
import subprocess, sys, time
import pytest

CHILD = """
import os, time
def stuck_in_the_child():
    time.sleep(600)
open(os.environ["PID_FILE"], "w").write(str(os.getpid()))
stuck_in_the_child()
"""

@pytest.mark.timeout(4)
def test_stuck(tmp_path):
    subprocess.Popen([sys.executable, "-c", CHILD])
    time.sleep(600)

def test_quick():
    pass

def test_leaves_one_behind():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
'''


def test_a_test_past_its_limit_fails_with_its_processes_stacks_and_leaves_none(pytester, tmp_path, monkeypatch):
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_stuck=_STUCK)
    pid_file = tmp_path / "child.pid"
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "PID_FILE": str(pid_file)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", timeout=120)
    result.assert_outcomes(failed=1, passed=2)
    out = result.stdout.str()
    assert "Timeout (>4.0s) from pytest-timeout" in out, out[-3000:]
    assert "stacks of the 1 processes still alive" in out, out[-3000:]
    assert "stuck_in_the_child" in out, out[-3000:]
    assert "[processes] test_stuck.py::test_leaves_one_behind left processes behind: killed 1" in out, out[-3000:]
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while processes.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes.alive(pid), f"the stuck test's child {pid} outlived it"


def test_every_test_under_functional_tests_is_marked_functional_and_has_a_limit(pytester):
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.mkdir("functional_tests")
    pytester.makepyfile(test_unit="def test_u(): pass")
    Path(pytester.path, "functional_tests", "test_f.py").write_text("def test_f(): pass\n")
    items, _ = pytester.inline_genitems("-p", "no:cacheprovider")
    marks = {item.name: item for item in items}
    assert marks["test_f"].get_closest_marker("functional") is not None
    assert marks["test_u"].get_closest_marker("functional") is None
    assert marks["test_u"].get_closest_marker("timeout").args == (60,)
    assert marks["test_f"].get_closest_marker("timeout").args == (600,)


def test_an_unknown_marker_is_an_error(pytester):
    pytester.makepyprojecttoml((REPO / "pyproject.toml").read_text())
    pytester.makepyfile(test_typo="import pytest\n\n@pytest.mark.functinal\ndef test_t(): pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*'functinal' not found in `markers` configuration option*"])


def test_the_longest_first_modules_exist_and_are_handed_out_first():
    from tests import conftest

    missing = [m for m in conftest.LONGEST_FIRST if not os.path.isfile(os.path.join(conftest._FUNCTIONAL_DIR, m))]
    assert not missing, f"LONGEST_FIRST names modules that are gone: {missing}"
    root = Path(conftest._FUNCTIONAL_DIR)

    class Item:
        def __init__(self, path: Path) -> None:
            self.path = path
            self.markers: list = []

        def get_closest_marker(self, name: str):
            return object() if name in ("functional", "timeout") else None

    items = [Item(root / "test_standby.py"), Item(root / "training/test_resume.py"), Item(root / "test_main_job.py")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [item.path.name for item in items] == ["test_main_job.py", "test_resume.py", "test_standby.py"]
