"""A config written as YAML and read back: the same config, or an error naming what cannot be restored."""

import functools
import os
import signal

import pytest
import torch
from tests.unit_tests.configs import base_config

from megatron.bridge.recipes.llama.llama3 import llama3_8b_pretrain_config, llama3_tiny_pretrain_config
from megatron.bridge.training.config import ConfigContainer
from megatron.bridge.training.utils.config_utils import from_plain, resolve, to_plain

RECIPES = [(base_config, 1), (llama3_tiny_pretrain_config, 1), (llama3_8b_pretrain_config, 8)]


@pytest.mark.parametrize("make, world_size", RECIPES)
def test_a_config_round_trips_through_yaml_before_and_after_validation(make, world_size, tmp_path):
    cfg = make()
    cfg.env_vars = {"TORCHINDUCTOR_WORKER_START": "fork", "NCCL_NVLS_ENABLE": 0}
    cfg.train.exit_signal = signal.SIGUSR2
    cfg.to_yaml(str(tmp_path / "recipe.yaml"))
    back = ConfigContainer.from_yaml(str(tmp_path / "recipe.yaml"))
    assert back.to_dict() == cfg.to_dict() and back.env_vars == cfg.env_vars
    assert back.train.exit_signal is signal.SIGUSR2 and back.model.params_dtype is cfg.model.params_dtype
    assert type(back.model) is type(cfg.model) and type(back.dataset) is type(cfg.dataset)
    cfg.validate(world_size=world_size)
    back.validate(world_size=world_size)
    assert back.to_dict() == cfg.to_dict()
    cfg.to_yaml(str(tmp_path / "validated.yaml"))  # what validate() computed comes back as it was
    again = ConfigContainer.from_yaml(str(tmp_path / "validated.yaml"))
    assert again.to_dict() == cfg.to_dict()
    cfg.train.train_iters *= 2  # a decay length validate() derived still follows the run's length
    again.train.train_iters *= 2
    cfg.validate(world_size=world_size)
    again.validate(world_size=world_size)
    assert again.scheduler.lr_decay_iters == cfg.scheduler.lr_decay_iters == cfg.train.train_iters


def test_a_live_object_is_named_not_restored_as_its_text(tmp_path):
    cfg = base_config()
    cfg.model.init_method = functools.partial(torch.nn.init.normal_, std=0.02)
    cfg.to_yaml(str(tmp_path / "c.yaml"))
    assert "functools.partial" in (tmp_path / "c.yaml").read_text()
    with pytest.raises(ValueError, match=r"config\.model\.init_method holds 'functools.partial.*set config\.model"):
        ConfigContainer.from_yaml(str(tmp_path / "c.yaml"))


def test_print_yaml_and_bad_files(tmp_path, capsys):
    base_config().print_yaml()
    assert "_target_: megatron.bridge.training.config.TrainingConfig" in capsys.readouterr().out
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="list.yaml holds a list, not a config mapping"):
        ConfigContainer.from_yaml(str(tmp_path / "list.yaml"))
    with pytest.raises(ImportError, match="config: cannot import 'nowhere.Config'"):
        from_plain({"_target_": "nowhere.Config"})
    with pytest.raises(ValueError, match="is not a dataclass; only config classes are built"):
        from_plain({"_target_": "os.system"})
    assert resolve("torch.float32") is torch.float32
    assert from_plain({"_target_": "os.getcwd", "_call_": False}) is os.getcwd


def test_sections_kept_out_of_config_py_are_named_where_megatron_bridge_has_them():
    from megatron.bridge.training.config import CheckpointConfig, FaultToleranceConfig, HealthConfig

    for section in (CheckpointConfig(), FaultToleranceConfig(), HealthConfig()):
        target = to_plain(section)["_target_"]
        assert target == f"megatron.bridge.training.config.{type(section).__name__}", target
        assert type(from_plain(to_plain(section))) is type(section)
