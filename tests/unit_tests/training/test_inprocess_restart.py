"""In-process restart: validation, the mapping of every config field onto the real ``inprocess.Wrapper``, teardown."""

import datetime
import logging
import socket
import threading
import time
import types

import pytest
import torch
from tests.unit_tests.configs import base_config

from megatron.bridge.training import inprocess_restart
from megatron.bridge.training.components.base import Teardown
from megatron.bridge.training.config import InProcessRestartConfig
from megatron.bridge.training.inprocess_restart import (
    GPU_RESTART_CHECKS,
    RestartIteration,
    _wait_until_listening,
    build_wrapper,
    maybe_wrap_for_inprocess_restart,
)
from megatron.bridge.training.state import GlobalState
from megatron.bridge.training.utils.overrides import apply_overrides

inprocess = pytest.importorskip("nvidia_resiliency_ext.inprocess")

ENV = {"TORCH_CPP_LOG_LEVEL": "error", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0"}


@pytest.fixture
def ipr_env(monkeypatch):
    launcher = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    for key, value in {**ENV, **launcher}.items():
        monkeypatch.setenv(key, value)
    for key in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)


def _validate(*overrides: str, world_size: int = 2) -> None:
    apply_overrides(base_config(), ["inprocess_restart.enabled=true", *overrides]).validate(world_size=world_size)


def test_documented_settings_validate(ipr_env):
    _validate()
    _validate("inprocess_restart.granularity=rank", "inprocess_restart.active_world_size=1")
    _validate("inprocess_restart.max_iterations=0", "inprocess_restart.max_rank_faults=0")


@pytest.mark.parametrize(
    "overrides,field_name",
    [
        (["inprocess_restart.granularity=gpu"], "inprocess_restart.granularity"),
        (["inprocess_restart.active_world_size=3"], "inprocess_restart.active_world_size"),
        (["inprocess_restart.active_world_size=0"], "inprocess_restart.active_world_size"),
        (["inprocess_restart.max_iterations=-1"], "inprocess_restart.max_iterations"),
        (["inprocess_restart.max_rank_faults=-1"], "inprocess_restart.max_rank_faults"),
        (["inprocess_restart.soft_timeout=0"], "inprocess_restart.soft_timeout"),
        (["inprocess_restart.soft_timeout=95"], "inprocess_restart.soft_timeout"),  # not below hard (90)
        (["inprocess_restart.hard_timeout=130"], "inprocess_restart.hard_timeout"),  # not below barrier (120)
        (
            ["inprocess_restart.completion_timeout=80"],  # hard (90) must be below completion
            "inprocess_restart.hard_timeout",
        ),
        (["inprocess_restart.heartbeat_interval=60"], "inprocess_restart.heartbeat_interval"),
        (["inprocess_restart.heartbeat_timeout=150"], "inprocess_restart.heartbeat_timeout"),  # above barrier (120)
        (["inprocess_restart.soft_timeout=0.5", "inprocess_restart.hard_timeout=2"], "inprocess_restart.soft_timeout"),
        (["dist.distributed_timeout_minutes=1"], "dist.distributed_timeout_minutes"),  # 60 s < hard_timeout 90 s
    ],
)
def test_invalid_settings_name_the_field_and_the_fix(ipr_env, overrides, field_name):
    with pytest.raises(ValueError) as err:
        _validate(*overrides)
    message = str(err.value)
    if message.startswith("override "):  # a value of the wrong type, refused by the override parser
        assert f": {field_name} expects " in message, message
    else:
        assert message.startswith(field_name + ":") and "Fix:" in message, message


def test_missing_environment_is_named_with_the_export_line(ipr_env, monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE")
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "info")
    with pytest.raises(ValueError) as err:
        _validate()
    message = str(err.value)
    assert message.startswith("inprocess_restart.enabled:"), message
    assert message.endswith(
        "Fix: export TORCH_CPP_LOG_LEVEL=error NCCL_NVLS_ENABLE=0 in the job script before launching."
    ), message
    assert "TORCH_NCCL_RETHROW_CUDA_ERRORS (" not in message  # set correctly: not reported


