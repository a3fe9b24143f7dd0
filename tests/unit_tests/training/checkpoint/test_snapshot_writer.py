"""The persistent CPU checkpoint writer: a snapshot at the save, one writer for the run, and no hang when it dies.

Real processes throughout: the writer is forked by the caller as in training, fed through shared memory.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from tests.unit_tests.training.checkpoint.async_helpers import one_world_on_cpu, until

from megatron.bridge.training.checkpoint import snapshot_writer
from megatron.bridge.utils import upstream

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    with one_world_on_cpu():
        yield


def _write_when_released(release: str, out: str, buckets: list, **extra) -> None:
    """A write function shaped like megatron-core's: tensors in lists of tuples; writes their values and pid."""
    while not os.path.exists(release):
        time.sleep(0.01)
    values = [t.tolist() for _, t in buckets[0][1]]
    with open(out, "w") as f:
        f.write(repr((values, os.getpid())))


def _request(release, out, buckets, committed):
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    return AsyncRequest(
        _write_when_released, (str(release), str(out), buckets), [lambda: committed.append(open(out).read())]
    )


def _buckets(tensors):
    return [("file", [(f"item{i}", t) for i, t in enumerate(tensors)])]


@pytest.fixture
def queue():
    q = snapshot_writer.calls_queue(rank=0)
    yield q
    q.close(abort=True)


def test_the_write_sees_the_state_of_the_save_not_the_training_that_follows(queue, tmp_path):
    params = [torch.arange(4, dtype=torch.float32), torch.ones(2, 3)]
    committed = []
    queue.schedule_async_request(_request(tmp_path / "go", tmp_path / "out", _buckets(params), committed))
    for p in params:
        p.add_(100.0)  # training goes on while the writer waits
    assert not any(p.is_shared() for p in params), "the live tensors must stay private to the rank"
    (tmp_path / "go").touch()
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    values, pid = eval(committed[0])
    assert values == [[0.0, 1.0, 2.0, 3.0], [[1.0] * 3] * 2]
    assert pid == queue.caller.process.pid and pid != os.getpid()


def test_one_writer_serves_every_save_and_its_slots_are_reused(queue, tmp_path):
    params = [torch.zeros(1000)]
    writer = queue.caller.process.pid
    slots = []
    for save in range(3):
        params[0].fill_(save)
        committed, go = [], tmp_path / f"go{save}"
        go.touch()
        queue.schedule_async_request(_request(go, tmp_path / f"out{save}", _buckets(params), committed))
        slots.append(queue.caller.arena.slots[("args", 2, 0, 1, 0, 1)].data_ptr())
        assert queue.maybe_finalize_async_calls(blocking=True) == [save]
        values, pid = eval(committed[0])
        assert values == [[float(save)] * 1000] and pid == writer
    assert slots[0] == slots[1] == slots[2]  # allocated once
    params.append(torch.zeros(5))  # a new tensor: a new slot, the old ones kept
    go = tmp_path / "go3"
    go.touch()
    queue.schedule_async_request(_request(go, tmp_path / "out3", _buckets(params), []))
    assert len(queue.caller.arena.slots) == 2
    assert queue.maybe_finalize_async_calls(blocking=True) == [3]


def test_slots_follow_positions_not_dict_keys_and_unused_ones_are_freed(queue, tmp_path):
    """The local tier's argument is {checkpoint id: state}: the id changes every save, the slots must not."""
    arena = snapshot_writer.SlotArena()
    new: dict = {}
    arena.snapshot({("it", 3): [torch.ones(4)]}, (), new)
    assert arena.drop_unused() == [] and len(new) == 1
    first = next(iter(arena.slots.values())).data_ptr()
    new = {}
    arena.snapshot({("it", 6): [torch.zeros(4)]}, (), new)
    assert new == {} and next(iter(arena.slots.values())).data_ptr() == first  # reused
    assert arena.drop_unused() == []
    arena.snapshot({("it", 9): [torch.zeros(2, 2)]}, (), new)  # reshaped: a new slot
    assert len(arena.slots) == 1 and arena.drop_unused() == []
    arena.snapshot({("it", 9): []}, (), {})
    assert arena.drop_unused() == [(0, 0)] and arena.slots == {}


