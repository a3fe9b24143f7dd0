"""Forward steps: which take the GlobalState, the GPT step's batch and loss, and the loss reduction of the loop."""

import functools

import pytest
import torch

from megatron.bridge.training.gpt_step import forward_step, get_batch
from megatron.bridge.training.losses import masked_next_token_loss
from megatron.bridge.training.state import GlobalState
from megatron.bridge.training.utils.train_utils import needs_global_state_injection, prepare_forward_step_func


def two_args(data_iterator, model):
    return "two", data_iterator, model


def with_plan(data_iterator, model, return_schedule_plan=False):
    return "plan", data_iterator, model


def named_state(state, data_iterator, model):
    return state, data_iterator, model


def annotated(gs: GlobalState, data_iterator, model):
    return gs, data_iterator, model


def string_annotated(gs: "GlobalState", data_iterator, model):
    return gs, data_iterator, model


class Functor:
    def __call__(self, global_state, data_iterator, model):
        return global_state, data_iterator, model


@pytest.mark.parametrize(
    "fn, takes_state",
    [
        (two_args, False),
        (with_plan, False),
        (named_state, True),
        (annotated, True),
        (string_annotated, True),
        (Functor(), True),
        (forward_step, True),
    ],
)
def test_the_state_is_bound_only_for_forward_steps_that_ask_for_it(fn, takes_state):
    assert needs_global_state_injection(fn) is takes_state
    state = GlobalState()
    prepared = prepare_forward_step_func(fn, state)
    if takes_state:
        assert isinstance(prepared, functools.partial) and prepared.args == (state,)
    else:
        assert prepared is fn


def test_a_forward_step_that_is_not_callable_is_refused():
    with pytest.raises(TypeError, match="forward_step_func.*not callable"):
        prepare_forward_step_func("gpt_step.forward_step", GlobalState())


def test_masked_loss_reports_sum_and_count():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, count, reported = masked_next_token_loss(mask, losses)
    assert loss.item() == 7.0 and count.item() == 3
    assert reported["lm loss"].tolist() == [7.0, 3.0]


class _EchoModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, position_ids, attention_mask, labels):
        self.seen = (input_ids, position_ids, attention_mask, labels)
        return labels.float() + self.w


def test_gpt_forward_step_feeds_the_model_a_causal_mask_and_returns_the_masked_loss():
    batch = {
        "tokens": torch.tensor([[1, 2, 3]]),
        "labels": torch.tensor([[2, 3, 4]]),
        "loss_mask": torch.tensor([[1.0, 1.0, 0.0]]),
        "position_ids": torch.tensor([[0, 1, 2]]),
    }
    model = _EchoModel()
    output, loss_func = forward_step(GlobalState(), iter([batch]), model)
    tokens, positions, mask, labels = model.seen
    assert torch.equal(tokens, batch["tokens"]) and torch.equal(labels, batch["labels"])
    assert mask.tolist() == [[[[False, True, True], [False, False, True], [False, False, False]]]]
    loss, count, _ = loss_func(output)
    assert loss.item() == 5.0 and count.item() == 2
    assert (
        get_batch(iter([{**batch, "attention_mask": torch.ones(1, 1, 3, 3)}]), torch.device("cpu"))[
            "attention_mask"
        ].dtype
        == torch.float32
    )  # a mask the data carries is used as is
    with pytest.raises(NotImplementedError, match="schedule plans"):
        forward_step(GlobalState(), iter([batch]), model, return_schedule_plan=True)