@pytest.mark.parametrize(
    "unset,field_name",
    [("MASTER_ADDR", "inprocess_restart.enabled"), ("LOCAL_WORLD_SIZE", "inprocess_restart.granularity")],
)
def test_launcher_environment_is_required(ipr_env, monkeypatch, unset, field_name):
    monkeypatch.delenv(unset)
    with pytest.raises(ValueError, match=f"^{field_name}:"):
        _validate()


def test_model_and_batch_are_checked_against_the_active_ranks(ipr_env):
    # 2 ranks, 1 active: tensor parallel 2 does not fit the one rank that trains.
    with pytest.raises(ValueError, match="^model.tensor_model_parallel_size:"):
        _validate("inprocess_restart.active_world_size=1", "model.tensor_model_parallel_size=2")
    _validate("model.tensor_model_parallel_size=2")


def _find(composed, cls):
    """The instance of ``cls`` inside an ``inprocess.Compose`` (or the object itself)."""
    for part in getattr(composed, "instances", (composed,)):
        if isinstance(part, cls):
            return part
    raise AssertionError(f"no {cls.__name__} in {composed}")


def test_every_field_reaches_the_wrapper(ipr_env, tmp_path):
    cfg = InProcessRestartConfig(
        enabled=True, active_world_size=3, granularity="node", max_iterations=4, soft_timeout=11.0,
        hard_timeout=22.0, heartbeat_interval=3.0, heartbeat_timeout=33.0, barrier_timeout=44.0,
        completion_timeout=55.0, empty_cuda_cache=False, max_rank_faults=2, monitor_process_logdir=str(tmp_path / "m"),
    )  # fmt: skip
    wrapper = build_wrapper(cfg, lambda: None, lambda: None)
    seconds = datetime.timedelta
    assert (wrapper.soft_timeout, wrapper.hard_timeout) == (seconds(seconds=11), seconds(seconds=22))
    assert (wrapper.heartbeat_interval, wrapper.heartbeat_timeout) == (seconds(seconds=3), seconds(seconds=33))
    assert (wrapper.barrier_timeout, wrapper.completion_timeout) == (seconds(seconds=44), seconds(seconds=55))
    assert wrapper.monitor_process_logfile == str(tmp_path / "m" / "monitor_process_{rank}.log")
    assert (tmp_path / "m").is_dir()
    assert wrapper.store_kwargs["port"] == 29502  # MASTER_PORT + 2
    retry = _find(wrapper.initialize, inprocess.initialize.RetryController)
    assert retry.max_iterations == 5  # the first run plus max_iterations=4 restarts
    assert retry.min_world_size == retry.min_active_world_size == 3
    assert _find(wrapper.health_check, inprocess.health_check.FaultCounter).max_rank_faults == 2
    root, node = wrapper.rank_assignment.layers
    assert (root.min_ranks, root.max_ranks) == (3, 3)  # active_world_size: the 4th rank is a reserve
    assert (node.min_ranks, node.max_ranks) == (2, 2) and callable(node.key_or_fn)  # LOCAL_WORLD_SIZE per host


def test_rank_granularity_unlimited_iterations_and_no_logdir(ipr_env):
    wrapper = build_wrapper(InProcessRestartConfig(enabled=True, granularity="rank"), lambda: None, lambda: None)
    assert len(wrapper.rank_assignment.layers) == 1
    assert wrapper.rank_assignment.layers[0].min_ranks == 4  # every rank active (WORLD_SIZE=4)
    assert _find(wrapper.initialize, inprocess.initialize.RetryController).max_iterations is None
    assert wrapper.monitor_process_logfile is None


def test_finalize_runs_the_iterations_teardown_and_abort_aborts(ipr_env):
    calls = []
    wrapper = build_wrapper(
        InProcessRestartConfig(enabled=True), lambda: calls.append("teardown"), lambda: calls.append("abort")
    )
    state = inprocess.State(rank=0, world_size=1)
    wrapper.finalize(state.freeze())
    wrapper.abort(state.freeze())
    assert calls == ["teardown", "abort"]


