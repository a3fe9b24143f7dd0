"""TrainState round trips (ours, older ones, Megatron-Bridge's tensors) and GlobalState's lazy handles."""

import signal

import torch
from tests.unit_tests.configs import base_config

from megatron.bridge.training.config import NVRxStragglerDetectionConfig
from megatron.bridge.training.state import FaultToleranceState, GlobalState, TrainState


def test_train_state_round_trip_and_older_forms():
    state = TrainState(step=7, consumed_train_samples=56, skipped_train_samples=8, do_train=True)
    again = TrainState()
    again.load_state_dict(state.state_dict())
    assert again == state

    legacy = TrainState()
    legacy.load_state_dict({"iteration": 5, "consumed_train_samples": 40})  # written by an older version
    assert (legacy.step, legacy.consumed_train_samples, legacy.skipped_train_samples) == (5, 40, 0)

    from_tensors = TrainState()
    from_tensors.load_state_dict({"step": torch.tensor(3, dtype=torch.int32), "do_valid": torch.tensor(True)})
    assert from_tensors.step == 3 and type(from_tensors.step) is int and from_tensors.do_valid is True


def test_train_state_saves_megatron_bridges_tensors_and_loads_our_older_plain_values():
    saved = TrainState(step=9, consumed_train_samples=72, floating_point_operations_so_far=1.5e18).state_dict()
    assert saved["step"].dtype == torch.int64 and saved["do_test"].dtype == torch.bool
    assert saved["floating_point_operations_so_far"].dtype == torch.float64
    older = {"step": 9, "consumed_train_samples": 72, "floating_point_operations_so_far": 7}  # before tensors
    loaded = TrainState()
    loaded.load_state_dict(older)
    assert (loaded.step, loaded.consumed_train_samples, loaded.do_train) == (9, 72, False)
    again = TrainState()
    again.load_state_dict(saved)
    assert again.floating_point_operations_so_far == 1.5e18 and type(again.step) is int


def test_global_state_builds_its_handles_once_and_a_restart_forgets_them():
    cfg = base_config()
    cfg.train.exit_signal = signal.SIGUSR1
    state = GlobalState()
    state.cfg = cfg
    assert state.nvrx_straggler_manager is None  # no nvrx_straggler section: no manager, as upstream
    assert state.signal_handler is None  # exit_signal_handler off: the signal keeps its default action
    cfg.nvrx_straggler = NVRxStragglerDetectionConfig()
    cfg.train.exit_signal_handler = True
    before = signal.getsignal(signal.SIGUSR1)
    state = GlobalState()
    state.cfg = cfg  # installs the handler at once
    assert signal.getsignal(signal.SIGUSR1) is not before
    assert state.cfg is cfg
    assert state.train_state is state.train_state
    assert isinstance(state.fault_tolerance_state, FaultToleranceState)
    handler = state.signal_handler
    assert handler is state.signal_handler and handler.sig == signal.SIGUSR1
    manager = state.nvrx_straggler_manager
    assert manager is state.nvrx_straggler_manager and manager.config is cfg.nvrx_straggler

    state.train_state.step = 4
    ft = state.fault_tolerance_state
    state.reset_for_restart()
    assert state.train_state.step == 0
    assert handler.released and signal.getsignal(signal.SIGUSR1) is before  # released by the reset
    assert state.signal_handler is not handler  # and entered anew
    state.reset_for_restart()
    assert signal.getsignal(signal.SIGUSR1) is before
    assert state.nvrx_straggler_manager is not manager
    assert state.fault_tolerance_state is ft and state.cfg is cfg  # kept over a restart


def test_a_stop_request_keeps_the_first_reason_until_a_restart():
    from megatron.bridge.training.state import GlobalState

    state = GlobalState()
    assert state.stop_request is None
    state.request_stop(21, "straggler")
    state.request_stop(18, "later")
    assert state.stop_request == (21, "straggler")
    state.reset_for_restart()
    assert state.stop_request is None


def test_megatron_bridges_async_save_functions_use_the_runs_queue():
    from types import SimpleNamespace

    from megatron.bridge.training.checkpointing import maybe_finalize_async_save, schedule_async_save
    from megatron.bridge.training.config import CheckpointConfig
    from megatron.bridge.training.state import GlobalState

    calls = []
    queue = SimpleNamespace(
        schedule_async_request=lambda request: calls.append(("schedule", request)),
        maybe_finalize_async_calls=lambda blocking: calls.append(("finalize", blocking)),
        close=lambda: calls.append(("close",)),
    )
    state = GlobalState()
    schedule_async_save(state, "R0")  # async saves off: no queue, nothing scheduled
    state.async_calls_queue = queue
    schedule_async_save(state, "R1")
    maybe_finalize_async_save(state, CheckpointConfig(async_save=False), blocking=True)  # off: nothing
    maybe_finalize_async_save(state, CheckpointConfig(save="/c", async_save=True), blocking=True, terminate=True)
    assert calls == [("schedule", "R1"), ("finalize", True), ("close",)]
    assert state.async_calls_queue is None


def test_a_restart_closes_the_writer_clears_the_loops_model_callbacks_and_keeps_the_async_queue(tmp_path):
    from types import SimpleNamespace

    cfg = base_config()
    cfg.logger.tensorboard_dir = str(tmp_path / "tb")
    cfg.model.finalize_model_grads_func = print  # bound by the loop to one iteration's model
    state = GlobalState()
    state.cfg = cfg
    writer = state.tensorboard_logger  # one process: it is the last rank
    assert writer is state.tensorboard_logger and state.timers is state.timers
    state.async_calls_queue = queue = SimpleNamespace()
    state.reset_for_restart()
    assert writer.file_writer is None  # closed
    assert state.async_calls_queue is queue and cfg.model.finalize_model_grads_func is None
    assert state.tensorboard_logger is not writer
    state.reset_for_restart()
    GlobalState.__init__(state)  # a second __init__ keeps what the state holds
    assert state.cfg is cfg
