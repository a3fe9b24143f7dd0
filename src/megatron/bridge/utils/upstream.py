"""Every private name of torch, megatron-core and nvidia-resiliency-ext that this package reads, calls or patches.

An upgrade of an upstream package may rename or drop a private name without notice. Where we call one, the call
would fail with a bare ``AttributeError``; where we override or patch one, nothing fails at all: upstream stops
calling our code and the fix it carried silently disappears. So each such name is listed here once
(:data:`SYMBOLS`), with what we do with it and the package release it was checked against
(:data:`CHECKED_AGAINST`). Code elsewhere reaches an underscore name only through this module: :func:`get`
(raises :class:`UpstreamChanged` naming the symbol and both releases), :func:`find` (``None`` instead, for the CPU
shims, which skip what is gone), :func:`patch`, :func:`bound` (a listed method of an upstream object),
:func:`base_class` (an upstream class to subclass; warns when a method the subclass overrides is gone). The other
entries are undocumented parts of upstream objects (the re-run state machine's state, module-level ``torch``
names the CPU shims swap): they are used where they are needed and listed here so that they are checked too.
``tests/unit_tests/utils/test_upstream.py`` resolves every entry and fails, naming each missing symbol, after an
upgrade that removed one, and fails when a source file uses another module's underscore name directly.

Names used through public API are not listed. nvidia-resiliency-ext 0.6 moved the straggler package: such entries
list the newer module too (tried first). It also dropped its own copy of torch elastic (``_torch_elastic_compat``):
its launcher starts workers and picks ports through torch's, so those entries hold only for some releases
(:attr:`Symbol.when`), and a caller picks the one that holds (:func:`applicable`).
"""

import importlib
import inspect
import logging
import queue as queue_module
import re
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any, Optional

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

logger = logging.getLogger(__name__)

CHECKED_AGAINST = {
    "torch": ("2.13.0",),
    "megatron-core": ("0.16.1", "0.17.1", "0.18.2", "0.19.2"),
    "nvidia-resiliency-ext": ("0.4.1", "0.6.0", "0.7.0"),
}
"""The releases every symbol below was checked against: each resolves in them (``test_upstream.py``, which
``scripts/run_tests.sh --nvrx VERSION`` runs against the other nvidia-resiliency-ext releases; megatron-core 0.17 to
0.19 need Python 3.12, so they were checked once, with nvidia-resiliency-ext 0.7.0, re-tagged for Python 3.11). A
symbol with a :attr:`Symbol.when` was checked against those of its package's releases that the condition admits."""

_PACKAGE_OF = {"torch": "torch", "megatron": "megatron-core", "nvidia_resiliency_ext": "nvidia-resiliency-ext"}


@dataclass(frozen=True)
class Symbol:
    """One private upstream name we depend on."""

    key: str
    """``"<module>:<attribute path>"`` as in :data:`CHECKED_AGAINST`'s releases, e.g.
    ``"megatron.core.rerun_state_machine:RerunStateMachine._maybe_report_stats"``."""
    use: str
    """What we do with it: ``call``, ``read``, ``patch`` (we replace it), ``override`` (a subclass of ours
    replaces it: upstream must still call it), ``state`` (an attribute upstream's ``__init__`` or methods set on
    instances, which we read or write)."""
    why: str
    """Where and why."""
    newer_modules: tuple[str, ...] = ()
    """The same attribute's module in newer releases (tried first)."""
    when: str = ""
    """A requirement the installed releases must meet for the symbol to exist, e.g. ``"nvidia-resiliency-ext<0.6"``
    (empty: every release). A symbol whose condition fails is not checked, and :func:`applicable` skips it."""

    @property
    def module(self) -> str:
        """The module of the attribute in the checked release."""
        return self.key.split(":", 1)[0]

    @property
    def attr(self) -> str:
        """The attribute path inside the module."""
        return self.key.split(":", 1)[1]

    @property
    def package(self) -> str:
        """The distribution that ships it."""
        return _PACKAGE_OF[self.module.split(".", 1)[0]]

    @property
    def checked(self) -> tuple[str, ...]:
        """The releases of :attr:`package` it was checked against (those :attr:`when` admits, when it names it)."""
        releases = CHECKED_AGAINST[self.package]
        if not self.when:
            return releases
        requirement = Requirement(self.when)
        if canonicalize_name(requirement.name) != canonicalize_name(self.package):
            return releases
        return tuple(r for r in releases if requirement.specifier.contains(r, prereleases=True))

    def applies(self) -> bool:
        """Whether the installed releases meet :attr:`when` (a package it names that is not installed: no)."""
        if not self.when:
            return True
        requirement = Requirement(self.when)
        version = installed_version(requirement.name)
        return version is not None and requirement.specifier.contains(version, prereleases=True)


