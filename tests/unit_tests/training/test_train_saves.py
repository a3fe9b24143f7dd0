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
