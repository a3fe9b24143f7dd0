"""Device health checks before training starts, which includes every restart (in-job and in-process).

Where CUDA devices exist, nvidia-resiliency-ext's checks run on this rank's device: its CUDA context must
synchronize within a timeout, NVML must not ask for a GPU reset or node reboot, and (releases that have it) NVLink
must be up. A failure stops the rank with :attr:`ExitCode.DEVICE_UNHEALTHY` before it joins training, naming the
check. Without CUDA there is nothing to check: that is said once per process, not treated as an error.
"""

import datetime
import logging

import torch

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
            logger.info("device health: no device checks on this machine (no CUDA device)")
            _said_no_devices = True
        return []
    health = require("nvidia_resiliency_ext.inprocess.health_check")
    shared = require("nvidia_resiliency_ext.shared_utils.health_check")
    ran = []
    try:
        health.CudaHealthCheck(timeout=CUDA_SYNC_TIMEOUT)(None)
    except Exception as err:  # noqa: BLE001 - any failure of the sync is the finding
        _fail(device, "CUDA context", f"{type(err).__name__}: {err or 'no sync within the timeout'}")
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


def _fail(device: torch.device, check: str, detail: str) -> None:
    raise TrainingExit(
        ExitCode.DEVICE_UNHEALTHY, f"device health check '{check}' failed on {device}: {detail}; exclude this node"
    )
