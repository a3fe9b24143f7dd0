"""``dist.device``: its resolution for each kind of node, the CPU shims it brings, and bfloat16 against it.

CUDA is stood in for (``torch.cuda`` and the ``/dev/nvidia<N>`` files): this machine has no GPU; what is tested is our
decision for each answer CUDA can give.
"""

import logging
import types

import pytest
import torch
from tests.unit_tests.configs import base_config

from megatron.bridge.training import initialize
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.training.health import device as device_health
from megatron.bridge.training.utils.overrides import apply_overrides
from megatron.bridge.utils import cpu_shims

BF16 = ["model.params_dtype=bfloat16", "model.bf16=true", "optimizer.bf16=true", "optimizer.params_dtype=bfloat16"]


def _untouched(*args, **kwargs):
    raise AssertionError("CUDA must not be touched here")


@pytest.fixture
def node(monkeypatch):
    """A stand-in node: ``node(count, files)`` sets what CUDA counts and which ``/dev/nvidia<N>`` files exist.

    CUDA itself (init, device selection) fails the test unless a test says otherwise; ranks are not pinned to cores.
    """
    pinned = []
    monkeypatch.setattr(initialize, "bind_cpu_cores", lambda rank, per_node: pinned.append((rank, per_node)))
    monkeypatch.setattr(initialize, "_logged_device", None)
    monkeypatch.setattr(torch.cuda, "init", _untouched)
    monkeypatch.setattr(torch.cuda, "set_device", _untouched)

    def make(count: int, files: list[str]) -> list:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(device_health, "glob", types.SimpleNamespace(glob=lambda pattern: list(files)))
        return pinned

    return make


@pytest.fixture
def shims(monkeypatch):
    """The CPU shims, not applied yet, each recording its application instead of patching upstream code."""
    applied = []
    monkeypatch.setattr(cpu_shims, "_APPLIED", False)
    monkeypatch.setattr(cpu_shims, "_SHIMS", {"probe": lambda: applied.append("probe")})
    return applied


@pytest.mark.timeout(60)
def test_auto_on_a_node_without_a_gpu_is_the_cpu(node):
    pinned = node(0, [])
    assert initialize.select_device(1, "auto") == torch.device("cpu")
    assert pinned and pinned[0][0] == 1, "a CPU rank gets its share of the cores"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("count", "files", "evidence"),
    [(0, ["/dev/nvidia0"], "/dev/nvidia0 present"), (2, [], "torch.cuda.device_count() is 2")],
    ids=["driver-counts-none", "counted"],
)
def test_auto_with_a_visible_but_broken_gpu_exits_25_naming_it(node, monkeypatch, count, files, evidence):
    node(count, files)

    def broken_driver():
        raise RuntimeError("CUDA driver initialization failed, you might not have a CUDA gpu.")

    monkeypatch.setattr(torch.cuda, "init", broken_driver)
    with pytest.raises(TrainingExit) as stop:
        initialize.select_device(0, "auto")
    assert stop.value.exit_code == ExitCode.DEVICE_UNHEALTHY == 25
    reason = stop.value.reason
    assert "dist.device=auto: GPU cuda:0 is visible" in reason, reason
    assert evidence in reason, reason
    assert "RuntimeError: CUDA driver initialization failed" in reason, reason
    assert "repair the GPU driver" in reason and "set dist.device=cpu" in reason, reason
    assert "never falls back to CPU" in reason, reason


@pytest.mark.timeout(60)
def test_a_gpu_whose_first_kernel_fails_exits_25(node, monkeypatch):
    node(1, ["/dev/nvidia0"])
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)

    def failing_ones(*args, **kwargs):
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(torch, "ones", failing_ones)
    with pytest.raises(TrainingExit) as stop:
        initialize.select_device(0, "cuda")
    assert stop.value.exit_code == ExitCode.DEVICE_UNHEALTHY
    assert "dist.device=cuda: GPU cuda:0 is visible" in stop.value.reason
    assert "unspecified launch failure" in stop.value.reason


@pytest.mark.timeout(60)
def test_a_gpu_whose_context_does_not_synchronize_exits_25(node, monkeypatch):
    node(1, ["/dev/nvidia0"])
    monkeypatch.setattr(device_health, "_probe_cuda", lambda device: None)

    def hung_sync(timeout):
        def check(state):
            raise TimeoutError

        return check

    checks = types.SimpleNamespace(CudaHealthCheck=hung_sync)
    monkeypatch.setattr(device_health, "require", lambda name: checks)
    with pytest.raises(TrainingExit) as stop:
        initialize.select_device(0, "auto")
    assert stop.value.exit_code == ExitCode.DEVICE_UNHEALTHY
    assert "GPU cuda:0 is visible (torch.cuda.device_count() is 1) but unusable: TimeoutError: no sync within" in (
        stop.value.reason
    )
    assert "set dist.device=cpu" in stop.value.reason


