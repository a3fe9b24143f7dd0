"""Shared runs for the functional tests: each is a real 2-rank training launch, so it is made once per test run
(whichever pytest-xdist worker asks first) and reused, read-only, by every test that needs it."""

import shutil
from pathlib import Path

import pytest
from tests.functional_tests.harness import BASE, Run, tail, torchrun
from tests.resources import once_per_run


def _reference(ckpt: Path) -> tuple[Run, Path]:
    run = torchrun(ckpt)
    assert run.exit_code == 0, tail(run)
    assert sorted(run.losses()) == list(range(1, 13)), tail(run)
    return run, ckpt


def _interrupted(ckpt: Path) -> tuple[Run, Path]:
    run = torchrun(ckpt, "train.exit_interval=6")
    assert run.exit_code == 20, tail(run)
    return run, ckpt


@pytest.fixture(scope="session")
def reference_tp1(tmp_path_factory) -> tuple[Run, Path]:
    """Uninterrupted run to iteration 12, tensor parallel 1 (data parallel 2). Read-only."""
    return once_per_run(tmp_path_factory, "reference_tp1", _reference)


@pytest.fixture(scope="session")
def interrupted_tp1(tmp_path_factory) -> tuple[Run, Path]:
    """The same run stopped by ``train.exit_interval=6``: checkpoints at 3 and 6. Read-only: copy before changing."""
    return once_per_run(tmp_path_factory, "interrupted_tp1", _interrupted)


@pytest.fixture
def interrupted_copy(interrupted_tp1, tmp_path) -> Path:
    """A private copy of the interrupted run's checkpoints."""
    dst = tmp_path / "ckpt"
    shutil.copytree(interrupted_tp1[1], dst)
    return dst


__all__ = ["BASE"]