_RSM = "megatron.core.rerun_state_machine"
_FS_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
ASYNC_UTILS = "megatron.core.dist_checkpointing.strategies.async_utils"
"""megatron-core's async save queue and callers."""
NVRX_ASYNC = "nvidia_resiliency_ext.checkpointing.async_ckpt"
"""nvidia-resiliency-ext's asynchronous-save modules, which megatron-core 0.17 and later write through."""
_LOCAL_MANAGER = "nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager"
_FT_AGENT = "nvidia_resiliency_ext.fault_tolerance.launcher:LocalElasticAgent"
_RANK_MONITOR = "nvidia_resiliency_ext.fault_tolerance.rank_monitor_server:RankMonitorServer"
_STRAGGLER = "nvidia_resiliency_ext.straggler"
_STRAGGLER_NEW = "nvidia_resiliency_ext.attribution.straggler"

NVRX_OWN_ELASTIC = "nvidia-resiliency-ext<0.6"
"""Releases whose ``ft_launcher`` runs on the package's own copy of torch elastic (``_torch_elastic_compat``)."""
NVRX_TORCH_ELASTIC = "nvidia-resiliency-ext>=0.6"
"""Releases whose ``ft_launcher`` runs on torch's elastic agent: workers start and ports are picked there."""
MCORE_FORKING_WRITER = f"{_FS_ASYNC}:FileSystemWriterAsync.write_preloaded_data_multiproc"
"""megatron-core's bucket writer that forks a process per bucket (before 0.17)."""
_TORCH_HANDLER = "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler"
_NVRX_HANDLER = (
    "nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.multiprocessing.subprocess_handler.subprocess_handler"
)
STANDBY_PATCHES = {
    "torch": (f"{_TORCH_HANDLER}:SubprocessHandler._popen",),
    "ft_launcher": (f"{_NVRX_HANDLER}:SubprocessHandler._popen", f"{_TORCH_HANDLER}:SubprocessHandler._popen"),
}
"""The worker-start method of each launcher, which :mod:`megatron.bridge.standby` replaces: the first that
:func:`applicable` finds (``ft_launcher`` before nvidia-resiliency-ext 0.6 has its own)."""

PICK_PORT_SOCKET = "nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.agent.server.api:_get_socket_with_port"
"""``ft_launcher``'s pick of the workers' store port before nvidia-resiliency-ext 0.6: returns a bound socket."""
PICK_PORT_NUMBER = "torch.distributed.elastic.rendezvous.api:get_free_port"
"""The same pick from 0.6 on (torch's rendezvous, as the module's own name): returns the port number."""
RENDEZVOUS_SETTINGS = "nvidia_resiliency_ext.fault_tolerance._ft_rendezvous:RendezvousSettings"
"""The settings class of ``ft_launcher``'s legacy rendezvous (the only one before 0.6; gone in 0.7)."""


def _worker_handler(module: str, launcher: str, when: str = "") -> tuple[Symbol, ...]:
    """The worker-start method of ``launcher``'s ``SubprocessHandler`` and the output files it reads."""
    why = f"standby.py: {launcher}'s workers are forked from a pre-imported standby process"
    return (
        Symbol(f"{module}:SubprocessHandler._popen", "patch", why, when=when),
        *(
            Symbol(f"{module}:SubprocessHandler.{a}", "state", "standby.py: the worker's output file", when=when)
            for a in ("_stdout", "_stderr")
        ),
    )


def _torch_global(module: str, why: str, newer: tuple[str, ...] = ()) -> Symbol:
    return Symbol(
        f"{module}:torch", "patch", f"cpu_shims: the module's own `torch` name, swapped for a CPU view ({why})", newer
    )


def _manager(attr: str, use: str, why: str) -> Symbol:
    return Symbol(f"{_LOCAL_MANAGER}:LocalCheckpointManager.{attr}", use, f"checkpoint/local_tier.py: {why}")


