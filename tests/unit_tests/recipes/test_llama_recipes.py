"""The Llama recipes: Megatron-Bridge's H100 names and short aliases, no arguments, valid as they come, run by name."""

import pytest
import torch

from megatron.bridge.models.llama import (
    Llama3ModelProvider8B,
    Llama3ModelProvider70B,
    Llama31ModelProvider70B,
    Llama32ModelProvider3B,
    LlamaTinyModelProvider,
)
from megatron.bridge.recipes import run
from megatron.bridge.recipes.llama import (
    h100,
    llama3_8b_pretrain_config,
    llama3_70b_pretrain_config,
    llama3_tiny_pretrain_config,
    llama31_8b_pretrain_config,
    llama31_70b_pretrain_config,
    llama32_1b_pretrain_config,
    llama32_3b_pretrain_config,
)
from megatron.bridge.training.utils.overrides import apply_overrides


@pytest.mark.parametrize(
    "recipe, world_size",
    [
        (llama3_8b_pretrain_config, 8),
        (llama3_70b_pretrain_config, 64),
        (llama31_8b_pretrain_config, 8),
        (llama31_70b_pretrain_config, 64),
        (llama32_1b_pretrain_config, 8),
        (llama32_3b_pretrain_config, 8),
    ],
)
def test_published_recipes_take_no_argument_and_validate_with_their_defaults(recipe, world_size, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = recipe()
    cfg.validate(world_size=world_size)
    assert cfg.checkpoint.save == str(tmp_path / "nemo_experiments" / "default" / "checkpoints")
    assert cfg.optimizer.use_distributed_optimizer and cfg.ddp.use_distributed_optimizer
    assert cfg.tokenizer.tokenizer_type == "NullTokenizer"  # nothing is downloaded: ids only, mock data
    assert (cfg.tokenizer.vocab_size, cfg.model.vocab_size) == (32000, 128256)  # Megatron-Bridge's NullTokenizer
    assert cfg.env_vars["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.adam_eps) == (3e-4, 3e-5, 1e-8)
    assert cfg.scheduler.start_weight_decay == cfg.scheduler.end_weight_decay == 0.033
    assert cfg.scheduler.lr_decay_iters == cfg.train.train_iters and cfg.scheduler.lr_warmup_iters == 2000
    assert cfg.dataset.blend is None
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (512, 1)
    assert (cfg.model.cross_entropy_loss_fusion, cfg.model.cross_entropy_fusion_impl) == (True, "te")
    assert cfg.model.bf16 == torch.cuda.is_available()


def test_the_short_names_are_aliases_of_the_h100_recipes():
    assert llama3_8b_pretrain_config is h100.llama3_8b_pretrain_2gpu_h100_bf16_config
    assert llama3_70b_pretrain_config is h100.llama3_70b_pretrain_32gpu_h100_bf16_config
    assert llama31_8b_pretrain_config is h100.llama31_8b_pretrain_2gpu_h100_bf16_config
    assert llama31_70b_pretrain_config is h100.llama31_70b_pretrain_32gpu_h100_bf16_config
    assert llama32_1b_pretrain_config is h100.llama32_1b_pretrain_1gpu_h100_bf16_config
    assert llama32_3b_pretrain_config is h100.llama32_3b_pretrain_1gpu_h100_bf16_config


def test_recipes_carry_our_provider_of_the_size_and_megatron_bridge_parallelism():
    assert isinstance(llama3_8b_pretrain_config().model, Llama3ModelProvider8B)
    assert isinstance(llama32_3b_pretrain_config().model, Llama32ModelProvider3B)
    for recipe, provider in (
        (llama3_70b_pretrain_config, Llama3ModelProvider70B),
        (llama31_70b_pretrain_config, Llama31ModelProvider70B),
    ):
        big = recipe().model
        assert isinstance(big, provider)
        assert (big.tensor_model_parallel_size, big.pipeline_model_parallel_size) == (4, 4)
        assert big.virtual_pipeline_model_parallel_size == 5 and big.sequence_parallel
        assert big.context_parallel_size == 1  # Megatron-Bridge: 2; not supported here
    assert llama31_70b_pretrain_config().model.seq_length == 131072


def test_the_tiny_recipe_is_the_cpu_llama_and_changes_by_its_fields():
    with pytest.raises(TypeError):
        llama3_tiny_pretrain_config(train_iters=5)  # no arguments: set fields or give overrides
    cfg = apply_overrides(
        llama3_tiny_pretrain_config(),
        ["model.pipeline_model_parallel_size=2", "dataset.blend=[['/data/a','/data/b'],[0.7,0.3]]"],
    )
    assert isinstance(cfg.model, LlamaTinyModelProvider)
    assert cfg.model.pipeline_model_parallel_size == 2
    assert cfg.dataset.blend == (["/data/a", "/data/b"], [0.7, 0.3])
    assert cfg.tokenizer.metadata_path == {"library": "byte-level"}
    assert (cfg.train.train_iters, cfg.dataset.num_workers, cfg.dataset.split) == (40, 0, "90,8,2")


def test_the_tiny_recipe_validates_on_two_ranks_with_each_layout(tmp_path):
    for layout in (
        [],
        ["model.tensor_model_parallel_size=2"],
        ["model.pipeline_model_parallel_size=2"],
        ["optimizer.use_distributed_optimizer=false", "ddp.use_distributed_optimizer=false"],
    ):
        cfg = apply_overrides(llama3_tiny_pretrain_config(), [f"checkpoint.save={tmp_path}"] + layout)
        cfg.validate(world_size=2)
        assert cfg.model.vocab_size == 512


def test_a_missing_dataset_prefix_is_named_before_anything_starts(tmp_path):
    cfg = llama3_tiny_pretrain_config()
    cfg.checkpoint.save = cfg.checkpoint.load = str(tmp_path / "default" / "checkpoints")
    cfg.dataset.blend = ([str(tmp_path / "corpus")], None)
    with pytest.raises(ValueError, match=r"^dataset\.blend.*corpus\.(bin|idx)") as err:
        cfg.validate(world_size=2)
    assert "Fix:" in str(err.value)
    assert not (tmp_path / "default").exists()  # nothing written


def test_recipes_are_found_by_name_and_a_misspelt_one_names_the_close_ones():
    assert run.find_recipe("llama3_8b_pretrain_config") is llama3_8b_pretrain_config
    assert run.find_recipe("llama3_8b_pretrain_2gpu_h100_bf16_config") is llama3_8b_pretrain_config
    assert run.find_recipe("megatron.bridge.recipes.llama:llama32_1b_pretrain_config") is llama32_1b_pretrain_config
    with pytest.raises(ValueError, match="did you mean llama3_8b_pretrain_config"):
        run.find_recipe("llama3_8b_pretrain")
    with pytest.raises(SystemExit) as stop:
        run.main(["no_such_recipe_config"])
    assert stop.value.code == 2