@pytest.mark.parametrize("empty_cuda_cache", [True, False])
def test_finalize_empties_the_cuda_cache_only_when_asked(ipr_env, monkeypatch, empty_cuda_cache):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    cfg = InProcessRestartConfig(enabled=True, empty_cuda_cache=empty_cuda_cache)
    wrapper = build_wrapper(cfg, lambda: None, lambda: None)
    steps = [step.threaded for step in wrapper.finalize.instances]
    assert all(isinstance(step, inprocess.finalize.ThreadedFinalize) for step in steps)
    assert [step.fn for step in steps][1:] == ([inprocess_restart._empty_cuda_cache] if empty_cuda_cache else [])
    # Our logic only: no device is touched (the GPU-bound thread is replaced, see the next test).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(inprocess.finalize.ThreadedFinalize, "__call__", lambda self, state: self.fn() or state)
    wrapper.finalize(inprocess.State(rank=0, world_size=1).freeze())
    assert emptied == ([True] if empty_cuda_cache else [])


@pytest.mark.parametrize("cuda", [True, False])
def test_finalize_steps_run_in_the_gpu_thread_only_where_cuda_runs(ipr_env, monkeypatch, cuda):
    # ThreadedFinalize refuses to run without an initialized CUDA: there the step runs in the calling thread.
    ran, threaded = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda)
    monkeypatch.setattr(
        inprocess.finalize.ThreadedFinalize, "__call__", lambda self, state: threaded.append(1) or state
    )
    wrapper = build_wrapper(InProcessRestartConfig(enabled=True, empty_cuda_cache=False), lambda: ran.append(1), None)
    state = inprocess.State(rank=0, world_size=1).freeze()
    assert wrapper.finalize(state) is state
    assert (ran, threaded) == (([], [1]) if cuda else ([1], []))


NVRX_ADDS_GPU_CHECKS = all(hasattr(inprocess.health_check, name) for name in GPU_RESTART_CHECKS)
"""nvidia-resiliency-ext >= 0.5: its wrapper adds GPU, NVLink and NIC checks to those it runs after a fault."""
NO_GPU, GPU, BROKEN_DRIVER = (
    "",
    "torch.cuda.device_count() is 2",
    "/dev/nvidia0 present, torch.cuda.device_count() is 0",
)


def _names(composed) -> list[str]:
    return [type(part).__name__ for part in getattr(composed, "instances", () if composed is None else (composed,))]


def _build_on(monkeypatch, caplog, evidence: str, cuda: bool):
    """The wrapper built where ``visible_gpu()`` says ``evidence`` and CUDA is (not) available; the lines it logged."""
    monkeypatch.setenv("LOCAL_RANK", "1")  # what makes nvidia-resiliency-ext >= 0.5 add its GPU checks
    monkeypatch.setattr(inprocess_restart, "visible_gpu", lambda: evidence)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(inprocess_restart, "_said_left_out", False)
    with caplog.at_level(logging.INFO, logger=inprocess_restart.__name__):
        wrappers = [build_wrapper(InProcessRestartConfig(enabled=True), lambda: None, lambda: None) for _ in range(2)]
    said = [
        r.getMessage() for r in caplog.records if r.name == inprocess_restart.__name__ and "left out" in r.getMessage()
    ]
    return wrappers[0], said


def test_without_a_gpu_the_checks_that_need_one_are_left_out_and_said_once(ipr_env, monkeypatch, caplog):
    wrapper, said = _build_on(monkeypatch, caplog, NO_GPU, cuda=False)
    restart_checks = getattr(wrapper, "restart_health_check", wrapper.health_check)  # after a fault (< 0.5: the same)
    assert _names(wrapper.health_check) == _names(restart_checks) == ["FaultCounter", "CudaHealthCheck"]
    # The counter after a fault is the one before each iteration, and it passes without a GPU (it raised before).
    assert _find(restart_checks, inprocess.health_check.FaultCounter) is _find(
        wrapper.health_check, inprocess.health_check.FaultCounter
    )
    restart_checks(inprocess.State(rank=0, world_size=1).freeze())  # the CUDA check does nothing without CUDA
    if not NVRX_ADDS_GPU_CHECKS:
        assert said == []
        return
    assert len(said) == 1, said  # two wrappers built, one line
    assert said[0] == (
        f"in-process restart: left out the health checks that need a GPU ({', '.join(GPU_RESTART_CHECKS)}): this node "
        "has no GPU (CUDA counts none, no /dev/nvidia<N>); nvidia-resiliency-ext's NVML and NIC errors logged while "
        "it built them are expected here"
    ), said


