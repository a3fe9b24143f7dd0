"""CPU stand-ins for the CUDA calls megatron-core makes on the training path.

megatron-core assumes a GPU in a handful of places that the training loop reaches even when the
model lives on CPU (``use_cpu_initialization=True``) and the process group uses gloo. This module
patches exactly those places so that a tiny GPT can be trained, checkpointed with
``dist_checkpointing`` and resumed bit-identically on a CPU-only machine (tests, CI, laptops), or on a GPU node
with ``dist.device=cpu``: they are applied whenever the resolved device is the CPU. The same goes
for nvidia-resiliency-ext's straggler ``Detector``: without CUDA it times sections only (no kernel scores), and for
its local checkpoint manager (replica exchange without CUDA staging buffers).

Most shims swap the module-level ``torch`` name of one upstream module for a :class:`_TorchView`:
it forwards every attribute to the real ``torch`` except that its ``cuda`` attribute answers the
few CUDA queries on CPU (``is_available`` -> False, ``current_device`` -> cpu, ``synchronize`` -> no-op, RNG
calls -> the CPU generator) and its tensor factories build tensors on CPU when asked for a CUDA device. Nothing
else in the process sees a changed ``torch``. The remaining shims replace single functions, and one turns
megatron-core's jit fuser off before its fused ops are imported (they would bring in ``torch.compile``: ~2 s per
process, for kernels a CPU run never calls).

The model-parallel RNG tracker is mapped onto the CPU default generator: ``fork()`` swaps the CPU
generator state in and out, so dropout inside tensor-parallel regions is deterministic per TP rank
and ``get_cuda_rng_tracker().get_states()`` / ``set_states()`` save and restore it for checkpoints.

Example:
    >>> from megatron.bridge.utils.cpu_shims import apply_cpu_shims
    >>> apply_cpu_shims(torch.device("cpu"))  # the resolved dist.device; no-op for a CUDA device

Note:
    Call :func:`apply_cpu_shims` before building models, optimizers or checkpoints. Every upstream name
    patched here is listed, with the release it was checked against, in :mod:`megatron.bridge.utils.upstream`
    and reached through it; a shim whose target is missing in another release is skipped with a warning
    naming it.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from megatron.bridge.utils import upstream

logger = logging.getLogger(__name__)

_APPLIED = False
_RANDOM = "megatron.core.tensor_parallel.random"
_LANGUAGE_MODULE = "megatron.core.models.common.language_module.language_module"
_DISTRIB_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer"

# Tensor factories whose ``device=`` argument _TorchView rewrites.
_FACTORY_NAMES = ("tensor", "zeros", "ones", "empty", "full")


def _is_accelerator_device(device: Any) -> bool:
    """Return True if ``device`` names the CUDA device type (str, torch.device or ordinal)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaView:
    """What one patched upstream module sees as ``torch.cuda``; other names go to ``torch.cuda``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available() -> bool:
        """False: the process trains on CPU, even on a GPU node with ``dist.device=cpu``."""
        return False

    @staticmethod
    def current_device() -> torch.device:
        """The CPU device, so ``device=torch.cuda.current_device()`` allocates on CPU."""
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """No-op: CPU ops have completed when they return."""

    @staticmethod
    def current_stream(device: Any = None) -> Any:
        """The CPU stream, whose waits are no-ops (megatron-core 0.19's gradient buffers wait on CUDA events)."""
        return torch.cpu.current_stream()

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        """The CPU default generator's state (the RNG tracker lives on the CPU generator)."""
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
        """Set the CPU default generator's state."""
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        """Seed the CPU default generator (it plays the role of the CUDA default generator)."""
        torch.manual_seed(seed)


def _cpu_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap a tensor factory so that a CUDA ``device=`` argument becomes CPU."""

    def factory_on_cpu(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_accelerator_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    factory_on_cpu.__name__ = factory.__name__
    return factory_on_cpu


class _TorchView(types.ModuleType):
    """What one patched upstream module sees as ``torch``; every other name is the real one."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaView()
        for name in _FACTORY_NAMES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _install_torch_view(module_name: str) -> None:
    """Make ``module_name`` see a :class:`_TorchView` as its global ``torch`` (skipped, logged, if it has none)."""
    key = f"{module_name}:torch"
    module = upstream.owner(key)
    if module is None or isinstance(module.torch, _TorchView):
        return
    if module.torch is not torch:
        logger.debug("cpu_shims: %s's global `torch` is not torch; skipped", module.__name__)
        return
    upstream.patch(key, _TorchView())


# --------------------------------------------------------------------------------------------
# Individual shims (each idempotent). _SHIMS maps a name to each, in application order.
# --------------------------------------------------------------------------------------------


class _AfterFirstImport(importlib.abc.MetaPathFinder):
    """A one-shot import hook: runs ``then(module)`` right after module ``name`` first executes."""

    def __init__(self, name: str, then: Callable[[types.ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            execute(module)
            self.then(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _shim_jit_fuser() -> None:
    # megatron-core wraps ~40 fused ops in torch.compile at import: ~2 s per process, for kernels CPU runs never use.
    jit = "megatron.core.jit"
    if jit in sys.modules:
        sys.modules[jit].disable_jit_fuser()  # too late for what is imported; later imports still skip it
    elif not any(isinstance(hook, _AfterFirstImport) and hook.name == jit for hook in sys.meta_path):
        sys.meta_path.insert(0, _AfterFirstImport(jit, lambda module: module.disable_jit_fuser()))


def _shim_global_memory_buffer() -> None:
    # utils.GlobalMemoryBuffer.get_tensor allocates with device=torch.cuda.current_device().
    _install_torch_view("megatron.core.utils")


def _shim_rng_tracker() -> None:
    # CudaRNGStatesTracker.add and model_parallel_cuda_manual_seed call torch.cuda.get_rng_state,
    # torch.cuda.manual_seed; fork() calls _get/_set_cuda_rng_state (torch.cuda.default_generators).
    module = upstream.owner(f"{_RANDOM}:_get_cuda_rng_state")
    if module is None or getattr(module, "_cpu_shimmed", False):
        return
    _install_torch_view(_RANDOM)

    def _get_cuda_rng_state(
        device: int | str | torch.device | None = None, clone: bool = False, graph_safe: bool = False
    ) -> torch.Tensor:
        """CPU stand-in: the tracked "CUDA" state is the CPU default generator's state."""
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        """CPU stand-in: set the CPU default generator's state."""
        torch.set_rng_state(new_state)

    upstream.patch(f"{_RANDOM}:_get_cuda_rng_state", _get_cuda_rng_state)
    upstream.patch(f"{_RANDOM}:_set_cuda_rng_state", _set_cuda_rng_state)
    # fork() warns on every exit when its region drew random numbers ("CPU RNG state changed
    # within GPU RNG context"): expected here, as the tracked state *is* the CPU generator.
    logging.getLogger(module.__name__).addFilter(_drop_cpu_rng_changed_warning)
    module._cpu_shimmed = True


def _drop_cpu_rng_changed_warning(record: logging.LogRecord) -> bool:
    """Logging filter dropping the RNG tracker's CPU-state-changed warning."""
    return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _shim_grad_buffer() -> None:
    # DDP: _ParamAndGradBuffer.__init__ allocates grad_data/param_data on torch.cuda.current_device().
    _install_torch_view("megatron.core.distributed.param_and_grad_buffer")


def _shim_optimizer() -> None:
    # FP32Optimizer.__init__ / MixedPrecisionOptimizer.__init__ create tensors on the CUDA device;
    # ChainedOptimizer.get_loss_scale uses torch.cuda.current_device().
    _install_torch_view("megatron.core.optimizer.optimizer")


def _shim_grad_clipping() -> None:
    # clip_grads.get_grad_norm_fp32/count_zeros_fp32 create tensors on the CUDA device, and
    # clip_grad_by_total_norm_fp32 asserts param.grad.type() == 'torch.cuda.FloatTensor'.
    _install_torch_view("megatron.core.optimizer.clip_grads")
    for module in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        key = f"{module}:clip_grad_by_total_norm_fp32"
        if not getattr(upstream.find(key), "_cpu_shim", False):
            upstream.patch(key, _clip_grad_by_total_norm_fp32)


def _clip_grad_by_total_norm_fp32(
    parameters: list[torch.Tensor] | torch.Tensor,
    max_norm: float,
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """CPU version of ``clip_grads.clip_grad_by_total_norm_fp32`` (fp32 grads scaled in place).

    Args:
        parameters: parameters whose gradients are clipped.
        max_norm: max norm of the gradients.
        total_norm: total norm of the gradients.
        use_decoupled_grad: read ``param.decoupled_grad`` instead of ``param.grad``.
    """
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = []
    for param in parameters:
        grad = getattr(param, attr, None)
        if grad is not None:
            allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
            assert grad.dtype in allowed, f"expected {allowed} gradients, got {grad.dtype}"
            grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        upstream.get("torch:_foreach_mul_")(grads, clip_coeff)


_clip_grad_by_total_norm_fp32._cpu_shim = True  # type: ignore[attr-defined]


def _shim_schedules() -> None:
    # forward_backward_{no_pipelining,pipelining_*} create total_num_tokens on the CUDA device.
    _install_torch_view("megatron.core.pipeline_parallel.schedules")


def _shim_dist_checkpointing() -> None:
    # dist_checkpointing.save: FileSystemWriterAsync.preload_tensors calls torch.cuda.synchronize().
    _install_torch_view("megatron.core.dist_checkpointing.strategies.filesystem_async")
    # dist_checkpointing.save: save_state_dict_async_finalize broadcasts a flag tensor allocated on
    # torch.cuda.current_device().
    _install_torch_view("megatron.core.dist_checkpointing.strategies.state_dict_saver")
    # async save: TemporalAsyncCaller.schedule_async_call calls torch.cuda.synchronize() before forking.
    _install_torch_view("megatron.core.dist_checkpointing.strategies.async_utils")
    # megatron-core >= 0.17 saves asynchronously through nvidia-resiliency-ext's copies of the same three modules
    # (its writer synchronizes, its finalize broadcasts a flag on torch.cuda.current_device(), its caller both).
    for name in ("filesystem_async", "state_dict_saver", "core"):
        _install_torch_view(f"{upstream.NVRX_ASYNC}.{name}")


def _shim_rerun_state_machine() -> None:
    # RerunStateMachine (modes other than DISABLED): _save_state/_restore_state call
    # torch.cuda.get_rng_state/set_rng_state, _reduce_any all-reduces a tensor on the CUDA device.
    _install_torch_view("megatron.core.rerun_state_machine")


class _NoKernelProfiler:
    """Stand-in for nvidia-resiliency-ext's ``CuptiManager``: records no CUDA kernels, so GPU scores are NaN."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def initialize(self) -> None:
        """Nothing to set up."""

    def shutdown(self) -> None:
        """Nothing to tear down."""

    def start_profiling(self) -> None:
        """No kernels to capture."""

    def stop_profiling(self) -> None:
        """No kernels to capture."""

    def get_results(self) -> dict:
        """No kernel statistics."""
        return {}

    def reset_results(self) -> None:
        """Nothing recorded."""


def _shim_straggler_detector() -> None:
    # (upstream.py resolves these names in nvidia-resiliency-ext's 0.4 and >= 0.6 layouts.)
    # Detector.initialize builds a CuptiManager, whose compiled module needs libcupti (a CUDA library).
    upstream.patch("nvidia_resiliency_ext.straggler.straggler:CuptiManager", _NoKernelProfiler)
    # Detector.generate_report calls torch.cuda.synchronize().
    _install_torch_view("nvidia_resiliency_ext.straggler.straggler")
    # ReportIntervalTracker moves the report interval to torch.cuda.current_device() before all-reducing it.
    _install_torch_view("nvidia_resiliency_ext.straggler.interval_tracker")


def _send_state_dict_on_cpu(self: Any, state_dict: Any, dst: int) -> dict[str, float]:
    """GroupWrapper.isend_state_dict without its ``.cuda()``: gloo sends CPU tensors."""
    import torch.distributed as dist

    tensors = state_dict.pop_tensors()
    self.send_object(state_dict, dst)
    for tensor in tensors:
        dist.send(tensor.contiguous(), dst, group=self.group)
    state_dict.insert_tensors(tensors)
    return {"data_sent": sum(t.nbytes for t in tensors)}


def _recv_state_dict_on_cpu(self: Any, src: int) -> tuple[Any, dict[str, float]]:
    """GroupWrapper.irecv_state_dict receiving straight into CPU tensors (upstream stages through CUDA)."""
    import torch.distributed as dist

    hollow = self.recv_object(src)
    hollow.init_tensors()
    for tensor in hollow.tensors:
        dist.recv(tensor, src, group=self.group)
    return hollow, {"data_recv": sum(t.nbytes for t in hollow.tensors)}


def _shim_local_checkpointing() -> None:
    # MCoreTensorAwareStateDict.to_state_dict (fully_parallel load) calls torch.cuda.synchronize().
    _install_torch_view("megatron.core.dist_checkpointing.tensor_aware_state_dict")
    # BaseCheckpointManager.save (async) calls torch.cuda.synchronize() before returning the request.
    _install_torch_view("nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager")
    # GroupWrapper.isend_state_dict/irecv_state_dict (replica retrieval) move every tensor through CUDA.
    group_utils = "nvidia_resiliency_ext.checkpointing.local.replication.group_utils"
    upstream.patch(f"{group_utils}:GroupWrapper.isend_state_dict", _send_state_dict_on_cpu)
    upstream.patch(f"{group_utils}:GroupWrapper.irecv_state_dict", _recv_state_dict_on_cpu)


@contextlib.contextmanager
def _cpu_tensors_pass_as_cuda() -> Any:
    """While open, a CPU tensor's ``.type()`` names the CUDA type and ``.cuda()`` returns the tensor itself.

    Only around the upstream calls patched below, which run on the main thread while the model and optimizer are
    built; every other thread keeps the real methods' behaviour for CPU tensors there is no CUDA to copy to anyway.
    """
    real_type, real_cuda = torch.Tensor.type, torch.Tensor.cuda

    def type_as_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = real_type(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_as_cuda  # type: ignore[method-assign]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = real_type, real_cuda  # type: ignore[method-assign]


def _as_if_cuda(function: Callable[..., Any], bound_classmethod: bool = False) -> Any:
    """``function`` (an upstream method) run inside :func:`_cpu_tensors_pass_as_cuda`.

    A classmethod comes bound to its class (as read from it) and goes back as a staticmethod.
    """

    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        with _cpu_tensors_pass_as_cuda():
            return function(*args, **kwargs)

    on_cpu.__name__ = function.__name__
    on_cpu._cpu_shim = True  # type: ignore[attr-defined]
    return staticmethod(on_cpu) if bound_classmethod else on_cpu


def _shim_rotary_embedding() -> None:
    # RotaryEmbedding moves its inverse frequencies to torch.cuda.current_device() at the first forward.
    _install_torch_view("megatron.core.models.common.embeddings.rotary_pos_embedding")


def _shim_pipeline_parallel() -> None:
    # p2p_communication exchanges tensor shapes in buffers on torch.cuda.current_device() and synchronizes CUDA.
    _install_torch_view("megatron.core.pipeline_parallel.p2p_communication")
    # Tied embeddings with pipeline parallelism: the last stage's copy is moved with .cuda() before the all-reduce.
    key = f"{_LANGUAGE_MODULE}:LanguageModule.setup_embeddings_and_output_layer"
    setup = upstream.find(key)
    if setup is not None and not getattr(setup, "_cpu_shim", False):
        upstream.patch(key, _as_if_cuda(setup))


def _shim_distributed_optimizer() -> None:
    # The distributed optimizer allocates state on torch.cuda.current_device() when loading checkpoints.
    _install_torch_view("megatron.core.optimizer.distrib_optimizer")
    # It accepts only parameters whose .type() is a torch.cuda type when sharding them.
    key = f"{_DISTRIB_OPTIMIZER}:DistributedOptimizer._build_model_and_main_param_groups"
    build = upstream.find(key)
    if build is not None and not getattr(build, "_cpu_shim", False):
        upstream.patch(key, _as_if_cuda(build, bound_classmethod=True))


_SHIMS: dict[str, Callable[[], None]] = {
    "jit_fuser": _shim_jit_fuser,  # first: the other shims import megatron.core
    "global_memory_buffer": _shim_global_memory_buffer,
    "rng_tracker": _shim_rng_tracker,
    "grad_buffer": _shim_grad_buffer,
    "optimizer": _shim_optimizer,
    "grad_clipping": _shim_grad_clipping,
    "schedules": _shim_schedules,
    "rotary_embedding": _shim_rotary_embedding,
    "pipeline_parallel": _shim_pipeline_parallel,
    "distributed_optimizer": _shim_distributed_optimizer,
    "dist_checkpointing": _shim_dist_checkpointing,
    "rerun_state_machine": _shim_rerun_state_machine,
    "straggler_detector": _shim_straggler_detector,
    "local_checkpointing": _shim_local_checkpointing,
}


def apply_cpu_shims(device: torch.device | None = None) -> None:
    """Patch upstream code so that training, DDP, the optimizer, checkpointing and straggler timing run on CPU.

    Idempotent. ``device``: the device this process trains on (``dist.device`` resolved); the shims are applied when
    it is the CPU, on a GPU node too. ``None``: when this machine has no CUDA.
    """
    global _APPLIED
    on_cpu = not torch.cuda.is_available() if device is None else device.type == "cpu"
    if _APPLIED or not on_cpu:
        return
    for name, shim in _SHIMS.items():
        shim()
        logger.debug("cpu_shims: applied %s", name)
    _APPLIED = True
    logger.info("cpu_shims: applied %d CPU shims", len(_SHIMS))


def training_on_cpu() -> bool:
    """Whether this process trains on CPU: the shims are applied (``dist.device`` resolved to cpu), or no CUDA.

    The code that would otherwise ask ``torch.cuda.is_available()`` asks this: on a GPU node with
    ``dist.device=cpu`` CUDA is available but must not be used (nor even initialized).
    """
    return _APPLIED or not torch.cuda.is_available()


def before_megatron_core_import() -> None:
    """Turn megatron-core's jit fuser off before megatron-core is first imported, on CPU only.

    Modules that import megatron-core at their top (the model providers) call this first, so that a user script
    importing them before ``pretrain`` applies the shims does not pay for ``torch.compile`` wrappers. At import
    ``dist.device`` is not resolved yet: on a GPU node with ``dist.device=cpu`` the fuser is turned off later, by
    :func:`apply_cpu_shims` (what was imported by then keeps its wrappers: a start-up cost, never called on CPU).
    """
    if not _APPLIED and not torch.cuda.is_available():
        _shim_jit_fuser()


def process_group_backend(requested: str) -> str:
    """The backend to use: gloo when training on CPU (:func:`training_on_cpu`), else the one asked (nccl needs GPUs)."""
    if requested == "nccl" and training_on_cpu():
        logger.info("cpu_shims: dist.distributed_backend=nccl needs CUDA; using gloo (training on CPU)")
        return "gloo"
    return requested


def gloo_pipeline_settings(config: Any) -> None:
    """Pipeline settings gloo needs on a model config: point-to-point sends and receives one at a time.

    Batched p2p over gloo pairs the wrong messages when a stage's previous and next peers are the same rank
    (interleaved stages on two ranks): gradients came out silently wrong.
    """
    config.batch_p2p_comm = False
    config.overlap_p2p_comm = False


def use_persistent_async_worker() -> bool:
    """Whether async checkpoint saves may use megatron-core's persistent (spawned) worker.

    On CPU: no. A spawned worker starts without these shims, dies on its first CUDA call and leaves the trainer
    waiting forever in ``schedule_async_request``; and it would be handed the live CPU tensors, not a copy. Saves use
    this package's persistent writer instead (``training/checkpoint/snapshot_writer.py``).
    """
    return not training_on_cpu()


def local_checkpoint_exchange_algo() -> str:
    """How a ``fully_parallel`` local-checkpoint load exchanges shards between data-parallel ranks.

    On CPU: ``gather_object`` (pickled tensors). megatron-core's ``broadcast`` exchange stages every tensor in a
    CUDA buffer.
    """
    return "gather_object" if training_on_cpu() else "broadcast"


def shutdown_gloo_connections(keep_ports: set[int]) -> int:
    """Shut down this process's established TCP connections except those on ``keep_ports``; return how many.

    gloo process groups have no working abort: their connections close only when the last reference to the group
    goes, and an aborted training iteration keeps references alive (tracebacks, autograd hooks). A peer blocked in a
    collective with this rank would wait for its timeout. Shutting the sockets down makes that collective fail at
    once on both sides (the role ``abort()`` plays for NCCL communicators). The stores' connections (``keep_ports``,
    local or remote) stay up: the next restart iteration needs them. Linux only (``/proc``); elsewhere nothing.
    """
    import socket

    from megatron.bridge.utils.tcp_sockets import ESTABLISHED, socket_fds, tcp_sockets

    fds = socket_fds()
    closed = 0
    for row in tcp_sockets():
        if row.inode not in fds or row.state != ESTABLISHED:
            continue
        if row.local_port in keep_ports or row.remote_port in keep_ports:
            continue
        try:
            sock = socket.socket(fileno=fds[row.inode])
        except OSError:  # gloo closed it meanwhile
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            closed += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the fd stays gloo's; only the connection is shut down
    return closed
