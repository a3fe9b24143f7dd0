"""Process setup: logging, device, torch.distributed, megatron-core parallel state and seeds."""

import datetime
import logging
import os
import random
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.bridge.training.config import INPROCESS_STORE_PORT_OFFSET, ConfigContainer
from megatron.bridge.training.config_checks.container import check_precision_on_device
from megatron.bridge.training.config_sections.resiliency import INPROCESS_COORDINATION_PORT_OFFSET
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.training.health.device import resolve_device
from megatron.bridge.utils import launch_env, upstream

logger = logging.getLogger(__name__)


def setup_logging(level: int) -> None:
    """Log ``megatron.bridge`` records with the rank in every line; quiet noisy upstream loggers."""
    rank = launch_env.current().rank
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    logging.getLogger("megatron.bridge").setLevel(level)


def select_device(local_rank: Optional[int] = None, requested: str = "auto") -> torch.device:
    """The device this rank trains on (``dist.device=requested``): its local GPU, checked usable, or the CPU.

    ``local_rank`` (``dist.local_rank``) defaults to the launcher's ``LOCAL_RANK``. On CPU the rank gets its share
    of the CPU cores. The resolution is ``health/device.py``'s ``resolve_device``: a visible GPU that does not work is
    exit 25, never a silent fall-back to CPU. The resolved device is logged once per process.

    Raises:
        TrainingExit: ``DEVICE_UNHEALTHY`` (``dist.device=cuda`` without a GPU, or an unusable GPU).
    """
    global _logged_device
    launch = launch_env.current()
    if local_rank is None:
        local_rank = launch.local_rank
    device = resolve_device(requested, local_rank)
    if device.type == "cpu":
        bind_cpu_cores(local_rank, launch.ranks_per_node)
    if _logged_device != (requested, device):
        logger.info("device: %s (dist.device=%s)", device, requested)
        _logged_device = (requested, device)
    return device


_logged_device: Optional[tuple[str, torch.device]] = None


def prepare_device(cfg: ConfigContainer) -> tuple[torch.device, str]:
    """Resolve ``dist.device`` for this rank and make the process ready for it; return it and the backend.

    On CPU: bfloat16 is refused (with ``dist.device=auto`` only now that the device is known; ``validate()`` refuses
    an explicit ``dist.device=cpu``), the CPU shims are applied (on a GPU node too) and ``nccl`` becomes gloo.

    Raises:
        TrainingExit: ``DEVICE_UNHEALTHY`` from :func:`select_device`; ``CONFIG_ERROR`` for bfloat16 on CPU.
    """
    device = select_device(cfg.dist.local_rank, cfg.dist.device)
    if device.type != "cpu":
        if cfg.dist.disable_jit_fuser:  # (always off on CPU)
            from megatron.core.jit import disable_jit_fuser

            disable_jit_fuser()
        return device, cfg.dist.distributed_backend
    try:
        check_precision_on_device(cfg.model, device, cfg.dist.device)
    except ValueError as err:
        raise TrainingExit(ExitCode.CONFIG_ERROR, str(err)) from err
    from megatron.bridge.utils.cpu_shims import apply_cpu_shims, process_group_backend

    apply_cpu_shims(device)
    return device, process_group_backend(cfg.dist.distributed_backend)


def bind_cpu_cores(local_rank: int, local_world_size: int) -> list[int]:
    """Pin this rank to its own slice of the cores the process may use, as each GPU rank owns its device.

    Unpinned ranks migrate between cores and share them with each other's helper threads, which makes one rank
    2x slower now and then on a small machine (seen as false stragglers on 2 cores). Nothing is changed when
    there are fewer cores than local ranks. Returns the cores this rank runs on.
    """
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // max(local_world_size, 1)
    if local_world_size <= 1 or share < 1 or local_rank >= local_world_size:
        return cores
    mine = cores[local_rank * share : (local_rank + 1) * share]
    os.sched_setaffinity(0, mine)
    logger.debug("local rank %d pinned to CPU cores %s", local_rank, mine)
    return mine


