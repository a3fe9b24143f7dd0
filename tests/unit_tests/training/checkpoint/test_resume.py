"""Resume path precedence: explicit load → save → nothing."""

import logging

import pytest

from megatron.bridge.training.checkpoint import layout
from megatron.bridge.training.checkpoint.resume import resolve_resume_path


def _with_checkpoint(path, iteration=3):
    (path / f"iter_{iteration:07d}").mkdir(parents=True)
    return str(path)


def test_load_with_checkpoints_wins(tmp_path):
    load, save = _with_checkpoint(tmp_path / "load"), _with_checkpoint(tmp_path / "save")
    source = resolve_resume_path(load, save)
    assert (source.directory, source.field) == (load, "checkpoint.load")


def test_empty_load_falls_back_to_save(tmp_path):
    load, save = str(tmp_path / "load"), _with_checkpoint(tmp_path / "save")
    source = resolve_resume_path(load, save)
    assert (source.directory, source.field) == (save, "checkpoint.save")
    assert "holds none" in source.reason


def test_unset_load_uses_save(tmp_path, caplog):
    save = _with_checkpoint(tmp_path / "save")
    with caplog.at_level(logging.INFO, logger="megatron.bridge"):
        source = resolve_resume_path(None, save)
    assert (source.directory, source.field) == (save, "checkpoint.save")
    assert f"resume from: {save}" in caplog.text


@pytest.mark.parametrize("load_set", [True, False])
def test_nothing_anywhere(tmp_path, load_set):
    load = str(tmp_path / "load") if load_set else None
    source = resolve_resume_path(load, str(tmp_path / "save"))
    # An explicit but empty load stays the answer, so checkpoint.exit_on_missing_checkpoint applies to it.
    assert source.directory == load
    assert source.field == ("checkpoint.load" if load_set else None)


def test_uncommitted_saves_do_not_count(tmp_path):
    save = tmp_path / "save"
    (save / ".tmp_iter_0000005.abc").mkdir(parents=True)
    assert layout.committed_iterations(str(save)) == []
    assert resolve_resume_path(None, str(save)).directory is None
