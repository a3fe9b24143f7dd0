"""A process forked while a rank saves dies with the rank; one forked outside that span is left alone."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

PARENT = textwrap.dedent(
    """
    import os, sys, time
    from megatron.bridge.utils.orphans import die_with_this_process

    def child():
        pid = os.fork()
        if pid == 0:
            time.sleep(60)  # a writer that will never finish on its own
            os._exit(0)
        return pid

    if sys.argv[1] == "inside":
        with die_with_this_process():
            pid = child()
    else:
        pid = child()
    print(pid, flush=True)
    time.sleep(60)  # killed by the test, as a rank monitor kills a hung rank
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _child_after_parent_killed(where: str) -> tuple[int, bool]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, where], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    return child, _alive(child)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_process_forked_inside_the_span_dies_with_its_parent():
    _, alive = _child_after_parent_killed("inside")
    assert not alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_process_forked_outside_the_span_outlives_its_parent():
    child, alive = _child_after_parent_killed("outside")
    try:
        assert alive, "forks outside a save (in-process restart's monitor, loader workers) are not touched"
    finally:
        if alive:
            os.kill(child, signal.SIGKILL)