@pytest.mark.timeout(60)
def test_a_local_rank_past_the_visible_gpus_exits_25(node, monkeypatch):
    node(1, ["/dev/nvidia0"])
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    with pytest.raises(TrainingExit) as stop:
        initialize.select_device(3, "auto")
    assert stop.value.exit_code == ExitCode.DEVICE_UNHEALTHY
    assert "dist.local_rank 3 needs GPU 3, but 1 are visible" in stop.value.reason


@pytest.mark.timeout(60)
def test_cuda_on_a_node_without_a_gpu_exits_25_naming_the_field_and_the_fix(node):
    node(0, [])
    with pytest.raises(TrainingExit) as stop:
        initialize.select_device(0, "cuda")
    assert stop.value.exit_code == ExitCode.DEVICE_UNHEALTHY
    reason = stop.value.reason
    assert reason.startswith("dist.device=cuda but this node has no GPU"), reason
    assert "run this job on GPU nodes" in reason and "set dist.device=cpu" in reason, reason


@pytest.mark.timeout(60)
def test_auto_on_a_working_gpu_is_cuda_with_nccl_and_no_shims(node, shims, monkeypatch):
    node(2, ["/dev/nvidia0", "/dev/nvidia1"])
    probed = []
    monkeypatch.setattr(device_health, "_probe_cuda", probed.append)
    monkeypatch.setattr(device_health, "_sync_cuda_context", lambda: probed.append("sync"))
    cfg = base_config()
    cfg.dist.local_rank = 1
    device, backend = initialize.prepare_device(cfg)
    assert device == torch.device("cuda", 1)
    assert probed == [device, "sync"], "allocation and context sync run before the device is used"
    assert backend == "nccl"
    assert shims == [] and not cpu_shims.training_on_cpu()


@pytest.mark.timeout(60)
def test_cpu_on_a_gpu_node_is_the_cpu_with_gloo_and_every_shim(node, shims):
    pinned = node(2, ["/dev/nvidia0", "/dev/nvidia1"])  # CUDA works here, but init/set_device would fail the test
    cfg = apply_overrides(base_config(), ["dist.device=cpu"])
    assert cfg.dist.distributed_backend == "nccl"
    device, backend = initialize.prepare_device(cfg)
    assert device == torch.device("cpu")
    assert pinned, "a CPU rank gets its share of the cores"
    assert shims == ["probe"], "the shims follow the chosen device, not CUDA's presence"
    assert backend == "gloo"
    # Everything that asked torch.cuda.is_available() now follows the chosen device.
    assert cpu_shims.training_on_cpu()
    assert cpu_shims.use_persistent_async_worker() is False
    assert cpu_shims.local_checkpoint_exchange_algo() == "gather_object"
    assert cpu_shims._TorchView().cuda.is_available() is False


@pytest.mark.timeout(60)
def test_the_resolved_device_is_logged_once(node, caplog):
    node(0, [])
    with caplog.at_level(logging.INFO, logger="megatron.bridge"):
        initialize.select_device(0, "auto")
        initialize.select_device(0, "auto")
    assert caplog.text.count("device: cpu (dist.device=auto)") == 1, caplog.text


@pytest.mark.timeout(60)
def test_bf16_with_cpu_is_a_config_error_naming_both_fields_and_the_fix():
    cfg = apply_overrides(base_config(), [*BF16, "dist.device=cpu"])
    with pytest.raises(ValueError) as err:
        cfg.validate(world_size=1)
    message = str(err.value)
    assert message.startswith("model.params_dtype: bfloat16 needs CUDA"), message
    assert "but dist.device=cpu" in message, message
    assert "Fix: to train on CPU set model.bf16=false and model.params_dtype=float32" in message, message


@pytest.mark.timeout(60)
def test_bf16_with_cuda_passes_validation_without_asking_cuda(monkeypatch):
    # Imported first: the data modules ask CUDA once at import (whether to turn megatron-core's jit fuser off).
    base_config().validate(world_size=1)
    monkeypatch.setattr(torch.cuda, "is_available", _untouched)
    monkeypatch.setattr(torch.cuda, "device_count", _untouched)
    apply_overrides(base_config(), [*BF16, "dist.device=cuda"]).validate(world_size=1)


@pytest.mark.timeout(60)
def test_bf16_with_auto_is_checked_once_the_device_is_resolved(node, shims):
    node(0, [])
    cfg = apply_overrides(base_config(), BF16)
    cfg.validate(world_size=1)  # auto: validation cannot know the device, and does not probe CUDA
    with pytest.raises(TrainingExit) as stop:
        initialize.prepare_device(cfg)
    assert stop.value.exit_code == ExitCode.CONFIG_ERROR
    assert stop.value.reason.startswith("model.params_dtype: bfloat16 needs CUDA"), stop.value.reason
    assert "but dist.device=auto resolved to cpu (no GPU on this node)" in stop.value.reason
    assert "Fix: " in stop.value.reason
    assert shims == [], "nothing is set up for a run that stops"


@pytest.mark.timeout(60)
def test_an_unknown_device_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"dist\.device expects one of 'auto', 'cuda', 'cpu', got 'gpu'"):
        apply_overrides(base_config(), ["dist.device=gpu"])
