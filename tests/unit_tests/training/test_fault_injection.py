"""Fault specs parse strictly, and the ``slow`` fault really makes the wrapped step that many times slower."""

import time

import pytest

from megatron.bridge.training import fault_injection
from megatron.bridge.training.fault_injection import Fault, StepFaults, parse


def test_parse_accepts_every_kind_and_option():
    assert parse("sigterm@4:1,sigterm-tree@6:0") == [Fault("sigterm", 4, 1), Fault("sigterm-tree", 6, 0)]
    assert parse("hang@3:1, kill@5:0:always,slow@1:1,slow@2:0:x3.5:always") == [
        Fault("hang", 3, 1),
        Fault("kill", 5, 0, always=True),
        Fault("slow", 1, 1, factor=2.0),
        Fault("slow", 2, 0, always=True, factor=3.5),
    ]


@pytest.mark.parametrize(
    "spec",
    [
        "hang",
        "hang@x:1",
        "melt@1:0",
        "kill@1:0:x2",
        "slow@1:0:x1",
        "slow@1:0:x2:x3",
        "slow@1:0:xnan",
        "slow@1:0:xinf",
        "hang@1:0:sometimes",
    ],
)
def test_parse_rejects_malformed_items(spec):
    with pytest.raises(ValueError, match=fault_injection.ENV):
        parse(spec)


def test_slow_fault_stretches_the_step_from_its_iteration_on(monkeypatch):
    monkeypatch.setenv(fault_injection.ENV, "slow@3:0:x3")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    sleeps = []
    monkeypatch.setattr(fault_injection.time, "sleep", sleeps.append)
    faults = StepFaults(rank=0)

    def busy_step():
        end = time.perf_counter() + 0.01
        while time.perf_counter() < end:
            pass
        return "out"

    step = faults.wrap_forward_step(busy_step)
    faults.before_step(1)
    assert step() == "out" and sleeps == []  # not slowed before iteration 3
    faults.before_step(3)
    assert step() == "out"
    assert len(sleeps) == 1 and sleeps[0] >= 0.02  # 3x: twice the step's own time on top


def test_other_ranks_and_restarted_jobs_are_not_slowed(monkeypatch):
    monkeypatch.setenv(fault_injection.ENV, "slow@1:1")

    def step():
        return None

    assert StepFaults(rank=0).wrap_forward_step(step) is step
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert StepFaults(rank=1).wrap_forward_step(step) is step
