"""Garbage collection around training: set-up's objects frozen, Megatron-Bridge's manual collection, all undone."""

import gc
from types import SimpleNamespace

import pytest
from tests.unit_tests.configs import base_config

from megatron.bridge.training import train
from megatron.bridge.training.config import TrainingConfig
from megatron.bridge.training.utils.garbage_collection import GarbageCollectionCallback, maybe_run_manual_gc
from megatron.bridge.utils.fields import ConfigError

pytestmark = pytest.mark.timeout(60)


class _Cycle:
    """An object in a reference cycle: only the collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _context(step: int) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(train_state=SimpleNamespace(step=step)))


@pytest.fixture
def collector_state():
    """Leave the interpreter's collector as the test found it."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_set_up_objects_are_frozen_when_training_starts_and_given_back_when_it_ends(collector_state):
    collector = GarbageCollectionCallback(TrainingConfig(), freeze=True)
    collector.on_train_start(_context(0))
    assert gc.get_freeze_count() > 0 and gc.isenabled()  # frozen; automatic collection stays on without manual_gc
    garbage = _Cycle()
    del garbage
    collector.on_train_step_end(_context(0))  # no manual collection without manual_gc
    collector.close()
    assert gc.get_freeze_count() == 0
    collector.close()  # twice is harmless (teardown runs it on every path)
    assert gc.get_freeze_count() == 0


def test_nothing_is_frozen_under_in_process_restart(collector_state):
    collector = GarbageCollectionCallback(TrainingConfig(), freeze=False)
    collector.on_train_start(_context(0))
    assert gc.get_freeze_count() == 0
    collector.close()


def test_manual_gc_turns_collection_off_collects_at_the_interval_and_around_evaluation(collector_state):
    cfg = TrainingConfig(manual_gc=True, manual_gc_interval=3)
    collector = GarbageCollectionCallback(cfg, freeze=True)
    collector.on_train_start(_context(0))
    assert not gc.isenabled()
    collected = []
    callback = lambda phase, info: phase == "stop" and collected.append(info["generation"])  # noqa: E731
    gc.callbacks.append(callback)
    try:
        for step in range(6):  # completes iterations 1..6: collections at 3 and 6
            collector.on_train_step_end(_context(step))
        assert collected == [2, 2]
        collected.clear()
        collector.on_eval_start(_context(6))
        collector.on_eval_end(_context(6))
        assert collected == [2, 0]  # a full collection before evaluating, the young generation after
    finally:
        gc.callbacks.remove(callback)
    collector.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_cycle_made_during_training_is_still_collected(collector_state):
    collector = GarbageCollectionCallback(TrainingConfig(), freeze=True)
    collector.on_train_start(_context(0))
    garbage = _Cycle()
    ref = id(garbage)
    del garbage
    gc.collect()
    assert all(id(o) != ref for o in gc.get_objects() if isinstance(o, _Cycle))
    collector.close()


def test_upstreams_helper_and_validation():
    seen = []
    callback = lambda phase, info: phase == "stop" and seen.append(info["generation"])  # noqa: E731
    gc.callbacks.append(callback)
    try:
        maybe_run_manual_gc(True, 0, 4)  # interval 0: never
        maybe_run_manual_gc(False, 2, 4)  # off
        assert seen == []
        maybe_run_manual_gc(True, 2, 4)
        assert seen == [2]
    finally:
        gc.callbacks.remove(callback)
    assert train.maybe_run_manual_gc is maybe_run_manual_gc  # Megatron-Bridge's place for it
    cfg = base_config()
    cfg.train.manual_gc, cfg.train.manual_gc_interval = True, -1
    with pytest.raises(ConfigError, match="train.manual_gc_interval"):
        cfg.validate()