def initialize_distributed(cfg: ConfigContainer, store: Optional[dist.Store] = None) -> torch.device:
    """Initialise torch.distributed and megatron-core's model-parallel groups; return this rank's device.

    The device is ``dist.device`` resolved for this rank (:func:`prepare_device`). The backend is
    ``dist.distributed_backend``; on CPU it is gloo whatever it says (a CPU shim), and the CPU shims for upstream code
    are applied first.

    Args:
        cfg: the run's configuration.
        store: rendezvous store for the default group (in-process restart gives each iteration its own);
            ``None`` uses the launcher's environment (``env://``).
    """
    device, backend = prepare_device(cfg)
    timeout = datetime.timedelta(minutes=cfg.dist.distributed_timeout_minutes)
    if not dist.is_initialized() and store is not None:
        launch = launch_env.current()  # this iteration's numbering (in-process restart renumbers the ranks)
        rank, world_size = launch.rank, launch.world_size
        dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=rank, world_size=world_size)
    elif not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=cfg.model.tensor_model_parallel_size,
            pipeline_model_parallel_size=cfg.model.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=cfg.model.virtual_pipeline_model_parallel_size,
            distributed_timeout_minutes=cfg.dist.distributed_timeout_minutes,
        )
    dp = parallel_state.get_data_parallel_world_size()
    batch, micro = cfg.train.global_batch_size, cfg.train.micro_batch_size
    logger.info(
        "initialized %s on %s: world size %d, tensor parallel %d, pipeline parallel %d, data parallel %d "
        "(global batch %s: %s micro-batch(es) of %s per data-parallel rank and step)",
        backend,
        device,
        dist.get_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        dp,
        batch,
        batch // (micro * dp) if batch and micro else "?",
        micro,
    )
    return device


def set_seeds(seed: int) -> None:
    """Seed python, numpy and torch identically on every rank, and megatron-core's model-parallel RNG tracker.

    Identical seeds on all ranks keep non-split parameters equal across tensor-parallel ranks; the tracker gives
    each tensor-parallel rank its own stream for dropout inside split regions.
    """
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def init_rerun_state(cfg: ConfigContainer) -> None:
    """Install megatron-core's re-run state machine for this run, replacing one a previous run left in the process.

    Call after :func:`initialize_distributed` (the machine all-reduces its decisions) and before the checkpoint
    load (a checkpoint saved to re-run a step carries the machine's state).
    """
    from megatron.core import rerun_state_machine

    from megatron.bridge.training.health.rerun import build_rerun_state_machine

    rerun_state_machine.destroy_rerun_state_machine()
    # The public initializer builds the plain upstream class; ours fixes its determinism-stats report.
    upstream.set_rerun_state_machine(build_rerun_state_machine(cfg.rerun_state_machine))


def abort_distributed() -> None:
    """Abort every process group, so that peers blocked in a collective with this rank fail now (idempotent).

    Destroying a group is not enough: NCCL communicators must be aborted, and gloo groups, which have no working
    abort, keep their connections open while anything references them; their connections are shut down instead
    (all but the stores': the launcher's on ``MASTER_PORT``, in-process restart's on ``MASTER_PORT + 1`` and ``+ 2``).
    """
    # In-process restart's monitor thread may abort while the main thread unwinds: either may find the groups gone.
    try:
        if dist.is_initialized():
            if dist.get_backend() == "gloo":
                from megatron.bridge.utils.cpu_shims import shutdown_gloo_connections

                port = launch_env.current().master_port or 0
                keep = {port, port + INPROCESS_COORDINATION_PORT_OFFSET, port + INPROCESS_STORE_PORT_OFFSET}
                shutdown_gloo_connections(keep_ports=keep)
            upstream.abort_process_groups()
        destroy_distributed()
    except (AssertionError, RuntimeError, ValueError) as err:  # already aborted or destroyed underneath
        logger.debug("process group abort: %s", err)


def destroy_distributed() -> None:
    """Tear down megatron-core's groups and the default process group (idempotent)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