def test_with_a_gpu_every_check_stays_and_nothing_is_said(ipr_env, monkeypatch, caplog):
    wrapper, said = _build_on(monkeypatch, caplog, GPU, cuda=True)
    assert _names(wrapper.health_check) == ["FaultCounter", "CudaHealthCheck"]
    if NVRX_ADDS_GPU_CHECKS:
        assert _names(wrapper.restart_health_check) == ["FaultCounter", "CudaHealthCheck", *GPU_RESTART_CHECKS]
    assert said == []


def test_a_gpu_without_cuda_keeps_the_nvml_checks(ipr_env, monkeypatch, caplog):
    # A GPU whose driver CUDA cannot use: NVML's checks stay (they report the GPU); the CUDA sync finds no context.
    wrapper, said = _build_on(monkeypatch, caplog, BROKEN_DRIVER, cuda=False)
    assert _names(wrapper.health_check) == ["FaultCounter", "CudaHealthCheck"]
    if NVRX_ADDS_GPU_CHECKS:
        assert _names(wrapper.restart_health_check) == ["FaultCounter", "CudaHealthCheck", *GPU_RESTART_CHECKS]
    assert said == []


def test_only_the_gpu_checks_are_taken_out_of_the_restart_checks():
    # Our logic's inputs only: a wrapper of any release, and the check classes its release has.
    classes = {
        name: type(name, (inprocess.health_check.HealthCheck,), {"__call__": lambda self, s: s})
        for name in GPU_RESTART_CHECKS
    }
    release = types.SimpleNamespace(health_check=types.SimpleNamespace(**classes), Compose=inprocess.Compose)
    counter = inprocess.health_check.FaultCounter()
    wrapper = types.SimpleNamespace(restart_health_check=inprocess.Compose(counter, *(c() for c in classes.values())))
    assert inprocess_restart._leave_out_gpu_restart_checks(release, wrapper) == list(GPU_RESTART_CHECKS)
    assert wrapper.restart_health_check.instances == (counter,)
    assert inprocess_restart._leave_out_gpu_restart_checks(release, wrapper) == []  # nothing left to take out
    alone = types.SimpleNamespace(restart_health_check=classes["ChainedGPUHealthCheck"]())
    assert inprocess_restart._leave_out_gpu_restart_checks(release, alone) == ["ChainedGPUHealthCheck"]
    assert alone.restart_health_check is None
    older = types.SimpleNamespace(health_check=counter)  # before 0.5: no restart checks of its own
    bare = types.SimpleNamespace(health_check=types.SimpleNamespace(), Compose=inprocess.Compose)
    assert inprocess_restart._leave_out_gpu_restart_checks(bare, older) == []
    assert vars(older) == {"health_check": counter}


def test_teardown_runs_each_step_once_and_finishes_after_an_interruption():
    calls = []

    class Interrupted(BaseException):
        pass

    def interrupted_the_first_time():
        calls.append("b")
        if calls.count("b") == 1:
            raise Interrupted

    teardown = Teardown(lambda: [lambda: calls.append("a"), interrupted_the_first_time, lambda: calls.append("c")])
    with pytest.raises(Interrupted):
        teardown()
    teardown()  # the wrapper's finalize step: the interrupted step again, then the rest
    teardown()
    assert calls == ["a", "b", "b", "c"]


def test_a_failing_teardown_step_is_logged_and_the_later_ones_still_run(caplog):
    calls = []

    def half_closed_writer():
        calls.append("close")
        raise OSError("Writer is closed")

    teardown = Teardown(lambda: [half_closed_writer, lambda: calls.append("rank monitor client shut down")])
    with caplog.at_level(logging.WARNING):
        teardown()
    teardown()  # nothing left: the failed step is not retried
    assert calls == ["close", "rank monitor client shut down"]
    assert "half_closed_writer failed (OSError: Writer is closed); going on" in caplog.text


def test_cleanups_go_on_after_a_failure():
    calls = []
    restart = RestartIteration(iteration=0)
    restart.cleanups += [lambda: calls.append("first"), lambda: 1 / 0]
    restart.run_cleanups()  # newest first; the ZeroDivisionError is logged, not raised
    assert calls == ["first"]


