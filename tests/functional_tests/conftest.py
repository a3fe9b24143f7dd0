"""Shared runs for the functional tests: each is a real 2-rank training launch, so they are made once."""

import shutil
from pathlib import Path

import pytest
from tests.functional_tests.harness import BASE, Run, tail, torchrun


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def _reference(root: Path, name: str, *overrides: str) -> tuple[Run, Path]:
    ckpt = root / name
    run = torchrun(ckpt, *overrides)
    assert run.exit_code == 0, tail(run)
    assert sorted(run.losses()) == list(range(1, 13)), tail(run)
    return run, ckpt


@pytest.fixture(scope="session")
def reference_tp1(runs_dir) -> tuple[Run, Path]:
    """Uninterrupted run to iteration 12, tensor parallel 1 (data parallel 2)."""
    return _reference(runs_dir, "reference_tp1")


@pytest.fixture(scope="session")
def interrupted_tp1(runs_dir) -> tuple[Run, Path]:
    """The same run stopped by ``train.exit_interval=6``: checkpoints at 3 and 6. Copy before changing it."""
    ckpt = runs_dir / "interrupted_tp1"
    run = torchrun(ckpt, "train.exit_interval=6")
    assert run.exit_code == 20, tail(run)
    return run, ckpt


@pytest.fixture
def interrupted_copy(interrupted_tp1, tmp_path) -> Path:
    """A private copy of the interrupted run's checkpoints."""
    dst = tmp_path / "ckpt"
    shutil.copytree(interrupted_tp1[1], dst)
    return dst


__all__ = ["BASE"]
