"""The device a rank trains on (``dist.device``), and its health checks before training starts (every restart).

:func:`resolve_device` turns ``dist.device`` into this rank's device. A node with a GPU (CUDA counts a device, or a
``/dev/nvidia<N>`` device file exists) must be able to use it: CUDA must initialize, and a tiny allocation, kernel
and synchronization must succeed on this rank's GPU. Otherwise the rank stops with
:attr:`ExitCode.DEVICE_UNHEALTHY`, naming the device, the error and the fix; nothing ever falls back to the CPU on
its own (only ``dist.device=cpu`` trains on CPU where a GPU exists).

Where CUDA devices are used, nvidia-resiliency-ext's checks run on this rank's device: its CUDA context must
synchronize within a timeout, NVML must not ask for a GPU reset or node reboot, and (releases that have it) NVLink
must be up. A failure stops the rank with :attr:`ExitCode.DEVICE_UNHEALTHY` before it joins training, naming the
check. On CPU there is nothing to check: that is said once per process, not treated as an error.
"""

import datetime
import glob
import logging

import torch

from megatron.bridge.training.components import Component, Run
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.utils.optional_imports import require

logger = logging.getLogger(__name__)

CUDA_SYNC_TIMEOUT = datetime.timedelta(seconds=30)
_said_no_devices = False


def check_device_health(device: torch.device) -> list[str]:
    """Run the checks for ``device``; return the names of those that ran.

    Raises:
        TrainingExit: ``DEVICE_UNHEALTHY`` when a check fails.
    """
    global _said_no_devices
    if device.type != "cuda":
        if not _said_no_devices:
            logger.info("device health: no device checks on this machine (training on %s)", device)
            _said_no_devices = True
        return []
    shared = require("nvidia_resiliency_ext.shared_utils.health_check")
    ran = []
    try:
        _sync_cuda_context()
    except Exception as err:  # noqa: BLE001 - any failure of the sync is the finding
        _fail(device, "CUDA context", _describe(err))
    ran.append("CUDA context")
    gpu = shared.GPUHealthCheck()
    if gpu.enabled:  # needs pynvml and a driver >= r570; its own warning says why when not
        if not gpu():
            _fail(device, "GPU (NVML recovery action)", "NVML reports a recovery action; see the warning above")
        ran.append("GPU (NVML)")
    nvlink_check = getattr(shared, "NVLHealthCheck", None)  # nvidia-resiliency-ext >= 0.5
    if nvlink_check is not None:
        if not nvlink_check(device_index=device.index)():
            _fail(device, "NVLink", "links are down or degraded; see the warning above")
        ran.append("NVLink")
    logger.info("device health: %s passed on %s", ", ".join(ran), device)
    return ran


def resolve_device(requested: str, local_rank: int) -> torch.device:
    """The device of this rank for ``dist.device=requested``: ``cuda:<local_rank>``, checked usable, or the CPU.

    ``"cpu"`` never touches CUDA. ``"auto"`` is the CPU only on a node without a GPU (CUDA counts none and no
    ``/dev/nvidia<N>`` exists). The GPU is probed here, before any process group exists: CUDA initializes, this
    rank's device is selected, a tiny tensor is allocated and changed by a kernel, and the CUDA context synchronizes
    within :data:`CUDA_SYNC_TIMEOUT` (the check :func:`check_device_health` runs).

    Raises:
        TrainingExit: ``DEVICE_UNHEALTHY`` when ``"cuda"`` finds no GPU, or a GPU is visible but unusable.
    """
    if requested == "cpu":
        return torch.device("cpu")
    evidence = visible_gpu()
    if not evidence:
        if requested == "cuda":
            build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
            raise TrainingExit(
                ExitCode.DEVICE_UNHEALTHY,
                f"dist.device=cuda but this node has no GPU (torch.cuda.device_count() is 0, no /dev/nvidia<N>; torch "
                f"{torch.__version__} {build}). Fix: run this job on GPU nodes (exit 25 asks to exclude this node and "
                "requeue), or set dist.device=cpu (or auto) to train on CPU",
            )
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    try:
        _probe_cuda(device)
        _sync_cuda_context()
    except Exception as err:  # noqa: BLE001 - whatever CUDA raised is the finding, named in the message
        raise TrainingExit(
            ExitCode.DEVICE_UNHEALTHY,
            f"dist.device={requested}: GPU {device} is visible ({evidence}) but unusable: {_describe(err)}. Fix: "
            "repair the GPU driver or CUDA install on this node (exit 25 asks to exclude it and requeue), or set "
            "dist.device=cpu to train on CPU deliberately (training never falls back to CPU on its own)",
        ) from err
    return device


def visible_gpu() -> str:
    """What shows this node has an NVIDIA GPU (``""`` when nothing does): CUDA's device count, or a device file.

    A GPU whose driver is broken is often counted as 0 by CUDA: its ``/dev/nvidia<N>`` file still shows it
    (``/dev/nvidiactl`` alone is a driver without a GPU).
    """
    try:
        count = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a driver that cannot count devices: the device files tell
        count = 0
    if count > 0:
        return f"torch.cuda.device_count() is {count}"
    files = sorted(glob.glob("/dev/nvidia[0-9]*"))
    return f"{', '.join(files)} present, torch.cuda.device_count() is 0" if files else ""


def _probe_cuda(device: torch.device) -> None:
    """Initialize CUDA, select ``device``, allocate a tiny tensor and run a kernel on it (raises what CUDA raises)."""
    torch.cuda.init()
    count = torch.cuda.device_count()
    if device.index >= count:
        raise RuntimeError(f"dist.local_rank {device.index} needs GPU {device.index}, but {count} are visible")
    torch.cuda.set_device(device)
    torch.ones(1, device=device).add_(1)


def _sync_cuda_context() -> None:
    """nvidia-resiliency-ext's CUDA context check: the context synchronizes within :data:`CUDA_SYNC_TIMEOUT`."""
    require("nvidia_resiliency_ext.inprocess.health_check").CudaHealthCheck(timeout=CUDA_SYNC_TIMEOUT)(None)


def _describe(err: BaseException) -> str:
    """``Type: message``; nvidia-resiliency-ext's sync timeout is a ``TimeoutError`` without one."""
    return f"{type(err).__name__}: {str(err) or 'no sync within the timeout'}"


def _fail(device: torch.device, check: str, detail: str) -> None:
    raise TrainingExit(
        ExitCode.DEVICE_UNHEALTHY, f"device health check '{check}' failed on {device}: {detail}; exclude this node"
    )


class DeviceHealth(Component):
    """The device checks as a run's component: run once the process group (and so the device) exists."""

    def setup(self, run: Run) -> None:
        """Check ``run.device``; an unhealthy one stops the rank with ``DEVICE_UNHEALTHY`` before training starts."""
        check_device_health(run.device)
