"""The fault registry: specs parse strictly and round-trip; each fault strikes where, when and as often as it says.

``slow`` really stretches the wrapped step, ``nan``/``spike`` corrupt its output, save points and local saves ask the
registry, the ledger spans restarts, ``ft.simulate_fault*`` becomes a timed fault, and ``validate()`` rejects a bad
spec from the config or the environment by name.
"""

import ast
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tests.unit_tests.configs import base_config

from megatron.bridge.training.config import FaultInjectionConfig
from megatron.bridge.training.fault_tolerance import maybe_setup_simulated_fault
from megatron.bridge.training.faults import injection as fault_injection
from megatron.bridge.training.faults.injection import Fault, FaultRegistry, StepFaults, parse
from megatron.bridge.training.utils.overrides import apply_overrides


@pytest.fixture(autouse=True)
def _fresh_process(monkeypatch):
    """No fault from the environment or an earlier test; the first attempt of a job."""
    monkeypatch.delenv(fault_injection.ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(fault_injection, "_active", None)


def _faults(spec: str, rank: int, **registry_args) -> StepFaults:
    return StepFaults(rank, FaultRegistry(parse(spec), **registry_args))


def test_parse_accepts_every_kind_and_option():
    assert parse("preempt@4:1,preempt-tree@6:0") == [Fault("preempt", 4, 1), Fault("preempt-tree", 6, 0)]
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


def test_every_kind_has_its_default_phase_and_parses_in_each_of_its_phases():
    assert [f.phase for f in parse("hang@1:0,kill@1:0,exception@1:0,preempt@1:0,preempt-tree@1:0,stall@1:0")] == [
        "step"
    ] * 6
    assert [f.phase for f in parse("slow@1:0,nan@1:0,spike@1:0")] == ["forward"] * 3
    assert parse("kill@6:1:save.during_write") == [Fault("kill", 6, 1, phase="save.during_write")]
    assert parse("stall@5:0:always:save.after_rename") == [Fault("stall", 5, 0, "save.after_rename", always=True)]
    assert parse("nan@8:0:local_save") == [Fault("nan", 8, 0, phase="local_save")]
    assert parse("hang@4s:1,kill@0.5s:0:timer") == [
        Fault("hang", None, 1, phase="timer", seconds=4.0),
        Fault("kill", None, 0, seconds=0.5),
    ]
    for kind, phases in fault_injection.PHASES.items():
        for phase in phases:
            when = "3s" if phase == "timer" else "3"
            phase = phase + {"save.": "after_tracker"}.get(phase, "")
            [fault] = parse(f"{kind}@{when}:0:{phase}")
            assert (fault.kind, fault.phase, fault.rank) == (kind, phase, 0)


@pytest.mark.parametrize(
    "spec",
    [
        "hang@8:1",
        "kill@27:1:always",
        "slow@60:1:x6",
        "slow@2:0:x3.5:always",
        "spike@60:1:x100",
        "nan@12:1",
        "exception@5:0:save.after_manifest",
        "kill@6:1:save.during_write",
        "hang@6:0:save.after_tracker_tmp:always",
        "nan@8:0:local_save",
        "hang@4s:1",
        "kill@0.25s:0:always",
        "preempt-tree@5:1",
        "corrupt-local@45:1",
        "no-rng-restore@6:1",
        "clock-jump@4:0:x-2.5",
    ],
)
def test_specs_round_trip(spec):
    [fault] = parse(spec)
    assert str(fault) == spec
    assert parse(str(fault)) == [fault]


def test_a_constructed_fault_round_trips_with_any_number():
    fault = Fault("slow", 1, 0, factor=1.0000001)
    assert parse(str(fault)) == [fault]
    timed = Fault("kill", None, 1, seconds=1 / 3)
    assert parse(str(timed)) == [timed]


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


def test_a_fault_given_twice_is_rejected():
    with pytest.raises(ValueError, match=r"fault_injection.faults: item 'kill@5:1:step' is there twice"):
        parse("kill@5:1,kill@5:1:step", "fault_injection.faults")
    assert len(parse("kill@5:1,kill@5:0,kill@6:1")) == 3


@pytest.mark.parametrize(
    "spec,bad_part",
    [
        ("hang", "no '@' after the kind"),
        ("melt@1:0", "unknown kind 'melt'"),
        ("hang@x:1", "'x' is neither an iteration nor <seconds>s"),
        ("hang@3", "no :<rank>"),
        ("hang@3:one", "rank 'one' is not a whole number"),
        ("hang@0:1", "iteration 0 is not >= 1"),
        ("hang@3:-1", "rank -1 is not >= 0"),
        ("hang@1:0:sometimes", "option 'sometimes' is unknown"),
        ("hang@1:0:always:always", "option 'always' is unknown or given twice"),
        ("kill@1:0:step:save.during_write", "option 'save.during_write' is unknown or given twice"),
        ("kill@1:0:x2", "x<factor> is only for slow, spike, clock-jump"),
        ("slow@1:0:x1", "factor 1 is not in (1, 1000)"),
        ("slow@1:0:xfast", "factor 'xfast' is not x<number>"),
        ("exception@1:0:forward", "exception cannot strike in phase 'forward'"),
        ("nan@1:0:step", "nan cannot strike in phase 'step' (its phases: forward, local_save)"),
        ("kill@6:0:save.during_commit", "unknown checkpoint point 'save.during_commit'"),
        ("kill@6:1:save.after_rename", "only rank 0 reaches 'save.after_rename'"),
        ("exception@4s:0", "exception cannot strike in phase 'timer'"),
        ("kill@4:0:timer", "a <seconds>s time goes with phase timer"),
        ("kill@4s:0:step", "a <seconds>s time goes with phase timer"),
        ("kill@-1s:0", "time -1.0s is not a number of seconds >= 0"),
        ("sigterm@5:1", "unknown kind 'sigterm'"),  # one name per kind: preempt
        ("no-model-restore@5:1", "unknown kind 'no-model-restore'"),
        ("no-rng-restore@5:1:restore.rng", "option 'restore.rng' is unknown"),
        ("kill@5:1:restore", "kill cannot strike in phase 'restore'"),
        ("no-rng-restore@5:1:step", "no-rng-restore cannot strike in phase 'step' (its phases: restore)"),
    ],
)
def test_a_malformed_item_is_named_with_its_bad_part_and_the_expected_form(spec, bad_part):
    with pytest.raises(ValueError) as err:
        parse(f"kill@2:0,{spec}", source="fault_injection.faults")
    message = str(err.value)
    assert message.startswith(f"fault_injection.faults: bad item {spec!r}: "), message
    assert bad_part in message, message
    assert fault_injection.GRAMMAR in message and ", ".join(fault_injection.KINDS) in message  # form and kinds


def test_slow_fault_adds_a_multiple_of_the_median_recent_forward_time(monkeypatch):
    sleeps, clock = [], [0.0]
    monkeypatch.setattr(fault_injection.time, "sleep", sleeps.append)
    monkeypatch.setattr(fault_injection.time, "perf_counter", lambda: clock[0])
    faults = _faults("slow@4:0:x3", rank=0)

    def step(seconds):
        clock[0] += seconds
        return "out", None

    forward = faults.wrap_forward_step(step)
    for iteration, seconds in ((1, 0.01), (2, 0.05), (3, 0.02)):
        faults.before_step(iteration)
        assert forward(seconds) == ("out", None)
    assert sleeps == []  # not slowed before iteration 4
    faults.before_step(4)
    forward(0.02)  # median of 0.01, 0.05, 0.02, 0.02: 0.02
    forward(1.0)  # a step the machine delayed: the median barely moves, the delay is not stretched 3x
    assert sleeps == [pytest.approx(0.04), pytest.approx(0.04)]  # 3x: twice the median on top
    for _ in range(20):  # the rank runs slower for good: the extra time follows
        forward(0.1)
    assert sleeps[-1] == pytest.approx(0.2)


def test_other_ranks_and_restarted_jobs_are_not_slowed(monkeypatch):
    def step():
        return None

    assert _faults("slow@1:1", rank=0).wrap_forward_step(step) is step
    assert _faults("slow@1:1", rank=1, inprocess_iteration=1).wrap_forward_step(step) is step  # in-process restart
    assert _faults("slow@1:1", rank=1).wrap_forward_step(step) is not step
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _faults("slow@1:1", rank=1).wrap_forward_step(step) is step


def _output_step():
    return torch.ones(3), "loss_func"


def test_transient_nan_corrupts_only_the_first_pass_of_its_iteration():
    faults = _faults("nan@2:0", rank=0)
    step = faults.wrap_forward_step(_output_step)
    faults.before_step(1)
    assert torch.isfinite(step()[0]).all()
    faults.before_step(2)
    out, loss_func = step()
    assert torch.isnan(out).all() and loss_func == "loss_func"
    assert torch.isfinite(step()[0]).all()  # the re-run of the same iteration computes the true value


def test_persistent_spike_corrupts_every_pass_in_every_attempt(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    faults = _faults("spike@2:1:x40:always", rank=1)
    step = faults.wrap_forward_step(_output_step)
    faults.before_step(2)
    assert step()[0].tolist() == [40.0] * 3
    assert step()[0].tolist() == [40.0] * 3
    faults.before_step(3)
    assert step()[0].tolist() == [1.0] * 3


def test_ledger_makes_each_fault_strike_once_per_job(tmp_path, monkeypatch):
    ledger = str(tmp_path / "ledger.jsonl")
    spec = "exception@3:0,exception@5:0,exception@4:1"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = _faults(spec, rank=0, ledger=ledger)
    first.before_step(2)
    with pytest.raises(RuntimeError, match="iteration 3"):
        first.before_step(3)
    records = fault_injection.struck_faults(ledger)
    assert [(r["kind"], r["iteration"], r["rank"], r["restart_count"]) for r in records] == [("exception", 3, 0, 0)]
    assert (records[0]["fault"], records[0]["phase"]) == ("exception@3:0", "step")
    assert abs(records[0]["time"] - time.time()) < 60
    # The restarted attempt goes through iteration 3 again without a fault, and still meets the one at 5.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = _faults(spec, rank=0, ledger=ledger)
    again.before_step(3)
    with pytest.raises(RuntimeError, match="iteration 5"):
        again.before_step(5)
    assert [r["iteration"] for r in fault_injection.struck_faults(ledger)] == [3, 5]


def test_ledger_tolerates_a_line_cut_short(tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text('{"kind": "kill", "iteration": 3, "rank": 1, "time": 1.0}\n{"kind": "ha')
    assert [r["kind"] for r in fault_injection.struck_faults(str(ledger))] == ["kill"]
    assert fault_injection.struck_faults(str(tmp_path / "absent.jsonl")) == []


def test_ledger_records_a_value_fault_once(tmp_path):
    ledger = str(tmp_path / "ledger.jsonl")
    faults = _faults("nan@2:0", rank=0, ledger=ledger)
    step = faults.wrap_forward_step(lambda: (torch.ones(2), None))
    faults.before_step(2)
    assert torch.isnan(step()[0]).all()
    assert torch.equal(step()[0], torch.ones(2))  # the re-run pass computes the true value
    assert len(fault_injection.struck_faults(ledger)) == 1
    assert _faults("nan@2:0", rank=0, ledger=ledger).wrap_forward_step(step) is step  # struck: a restart gets none


def test_a_save_point_fault_strikes_at_its_point_rank_and_iteration_in_the_first_attempt(monkeypatch):
    monkeypatch.setenv(fault_injection.ENV, "exception@6:1:save.during_write,exception@6:0:save.after_rename")
    for point, rank, iteration in [("during_write", 1, 3), ("during_write", 0, 6), ("after_manifest", 0, 6)]:
        fault_injection.at_save_point(point, rank, iteration)  # not this one: nothing happens
    with pytest.raises(RuntimeError, match="checkpoint point 'during_write' on rank 1, iteration 6"):
        fault_injection.at_save_point("during_write", 1, 6)
    fault_injection.at_save_point("during_write", 1, 6)  # struck already in this attempt
    monkeypatch.setattr(fault_injection, "_active", None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    fault_injection.at_save_point("after_rename", 0, 6)  # a restarted job is spared


def test_a_save_point_kill_is_logged_by_its_signal(monkeypatch, caplog):
    struck = []
    monkeypatch.setattr(fault_injection.os, "kill", lambda pid, sig: struck.append(sig))
    monkeypatch.setenv(fault_injection.ENV, "kill@6:1:save.during_write,hang@6:0:save.after_tracker")
    fault_injection.at_save_point("during_write", 1, 6)
    fault_injection.at_save_point("after_tracker", 0, 6)
    assert struck == [fault_injection.signal.SIGKILL, fault_injection.signal.SIGSTOP]
    assert "fault injection: SIGKILL at checkpoint point 'during_write' on rank 1, iteration 6" in caplog.text
    assert "fault injection: SIGSTOP at checkpoint point 'after_tracker' on rank 0, iteration 6" in caplog.text


def test_a_poisoned_local_save_is_due_once_on_its_rank_and_iteration(tmp_path, monkeypatch):
    ledger = str(tmp_path / "ledger.jsonl")
    fault_injection.install(FaultInjectionConfig(faults="nan@8:1:local_save", ledger=ledger))
    assert not fault_injection.poisons_local_save(rank=0, iteration=8)
    assert not fault_injection.poisons_local_save(rank=1, iteration=6)
    assert fault_injection.poisons_local_save(rank=1, iteration=8)
    assert not fault_injection.poisons_local_save(rank=1, iteration=8)
    assert [r["fault"] for r in fault_injection.struck_faults(ledger)] == ["nan@8:1:local_save"]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    fault_injection.install(FaultInjectionConfig(faults="nan@8:1:local_save", ledger=ledger))
    assert not fault_injection.poisons_local_save(rank=1, iteration=8)  # once per job


def test_a_skipped_restore_is_due_once_at_the_load_of_its_iteration_on_its_rank(tmp_path, monkeypatch, caplog):
    ledger = str(tmp_path / "ledger.jsonl")
    spec = "no-rng-restore@6:1,no-data-restore@6:1,no-optimizer-restore@10:0"
    assert [(f.kind, f.phase) for f in parse(spec)] == [(k, "restore") for k in spec.replace("@", ",").split(",")[::2]]
    assert [str(f) for f in parse(spec)] == spec.split(",")
    fault_injection.install(FaultInjectionConfig(faults=spec, ledger=ledger))
    assert fault_injection.skipped_restores(rank=0, iteration=6) == frozenset()
    assert fault_injection.skipped_restores(rank=1, iteration=5) == frozenset()
    assert fault_injection.skipped_restores(rank=1, iteration=6) == {"rng", "data"}
    assert "fault injection: rank 1 resumes iteration 6 without restoring its rng" in caplog.text
    assert fault_injection.skipped_restores(rank=1, iteration=6) == frozenset()  # struck: a later load restores
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    fault_injection.install(FaultInjectionConfig(faults=spec, ledger=ledger))
    assert fault_injection.skipped_restores(rank=1, iteration=6) == frozenset()  # once per job
    assert fault_injection.skipped_restores(rank=0, iteration=10) == {"optimizer"}  # never struck before
    assert len(fault_injection.struck_faults(ledger)) == 3


def test_a_written_local_checkpoint_is_corrupted_once_in_its_middle(tmp_path):
    shard, other = tmp_path / "iter_0000045_1_local.pt", tmp_path / "iter_0000040_1_local.pt"
    payload = bytes(range(256)) * 8
    shard.write_bytes(payload)
    other.write_bytes(payload)
    ledger = str(tmp_path / "ledger.jsonl")
    fault_injection.install(FaultInjectionConfig(faults="corrupt-local@45:1,nan@45:1:local_save", ledger=ledger))
    assert parse("corrupt-local@45:1") == [Fault("corrupt-local", 45, 1, phase="local_save")]
    fault_injection.corrupt_written_local_checkpoint(0, 45, lambda: str(shard))  # another rank
    fault_injection.corrupt_written_local_checkpoint(1, 40, lambda: str(other))  # another iteration
    assert shard.read_bytes() == payload and other.read_bytes() == payload
    fault_injection.corrupt_written_local_checkpoint(1, 45, lambda: str(shard))
    changed = [i for i, (a, b) in enumerate(zip(payload, shard.read_bytes())) if a != b]
    assert len(changed) == 64 and changed[0] == len(payload) // 2
    assert [r["kind"] for r in fault_injection.struck_faults(ledger)] == ["corrupt-local"]
    fault_injection.corrupt_written_local_checkpoint(1, 45, lambda: str(shard))  # once
    assert len([i for i, (a, b) in enumerate(zip(payload, shard.read_bytes())) if a != b]) == 64
    assert fault_injection.poisons_local_save(rank=1, iteration=45), "the NaN fault of that save is still due"


def test_a_timed_fault_is_armed_at_the_first_iteration_and_strikes_after_its_delay(monkeypatch):
    struck = []
    monkeypatch.setattr(fault_injection, "strike", lambda kind, where, label=None: struck.append((kind, where)))
    faults = _faults("hang@0.2s:1", rank=1)
    assert _faults("hang@0.2s:1", rank=0)._timed == []
    time.sleep(0.3)
    assert struck == []  # not armed before training starts
    start = time.monotonic()
    faults.before_step(1)
    while not struck and time.monotonic() - start < 10:
        time.sleep(0.01)
    assert struck == [("hang", "0.2 s into training on rank 1")]
    assert time.monotonic() - start >= 0.2


def test_a_timer_armed_before_an_in_process_restart_does_not_strike_after_it(monkeypatch, caplog):
    struck = []
    monkeypatch.setattr(fault_injection, "strike", lambda kind, where, label=None: struck.append((kind, where)))
    installed = fault_injection.install(FaultInjectionConfig(faults="kill@0.3s:0"))
    StepFaults(0, installed).before_step(1)  # armed
    fault_injection.install(FaultInjectionConfig(faults="kill@0.3s:0"), inprocess_iteration=1)  # the restart
    with caplog.at_level(logging.WARNING):
        time.sleep(0.6)
    assert struck == [] and "kill@0.3s:0 disarmed: the process restarted in process" in caplog.text


def test_config_and_environment_faults_both_apply(monkeypatch):
    monkeypatch.setenv(fault_injection.ENV, "kill@9:1")
    installed = fault_injection.install(FaultInjectionConfig(faults="nan@8:0:local_save"))
    installed.add(Fault("hang", 3, 0))
    assert [str(f) for f in installed.faults] == ["nan@8:0:local_save", "kill@9:1", "hang@3:0"]
    assert [str(f) for f in installed.pending(0, [fault_injection.STEP])] == ["hang@3:0"]
    assert fault_injection.registry() is installed


def test_without_an_installed_registry_the_environment_alone_applies(monkeypatch):
    monkeypatch.setenv(fault_injection.ENV, "stall@4:0,kill@6:0:save.after_manifest")
    assert [str(f) for f in fault_injection.registry().faults] == ["stall@4:0", "kill@6:0:save.after_manifest"]
    assert fault_injection.registry().ledger is None


@pytest.mark.parametrize(
    "overrides,env,field,bad",
    [
        (["fault_injection.faults=melt@1:0"], "", "fault_injection.faults", "unknown kind 'melt'"),
        (["fault_injection.faults=kill@1:0:save.nowhere"], "", "fault_injection.faults", "save.nowhere"),
        ([], "kill@5", "MBRIDGE_FAULTS", "no :<rank>"),
        (["fault_injection.faults=kill@5:2"], "", "fault_injection.faults", "names rank 2, not a rank of a world of 2"),
        ([], "hang@5:0,stall@5:3", "MBRIDGE_FAULTS", "stall@5:3 names rank 3"),
        (["fault_injection.ledger=/nonexistent/dir/ledger.jsonl"], "", "fault_injection.ledger", "does not exist"),
    ],
)
def test_validate_rejects_a_bad_spec_naming_the_field(monkeypatch, overrides, env, field, bad):
    if env:
        monkeypatch.setenv(fault_injection.ENV, env)
    cfg = apply_overrides(base_config(), overrides)
    with pytest.raises(ValueError) as err:
        cfg.validate(world_size=2)
    assert str(err.value).startswith(f"{field}: ") and bad in str(err.value), str(err.value)


def test_validate_accepts_faults_from_both_sources(monkeypatch, tmp_path):
    monkeypatch.setenv(fault_injection.ENV, "kill@5:1,hang@4s:0")
    ledger = tmp_path / "ledger.jsonl"
    overrides = [
        "fault_injection.faults=nan@8:1:local_save,kill@6:0:save.after_rename",
        f"fault_injection.ledger={ledger}",
    ]
    apply_overrides(base_config(), overrides).validate(world_size=2)


@pytest.mark.parametrize(
    "fields,world_size,expected",
    [
        (
            ["ft.simulated_fault_type=rank_hung", "ft.simulated_fault_rank=1", "ft.simulated_fault_base_delay=4"],
            2,
            "hang@4s:1",
        ),
        (["ft.simulated_fault_type=rank_killed", "ft.simulated_fault_rank=0"], 2, "kill@0s:0"),
    ],
)
def test_simulate_fault_is_a_timed_registry_fault(fields, world_size, expected):
    cfg = apply_overrides(base_config(), ["ft.enable_ft_package=true", "ft.simulate_fault=true", *fields])
    installed = fault_injection.install(FaultInjectionConfig())
    armed = maybe_setup_simulated_fault(cfg.ft, seed=cfg.rng.seed, world_size=world_size)
    assert [str(f) for f in armed] == [expected]
    assert [str(f) for f in installed.faults] == [expected]  # in the registry the loop takes faults from


def test_a_random_simulated_fault_is_the_same_on_every_rank_and_follows_the_seed():
    def chosen(seed: int, rank: int) -> list[str]:
        cfg = apply_overrides(base_config(), ["ft.enable_ft_package=true", "ft.simulate_fault=true"])
        cfg.rng.seed = seed
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RANK", str(rank))
            return [str(f) for f in maybe_setup_simulated_fault(cfg.ft, seed=seed, world_size=8)]

    picks = {seed: chosen(seed, 0) for seed in range(20)}
    assert all(chosen(seed, 5) == pick for seed, pick in picks.items())
    kinds = {pick[0].split("@")[0] for pick in picks.values()}
    ranks = {pick[0].split(":")[1] for pick in picks.values()}
    assert kinds == {"hang", "kill"} and len(ranks) > 2, picks


def test_simulated_fault_off_adds_nothing():
    cfg = apply_overrides(base_config(), ["ft.simulated_fault_type=rank_hung", "ft.simulated_fault_rank=1"])
    installed = fault_injection.install(FaultInjectionConfig())
    assert maybe_setup_simulated_fault(cfg.ft, seed=1, world_size=2) == [] and installed.faults == []
    assert maybe_setup_simulated_fault(None) == []  # no ft section at all


def test_a_bad_simulated_fault_is_named_as_from_ft_simulate_fault():
    ft = SimpleNamespace(enable_ft_package=True, simulate_fault=True, simulated_fault_type="rank_killed",
                         simulated_fault_rank=0, simulated_fault_base_delay=-2)  # fmt: skip
    with pytest.raises(ValueError) as err:
        maybe_setup_simulated_fault(ft, world_size=2)
    message = str(err.value)
    assert message.startswith("ft.simulate_fault (") and "bad item 'kill@-2.0s:0'" in message, message
    assert "time -2.0s is not a number of seconds >= 0" in message and "preempt" in message, message


def test_the_faults_package_imports_neither_the_config_nor_another_feature():
    allowed = (
        "megatron.bridge.training.faults",
        "megatron.bridge.training.events.stream",
        "megatron.bridge.training.callbacks",  # the loop's hooks and a run's components: the framework, no feature
        "megatron.bridge.training.components",
        "megatron.bridge.utils",
    )
    package = Path(fault_injection.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron"):
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names if alias.name.startswith("megatron")]
            else:
                continue
            for name in names:
                assert name.startswith(allowed), f"{path.name} imports {name}"
                assert not name.startswith("megatron.bridge.training.config"), f"{path.name} imports {name}"
