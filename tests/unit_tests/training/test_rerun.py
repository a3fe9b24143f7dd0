"""Our logic around megatron-core's re-run state machine: checkpointed state, the restart record, the fallback."""

import json
import math

import pytest
import torch
from megatron.core import rerun_state_machine as upstream

from megatron.bridge.training.checkpoint import layout
from megatron.bridge.training.config import RerunStateMachineConfig
from megatron.bridge.training.health.rerun import ATTEMPTS_FILE, RerunController, build_rerun_state_machine
from megatron.bridge.utils import upstream as compat


@pytest.fixture
def machine():
    """A validate_results machine installed as the process's singleton (removed afterwards)."""
    upstream.destroy_rerun_state_machine()
    m = build_rerun_state_machine(RerunStateMachineConfig(rerun_mode="validate_results", error_injection_rate=7))
    compat.set_rerun_state_machine(m)
    yield m
    upstream.destroy_rerun_state_machine()


def test_exported_state_is_plain_and_restores_what_the_rerun_needs(machine, tmp_path):
    machine.state = upstream.RerunState.WILL_RERUN_FROM_CHECKPOINT
    machine.current_iteration = 5
    machine.checkpoint_requested = True
    machine.failed_validation_call = upstream.Call(upstream.Caller("found NaN in local forward loss calculation", 1), 1)
    machine.initial_result = torch.tensor(float("nan"))
    machine.suspicious_node, machine.suspicious_device = "node-a", torch.device("cpu")
    machine.max_values, machine.large_value_counts = {"loss": 4.8}, {"loss": 100}
    controller = RerunController(RerunStateMachineConfig(rerun_mode="validate_results"), str(tmp_path))
    saved = controller.export_state()
    json.dumps(saved)  # plain values only: loads with weights_only=True

    upstream.destroy_rerun_state_machine()
    fresh = build_rerun_state_machine(RerunStateMachineConfig(rerun_mode="validate_results"))
    compat.set_rerun_state_machine(fresh)
    controller.import_state(saved)
    assert fresh.state == upstream.RerunState.WILL_RERUN_FROM_CHECKPOINT
    assert fresh.current_iteration == 5 and fresh.checkpoint_requested and not fresh.rerun_requested
    assert fresh.failed_validation_call == machine.failed_validation_call
    assert math.isnan(fresh.initial_result.item())
    assert (fresh.suspicious_node, fresh.suspicious_device) == ("node-a", torch.device("cpu"))
    assert fresh.max_values == {"loss": 4.8} and fresh.large_value_counts == {"loss": 100}
    assert fresh.error_injector.error_injection_rate == 7


def test_nothing_is_exported_between_reruns(machine, tmp_path):
    controller = RerunController(RerunStateMachineConfig(rerun_mode="validate_results"), str(tmp_path))
    assert controller.export_state() is None
    controller.import_state(None)
    assert machine.state == upstream.RerunState.NOT_RUNNING_YET


def test_restarts_are_counted_per_step_and_survive_a_new_process(tmp_path):
    controller = RerunController(RerunStateMachineConfig(), str(tmp_path))
    assert controller._count_restart(5) == {"step": 5, "restarts": 1, "fallbacks": 0}
    again = RerunController(RerunStateMachineConfig(), str(tmp_path))  # the restarted job
    assert again._count_restart(5)["restarts"] == 2
    assert again._count_restart(9) == {"step": 9, "restarts": 1, "fallbacks": 0}  # another step starts over
    (tmp_path / ATTEMPTS_FILE).write_text("{torn")
    assert again._count_restart(9)["restarts"] == 1  # an unreadable record never blocks training


def _commit(root, iteration):
    tmp = layout.tmp_dir(str(root), iteration, "a")
    (root / tmp).mkdir(parents=True)
    layout.commit(str(root), iteration, "a")


def test_fallback_sets_the_failing_checkpoint_aside_and_tracks_the_older_one(tmp_path):
    for it in (3, 6, 8):
        _commit(tmp_path, it)
    controller = RerunController(RerunStateMachineConfig(on_rerun_limit="fallback"), str(tmp_path))
    assert controller._fall_back(step=9, failing=8) == 6
    assert layout.read_tracker(str(tmp_path)) == 6
    assert (tmp_path / "iter_0000008.rerun_failed").is_dir() and not (tmp_path / "iter_0000008").exists()
    assert json.loads((tmp_path / ATTEMPTS_FILE).read_text()) == {"step": 9, "restarts": 0, "fallbacks": 1}
    assert layout.committed_iterations(str(tmp_path)) == [6, 3]


def test_no_fallback_without_an_older_checkpoint(tmp_path):
    _commit(tmp_path, 4)
    controller = RerunController(RerunStateMachineConfig(on_rerun_limit="fallback"), str(tmp_path))
    assert controller._fall_back(step=5, failing=4) is None
    assert (tmp_path / "iter_0000004").is_dir() and layout.read_tracker(str(tmp_path)) == 4


def test_check_losses_validates_a_copy_of_each_loss_where_the_loss_function_computes_it(monkeypatch):
    from megatron.bridge.training.health import rerun

    checked = []
    monkeypatch.setattr(rerun, "validate_loss", checked.append)
    loss = torch.tensor(2.5)

    def loss_func(output, non_loss_data=False):
        return (output if non_loss_data else loss), {"lm loss": loss.clone()}

    def forward_step(data_iterator, model):
        return torch.tensor([1.0]), loss_func

    output, checked_loss_func = rerun.check_losses(forward_step)(iter(()), None)
    assert torch.equal(output, torch.tensor([1.0])) and not checked  # nothing checked before the loss is computed
    returned, reduced = checked_loss_func(output)
    assert returned is loss and reduced["lm loss"].item() == 2.5  # passed through unchanged
    assert len(checked) == 1 and checked[0].item() == 2.5 and checked[0] is not loss  # a copy: the schedule
    returned /= 4  # divides the returned loss in place; the checked copy keeps its value
    assert checked[0].item() == 2.5
    checked_loss_func(output, non_loss_data=True)
    assert len(checked) == 1  # non-loss data is not a loss


def test_the_machines_per_step_all_reduce_carries_the_loops_flags(machine, monkeypatch):
    """With validate_results the step's agreement rides on megatron-core's own all-reduce: one collective, not two."""
    import torch.distributed as dist

    from megatron.bridge.utils.cpu_shims import apply_cpu_shims

    apply_cpu_shims(torch.device("cpu"))  # megatron-core builds its flag tensor on "cuda"
    reduced = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **k: reduced.append(tensor.tolist()))  # one rank
    controller = RerunController(RerunStateMachineConfig(rerun_mode="validate_results"), None)
    data = controller.wrap_data_iterator(iter(range(100)))
    controller.carry(lambda: [1, 0, 1, 0])
    assert [n for n in controller.passes(data, 0)] == [0]
    assert reduced == [[0, 1, 0, 1, 0]]  # no re-run asked, then the loop's four flags, in one all-reduce
    assert controller.agreed() == (True, False, True, False)
    assert controller.agreed() is None  # taken once
    controller.carry(lambda: None)  # nothing to agree this step: upstream's own question only
    list(controller.passes(data, 1))
    assert reduced[-1] == [0] and controller.agreed() is None
    controller.carry(None)
    list(controller.passes(data, 2))
    assert reduced[-1] == [0] and machine.step_flags is None
