"""Atomic writes: a reader sees the old content or the new one, never a mix, and durable writes reach the disk."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron.bridge.utils import fs


def _names(directory) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("data", ["text ✓\n", b"\x00\xffbytes"], ids=["text", "bytes"])
def test_atomic_write_replaces_the_file_and_leaves_nothing_else(tmp_path, data):
    target = tmp_path / "record"
    target.write_text("old")
    fs.atomic_write(str(target), data)
    expected = data.encode() if isinstance(data, str) else data
    assert target.read_bytes() == expected
    assert _names(tmp_path) == ["record"]


def test_atomic_write_json_round_trips_with_dump_options(tmp_path):
    target = tmp_path / "r.json"
    fs.atomic_write_json(str(target), {"b": 1, "a": [1, 2]}, indent=1, sort_keys=True)
    assert target.read_text() == json.dumps({"b": 1, "a": [1, 2]}, indent=1, sort_keys=True)


def test_a_failure_before_the_rename_keeps_the_old_content_and_no_temporary(tmp_path):
    target = tmp_path / "tracker"
    target.write_text("10\n")

    def fail() -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        fs.atomic_write(str(target), "20\n", before_rename=fail)
    assert target.read_text() == "10\n"
    assert _names(tmp_path) == ["tracker"]


@pytest.mark.parametrize("durable", [True, False])
def test_durable_fsyncs_the_file_and_its_directory_and_otherwise_nothing(tmp_path, monkeypatch, durable):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    target = tmp_path / "state.json"
    fs.atomic_write_json(str(target), {"x": 1}, durable=durable)
    if durable:
        # The temporary file (under its own name, before the rename), then the directory after the rename.
        assert len(synced) == 2, synced
        assert os.path.basename(synced[0]).startswith(".state.json.") and synced[0].endswith(".tmp")
        assert synced[1] == str(tmp_path)
    else:
        assert synced == []


def test_a_killed_writer_leaves_the_old_file_and_a_temporary_that_remove_temporaries_deletes(tmp_path):
    target = tmp_path / "latest.txt"
    target.write_text("5\n")
    child = textwrap.dedent(
        """
        import os, signal, sys
        from megatron.bridge.utils import fs
        fs.atomic_write(sys.argv[1], "6\\n", before_rename=lambda: os.kill(os.getpid(), signal.SIGKILL))
        """
    )
    proc = subprocess.run([sys.executable, "-c", child, str(target)])
    assert proc.returncode == -9
    assert target.read_text() == "5\n"
    leftovers = [n for n in _names(tmp_path) if n != "latest.txt"]
    assert len(leftovers) == 1 and fs.is_temporary_of(leftovers[0], "latest.txt"), leftovers
    assert (tmp_path / leftovers[0]).read_text() == "6\n"
    (tmp_path / ".latest.txt.other").write_text("not ours")  # not a temporary of the target: kept
    removed = fs.remove_temporaries(str(target))
    assert [os.path.basename(p) for p in removed] == leftovers
    assert _names(tmp_path) == [".latest.txt.other", "latest.txt"]


def test_fsync_tree_flushes_every_file_and_directory_below_and_the_root(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f1").write_text("1")
    (tmp_path / "f2").write_text("2")
    flushed: list[str] = []
    monkeypatch.setattr(fs, "fsync_path", flushed.append)
    fs.fsync_tree(str(tmp_path))
    expected = {str(tmp_path / p) for p in ("a/b/f1", "a/b", "a", "f2")} | {str(tmp_path)}
    assert set(flushed) == expected
    assert flushed[-1] == str(tmp_path)  # children first: the root's entry list is flushed last