def _rerun_state(attr: str) -> Symbol:
    return Symbol(
        f"{_RSM}:RerunStateMachine.{attr}",
        "state",
        "health/rerun.py: exported to and restored from checkpoints, read to drive the controller",
    )


SYMBOLS: tuple[Symbol, ...] = (
    # ---------------------------------------------------------------- torch
    Symbol(
        "torch.distributed.distributed_c10d:_abort_process_group",
        "call",
        "initialize.abort_distributed: abort every group so that peers blocked in a collective fail now",
    ),
    Symbol(
        "torch.distributed.distributed_c10d:_get_default_store",
        "call",
        "the default group's store: liveness records, utils.dist.barrier with a timeout",
    ),
    Symbol("torch:_foreach_mul_", "call", "cpu_shims: clip gradients in place, as upstream's clipping does"),
    Symbol(
        "torch.utils.serialization:config.save.compute_crc32",
        "read",
        "local_tier.py, async_writer.py: restore torch.save's CRC setting after a save without it",
    ),
    # ---------------------------------------------------------------- megatron-core
    Symbol(
        f"{_RSM}:_set_rerun_state_machine",
        "call",
        "initialize.init_rerun_state: install our RerunStateMachine subclass (the public initializer builds the base)",
    ),
    Symbol(
        f"{_RSM}:RerunStateMachine._reduce_any",
        "override",
        "health/rerun.py: the machine's per-step all-reduce also carries the training loop's per-step flags",
    ),
    Symbol(
        f"{_RSM}:RerunStateMachine._maybe_report_stats",
        "override",
        "health/rerun.py: upstream's determinism-stats report reads caller fields that do not exist",
    ),
    Symbol(f"{_RSM}:RerunStateMachine.REPORTING_INTERVAL_ITERATIONS", "read", "health/rerun.py: when to report stats"),
    Symbol(f"{_RSM}:Call", "call", "health/rerun.py: rebuild the failed validation call from a checkpoint"),
    Symbol(f"{_RSM}:Caller", "call", "health/rerun.py: rebuild the failed validation call from a checkpoint"),
    Symbol(f"{_RSM}:QuickStats.combine", "call", "health/rerun.py: merge every rank's determinism stats"),
    Symbol(f"{_RSM}:QuickStats.print_stats", "call", "health/rerun.py: log the merged determinism stats"),
    *(
        _rerun_state(attr)
        for attr in (
            "mode",
            "state",
            "current_iteration",
            "first_iteration_complete",
            "failed_validation_call",
            "rerun_requested",
            "checkpoint_requested",
            "restart_again_requested",
            "continue_requested",
            "initial_result",
            "suspicious_node",
            "suspicious_device",
            "large_value_counts",
            "max_values",
            "stats",
            "error_injector",
        )
    ),
    *(
        Symbol(
            f"{_RSM}:RerunErrorInjector.{attr}", "state", "health/rerun.py: exported to and restored from checkpoints"
        )
        for attr in ("error_injection_rate", "error_injection_type", "injected_error_type")
    ),
    *(
        Symbol(
            f"{module}:_results_queue",
            "patch",
            "checkpoint/async_writer.py: a results queue in files, without upstream's manager process",
        )
        for module in (_FS_ASYNC, f"{NVRX_ASYNC}.filesystem_async")  # the second: megatron-core >= 0.17 writes there
    ),
    Symbol(
        MCORE_FORKING_WRITER,
        "read",
        "checkpoint/async_writer.py: recognise upstream's per-bucket forking writer, to write in one process "
        "(megatron-core 0.17 writes with threads instead)",
        when="megatron-core<0.17",
    ),
    Symbol(
        f"{_FS_ASYNC}:FileSystemWriterAsync.write_preloaded_data",
        "call",
        "checkpoint/async_writer.py: write one bucket in the forked writer",
    ),
    Symbol(
        "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
        "patch",
        "cpu_shims: the RNG tracker's 'CUDA' state is the CPU generator's",
    ),
    Symbol(
        "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
        "patch",
        "cpu_shims: the RNG tracker's 'CUDA' state is the CPU generator's",
    ),
    Symbol(
        "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
        "patch",
        "cpu_shims: upstream asserts CUDA gradients",
    ),
    Symbol(
        "megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32",
        "patch",
        "cpu_shims: the optimizer module's imported copy of the same function",
    ),
    _torch_global("megatron.core.utils", "GlobalMemoryBuffer allocates on the CUDA device"),
    _torch_global("megatron.core.tensor_parallel.random", "the RNG tracker seeds and reads CUDA generators"),
    _torch_global("megatron.core.distributed.param_and_grad_buffer", "DDP buffers on the CUDA device"),
    _torch_global("megatron.core.optimizer.optimizer", "optimizer state on the CUDA device"),
    _torch_global("megatron.core.optimizer.clip_grads", "norms on the CUDA device"),
    _torch_global("megatron.core.pipeline_parallel.schedules", "token counts on the CUDA device"),
    _torch_global("megatron.core.pipeline_parallel.p2p_communication", "shape buffers on the CUDA device"),
    _torch_global(
        "megatron.core.models.common.embeddings.rotary_pos_embedding", "rotary frequencies moved to the CUDA device"
    ),
    _torch_global("megatron.core.optimizer.distrib_optimizer", "state allocated on the CUDA device on load"),
    Symbol(
        "megatron.core.models.common.language_module.language_module:LanguageModule.setup_embeddings_and_output_layer",
        "patch",
        "cpu_shims: tied embeddings across pipeline stages are moved with .cuda() before their all-reduce",
    ),
    Symbol(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._init_optimizer_states_with_dummy_values",
        "call",
        "checkpoint/optimizer_state.py: without Apex/TE the distributed optimizer has no state to load into until "
        "it stepped",
    ),
    Symbol(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups",
        "patch",
        "cpu_shims: the distributed optimizer accepts only parameters whose .type() is a torch.cuda type",
    ),
    _torch_global(_FS_ASYNC, "torch.cuda.synchronize before writing"),
    *(
        _torch_global(f"{NVRX_ASYNC}.{name}", f"megatron-core >= 0.17 saves asynchronously through it: {why}")
        for name, why in (
            ("filesystem_async", "torch.cuda.synchronize before writing"),
            ("state_dict_saver", "a flag on the CUDA device"),
            ("core", "torch.cuda.synchronize before forking, a flag on the CUDA device"),
        )
    ),
    _torch_global("megatron.core.dist_checkpointing.strategies.state_dict_saver", "a flag on the CUDA device"),
    _torch_global(ASYNC_UTILS, "torch.cuda.synchronize before forking"),
    Symbol(
        f"{ASYNC_UTILS}:AsyncCallsQueue._get_async_caller",
        "override",
        "checkpoint/snapshot_writer.py: every call of the queue goes to the persistent CPU writer",
    ),
    *(
        Symbol(
            f"{ASYNC_UTILS}:{attr}",
            "state",
            "async_call_finished_here: whether this rank's async save finished, without the poll's all-reduce",
        )
        for attr in (
            "AsyncCallsQueue.async_calls",
            "TemporalAsyncCaller.process",
            "PersistentAsyncCaller.process",
            "PersistentAsyncCaller.cur_item",
        )
    ),
    *(
        Symbol(
            f"{ASYNC_UTILS}:PersistentAsyncCaller.{attr}",
            "state",
            "async_call_finished_here: the persistent worker's queue of finished calls",
            when=when,
        )
        for attr, when in (("comp_q", "megatron-core<0.17"), ("_persistent_comp_q", "megatron-core>=0.17"))
    ),
    _torch_global(_RSM, "CUDA RNG state and a CUDA tensor for its all-reduce"),
    _torch_global("megatron.core.dist_checkpointing.tensor_aware_state_dict", "torch.cuda.synchronize"),
    *_worker_handler(_TORCH_HANDLER, "torchrun's (and from nvidia-resiliency-ext 0.6 ft_launcher's)"),
    Symbol(
        PICK_PORT_NUMBER,
        "patch",
        "ft_launch.py: the workers' store port is picked outside the kernel's ephemeral range",
        when=NVRX_TORCH_ELASTIC,
    ),
    # ---------------------------------------------------------------- nvidia-resiliency-ext
    Symbol(
        RENDEZVOUS_SETTINGS,
        "patch",
        "utils/rendezvous_keep_alive.py: the heartbeat settings of --rdzv-conf",
        when="nvidia-resiliency-ext<0.7",
    ),
    *_worker_handler(_NVRX_HANDLER, "ft_launcher", when=NVRX_OWN_ELASTIC),
    Symbol(
        PICK_PORT_SOCKET,
        "patch",
        "ft_launch.py: the workers' store port is picked outside the kernel's ephemeral range",
        when=NVRX_OWN_ELASTIC,
    ),
    *(
        Symbol(f"{_FT_AGENT}.{method}", "patch", f"training/events/launcher.py: {why} (observed, then upstream's runs)")
        for method, why in (
            ("_monitor_workers", "worker exits and their codes or signals (also ft_launch.py: the job's exit code)"),
            ("_restart_workers", "when an in-job restart begins"),
            ("_stop_workers", "when the workers are stopped"),
            ("_initialize_workers", "when the new workers run"),
        )
    ),
    Symbol(
        f"{_FT_AGENT}._remaining_restarts",
        "state",
        "training/events/launcher.py: the in-job restart count; ft_launch.py: no restart after a worker's stop code",
    ),
    Symbol(
        f"{_RANK_MONITOR}._handle_timeout",
        "patch",
        "training/events/launcher.py: which timeout a rank monitor acts on, before it kills the rank",
    ),
    *(
        Symbol(f"{_RANK_MONITOR}.{attr}", "state", "training/events/launcher.py: the rank monitor's timeout state")
        for attr in ("rank_info", "open_sections", "out_of_section_time", "last_hb_time", "start_time", "cfg")
    ),
    Symbol(
        "nvidia_resiliency_ext.inprocess.wrap:Wrapper.restart_health_check",
        "state",
        "inprocess_restart.py: the checks the wrapper runs after a fault; on a node without a GPU its own GPU, "
        "NVLink and NIC checks are taken out of it (they fail without NVML)",
        when="nvidia-resiliency-ext>=0.5",
    ),
    Symbol(
        "nvidia_resiliency_ext.inprocess.monitor_thread:MonitorThread.store",
        "state",
        "inprocess_restart.py: the interruption records (each rank's cause) are read from it for fault_detected events",
    ),
    Symbol(
        "nvidia_resiliency_ext.fault_tolerance.rank_monitor_client:RankMonitorClient._set_calculated_timeouts",
        "call",
        "health/rank_monitor_client.py: hang timeouts kept above inprocess_restart.hard_timeout (the outer layer)",
    ),
    _torch_global(
        "nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager", "torch.cuda.synchronize after a save"
    ),
    _torch_global(f"{_STRAGGLER}.straggler", "torch.cuda.synchronize in reports", (f"{_STRAGGLER_NEW}.straggler",)),
    _torch_global(
        f"{_STRAGGLER}.interval_tracker",
        "the report interval on the CUDA device",
        (f"{_STRAGGLER_NEW}.interval_tracker",),
    ),
    Symbol(
        f"{_STRAGGLER}.straggler:CuptiManager",
        "patch",
        "cpu_shims: the kernel profiler needs libcupti; replaced by one that records nothing",
        (f"{_STRAGGLER_NEW}.straggler",),
    ),
    *(
        Symbol(
            f"nvidia_resiliency_ext.checkpointing.local.replication.group_utils:GroupWrapper.{attr}",
            use,
            f"cpu_shims: replica exchange without CUDA staging ({why})",
        )
        for attr, use, why in (
            ("isend_state_dict", "patch", "sends CPU tensors"),
            ("irecv_state_dict", "patch", "receives into CPU tensors"),
            ("send_object", "call", "the replacements send the hollow state dict with it"),
            ("recv_object", "call", "the replacements receive the hollow state dict with it"),
        )
    ),
    _manager("_ckpt_id", "call", "the id of this rank's shard of an iteration"),
    _manager("_load_fn", "call", "read one shard (own or a replica) to verify it before it is used or sent"),
    _manager("_cleanup_failed_save", "override", "delete an iteration's files in every rank directory of the node"),
    _manager("_cleanup", "override", "retention over every rank directory of the node"),
    _manager("_my_ckpt_ids", "override", "find the node's shards in every rank directory (ranks move after restarts)"),
    _manager("_load", "override", "load a shard from whichever rank directory holds it"),
    _manager("_save", "override", "save without torch.save's CRC (the content hashes cover it)"),
    _manager("_ensure_dir", "call", "create the rank directory before scanning"),
    _manager("_filename_from_template", "call", "the shard file name pattern"),
    _manager("_filename_to_id", "call", "a shard file name's id"),
    _manager("_local_ckpt_path_from_id", "call", "a shard's file name"),
    _manager("root_local_ckpt_dir", "state", "the node's root directory"),
    _manager("session_id", "state", "the job's session directory"),
    _manager("local_ckpt_dir", "read", "this rank's directory"),
    _manager("latest_iteration", "state", "reset before a scan, set before a load"),
    _manager("globally_available_ids", "state", "every rank's shards, for the replica retrieval plan"),
    _manager("repl_strategy", "state", "the replication strategy, if any"),
)

