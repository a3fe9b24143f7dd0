"""GPTModelProvider as a ModelProviderMixin: the distributed build, its hooks, and the fusions the device lacks.

The build runs in this one process over gloo (every parallel size 1), as the training loop's does on CPU.
"""

import pytest
import torch

from megatron.bridge.models import GPTModelProvider
from megatron.bridge.models.model_provider import ModelProviderMixin

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_parallel():
    """megatron-core's model-parallel state for this one process (gloo), torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron.bridge.utils.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _tiny(**kwargs) -> GPTModelProvider:
    return GPTModelProvider(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, **kwargs)


def test_the_gpt_provider_is_a_model_provider_with_megatron_bridge_defaults():
    provider = _tiny()
    assert isinstance(provider, ModelProviderMixin)
    assert provider.cross_entropy_loss_fusion is True
    assert provider.scatter_embedding_sequence_parallel is True
    assert (provider.mtp_enabled, provider.logit_dtype) == (False, None)


def test_on_cpu_the_fused_cross_entropy_is_turned_off_in_the_built_copy_only():
    provider = _tiny()
    built = provider.for_device(CPU)
    assert built.cross_entropy_loss_fusion is False
    assert provider.cross_entropy_loss_fusion is True  # the config keeps what was asked for


@pytest.mark.parametrize("name", ["mtp_enabled", "restore_modelopt_state", "use_transformer_engine_full_layer_spec"])
def test_features_this_package_lacks_are_refused_by_field_name(name):
    with pytest.raises(ValueError, match=rf"^model\.{name}: .*Fix: leave it False"):
        _tiny(**{name: True}).finalize()


def test_a_logit_dtype_the_installed_megatron_core_does_not_take_is_refused_when_built(monkeypatch):
    from megatron.bridge.models import gpt_provider

    def old_gpt_model(config, transformer_layer_spec, vocab_size):  # no logit_dtype
        raise AssertionError("not reached")

    monkeypatch.setattr(gpt_provider, "MCoreGPTModel", old_gpt_model)
    with pytest.raises(RuntimeError, match="logit_dtype.*PR #6252"):
        _tiny(logit_dtype=torch.float32).provide(pre_process=True, post_process=True)


def test_provide_distributed_model_refuses_to_start_distributed_itself():
    """Before the fixture below starts model parallelism (tests run in file order)."""
    with pytest.raises(RuntimeError, match="torch.distributed and megatron-core model parallelism"):
        _tiny().provide_distributed_model(wrap_with_ddp=False)
    with pytest.raises(ValueError, match="ddp_config is required"):
        _tiny().provide_distributed_model()


def test_provide_distributed_model_builds_hooks_and_wraps_the_chunks(model_parallel):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    calls = []
    provider = _tiny().for_device(CPU)
    provider.register_pre_wrap_hook(lambda model: calls.append(("pre", type(model[0]).__name__)))
    provider.register_post_wrap_hook(lambda model: calls.append(("post", type(model[0]).__name__)))
    model = provider.provide_distributed_model(ddp_config=DistributedDataParallelConfig(), use_cpu_initialization=True)
    assert len(model) == 1 and isinstance(model[0], DistributedDataParallel)
    assert calls == [("pre", "GPTModel"), ("post", "DistributedDataParallel")]
    assert provider._pg_collection is not None
    assert all(p.device == CPU for p in model[0].parameters())
