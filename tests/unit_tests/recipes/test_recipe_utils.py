"""Recipe helpers: optimizer presets that validate into the schedule they describe, data paths to blends."""

import json

import pytest
from tests.unit_tests.configs import base_config

from megatron.bridge.data.loaders import get_blend_and_blend_per_split
from megatron.bridge.recipes.utils.dataset_utils import get_blend_fields_from_data_paths
from megatron.bridge.recipes.utils.optimizer_utils import (
    distributed_fused_adam_with_cosine_annealing,
    distributed_fused_adam_with_cosine_annealing_samples,
)


def test_the_iteration_preset_decays_over_the_run_with_a_tenth_of_the_peak_at_the_end():
    optimizer, scheduler = distributed_fused_adam_with_cosine_annealing(precision="fp32", lr_warmup_iters=10)
    assert (optimizer.lr, optimizer.min_lr, optimizer.bf16, optimizer.fp16) == (1e-4, 1e-5, False, False)
    assert optimizer.use_distributed_optimizer and optimizer.clip_grad == 1.0
    cfg = base_config()
    optimizer.params_dtype = cfg.optimizer.params_dtype
    cfg.optimizer, cfg.scheduler = optimizer, scheduler
    cfg.validate(world_size=1)
    assert cfg.scheduler.lr_decay_iters == cfg.train.train_iters == 100  # None: the run's length
    assert (cfg.scheduler.lr_warmup_steps, cfg.scheduler.lr_decay_steps) == (10 * 8, 100 * 8)
    bf16, _ = distributed_fused_adam_with_cosine_annealing(min_lr=0.0)
    assert bf16.bf16 and not bf16.fp16 and bf16.min_lr == 0.0


def test_the_sample_preset_counts_warmup_and_decay_in_samples():
    optimizer, scheduler = distributed_fused_adam_with_cosine_annealing_samples(
        precision="fp32", lr_warmup_samples=8, lr_decay_samples=24, max_lr=1e-3
    )
    cfg = base_config()
    optimizer.params_dtype = cfg.optimizer.params_dtype
    cfg.optimizer, cfg.scheduler = optimizer, scheduler
    cfg.train.train_iters, cfg.train.train_samples, cfg.train.global_batch_size = None, 32, 4
    cfg.validate(world_size=1)
    assert cfg.train.train_iters == 8
    assert (cfg.scheduler.lr_warmup_steps, cfg.scheduler.lr_decay_steps) == (8, 24)
    assert optimizer.min_lr == pytest.approx(1e-4)


def test_data_paths_become_a_blend_a_blend_per_split_or_mock_data(tmp_path):
    assert get_blend_fields_from_data_paths() == (None, None, "1,1,1")
    assert get_blend_fields_from_data_paths(data_paths=["a"], mock=True) == (None, None, "1,1,1")
    assert get_blend_fields_from_data_paths(data_paths=["30", "a", "70", "b"]) == (
        (["a", "b"], [30.0, 70.0]), None, "9999,8,2"
    )  # fmt: skip
    assert get_blend_fields_from_data_paths(train_data_path=["t"], valid_data_path=["v"], test_data_path=["s"]) == (
        None, [(["t"], None), (["v"], None), (["s"], None)], None
    )  # fmt: skip
    args = tmp_path / "blend.txt"
    args.write_text("1 a\n3 b\n")
    assert get_blend_and_blend_per_split(data_args_path=str(args)) == ((["a", "b"], [1.0, 3.0]), None)
    per_split = tmp_path / "splits.json"
    per_split.write_text(json.dumps({"train": "x y", "valid": ["v"], "test": ["s"]}))
    assert get_blend_and_blend_per_split(per_split_data_args_path=str(per_split))[1] == [
        (["x", "y"], None), (["v"], None), (["s"], None)
    ]  # fmt: skip
    per_split.write_text(json.dumps({"train": ["x"]}))
    with pytest.raises(ValueError, match="has no 'valid' entry"):
        get_blend_and_blend_per_split(per_split_data_args_path=str(per_split))
    with pytest.raises(ValueError, match="data_paths or data_args_path, not both"):
        get_blend_and_blend_per_split(data_paths=["a"], data_args_path=str(args))
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        get_blend_and_blend_per_split(data_args_path=str(tmp_path / "missing.txt"))
