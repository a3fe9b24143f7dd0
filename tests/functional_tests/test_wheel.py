"""The package works installed from its wheel, away from the source tree: the drill's help, then a 10-step drill.

The wheel is built from a copy of the sources (the build writes into its source directory) and installed without
its dependencies into a fresh virtual environment, which sees this environment's packages (torch, megatron-core,
nvidia-resiliency-ext) through a ``.pth`` file instead of downloading them again. The editable install of the
source tree in this environment stays invisible there: a ``.pth`` line adds a directory to ``sys.path`` without
running the ``.pth`` files inside it. Everything runs from a directory outside the repository.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.functional


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str], Path]:
    """(the fresh environment's python, the environment to run it in, a working directory outside the repo)."""
    work = tmp_path_factory.mktemp("wheel")
    project = work / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, project / name)
    shutil.copytree(REPO / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = work / "dist"
    build = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist),
         str(project)],
        work, dict(os.environ), 120,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = dist.glob("mbridge_resiliency-*.whl")

    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    install = _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        work, dict(os.environ), 120,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work, {}, 30)
    (Path(site.stdout.strip()) / "_dependencies_from_parent_env.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"
    outside = work / "cwd"
    outside.mkdir()
    return python, env, outside


def test_the_package_comes_from_the_wheel_not_the_source_tree(installed):
    python, env, cwd = installed
    code = "import json, sys, megatron.bridge; print(json.dumps([megatron.bridge.__file__, sys.path]))"
    probe = _run([str(python), "-c", code], cwd, env, 120)
    assert probe.returncode == 0, probe.stderr[-3000:]
    where, path = json.loads(probe.stdout.strip().splitlines()[-1])
    assert Path(where).is_relative_to(python.parents[1]), where
    assert not [p for p in path if p and Path(p).resolve().is_relative_to(REPO / "src")], path


def test_the_drill_help_runs_from_the_wheel(installed):
    python, env, cwd = installed
    out = _run([str(python), "-m", "megatron.bridge.drill", "--help"], cwd, env, 120)
    assert out.returncode == 0, out.stderr[-3000:]
    for option in ("--faults", "--train-iters", "--run-dir"):
        assert option in out.stdout


@pytest.mark.timeout(420)
def test_a_ten_step_drill_passes_from_the_wheel(installed):
    python, env, cwd = installed
    run_dir = cwd / "runs" / "drill"
    cmd = [str(python), "-m", "megatron.bridge.drill", "--train-iters", "10", "--faults", "nan@5:1",
           "--run-dir", str(run_dir), "--timeout", "180"]  # fmt: skip
    out = _run(cmd, cwd, env, 400)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "drill PASSED" in out.stdout
    report = json.loads((run_dir / "drill_report.json").read_text())
    assert report["passed"] and report["equal"] is True and report["final_iteration"] == 10
    (fault,) = report["faults"]
    assert fault["kind"] == "nan" and fault["detected"] and fault["recovered"], fault
