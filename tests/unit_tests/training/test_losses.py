"""The masked next-token loss: its value, the checks it makes itself, and the loop leaving those to it."""

import functools

import torch

from megatron.bridge.training import losses
from megatron.bridge.training.health import rerun


class _Machine:
    def __init__(self, mode):
        self.mode, self.calls = mode, []
        self.rerun_requested, self.failed_validation_call = False, None

    def get_mode(self):
        return self.mode

    def validate_result(self, **kwargs):
        self.calls.append(kwargs["message"])

    def is_unexpectedly_large(self, *args, **kwargs):
        return False


def test_tuple_output_carries_its_own_mask_and_the_checks_follow_the_flags(monkeypatch):
    from megatron.core.rerun_state_machine import RerunMode

    machine = _Machine(RerunMode.VALIDATE_RESULTS)
    monkeypatch.setattr(losses, "get_rerun_state_machine", lambda: machine)
    out = (torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1, 0], [0, 1]]))
    loss, count, reported = losses.masked_next_token_loss(torch.ones(2, 2), out, check_for_spiky_loss=True)
    assert loss.item() == 5.0 and count.item() == 2 and reported["lm loss"].tolist() == [5.0, 2.0]
    assert machine.calls == [losses.NAN_MESSAGE, losses.INF_MESSAGE, losses.SPIKY_MESSAGE]
    machine.calls.clear()
    losses.masked_next_token_loss(torch.ones(2), torch.ones(2), check_for_nan_in_loss=False)
    assert machine.calls == []


def test_disabled_mode_leaves_a_nan_to_the_loops_all_rank_guard(monkeypatch):
    from megatron.core.rerun_state_machine import RerunMode

    machine = _Machine(RerunMode.DISABLED)
    monkeypatch.setattr(losses, "get_rerun_state_machine", lambda: machine)
    loss, _, _ = losses.masked_next_token_loss(torch.ones(2), torch.tensor([float("nan"), 1.0]))
    assert loss.isnan() and machine.calls == []


def test_the_loop_checks_other_loss_functions_but_not_the_masked_loss_twice(monkeypatch):
    checked = []
    monkeypatch.setattr(rerun, "validate_loss", checked.append)
    own = losses.create_masked_next_token_loss_function(torch.ones(2), False, False)
    _, kept = rerun.check_losses(lambda: (torch.ones(2), own))()
    assert kept is own
    other = functools.partial(lambda mask, out: (out.sum(), {}), torch.ones(2))
    _, wrapped = rerun.check_losses(lambda: (torch.ones(2), other))()
    wrapped(torch.ones(2))
    assert len(checked) == 1
