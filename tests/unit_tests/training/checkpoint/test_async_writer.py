"""The async writer's own logic: which writers it takes over, and the report of a writer that runs long."""

import functools
import logging
import threading

from megatron.bridge.training.checkpoint import async_writer


def test_megatron_core_bucket_writer_is_replaced_and_others_are_kept():
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron.bridge.utils import upstream

    if upstream.applicable((upstream.MCORE_FORKING_WRITER,)) is not None:  # megatron-core < 0.17: a process a bucket
        forking = functools.partial(upstream.get(upstream.MCORE_FORKING_WRITER), [], False)
        replaced = async_writer._in_process_bucket_writer(forking)
        assert replaced.func is async_writer._write_buckets_here and replaced.args == ([], False)
    else:  # 0.17 and later write with threads in the one process: their writer is kept as it is
        threaded = functools.partial(FileSystemWriterAsync.write_preloaded_data_multithread, [], False)
        assert async_writer._in_process_bucket_writer(threaded) is None
    assert async_writer._in_process_bucket_writer(print) is None


def test_no_buckets_put_an_empty_result_like_upstream():
    results = []

    class Box:
        put = results.append

    async_writer._write_buckets_here([], False, 0, [], Box)
    assert results == [{}]


def test_a_long_running_writer_reports_itself_with_its_stack(monkeypatch, caplog, capfd):
    monkeypatch.setattr(async_writer, "REPORT_SECONDS", 0.2)
    done = threading.Event()
    reporter = threading.Thread(target=async_writer._report_while_running, args=(done, 1, 42))
    with caplog.at_level(logging.WARNING):
        reporter.start()
        reporter.join(timeout=0.5)
        done.set()
        reporter.join()
    assert "async checkpoint writer of iteration 42 (rank 1" in caplog.text
    assert "_report_while_running" in capfd.readouterr().err


def test_results_queue_passes_results_from_a_forked_writer_oldest_first(tmp_path):
    import multiprocessing
    import queue

    import pytest

    results = async_writer.FileResultsQueue(str(tmp_path))
    assert results.empty()
    with pytest.raises(queue.Empty):
        results.get_nowait()
    writer = multiprocessing.get_context("fork").Process(target=results.put, args=({0: ["bucket 0 results"]},))
    writer.start()
    writer.join(timeout=30)
    assert writer.exitcode == 0
    results.put(RuntimeError("second save failed"))
    assert results.get_nowait() == {0: ["bucket 0 results"]}
    assert isinstance(results.get_nowait(), RuntimeError)
    assert results.empty() and list(tmp_path.iterdir()) == []


def test_results_directories_of_dead_processes_are_removed(tmp_path):
    import os
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    prefix = async_writer._RESULTS_DIR_PREFIX
    (tmp_path / f"{prefix}{dead.pid}-abc").mkdir()
    (tmp_path / f"{prefix}{os.getpid()}-def").mkdir()
    (tmp_path / "unrelated").mkdir()
    async_writer._remove_results_of_dead_processes(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{prefix}{os.getpid()}-def", "unrelated"]
