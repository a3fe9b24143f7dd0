"""The weight-hash check's own logic: digests, who is named, recurrence, the bitflip fault and the config field."""

import json
import socket
import types

import pytest
import torch
import torch.distributed as dist
from tests.unit_tests.configs import base_config

from megatron.bridge.training.exit_codes import STOP_CODES, ExitCode, TrainingExit
from megatron.bridge.training.faults import injection
from megatron.bridge.training.faults.spec import UPDATE, parse
from megatron.bridge.training.health import weight_hash
from megatron.bridge.training.health.weight_hash import (
    RECORD_FILE,
    WeightHashCheck,
    check_replicas,
    compare_group,
    parameter_digests,
    read_record,
    seen_before,
)
from megatron.bridge.training.utils.overrides import apply_overrides

pytestmark = pytest.mark.timeout(60)


def _model(seed: int = 0) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    return [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))]


def _digests(model) -> torch.Tensor:
    return parameter_digests(model)[False][1]


def test_digests_are_sha1_of_the_raw_bytes_and_one_flipped_bit_changes_exactly_one():
    model = _model()
    names, digests = parameter_digests(model)[False]
    assert names == ["0.0.weight", "0.0.bias", "0.1.weight", "0.1.bias"]
    assert digests.shape == (4, 20) and digests.dtype == torch.uint8
    assert parameter_digests(model)[True][1].shape == (0, 20)  # no expert parameters
    before = digests.clone()
    where = injection.flip_one_bit(model)
    assert "0.0.weight" in where  # the largest parameter (16 x 8)
    changed = [i for i in range(4) if not torch.equal(before[i], _digests(model)[i])]
    assert changed == [0]
    bits = (_model()[0][0].weight.detach().view(torch.int32) ^ model[0][0].weight.detach().view(torch.int32)).flatten()
    assert sorted(int(b) for b in bits if b) == [1 << 20]  # one mantissa bit of one element
    assert torch.isfinite(model[0][0].weight).all()


def test_expert_parameters_are_digested_apart():
    model = _model()
    model[0][1].weight.allreduce = False  # megatron-core marks expert parameters so
    digests = parameter_digests(model)
    assert digests[True][0] == ["0.1.weight"] and len(digests[False][0]) == 3


def test_the_minority_is_named_and_two_replicas_are_both_named():
    good, bad = _digests(_model()), _digests(_model())
    assert compare_group(torch.stack([good, good, good]), [0, 2, 4], list("abcd")) is None
    bad[2, 0] ^= 1
    found = compare_group(torch.stack([good, bad, good]), [0, 2, 4], list("abcd"))
    assert (found.ranks, found.parameters, found.group) == ([2], ["c"], [0, 2, 4])
    found = compare_group(torch.stack([good, bad]), [0, 1], list("abcd"))
    assert found.ranks == [0, 1]  # no majority: either may be wrong


def test_recurrence_is_the_same_rank_on_the_same_host(tmp_path):
    assert read_record(None) == [] and read_record(str(tmp_path)) == []
    (tmp_path / RECORD_FILE).write_text(json.dumps({"mismatches": [{"iteration": 6, "ranks": {"1": "a", "0": "a"}}]}))
    record = read_record(str(tmp_path))
    assert seen_before(record, {1: "a"}) == [1]
    assert seen_before(record, {1: "b", 3: "a"}) == []  # requeued elsewhere: not the same hardware
    (tmp_path / RECORD_FILE).write_text("{not json")
    assert read_record(str(tmp_path)) == []


def test_exit_codes_roll_back_then_stop():
    assert ExitCode.WEIGHTS_DIVERGED in STOP_CODES and ExitCode.WEIGHT_HASH_ROLLBACK not in STOP_CODES


def test_bitflip_is_one_kind_of_the_grammar_after_the_update():
    (fault,) = parse("bitflip@5:1")
    assert (fault.kind, fault.iteration, fault.rank, fault.phase) == ("bitflip", 5, 1, UPDATE)
    assert str(fault) == "bitflip@5:1"
    with pytest.raises(ValueError, match="bitflip cannot strike in phase 'step'"):
        parse("bitflip@5:1:step")


def test_step_faults_flip_after_the_update_of_their_iteration_only(monkeypatch):
    monkeypatch.setattr(injection.launch_env, "current", lambda: types.SimpleNamespace(restart_count=0))
    registry = injection.FaultRegistry(parse("bitflip@2:0"))
    faults = injection.StepFaults(0, registry)
    model = _model()
    before = _digests(model)

    def end_of(iteration: int):
        state = types.SimpleNamespace(train_state=types.SimpleNamespace(step=iteration - 1))
        faults.on_train_step_end(types.SimpleNamespace(state=state, model=model))

    end_of(1)
    assert torch.equal(before, _digests(model))
    end_of(2)
    flipped = _digests(model)
    assert not torch.equal(before, flipped)
    end_of(2)  # struck once
    assert torch.equal(flipped, _digests(model))


@pytest.mark.parametrize("value", [0, -3, 1.5, True])
def test_a_hash_interval_that_is_not_a_positive_integer_is_a_config_error(value):
    cfg = base_config()
    cfg.train.check_weight_hash_across_dp_replicas_interval = value
    with pytest.raises(ValueError, match="check_weight_hash_across_dp_replicas_interval"):
        cfg.validate(world_size=2)


def test_the_interval_is_honoured():
    cfg = apply_overrides(base_config(), ["train.check_weight_hash_across_dp_replicas_interval=50"])
    cfg.validate(world_size=2)
    run = types.SimpleNamespace(cfg=cfg)
    assert WeightHashCheck.build(run).interval == 50
    cfg.train.check_weight_hash_across_dp_replicas_interval = None
    assert WeightHashCheck.build(run) is None


@pytest.fixture
def one_rank_world(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    from tests.resources import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_check_that_agrees_goes_on_and_a_mismatch_stops_and_is_recorded(one_rank_world, tmp_path):
    model = _model()
    assert check_replicas(model, {False: None, True: None}) == ([], [])  # None: the default group
    check = WeightHashCheck(2, str(tmp_path))
    check.ready(None)
    mismatch = weight_hash.GroupMismatch([0], ["0.0.weight"], [0, 1, 2])
    with pytest.raises(TrainingExit) as stop:
        check._stop(6, [0], [mismatch])
    assert stop.value.exit_code == ExitCode.WEIGHT_HASH_ROLLBACK
    assert "rank(s) 0 on" in stop.value.reason and "in 1 parameter(s) (0.0.weight)" in stop.value.reason
    record = json.loads((tmp_path / RECORD_FILE).read_text())["mismatches"]
    assert [(m["iteration"], m["ranks"], m["exit_code"]) for m in record] == [(6, {"0": socket.gethostname()}, 31)]
    check.ready(None)  # the next attempt reads the record
    with pytest.raises(TrainingExit) as stop:
        check._stop(8, [0], [mismatch])
    assert stop.value.exit_code == ExitCode.WEIGHTS_DIVERGED
    assert "were named before on the same host" in stop.value.reason
    assert len(read_record(str(tmp_path))) == 2
    without_save = WeightHashCheck(2, None)
    without_save.ready(None)
    with pytest.raises(TrainingExit, match="no checkpoint.save to roll back to"):
        without_save._stop(8, [0], [mismatch])
