"""Fault specs parse strictly; ``slow`` really stretches the wrapped step, ``nan``/``spike`` corrupt its output."""

import time

import pytest
import torch

from megatron.bridge.training import fault_injection
from megatron.bridge.training.fault_injection import Fault, StepFaults, parse


def test_parse_accepts_every_kind_and_option():
    assert parse("sigterm@4:1,sigterm-tree@6:0") == [Fault("sigterm", 4, 1), Fault("sigterm-tree", 6, 0)]
    assert parse("stall@5:1:always") == [Fault("stall", 5, 1, always=True)]
    assert parse("hang@3:1, kill@5:0:always,slow@1:1,slow@2:0:x3.5:always") == [
        Fault("hang", 3, 1),
        Fault("kill", 5, 0, always=True),
        Fault("slow", 1, 1),
        Fault("slow", 2, 0, always=True, factor=3.5),
    ]
    assert parse("nan@7:1,nan@8:0:always,spike@9:1:x50") == [
        Fault("nan", 7, 1),
        Fault("nan", 8, 0, always=True),
        Fault("spike", 9, 1, factor=50.0),
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
        "nan@1:0:x2",
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
        return "out", None

    step = faults.wrap_forward_step(busy_step)
    faults.before_step(1)
    assert step() == ("out", None) and sleeps == []  # not slowed before iteration 3
    faults.before_step(3)
    assert step() == ("out", None)
    assert len(sleeps) == 1 and sleeps[0] >= 0.02  # 3x: twice the step's own time on top


def test_other_ranks_and_restarted_jobs_are_not_slowed(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv(fault_injection.ENV, "slow@1:1")

    def step():
        return None

    assert StepFaults(rank=0).wrap_forward_step(step) is step
    assert StepFaults(rank=1, inprocess_iteration=1).wrap_forward_step(step) is step  # an in-process restart
    assert StepFaults(rank=1).wrap_forward_step(step) is not step
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert StepFaults(rank=1).wrap_forward_step(step) is step


def _output_step():
    return torch.ones(3), "loss_func"


def test_transient_nan_corrupts_only_the_first_pass_of_its_iteration(monkeypatch):
    monkeypatch.setenv(fault_injection.ENV, "nan@2:0")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    faults = StepFaults(rank=0)
    step = faults.wrap_forward_step(_output_step)
    faults.before_step(1)
    assert torch.isfinite(step()[0]).all()
    faults.before_step(2)
    out, loss_func = step()
    assert torch.isnan(out).all() and loss_func == "loss_func"
    assert torch.isfinite(step()[0]).all()  # the re-run of the same iteration computes the true value


def test_persistent_spike_corrupts_every_pass_in_every_attempt(monkeypatch):
    monkeypatch.setenv(fault_injection.ENV, "spike@2:1:x40:always")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    faults = StepFaults(rank=1)
    step = faults.wrap_forward_step(_output_step)
    faults.before_step(2)
    assert step()[0].tolist() == [40.0] * 3
    assert step()[0].tolist() == [40.0] * 3
    faults.before_step(3)
    assert step()[0].tolist() == [1.0] * 3


def test_ledger_makes_each_fault_strike_once_per_job(tmp_path, monkeypatch):
    ledger = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(fault_injection.ENV, "exception@3:0,exception@5:0,exception@4:1")
    monkeypatch.setenv(fault_injection.LEDGER_ENV, str(ledger))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = StepFaults(rank=0)
    first.before_step(2)
    with pytest.raises(RuntimeError, match="iteration 3"):
        first.before_step(3)
    records = fault_injection.struck_faults(str(ledger))
    assert [(r["kind"], r["iteration"], r["rank"], r["restart_count"]) for r in records] == [("exception", 3, 0, 0)]
    assert abs(records[0]["time"] - time.time()) < 60
    # The restarted attempt goes through iteration 3 again without a fault, and still meets the one at 5.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = StepFaults(rank=0)
    again.before_step(3)
    with pytest.raises(RuntimeError, match="iteration 5"):
        again.before_step(5)
    assert [r["iteration"] for r in fault_injection.struck_faults(str(ledger))] == [3, 5]


def test_ledger_tolerates_a_line_cut_short(tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text('{"kind": "kill", "iteration": 3, "rank": 1, "time": 1.0}\n{"kind": "ha')
    assert [r["kind"] for r in fault_injection.struck_faults(str(ledger))] == ["kill"]
    assert fault_injection.struck_faults(str(tmp_path / "absent.jsonl")) == []


def test_ledger_records_a_value_fault_once(tmp_path, monkeypatch):
    ledger = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(fault_injection.ENV, "nan@2:0")
    monkeypatch.setenv(fault_injection.LEDGER_ENV, str(ledger))
    faults = StepFaults(rank=0)
    step = faults.wrap_forward_step(lambda: (torch.ones(2), None))
    faults.before_step(2)
    assert torch.isnan(step()[0]).all()
    assert torch.equal(step()[0], torch.ones(2))  # the re-run pass computes the true value
    assert len(fault_injection.struck_faults(str(ledger))) == 1
    assert StepFaults(rank=0).wrap_forward_step(step) is step  # struck already: a restart gets no fault