def test_a_save_while_the_writer_still_writes_forks_instead_of_reusing_its_slots(queue, tmp_path):
    first, second = [torch.full((3,), 1.0)], [torch.full((3,), 2.0)]
    out1, out2 = [], []
    queue.schedule_async_request(_request(tmp_path / "go1", tmp_path / "out1", _buckets(first), out1))
    queue.schedule_async_request(_request(tmp_path / "go2", tmp_path / "out2", _buckets(second), out2))
    (tmp_path / "go1").touch()
    (tmp_path / "go2").touch()
    assert queue.maybe_finalize_async_calls(blocking=True) == [0, 1]
    (v1, pid1), (v2, pid2) = eval(out1[0]), eval(out2[0])
    assert v1 == [[1.0] * 3] and v2 == [[2.0] * 3]
    assert pid1 == queue.caller.process.pid and pid2 != pid1


def test_the_busy_probe_sees_the_write_and_commits_nothing(queue, tmp_path):
    committed = []
    queue.schedule_async_request(_request(tmp_path / "go", tmp_path / "out", _buckets([torch.ones(3)]), committed))
    time.sleep(0.2)
    assert not upstream.async_call_finished_here(queue)
    assert queue.maybe_finalize_async_calls(blocking=False, no_dist=True) == []
    (tmp_path / "go").touch()
    assert until(lambda: upstream.async_call_finished_here(queue))
    assert upstream.async_call_finished_here(queue)  # asking again changes nothing
    assert committed == []
    assert queue.maybe_finalize_async_calls(blocking=False, no_dist=True) == [0]
    assert len(committed) == 1


