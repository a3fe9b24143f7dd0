"""A real size-limited or read-only file system for storage drills: a tmpfs mounted for the test, then unmounted."""

import contextlib
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted at ``path`` with ``options`` (e.g. ``size=4m``, ``ro``), unmounted afterwards in any case.

    Skips the test where this process may not mount (it needs root with ``CAP_SYS_ADMIN``).
    """
    path.mkdir(parents=True, exist_ok=True)
    command = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]
    mounted = subprocess.run(command, capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False)
