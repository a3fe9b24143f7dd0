"""The CPU shims patch only the upstream modules they name, only without CUDA, and only once."""

import pytest
import torch

from megatron.bridge.utils import cpu_shims, upstream


@pytest.mark.skipif(torch.cuda.is_available(), reason="shims are for machines without CUDA")
def test_shims_answer_cuda_queries_on_cpu():
    cpu_shims.apply_cpu_shims()
    cpu_shims.apply_cpu_shims()  # idempotent
    import megatron.core.utils as mcore_utils

    assert mcore_utils.torch.cuda.current_device() == torch.device("cpu")
    assert mcore_utils.torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.cuda.current_device.__module__ == "torch.cuda"  # the global torch is untouched
    stream = mcore_utils.torch.cuda.current_stream()  # megatron-core 0.19's gradient buffers wait on it
    stream.wait_stream(stream)
    assert stream == torch.cpu.current_stream()
    state = upstream.get("megatron.core.tensor_parallel.random:_get_cuda_rng_state")()
    a = torch.rand(3)
    upstream.get("megatron.core.tensor_parallel.random:_set_cuda_rng_state")(state)
    assert torch.equal(a, torch.rand(3)), "the tracked state is the CPU generator's"


def test_nothing_is_patched_when_cuda_is_present(monkeypatch):
    monkeypatch.setattr(cpu_shims, "_APPLIED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    called = []
    monkeypatch.setattr(cpu_shims, "_SHIMS", {"probe": lambda: called.append(1)})
    cpu_shims.apply_cpu_shims()
    assert called == []
    assert cpu_shims.use_persistent_async_worker() is True


def test_jit_fuser_shim_keeps_torch_compile_out_of_megatron_core_imports():
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from megatron.bridge.utils import cpu_shims\n"
        "cpu_shims._shim_jit_fuser()\n"
        "import megatron.core, megatron.core.jit as jit\n"
        "import megatron.core.fusions.fused_bias_gelu as fused\n"
        "assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser\n"
        "assert not hasattr(fused.bias_gelu, '_torchdynamo_orig_callable'), 'torch.compile wrapped a fused op'\n"
        # From 0.17 megatron-core imports torch._dynamo itself (its pipeline schedules import triton); before, only a
        # torch.compile at import would have.
        "from megatron.bridge.utils.upstream import installed_version\n"
        "from packaging.version import Version\n"
        "if Version(installed_version('megatron-core')) < Version('0.17'):\n"
        "    assert 'torch._dynamo' not in sys.modules, 'torch.compile ran at import'\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]


def test_cpu_tensors_pass_as_cuda_only_inside_the_patched_upstream_calls():
    cpu_shims.apply_cpu_shims()
    t = torch.zeros(2)
    with cpu_shims._cpu_tensors_pass_as_cuda():
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.type(torch.float64).dtype == torch.float64  # a conversion is untouched
        assert t.cuda() is t
    assert t.type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        t.cuda()  # no CUDA here: the real method is back
    keys = [s.key for s in upstream.SYMBOLS if s.key.endswith(("embeddings_and_output_layer", "main_param_groups"))]
    assert len(keys) == 2
    for key in keys:  # tied embeddings across pipeline stages; the distributed optimizer
        assert upstream.get(key)._cpu_shim, key


def test_gloo_sends_pipeline_activations_one_at_a_time():
    config = type("Config", (), {"batch_p2p_comm": True, "overlap_p2p_comm": True})()
    cpu_shims.gloo_pipeline_settings(config)
    assert (config.batch_p2p_comm, config.overlap_p2p_comm) == (False, False)
