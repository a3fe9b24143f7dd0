"""The signal handler records real signals and restores the previous handler; the stop deadline fires or not."""

import os
import signal
import threading
import time

import pytest
import torch

from megatron.bridge.training.utils.sig_utils import (
    DistributedSignalHandler,
    StopDeadline,
    all_gather_item,
    get_device,
)


def test_handler_records_a_real_signal_and_restores_the_previous_one():
    previous = signal.getsignal(signal.SIGUSR1)
    with DistributedSignalHandler(signal.SIGUSR1) as handler:
        assert handler.signals_received() == [False] and not handler.received
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)  # delivered between bytecodes
        assert handler.signals_received() == [True] and handler.received
        first = handler.received_at
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert handler.received_at == first  # the first receipt counts
        assert not handler.released
    assert signal.getsignal(signal.SIGUSR1) is previous
    assert handler.released and handler.release() is False  # released once, by leaving the with


def test_release_restores_the_previous_handler_once():
    previous = signal.getsignal(signal.SIGUSR2)
    handler = DistributedSignalHandler(signal.SIGUSR2).__enter__()
    assert signal.getsignal(signal.SIGUSR2) is not previous
    assert handler.release() is True and handler.released
    assert signal.getsignal(signal.SIGUSR2) is previous
    assert handler.release() is False
    assert DistributedSignalHandler(signal.SIGUSR2).release() is False  # never entered: nothing to release


def test_handler_outside_the_main_thread_installs_nothing():
    previous = signal.getsignal(signal.SIGUSR2)
    seen = []

    def enter():
        with DistributedSignalHandler(signal.SIGUSR2) as handler:
            seen.append(signal.getsignal(signal.SIGUSR2))
        seen.append((handler.released, handler.release()))

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert seen == [previous, (True, False)]  # nothing installed, yet leaving the with released it, once
    assert signal.getsignal(signal.SIGUSR2) is previous


def test_deadline_exits_with_its_code_unless_cancelled():
    exits = []
    fired = threading.Event()

    def fake_exit(code):
        exits.append(code)
        fired.set()

    StopDeadline(0.05, 18, lambda: "too slow", exit_fn=fake_exit)
    assert fired.wait(5) and exits == [18]
    cancelled = StopDeadline(0.2, 18, lambda: "too slow", exit_fn=fake_exit)
    cancelled.cancel()
    time.sleep(0.4)
    assert exits == [18]


def test_a_signal_received_while_unwinding_is_delivered_again_on_release(caplog):
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        with DistributedSignalHandler(signal.SIGUSR1) as handler:  # a run that stops for it: recorded, not re-sent
            os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.received and seen == []
        with DistributedSignalHandler(signal.SIGUSR1) as handler:  # a run ending with an error: nobody acts on it
            handler.unwinding = RuntimeError("the error the run ends with")
            os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
        assert "ending with RuntimeError" in caplog.text and "the error the run ends with" in caplog.text
        with DistributedSignalHandler(signal.SIGUSR1) as handler:  # unwinding without a signal: nothing to send
            handler.unwinding = RuntimeError()
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_all_gather_item_without_distributed_is_this_rank_alone():
    assert all_gather_item(7, dtype=torch.int64) == [7]


@pytest.mark.timeout(60)
def test_all_gather_item_and_the_handler_gather_over_gloo_on_the_cpu():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert get_device() == torch.device("cpu") and get_device(local_rank=3) == torch.device("cpu")
        assert all_gather_item(2.5, dtype=torch.float64) == [2.5]
        assert all_gather_item(1, dtype=torch.int32, group=dist.group.WORLD) == [1]
        handler = DistributedSignalHandler(signal.SIGUSR2).__enter__()
        try:
            assert handler.signals_received() == [False]
            os.kill(os.getpid(), signal.SIGUSR2)
            assert handler.signals_received() == [True]
        finally:
            handler.release()
    finally:
        dist.destroy_process_group()
