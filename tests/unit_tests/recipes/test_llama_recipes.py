"""The Llama recipes validate as they come, take Megatron-Bridge's keywords, and run by name."""

import pytest
import torch

from megatron.bridge.models.llama import Llama3ModelProvider8B, Llama3ModelProvider70B, LlamaTinyModelProvider
from megatron.bridge.recipes import run
from megatron.bridge.recipes.llama import (
    llama3_8b_pretrain_config,
    llama3_70b_pretrain_config,
    llama3_tiny_pretrain_config,
    llama32_1b_pretrain_config,
)
from megatron.bridge.training.utils.overrides import apply_overrides


@pytest.mark.parametrize(
    "recipe, world_size",
    [(llama3_8b_pretrain_config, 8), (llama3_70b_pretrain_config, 64), (llama32_1b_pretrain_config, 8)],
)
def test_published_recipes_validate_with_their_defaults(recipe, world_size, tmp_path):
    cfg = recipe(dir=str(tmp_path))
    cfg.validate(world_size=world_size)
    assert cfg.checkpoint.save == str(tmp_path / "default" / "checkpoints")
    assert cfg.optimizer.use_distributed_optimizer and cfg.ddp.use_distributed_optimizer
    assert cfg.tokenizer.tokenizer_type == "NullTokenizer"  # nothing is downloaded: ids only, mock data
    assert cfg.dataset.blend is None
    assert cfg.model.bf16 == torch.cuda.is_available()


def test_recipes_carry_the_published_model_and_megatron_bridge_parallelism(tmp_path):
    assert isinstance(llama3_8b_pretrain_config(dir=str(tmp_path)).model, Llama3ModelProvider8B)
    big = llama3_70b_pretrain_config(dir=str(tmp_path))
    assert isinstance(big.model, Llama3ModelProvider70B)
    assert (big.model.tensor_model_parallel_size, big.model.pipeline_model_parallel_size) == (4, 4)
    assert big.model.virtual_pipeline_model_parallel_size == 5


def test_keywords_set_parallelism_and_data_and_unknown_ones_are_refused(tmp_path):
    cfg = llama3_tiny_pretrain_config(
        dir=str(tmp_path),
        name="run",
        pipeline_model_parallel_size=2,
        data_paths=["0.7", "/data/a", "0.3", "/data/b"],
        train_iters=5,
    )
    assert isinstance(cfg.model, LlamaTinyModelProvider)
    assert cfg.model.pipeline_model_parallel_size == 2
    assert cfg.dataset.blend == (["/data/a", "/data/b"], [0.7, 0.3])
    assert cfg.train.train_iters == 5
    assert cfg.tokenizer.metadata_path == {"library": "byte-level"}
    with pytest.raises(TypeError, match="unknown recipe argument.*'tensor_parallelism'"):
        llama3_8b_pretrain_config(tensor_parallelism=2)


def test_the_tiny_recipe_validates_on_two_ranks_with_each_layout(tmp_path):
    for layout in (
        [],
        ["model.tensor_model_parallel_size=2"],
        ["model.pipeline_model_parallel_size=2"],
        ["optimizer.use_distributed_optimizer=false", "ddp.use_distributed_optimizer=false"],
    ):
        cfg = apply_overrides(llama3_tiny_pretrain_config(dir=str(tmp_path)), layout)
        cfg.validate(world_size=2)
        assert cfg.model.vocab_size == 512


def test_a_missing_dataset_prefix_is_named_before_anything_starts(tmp_path):
    cfg = llama3_tiny_pretrain_config(dir=str(tmp_path), data_paths=[str(tmp_path / "corpus")])
    with pytest.raises(ValueError, match=r"^dataset\.blend.*corpus\.(bin|idx)") as err:
        cfg.validate(world_size=2)
    assert "Fix:" in str(err.value)
    assert not (tmp_path / "default").exists()  # nothing written


def test_recipes_are_found_by_name_and_a_misspelt_one_names_the_close_ones():
    assert run.find_recipe("llama3_8b_pretrain_config") is llama3_8b_pretrain_config
    assert run.find_recipe("megatron.bridge.recipes.llama:llama32_1b_pretrain_config") is llama32_1b_pretrain_config
    with pytest.raises(ValueError, match="did you mean llama3_8b_pretrain_config"):
        run.find_recipe("llama3_8b_pretrain")
    with pytest.raises(SystemExit) as stop:
        run.main(["no_such_recipe_config"])
    assert stop.value.code == 2
