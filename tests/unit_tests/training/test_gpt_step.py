"""Forward steps: which take the GlobalState, the GPT step's batch and loss, and the loss reduction of the loop."""

import functools
from types import SimpleNamespace

import pytest
import torch
from tests.unit_tests.configs import base_config

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


class _Group:
    def __init__(self, rank=0, size=1):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class _Groups:
    def __init__(self, pp_rank=0, pp_size=1):
        self.pp = _Group(pp_rank, pp_size)
        self.cp = _Group()


class _EchoModel(torch.nn.Module):
    def __init__(self, pp_rank=0, pp_size=1):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(seq_length=3, mtp_num_layers=None)
        self.pg_collection = _Groups(pp_rank, pp_size)

    def forward(self, input_ids, position_ids, attention_mask, labels):
        self.seen = (input_ids, position_ids, attention_mask, labels)
        return labels.float() + self.w if labels is not None else self.w


_BATCH = {
    "tokens": torch.tensor([[1, 2, 3]]),
    "labels": torch.tensor([[2, 3, 4]]),
    "loss_mask": torch.tensor([[1.0, 1.0, 0.0]]),
    "position_ids": torch.tensor([[0, 1, 2]]),
}


def _state():
    state = GlobalState()
    state.cfg = base_config()
    return state


def test_gpt_forward_step_feeds_the_model_a_causal_mask_and_returns_the_masked_loss():
    model = _EchoModel()
    output, loss_func = forward_step(_state(), iter([_BATCH]), model)
    tokens, positions, mask, labels = model.seen
    assert torch.equal(tokens, _BATCH["tokens"]) and torch.equal(labels, _BATCH["labels"])
    assert mask.tolist() == [[[[False, True, True], [False, False, True], [False, False, False]]]]
    assert loss_func.func is masked_next_token_loss  # it checks its own loss (rerun.check_losses leaves it)
    loss, count, _ = loss_func(output)
    assert loss.item() == 5.0 and count.item() == 2
    with pytest.raises(NotImplementedError, match="schedule plans"):
        forward_step(_state(), iter([_BATCH]), model, return_schedule_plan=True)


def test_each_pipeline_stage_reads_what_it_needs_and_uses_the_datasets_mask(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # the stage comes from the groups
    cfg = base_config()
    with_mask = {**_BATCH, "attention_mask": torch.ones(1, 1, 3, 3)}
    first = get_batch(iter([with_mask]), cfg, pg_collection=_Groups(0, 2))
    assert first[0] is not None and first[1] is None and first[2] is None  # tokens, no labels nor loss mask
    assert first[3].dtype == torch.float32  # a mask the data carries is used as is
    last = get_batch(iter([with_mask]), cfg, pg_collection=_Groups(1, 2))
    assert last[0] is None and last[1] is not None and last[2] is not None
    middle = get_batch(iter([with_mask]), cfg, pg_collection=_Groups(1, 3))
    assert all(x is not None for x in middle[:5])  # the dataset's mask is wanted: a middle stage reads all
    cfg.dataset.skip_getting_attention_mask_from_dataset = True
    untouched = iter([with_mask])
    assert get_batch(untouched, cfg, pg_collection=_Groups(1, 3)) == (None,) * 6
    assert next(untouched) is with_mask  # not read