_BY_KEY = {s.key: s for s in SYMBOLS}
_warned: set[str] = set()


class UpstreamChanged(AttributeError):
    """A listed private upstream name does not resolve in the installed release."""


def installed_version(package: str) -> Optional[str]:
    """The installed release of ``package`` (a distribution name), or ``None``."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _describe(symbol: Symbol, reason: str) -> str:
    return (
        f"{symbol.key} ({symbol.use}; {symbol.why}): {reason}. Checked against {symbol.package} "
        f"{', '.join(symbol.checked)}, installed {installed_version(symbol.package) or 'none'}; "
        f"update megatron/bridge/utils/upstream.py and its users"
    )


def _symbol(key: str) -> Symbol:
    try:
        return _BY_KEY[key]
    except KeyError:
        raise KeyError(f"{key} is not listed in megatron.bridge.utils.upstream.SYMBOLS: list it there first") from None


def _sets_on_instances(cls: type, name: str) -> bool:
    """Whether some class in ``cls``'s MRO assigns ``self.<name>`` in its source."""
    pattern = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]+)?=(?!=)")
    for klass in inspect.getmro(cls):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if pattern.search(source):
            return True
    return False


def _resolve(symbol: Symbol) -> tuple[Any, str, Any]:
    """``(owner, attribute name, value)`` of ``symbol``; raises :class:`UpstreamChanged` with the reason."""
    errors = []
    module: Optional[ModuleType] = None
    for name in (*symbol.newer_modules, symbol.module):
        try:
            module = importlib.import_module(name)
            break
        except ImportError as err:
            errors.append(f"{name}: {err}")
    if module is None:
        raise UpstreamChanged(_describe(symbol, "module not importable (" + "; ".join(errors) + ")"))
    *parents, last = symbol.attr.split(".")
    owner: Any = module
    for part in parents:
        if not hasattr(owner, part):
            raise UpstreamChanged(_describe(symbol, f"{module.__name__} has no {part!r}"))
        owner = getattr(owner, part)
    if hasattr(owner, last):
        return owner, last, getattr(owner, last)
    if symbol.use == "state" and inspect.isclass(owner) and _sets_on_instances(owner, last):
        return owner, last, None
    raise UpstreamChanged(_describe(symbol, f"{module.__name__}.{'.'.join(parents) or '<module>'} has no {last!r}"))