@pytest.mark.parametrize("plugin_name", ["FaultTolerancePlugin", "PreemptionPlugin"])
def test_nemo_run_plugins_take_a_task_with_inprocess_restart(plugin_name):
    run = pytest.importorskip("nemo_run")
    from megatron.bridge.recipes import run_plugins

    task = run.Script(path="examples/pretrain_tiny_gpt.py", entrypoint="python", args=["inprocess_restart.enabled=on"])
    getattr(run_plugins, plugin_name)().setup(task, run.LocalExecutor(ntasks_per_node=2))
    assert task.args[0] == "inprocess_restart.enabled=on" and len(task.args) > 1  # layered: the plugin adds its own


@pytest.mark.timeout(60)
def test_maybe_wrap_returns_the_function_and_the_coordination_store(ipr_env, monkeypatch):
    def train_fn(*args, **kwargs):
        return "trained"

    assert maybe_wrap_for_inprocess_restart(train_fn, InProcessRestartConfig(), GlobalState()) == (train_fn, None)
    assert maybe_wrap_for_inprocess_restart(train_fn, None, GlobalState()) == (train_fn, None)
    port = _free_port()
    monkeypatch.setenv("MASTER_PORT", str(port - 1))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    wrapped, store = maybe_wrap_for_inprocess_restart(train_fn, InProcessRestartConfig(enabled=True), GlobalState())
    assert wrapped is not train_fn and callable(wrapped)
    assert isinstance(store, torch.distributed.TCPStore) and store.port == port  # hosted by rank 0 on MASTER_PORT + 1
    restart = RestartIteration(iteration=2, store=store, store_timeout=datetime.timedelta(seconds=5))
    restart.process_group_store().set("k", "v")
    assert store.get("mbridge_pg_iteration2/k") == b"v"  # each iteration under its own prefix


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_a_rank_started_before_the_store_host_connects_once_it_listens(ipr_env, monkeypatch):
    # Ranks forked together after an in-job restart: rank 1 asks for the wrapper's store before rank 0 hosts it.
    port = _free_port()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    factory = build_wrapper(InProcessRestartConfig(enabled=True), lambda: None, lambda: None).store_factory
    assert issubclass(factory, inprocess.store.TCPStore)
    hosted = {}

    def host_later() -> None:
        time.sleep(0.5)
        hosted["store"] = torch.distributed.TCPStore(
            "127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=True
        )
        hosted["store"].set("from-host", "ready")

    thread = threading.Thread(target=host_later)
    thread.start()
    client = factory(port=port, timeout=datetime.timedelta(seconds=30))
    thread.join()
    assert client.get("from-host") == b"ready"


@pytest.mark.timeout(30)
def test_waiting_for_a_host_that_never_listens_ends_at_the_timeout():
    # The caller's own connect then fails with its own error, naming the address.
    start = time.monotonic()
    _wait_until_listening("127.0.0.1", _free_port(), timeout=0.3)
    assert time.monotonic() - start >= 0.3


class _ManagedQueue:
    """A results queue served by a ``multiprocessing`` manager, as megatron-core makes its own."""

    def __init__(self) -> None:
        self._manager = types.SimpleNamespace(shutdowns=0)
        self._manager.shutdown = lambda: setattr(self._manager, "shutdowns", self._manager.shutdowns + 1)


def test_an_abort_closes_the_async_queue_and_resets_both_results_queues(ipr_env, monkeypatch, tmp_path):
    # A writer of the aborted iteration reported into the queues: the next iteration's saves must not read that.
    from megatron.bridge.training.checkpoint import async_writer
    from megatron.bridge.utils import upstream

    keys = [key for key in async_writer._RESULTS_QUEUES if upstream.owner(key) is not None]
    assert len(keys) == 2  # megatron-core's writer's and nvidia-resiliency-ext's (the local tier writes through it)
    for key in keys:  # restored after the test
        monkeypatch.setattr(upstream.owner(key), "_results_queue", upstream.get(key))
    managed, stale = _ManagedQueue(), async_writer.FileResultsQueue(str(tmp_path))
    stale.put({"rank": 0, "iteration": 7})
    upstream.patch(keys[0], managed)
    upstream.patch(keys[1], stale)
    closed = []
    state = GlobalState()
    state.async_calls_queue = types.SimpleNamespace(close=lambda abort=False: closed.append(abort))

    wrapper = build_wrapper(InProcessRestartConfig(enabled=True), lambda: None, lambda: None, state)
    wrapper.abort(inprocess.State(rank=0, world_size=1).freeze())

    assert closed == [True] and state.async_calls_queue is None  # closed without finalizing, then forgotten
    assert managed._manager.shutdowns == 1
    assert [upstream.get(key) for key in keys] == [None, None]
    async_writer.install_results_queue()  # what the next iteration's checkpoint manager does
    fresh = [upstream.get(key) for key in keys]
    assert fresh[0] is fresh[1] and fresh[0] is not stale and fresh[0].empty()