def test_a_writer_killed_mid_save_ends_the_wait_and_later_saves_fork(queue, tmp_path, caplog):
    committed = []
    queue.schedule_async_request(_request(tmp_path / "never", tmp_path / "out", _buckets([torch.ones(3)]), committed))
    writer = queue.caller.process
    os.kill(writer.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(FileNotFoundError):  # no hang on a dead writer: the commit finds the save's output missing
        queue.maybe_finalize_async_calls(blocking=True)
    assert time.monotonic() - start < 10 and queue.get_num_unfinalized_calls() == 0
    assert "died" in caplog.text
    # The next save: a forked writer of its own, which sees the state of the save too.
    params, committed = [torch.full((3,), 7.0)], []
    queue.schedule_async_request(_request(tmp_path / "go", tmp_path / "out2", _buckets(params), committed))
    params[0].zero_()
    (tmp_path / "go").touch()
    assert queue.maybe_finalize_async_calls(blocking=True) == [1]
    values, pid = eval(committed[0])
    assert values == [[7.0] * 3] and pid != writer.pid


def test_tensors_inside_other_objects_go_to_a_forked_writer(queue, tmp_path, caplog):
    class Holder:
        def __init__(self, t):
            self.t = t

    assert queue.caller.arena.bytes_needed([torch.ones(2)], ()) == 8
    with pytest.raises(snapshot_writer.NotSnapshottable, match="Holder"):
        queue.caller.arena.bytes_needed([Holder(torch.ones(2))], ())
    params, committed = [torch.ones(2)], []
    request = _request(tmp_path / "go", tmp_path / "out", _buckets(params), committed)
    queue.schedule_async_request(request._replace(async_fn_kwargs={"extra": Holder(params[0])}))
    params[0].zero_()
    (tmp_path / "go").touch()
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    values, pid = eval(committed[0])
    assert values == [[1.0, 1.0]] and pid != queue.caller.process.pid  # a fork's copy-on-write snapshot
    assert "fork their writer" in caplog.text and "Holder" in caplog.text
    assert queue.caller.arena.slots == {}  # nothing was copied into shared memory


class Holder:
    """The interface of a ``TensorAwareStateDict`` (the local tier's): tensors given up and taken back."""

    def __init__(self, tensors):
        self.data, self.is_hollow = list(tensors), False

    def pop_tensors(self):
        popped, self.data, self.is_hollow = self.data, None, True
        return popped

    def insert_tensors(self, tensors):
        self.data, self.is_hollow = list(tensors), False


def _write_holder_when_released(release: str, out: str, holders: dict) -> None:
    while not os.path.exists(release):
        time.sleep(0.01)
    with open(out, "w") as f:
        f.write(repr(([t.tolist() for t in holders["own"].data], os.getpid())))


def test_a_tensor_aware_state_dict_is_sent_hollow_and_refilled_from_its_slots(queue, tmp_path):
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    params = [torch.ones(3), torch.arange(2.0)]
    holder, committed, out = Holder(params), [], tmp_path / "out"
    queue.schedule_async_request(
        AsyncRequest(
            _write_holder_when_released,
            (str(tmp_path / "go"), str(out), {"own": holder}),
            [lambda: committed.append(1)],
        )
    )
    assert not holder.is_hollow and holder.data[0] is params[0]  # the rank's object is left as it was
    for p in params:
        p.mul_(0)
    (tmp_path / "go").touch()
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    values, pid = eval(out.read_text())
    assert values == [[1.0, 1.0, 1.0], [0.0, 1.0]] and pid == queue.caller.process.pid


def test_too_little_shared_memory_forks_the_writer_with_a_warning(queue, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(snapshot_writer, "shm_free_bytes", lambda: 1)
    params, committed = [torch.ones(4)], []
    queue.schedule_async_request(_request(tmp_path / "go", tmp_path / "out", _buckets(params), committed))
    params[0].zero_()
    (tmp_path / "go").touch()
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    values, pid = eval(committed[0])
    assert values == [[1.0] * 4] and pid != queue.caller.process.pid
    assert "/dev/shm has 0 MiB free" in caplog.text and "docker --shm-size" in caplog.text


def test_close_stops_the_writer_and_it_ignores_the_jobs_sigterm(tmp_path):
    queue = snapshot_writer.calls_queue(rank=0)
    writer = queue.caller.process
    os.kill(writer.pid, signal.SIGTERM)
    time.sleep(0.3)
    assert writer.is_alive(), "SIGTERM is the rank's to handle"
    queue.close()
    assert not writer.is_alive() and writer.exitcode == 0


_ORPHAN = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from megatron.bridge.utils.cpu_shims import apply_cpu_shims
    from megatron.bridge.training.checkpoint import snapshot_writer
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    apply_cpu_shims(torch.device("cpu"))
    queue = snapshot_writer.calls_queue(rank=0)
    print(queue.caller.process.pid, flush=True)
    os.kill(os.getpid(), 9)
    """
)


def test_the_writer_dies_with_its_rank():
    rank = subprocess.run([sys.executable, "-c", _ORPHAN], capture_output=True, text=True, timeout=60)
    assert rank.returncode == -signal.SIGKILL, rank.stderr[-2000:]
    writer = int(rank.stdout.split()[-1])

    def gone() -> bool:
        try:
            os.kill(writer, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{writer}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"

    assert until(gone, 10), "the writer outlived its rank"


def test_a_rank_with_nothing_to_write_still_joins_the_polls_all_reduce(queue, monkeypatch):
    """Other ranks' polls all-reduce whether their writes finished: this rank must make the same collective."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    reduced = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (reduced.append(t.tolist()), real(t, *a, **k))[1])
    queue.schedule_async_request(AsyncRequest(None, (), []))
    assert upstream.async_call_finished_here(queue)
    assert queue.maybe_finalize_async_calls(blocking=False) == [0]
    assert reduced == [[0], [0]]  # the poll's (nothing alive here), then megatron-core's check of the call index


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("holds a process group")


def _write_with(release: str, out: str, buckets: list, handle=None) -> None:
    _write_when_released(release, out, buckets)


def test_a_write_function_that_cannot_be_sent_forks_without_copying_anything(queue, tmp_path, caplog):
    import functools

    params, committed = [torch.ones(2)], []
    request = _request(tmp_path / "go", tmp_path / "out", _buckets(params), committed)
    request = request._replace(async_fn=functools.partial(_write_with, handle=_Unpicklable()))
    queue.schedule_async_request(request)
    params[0].zero_()
    (tmp_path / "go").touch()
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    values, pid = eval(committed[0])
    assert values == [[1.0, 1.0]] and pid != queue.caller.process.pid
    assert "cannot be sent to the writer" in caplog.text and "process group" in caplog.text
    assert queue.caller.arena.slots == {}  # refused before any copy


def test_a_tensor_hidden_in_the_write_function_is_never_handed_over_live(queue, tmp_path, caplog):
    import functools

    live = torch.ones(3)
    params, committed = [torch.ones(2)], []
    request = _request(tmp_path / "go", tmp_path / "out", _buckets(params), committed)
    queue.schedule_async_request(request._replace(async_fn=functools.partial(_write_with, handle=live)))
    assert not live.is_shared()  # pickling it for the writer would have moved it into shared memory
    (tmp_path / "go").touch()
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert "tensor outside the snapshot's slots" in caplog.text


def test_more_slots_than_open_files_forks_the_writer(queue, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(snapshot_writer, "open_file_limit", lambda: 600)
    params, committed = [torch.ones(1) for _ in range(100)], []
    queue.schedule_async_request(_request(tmp_path / "go", tmp_path / "out", _buckets(params), committed))
    (tmp_path / "go").touch()
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert "100 snapshot slots need as many open files, the limit is 600" in caplog.text
    assert queue.caller.arena.slots == {}