def get(key: str) -> Any:
    """The object ``key`` names (a listed :class:`Symbol`); ``None`` for a ``state`` attribute of instances.

    Raises:
        UpstreamChanged: it does not resolve in the installed release (the message names both releases).
    """
    return _resolve(_symbol(key))[2]


def find(key: str) -> Any:
    """Like :func:`get`, but ``None`` (logged once) when the symbol is gone."""
    try:
        return get(key)
    except UpstreamChanged as err:
        if key not in _warned:
            _warned.add(key)
            logger.warning("upstream symbol missing: %s", err)
        return None


def owner(key: str) -> Any:
    """The module or class that holds ``key``'s attribute, or ``None`` (logged once) when the symbol is gone."""
    try:
        return _resolve(_symbol(key))[0]
    except UpstreamChanged as err:
        if key not in _warned:
            _warned.add(key)
            logger.warning("upstream symbol missing: %s", err)
        return None


def patch(key: str, value: Any) -> bool:
    """Replace ``key``'s attribute with ``value`` (a ``patch`` symbol); ``False`` (logged once) when it is gone."""
    symbol = _symbol(key)
    assert symbol.use == "patch", f"{key} is listed as {symbol.use!r}, not patched"
    holder = owner(key)
    if holder is None:
        return False
    setattr(holder, symbol.attr.rsplit(".", 1)[-1], value)
    return True