def test_a_failing_async_queue_close_still_resets_everything(monkeypatch):
    from megatron.bridge.training.checkpoint import async_writer

    resets = []
    monkeypatch.setattr(async_writer, "reset_results_queues", lambda: resets.append(1))
    state = GlobalState()
    state.async_calls_queue = types.SimpleNamespace(close=lambda abort=False: 1 / 0)
    inprocess_restart.abort_async_saves(state)
    assert state.async_calls_queue is None and resets == [1]


@pytest.mark.parametrize(
    "slurm,expected",
    [
        ({}, "monitor_process_{rank}.log"),  # the wrapper fills in each rank
        ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "77"}, "monitor_77_host1_0_0.log"),
        ({"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "77"}, None),  # under Slurm only rank 0 logs
    ],
)
def test_monitor_process_log_files(ipr_env, monkeypatch, tmp_path, slurm, expected):
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(socket, "gethostname", lambda: "host1")
    logfile = inprocess_restart.monitor_process_logfile(str(tmp_path / "logs"))
    assert logfile == (None if expected is None else str(tmp_path / "logs" / expected))
    assert inprocess_restart.monitor_process_logfile(None) is None


def test_the_finalize_step_tears_the_iteration_down_and_resets_the_state(ipr_env, monkeypatch):
    built = {}

    def keep(*args):
        built["wrapper"] = build_wrapper(*args)
        return built["wrapper"]

    monkeypatch.setattr(inprocess_restart, "build_wrapper", keep)
    state, resets = GlobalState(), []
    monkeypatch.setattr(state, "reset_for_restart", lambda: resets.append(len(torn_down)))
    torn_down = []
    wrapped = inprocess_restart.inprocess_restart(lambda *a, **k: None, InProcessRestartConfig(enabled=True), state)
    assert callable(wrapped)
    call_wrapper = types.SimpleNamespace(iteration=1, ping=lambda: None)
    restart = inprocess_restart.begin_iteration(call_wrapper, None, InProcessRestartConfig(enabled=True))
    restart.cleanups.append(lambda: torn_down.append(restart.iteration))
    built["wrapper"].finalize(inprocess.State(rank=0, world_size=1).freeze())
    assert torn_down == [1] and resets == [1]  # the state forgets its handles after the teardown
    built["wrapper"].finalize(inprocess.State(rank=0, world_size=1).freeze())  # nothing running: nothing to tear down
    assert torn_down == [1] and resets == [1, 1]


def test_run_wrapped_names_the_wrapper_giving_up_and_a_reserves_end():
    from megatron.bridge.training.exit_codes import ExitCode, TrainingExit

    cfg = InProcessRestartConfig(enabled=True, max_iterations=2)

    def gave_up(*args, **kwargs):
        raise inprocess.exception.RestartAbort("iteration=3 max_iterations=3")

    with pytest.raises(TrainingExit) as err:
        inprocess_restart.run_wrapped(gave_up, cfg)
    assert err.value.exit_code == ExitCode.INPROCESS_RESTART_EXHAUSTED
    assert "inprocess_restart.max_iterations=2" in str(err.value)
    assert inprocess_restart.run_wrapped(lambda *a, **k: None, cfg) == ExitCode.FINISHED  # a reserve never activated
    assert inprocess_restart.run_wrapped(lambda *a, **k: ExitCode.EXIT_INTERVAL, cfg) == ExitCode.EXIT_INTERVAL
