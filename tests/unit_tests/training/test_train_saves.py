"""Which save the loop makes after a step: a local (non-persistent) checkpoint never stands in for the exit one.

Megatron-Bridge fixed, after the commit we follow, a planned exit that skipped the global save because a local
checkpoint had just been written at the same iteration; the job then ended with nothing durable at its last step.
"""

from types import SimpleNamespace

import pytest

from megatron.bridge.training import train

pytestmark = pytest.mark.timeout(30)


def _ctx(step, save_interval=None, local_interval=None, global_saved=None, local_saved=None, save="ckpt"):
    checkpoints = SimpleNamespace(
        save=object(),
        save_local=object(),
        last_saved_iteration=global_saved,
        local=SimpleNamespace(last_saved_iteration=local_saved),
    )
    cfg = SimpleNamespace(
        checkpoint=SimpleNamespace(save=save, save_interval=save_interval, non_persistent_save_interval=local_interval)
    )
    return SimpleNamespace(cfg=cfg, checkpoints=checkpoints, state=SimpleNamespace(step=step))


def test_a_planned_exit_saves_globally_even_when_a_local_save_is_due_or_done():
    for local_saved in (None, 12):
        ctx = _ctx(12, save_interval=5, local_interval=2, local_saved=local_saved)
        assert train._due_save(ctx, stopping=True) is ctx.checkpoints.save


def test_without_an_exit_the_local_interval_gives_a_local_save():
    ctx = _ctx(12, save_interval=5, local_interval=2)
    assert train._due_save(ctx, stopping=False) is ctx.checkpoints.save_local


def test_a_global_save_already_made_at_this_iteration_is_not_repeated():
    assert train._due_save(_ctx(10, save_interval=5, global_saved=10), stopping=True) is None


def test_without_a_save_directory_nothing_global_is_saved():
    ctx = _ctx(12, save_interval=4, save=None)
    assert train._due_save(ctx, stopping=True) is None


def _agreement_ctx(signal_handler=False, in_flight=False, busy=(False, False), received=False):
    import torch

    from megatron.bridge.training.checkpoint.async_writer import AsyncSavesBusy

    train_cfg = SimpleNamespace(exit_signal_handler=signal_handler, exit_duration_in_mins=None)
    checkpoints = SimpleNamespace(async_save_in_flight=in_flight, busy_here=lambda: AsyncSavesBusy(*busy))
    return SimpleNamespace(
        cfg=SimpleNamespace(train=train_cfg),
        checkpoints=checkpoints,
        signals=SimpleNamespace(received=received),
        start_time=0.0,
        model=[torch.nn.Linear(1, 1)],
        rerun=SimpleNamespace(agreed=lambda: None),  # the re-run state machine carried nothing this step
    )


def test_the_step_agreement_carries_stop_flags_and_saves_in_one_collective(monkeypatch):
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None: calls.append(tensor.tolist()))
    assert train.agree_after_step(_agreement_ctx()) == train.StepAgreement()  # nothing to agree: no collective
    assert calls == []
    agreed = train.agree_after_step(_agreement_ctx(in_flight=True, busy=(True, False)))
    assert calls == [[0, 0, 1, 0]]  # one all-reduce: signal, duration, global busy, local busy
    assert agreed.saves_busy.global_tier and not agreed.saves_busy.local_tier and not agreed.signalled
    agreed = train.agree_after_step(_agreement_ctx(signal_handler=True, received=True))
    assert calls[-1] == [1, 0, 0, 0] and agreed.signalled and agreed.saves_busy is None
