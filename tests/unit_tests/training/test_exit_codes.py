import re
import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from megatron.bridge import launch
from megatron.bridge.training.exit_codes import STOP_CODES, ExitCode, job_exit_code

pytestmark = pytest.mark.timeout(30)

SCRIPT = ["train.py"]


def test_the_first_failure_names_the_job_unless_a_later_one_says_stop():
    assert job_exit_code([]) == 0
    assert job_exit_code([18, 18]) == 18
    assert job_exit_code([-signal.SIGKILL, 1]) == 128 + 9
    assert job_exit_code([24, -signal.SIGKILL]) == 24  # neither says stop: the first
    assert job_exit_code([1, 26]) == 26  # rank 0's full disk, after its peer crashed in the broken collective
    assert job_exit_code([-signal.SIGKILL, 27, 2]) == 27  # the first of two stop codes
    assert job_exit_code([0]) == 1  # a failed worker never makes the job a success


def test_stop_codes_are_the_ones_whose_documented_action_is_stop():
    table = (Path(__file__).resolve().parents[3] / "docs" / "training" / "resiliency.md").read_text()
    actions = {}
    for row in re.findall(r"^\| (\d+) \| ([A-Z_]+) \|.*\| ([^|]+) \|$", table, flags=re.M):
        actions[ExitCode[row[1]]] = row[2].strip()
    assert len(actions) == len(ExitCode)
    says_stop = {code for code, action in actions.items() if action.startswith("stop") and code != ExitCode.FINISHED}
    assert says_stop == STOP_CODES


def test_torchrun_launch_reports_a_stop_code_that_came_after_a_crash(monkeypatch):
    monkeypatch.setattr(launch.standby, "install", lambda launcher, argv: argv)

    def failed(args):  # rank 1 fails first, in the collective rank 0 left when it found the disk full
        failures = {0: ProcessFailure(0, 4320, int(ExitCode.STORAGE_FULL), ""), 1: ProcessFailure(1, 4321, 1, "")}
        failures[1].timestamp, failures[0].timestamp = 1000, 1001  # whole seconds, as torch records them
        raise ChildFailedError("train.py", failures)

    monkeypatch.setattr(launch, "run", failed)
    assert launch.main(["--nproc-per-node=2", *SCRIPT]) == ExitCode.STORAGE_FULL == 26