def bound(obj: Any, key: str) -> Any:
    """``obj``'s attribute named by ``key`` (a method listed on ``obj``'s upstream class, bound: overrides count).

    Raises:
        UpstreamChanged: the listed symbol does not resolve in the installed release.
    """
    symbol = _symbol(key)
    _resolve(symbol)
    return getattr(obj, symbol.attr.rsplit(".", 1)[-1])


def base_class(path: str) -> type:
    """The upstream class ``"<module>:<class>"`` to subclass; warns once for each listed override it lacks.

    An override of a method upstream renamed is never called: the warning names it when the subclass is built.
    """
    module, name = path.split(":", 1)
    cls = getattr(importlib.import_module(module), name)
    for symbol in SYMBOLS:
        if symbol.key.startswith(f"{path}.") and symbol.use == "override":
            find(symbol.key)
    return cls


def applicable(keys: tuple[str, ...]) -> Optional[str]:
    """The first of ``keys`` (listed symbols) whose :attr:`Symbol.when` the installed releases meet, or ``None``."""
    return next((key for key in keys if _symbol(key).applies()), None)


def problems() -> list[str]:
    """One line per listed symbol that does not resolve in the installed releases (empty when all do).

    A symbol whose :attr:`Symbol.when` the installed releases do not meet is not checked.
    """
    found = []
    for symbol in SYMBOLS:
        if not symbol.applies():
            continue
        try:
            _resolve(symbol)
        except UpstreamChanged as err:
            found.append(str(err))
    return found


