"""Real misbehaving file systems for storage drills: a size-limited or read-only tmpfs, and a slow disk.

Each is set up for the test and torn down after it in any case. Where this process may not make it, the test skips
(fails in CI: ``tests/capabilities.py``) with the reason.
"""

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.capabilities import unavailable


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted at ``path`` with ``options`` (e.g. ``size=4m``, ``ro``), unmounted afterwards in any case.

    Where this process may not mount (it needs root with ``CAP_SYS_ADMIN``): :func:`~tests.capabilities.unavailable`.
    """
    path.mkdir(parents=True, exist_ok=True)
    command = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]
    mounted = subprocess.run(command, capture_output=True, text=True)
    if mounted.returncode != 0:
        unavailable(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False)


SLOW_BPS = 200_000
"""Write bandwidth of the slow disk: a tiny-GPT checkpoint (~1.6 MB, written and fsynced) takes ~8 s."""


@contextlib.contextmanager
def slow_disk(tmp_path: Path):
    """A real slow file system: ext4 on a loop device whose writes a blkio cgroup throttles to :data:`SLOW_BPS`.

    Yields (mount point, the cgroup's ``cgroup.procs``, a function lifting the throttle). Where loop devices or cgroup
    v1 blkio throttling are not available to this process: :func:`~tests.capabilities.unavailable`.
    """
    blkio = Path("/sys/fs/cgroup/blkio")
    image, mount = tmp_path / "slow.img", tmp_path / "slow"
    if not (blkio / "cgroup.procs").exists() or shutil.which("losetup") is None or shutil.which("mkfs.ext4") is None:
        unavailable("needs cgroup v1 blkio, losetup and mkfs.ext4")
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    attached = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True)
    if attached.returncode != 0:
        unavailable(f"cannot attach a loop device: {attached.stderr.strip()}")
    device = attached.stdout.strip()
    cgroup = blkio / f"mbridge-slow-{os.getpid()}-{time.monotonic_ns()}"
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", device], check=True, capture_output=True)
        mount.mkdir()
        subprocess.run(["mount", device, str(mount)], check=True, capture_output=True)
        major_minor = f"{os.major(os.stat(device).st_rdev)}:{os.minor(os.stat(device).st_rdev)}"
        cgroup.mkdir()
        limit = cgroup / "blkio.throttle.write_bps_device"
        limit.write_text(f"{major_minor} {SLOW_BPS}")
        yield mount, cgroup / "cgroup.procs", lambda: limit.write_text(f"{major_minor} 0")
    finally:
        if mount.is_dir() and subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], check=False)
        subprocess.run(["losetup", "-d", device], check=False)
        if cgroup.exists():
            for pid in (cgroup / "cgroup.procs").read_text().split():  # what the launch left (killed already)
                with contextlib.suppress(OSError):
                    (blkio / "cgroup.procs").write_text(pid)
            cgroup.rmdir()
