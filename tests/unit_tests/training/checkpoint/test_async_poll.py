"""Whether an async save finished on this rank, asked without a collective and without committing it.

The training loop folds the poll of an in-flight async save into the one all-reduce of its step: each rank says
whether its background write is still running (``upstream.async_call_finished_here``), and once no rank is, the queue
commits with ``no_dist=True``. The probe must not commit anything itself, and what it learns must be what
megatron-core's own ``no_dist`` poll then sees.
"""

import os
import time
from types import SimpleNamespace

import pytest
from tests.unit_tests.training.checkpoint.async_helpers import one_world_on_cpu, until

from megatron.bridge.training.checkpoint import local_tier
from megatron.bridge.utils import upstream

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    with one_world_on_cpu():
        yield


def _write_when_released(release: str, out: str) -> None:
    while not os.path.exists(release):
        time.sleep(0.01)
    with open(out, "w") as f:
        f.write("written")


def test_the_forked_writer_is_seen_running_then_finished_and_only_the_queue_commits(tmp_path):
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

    queue = AsyncCallsQueue(persistent=False)  # the forked (temporal) writer, as on CPU
    assert upstream.async_call_finished_here(queue)  # nothing in flight
    release, out, committed = tmp_path / "go", tmp_path / "shard", []
    queue.schedule_async_request(
        AsyncRequest(_write_when_released, (str(release), str(out)), [lambda: committed.append(out.read_text())])
    )
    try:
        time.sleep(0.2)
        assert not upstream.async_call_finished_here(queue)
        assert queue.maybe_finalize_async_calls(blocking=False, no_dist=True) == []  # still running: nothing done
        release.touch()
        assert until(lambda: upstream.async_call_finished_here(queue))
        assert upstream.async_call_finished_here(queue)  # asking again changes nothing
        assert committed == [] and queue.get_num_unfinalized_calls() == 1  # the probe committed nothing
        assert queue.maybe_finalize_async_calls(blocking=False, no_dist=True) == [0]
        assert committed == ["written"] and queue.get_num_unfinalized_calls() == 0
    finally:
        queue.close(abort=True)


def test_a_persistent_workers_notice_is_kept_where_megatron_cores_poll_reads_it():
    """The persistent worker reports a finished call once, on its queue: the probe must leave it for the commit."""
    import queue as queue_module

    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    # Its state as __init__ and a started worker leave it, without the spawned worker (which needs CUDA).
    caller = PersistentAsyncCaller.__new__(PersistentAsyncCaller)
    caller.comp_q, caller.cur_item = queue_module.Queue(), None
    caller.process = SimpleNamespace(is_alive=lambda: True)
    queue = SimpleNamespace(async_calls=[SimpleNamespace(async_caller=caller)])
    assert not upstream.async_call_finished_here(queue)
    caller.comp_q.put(7)  # the worker finished call 7
    assert upstream.async_call_finished_here(queue)
    assert upstream.async_call_finished_here(queue)  # the notice is kept, not consumed twice
    assert caller.is_current_async_call_done(blocking=False, no_dist=True)  # megatron-core's poll finds it


def test_a_persistent_worker_of_megatron_core_0_17_and_later_is_read_from_its_class_queue():
    """Since 0.17 the worker, and its queue of finished calls, belong to the class: one per process."""
    import queue as queue_module

    finished = queue_module.Queue()

    class Caller:  # the state megatron-core 0.17+'s PersistentAsyncCaller keeps (no per-instance queue)
        _persistent_comp_q = finished

        def __init__(self):
            self.process, self.cur_item = SimpleNamespace(is_alive=lambda: True), None

    caller = Caller()
    queue = SimpleNamespace(async_calls=[SimpleNamespace(async_caller=caller)])
    assert not upstream.async_call_finished_here(queue)  # the worker is alive and has not reported
    finished.put(3)
    assert upstream.async_call_finished_here(queue) and caller.cur_item == 3


def test_the_local_tier_is_busy_only_while_its_async_write_runs(tmp_path):
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

    tier = local_tier.LocalTier.__new__(local_tier.LocalTier)  # only the async bookkeeping is exercised
    tier._queue, tier._pending, tier.last_saved_iteration, tier._on_saved = (
        AsyncCallsQueue(persistent=False),
        None,
        None,
        None,
    )
    assert not tier.busy_here()
    release, out = tmp_path / "go", tmp_path / "shard"
    tier._queue.schedule_async_request(
        AsyncRequest(_write_when_released, (str(release), str(out)), [lambda: tier._saved(12)])
    )
    tier._pending = 12
    try:
        assert tier.busy_here()
        tier.finalize(busy_anywhere=True)  # another rank (here: this one) still writes: nothing happens
        assert tier.pending_iteration == 12
        release.touch()
        assert until(lambda: not tier.busy_here())
        tier.finalize(busy_anywhere=False)  # agreed: nobody writes any more; committed without a poll collective
        assert tier.pending_iteration is None and tier.last_saved_iteration == 12 and out.read_text() == "written"
    finally:
        tier._queue.close(abort=True)


def test_a_stop_by_the_local_tier_commits_the_global_save_in_flight_first():
    """A local-tier storage fault stops training; the healthy global save still being written is committed first."""
    from megatron.bridge.training.checkpoint.manager import CheckpointManager
    from megatron.bridge.training.exit_codes import ExitCode, TrainingExit

    manager = CheckpointManager.__new__(CheckpointManager)  # only the stop path is exercised
    commits = []
    manager._finalize_global = lambda blocking, no_dist=False: commits.append(blocking)
    manager._queue, manager._pending = object(), 3
    with pytest.raises(TrainingExit):
        with manager._global_save_kept_on_a_local_stop():
            raise TrainingExit(ExitCode.STORAGE_FULL, "the local tier is full")
    assert commits == [True]  # waited for and committed before the exit goes on
    with pytest.raises(OSError):
        with manager._global_save_kept_on_a_local_stop():
            raise OSError("not a stop: nothing is committed on the way out")
    manager._pending = None
    with pytest.raises(TrainingExit):
        with manager._global_save_kept_on_a_local_stop():
            raise TrainingExit(ExitCode.STORAGE_FULL, "nothing in flight")
    assert commits == [True]