# ------------------------------------------------------------------------------------------ calls, by purpose


def default_store() -> Any:
    """The store of the default process group (its rendezvous store, under the group's prefix)."""
    return get("torch.distributed.distributed_c10d:_get_default_store")()


def abort_process_groups() -> None:
    """Abort every process group of this process (NCCL communicators are aborted, not just destroyed)."""
    get("torch.distributed.distributed_c10d:_abort_process_group")()


def worker_output_files(handler: Any) -> tuple[Optional[str], Optional[str]]:
    """The files a torch elastic ``SubprocessHandler`` opened for its worker's stdout and stderr (``None``: none)."""
    files = (getattr(handler, "_stdout", None), getattr(handler, "_stderr", None))
    return tuple(getattr(f, "name", None) if f is not None else None for f in files)


def agent_restart_count(agent: Any) -> int:
    """In-job restarts an ft_launcher agent has started so far (its restarts left are counted down)."""
    return int(agent.get_worker_group().spec.max_restarts) - int(agent._remaining_restarts)


def agent_restarts_left(agent: Any) -> int:
    """In-job restarts an ft_launcher agent may still start."""
    return int(agent._remaining_restarts)


def drop_agent_restarts(agent: Any) -> None:
    """Leave an ft_launcher agent no restart: at its next failed look it stops its workers and ends."""
    agent._remaining_restarts = 0


def set_rerun_state_machine(machine: Any) -> None:
    """Install ``machine`` as megatron-core's process-wide re-run state machine."""
    get(f"{_RSM}:_set_rerun_state_machine")(machine)


def async_call_finished_here(queue: Any) -> bool:
    """Whether the oldest call in megatron-core's ``AsyncCallsQueue`` finished on this rank (no collective).

    The check of the queue's own ``no_dist`` poll, without finalizing anything: a persistent worker's completion
    notice, once taken from its queue, is kept on the caller (``cur_item``), where that poll looks first. ``True``
    when the queue is empty.
    """
    if not queue.async_calls:
        return True
    caller = queue.async_calls[0].async_caller
    if hasattr(caller, "finished_here"):  # this package's persistent CPU writer: it knows
        return caller.finished_here()
    # The persistent worker reports each finished call on its queue: the caller's own before megatron-core 0.17,
    # its class's (one worker per process) since.
    finished = getattr(caller, "comp_q", None) or getattr(type(caller), "_persistent_comp_q", None)
    if finished is not None:
        if caller.process and caller.cur_item is None:
            try:
                caller.cur_item = finished.get_nowait()
            except queue_module.Empty:
                return False
        return True
    return caller.process is None or not caller.process.is_alive()
