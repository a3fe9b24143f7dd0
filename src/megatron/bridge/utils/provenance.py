"""Where a measurement was taken: the date, the machine and the code, so a figure quoted later can be traced.

The drill report and the benchmark report both carry this record; the figures the README and the docs quote are
rendered from a committed report together with it (``megatron.bridge.drill.figures``). No host name is recorded: a
report may be committed, and the project names no machine.
"""

import datetime as dt
import importlib.metadata
import os
import platform
import subprocess
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

PACKAGES = ("torch", "megatron-core", "nvidia-resiliency-ext", "mbridge-resiliency")
"""The installed packages whose versions a record names."""


@dataclass(frozen=True)
class Provenance:
    """When, on what and from which code a measurement was taken."""

    date: str
    """Local time with its UTC offset, to the second (ISO 8601)."""
    cpu: str
    """CPU model and the number of logical CPUs."""
    ram: str
    """Memory, GiB."""
    gpu: str
    """``none``, or how many GPUs of which model."""
    os: str
    """The platform string."""
    python: str
    """The Python version."""
    packages: dict[str, str]
    """Package -> installed version (``not installed``)."""
    commit: str
    """The git commit of the source tree (``unknown`` outside a checkout), marked when it had uncommitted changes."""

    def machine(self) -> str:
        """One line: CPU, memory and GPU."""
        gpu = "no GPU" if self.gpu == "none" else self.gpu
        return f"{self.cpu}, {self.ram}, {gpu}"

    def to_json(self) -> dict:
        """The record as plain JSON values."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Provenance":
        """The record :meth:`to_json` wrote; a missing field is a ``KeyError`` naming it."""
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return "unknown"


def _gpu() -> str:
    try:
        with warnings.catch_warnings():  # torch.cuda warns about deprecated helper packages on import
            warnings.simplefilter("ignore")
            import torch

        if not torch.cuda.is_available():
            return "none"
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    except Exception as exc:  # noqa: BLE001 - a broken CUDA set-up must not lose the record
        return f"unknown ({type(exc).__name__})"


def package_version(package: str) -> str:
    """The installed version of ``package`` (``not installed``)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git_commit(repo: Optional[Path] = None) -> str:
    """The short commit of the checkout holding ``repo`` (default: this source file's), or ``unknown``."""
    cwd = repo if repo is not None else Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=cwd, capture_output=True, text=True)
    except OSError:
        return "unknown"
    if rev.returncode != 0:
        return "unknown"
    return rev.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def collect(repo: Optional[Path] = None) -> Provenance:
    """The record of this machine, its software and the commit of ``repo``, now."""
    return Provenance(
        date=dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        cpu=f"{_cpu_model()} x {os.cpu_count()} logical CPUs",
        ram=_ram(),
        gpu=_gpu(),
        os=platform.platform(),
        python=platform.python_version(),
        packages={package: package_version(package) for package in PACKAGES},
        commit=git_commit(repo),
    )
