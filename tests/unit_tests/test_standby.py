"""standby: which entry points a standby can run, the launcher's handle on a forked worker, the opt-out flag."""

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron.bridge import standby
from megatron.bridge.utils import upstream


def test_a_python_script_or_module_entry_becomes_a_request():
    env = {"RANK": "1"}
    script = standby.entry_request((sys.executable, "-u", "train.py", "a=1"), env, "/o", None)
    assert (script["script"], script["module"], script["argv"], script["unbuffered"]) == (
        "train.py",
        None,
        ["a=1"],
        True,
    )
    assert (script["env"], script["cwd"], script["stdout"], script["stderr"]) == (env, os.getcwd(), "/o", None)
    module = standby.entry_request((sys.executable, "-m", "pkg.main", "--x"), env, None, None)
    assert (module["script"], module["module"], module["argv"], module["unbuffered"]) == (
        None,
        "pkg.main",
        ["--x"],
        False,
    )


@pytest.mark.parametrize(
    "args",
    [
        ("/usr/bin/env", "python", "train.py"),  # not the launcher's Python: started the usual way
        (sys.executable, "-X", "importtime", "train.py"),  # interpreter options a fork cannot honour
        (sys.executable, "-u"),
        (sys.executable, "-m"),
        (),
    ],
)
def test_other_entry_points_are_left_to_the_launcher(args):
    assert standby.entry_request(args, {}, None, None) is None


def _child(then) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            then()
        finally:
            os._exit(0)
    return pid


def test_the_handle_reports_exit_codes_and_signals_like_popen():
    worker = standby.ForkedWorker(_child(lambda: os._exit(7)), ("w",))
    assert worker.wait(timeout=30) == 7 and worker.poll() == 7

    sleeper = standby.ForkedWorker(_child(lambda: time.sleep(60)), ("w",))
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.1)
    sleeper.kill()
    assert sleeper.wait(timeout=30) == -signal.SIGKILL
    sleeper.terminate()  # exited already: nothing to signal, no error


def test_the_opt_out_flag_keeps_the_launchers_own_start_and_is_removed(monkeypatch):
    key = upstream.applicable(upstream.STANDBY_PATCHES["torch"])
    original = upstream.get(key)
    monkeypatch.setattr(upstream.owner(key), "_popen", original)  # restored after the test
    started = []
    monkeypatch.setattr(standby._STANDBY, "start", lambda: started.append(True))  # no standby forked from pytest
    argv = ["--nproc-per-node=2", standby.OPT_OUT, "train.py"]
    assert standby.install("torch", argv) == ["--nproc-per-node=2", "train.py"]
    assert upstream.get(key) is original and not started
    assert standby.install("torch", ["train.py"]) == ["train.py"]
    assert upstream.get(key) is not original and started
