"""Megatron-Bridge's config sections: misspelt, mistyped, refused and derived fields; the field reference."""

import dataclasses
import warnings
from pathlib import Path
from typing import Optional

import pytest
import torch
from tests.unit_tests.configs import base_config

from megatron.bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    FaultToleranceConfig,
    InProcessRestartConfig,
    MockGPTDatasetConfig,
    NVRxStragglerDetectionConfig,
    ProfilingConfig,
    SchedulerConfig,
    StragglerDetectionConfig,
    TokenizerConfig,
    TrainingConfig,
    is_enabled,
    runtime_config_update,
)
from megatron.bridge.training.config_checks import field_support
from megatron.bridge.training.config_checks.container import require_tokenizer
from megatron.bridge.training.optim import build_scheduler
from megatron.bridge.training.utils import config_reference
from megatron.bridge.training.utils.overrides import apply_overrides

REFERENCE = Path(__file__).resolve().parents[3] / "docs" / "training" / "config-reference.md"


@dataclasses.dataclass
class _FaultToleranceWithNewField(FaultToleranceConfig):
    """``FaultToleranceConfig`` with one field more, written as a contributor adds a field to a section."""

    drill_budget: int = 3
    """Faults a drill may inject before it stops. Later sentences stay off the page."""


# The container with that section in place of ``ft``: the same class otherwise.
_ContainerWithNewField = dataclasses.make_dataclass(
    "_ContainerWithNewField",
    [("ft", Optional[_FaultToleranceWithNewField], dataclasses.field(default=None))],
    bases=(ConfigContainer,),
    kw_only=True,
)


def _with_new_field(cfg: ConfigContainer) -> ConfigContainer:
    return _ContainerWithNewField(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init})


def _rejected(cfg, *fragments, world_size=2):
    with pytest.raises(ValueError) as err:
        cfg.validate(world_size=world_size)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    return str(err.value)


def test_a_misspelt_keyword_names_the_nearest_field():
    with pytest.raises(TypeError, match="TrainingConfig has no field 'trian_iters'; did you mean 'train_iters'"):
        TrainingConfig(trian_iters=5)
    with pytest.raises(TypeError, match="did you mean 'save_interval'"):
        CheckpointConfig(save_intervall=5)
    with pytest.raises(TypeError, match="has no field 'seq_lenght'; did you mean 'seq_length'"):
        MockGPTDatasetConfig(seq_lenght=32, random_seed=1)


def test_a_misspelt_attribute_and_a_mistyped_value_are_refused_by_name():
    cfg = base_config()
    cfg.train.trian_iters = 5
    _rejected(cfg, "train.trian_iters: is not a field of TrainingConfig", "did you mean train.train_iters?")
    cfg = base_config()
    cfg.train.train_iters = "10"
    _rejected(cfg, "train.train_iters: expects int or None, got '10' (str)")
    cfg = base_config()
    cfg.scheduler.lr_decay_style = "step"
    _rejected(cfg, "scheduler.lr_decay_style: expects one of 'constant', 'linear', 'cosine'")
    cfg = base_config()
    cfg.train = SchedulerConfig()
    _rejected(cfg, "train: expects TrainingConfig, got SchedulerConfig")


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("logger.wandb_project=demo", "logger.wandb_project: 'demo' is not supported here (Weights & Biases"),
        ("checkpoint.save_optim=False", "checkpoint.save_optim: False is not supported here"),
        ("dist.use_torch_fsdp2=True", "dist.use_torch_fsdp2: True is not supported here (FSDP"),
        ("profiling.use_pytorch_profiler=True", "profiling.use_pytorch_profiler"),
        ("train.train_sync_interval=5", "train.train_sync_interval"),
        ("rng.te_rng_tracker=True", "rng.te_rng_tracker"),
        ("mixed_precision=bf16_mixed", "mixed_precision: 'bf16_mixed' is not supported here"),
    ],
)
def test_a_field_that_cannot_be_honoured_is_refused_unless_at_its_default(override, fragment):
    message = _rejected(apply_overrides(base_config(), [override]), fragment)
    assert "Fix: leave it at its default" in message


def test_every_listed_field_exists_and_inert_fields_are_accepted():
    for dotted in [*field_support.REFUSED, *field_support.INERT]:
        section_name, _, name = dotted.rpartition(".")
        section = config_reference.section_class(section_name) if section_name else ConfigContainer
        declared = name in {f.name for f in dataclasses.fields(section)}
        assert declared or dotted in field_support.NEWER_UPSTREAM, dotted
    assert not set(field_support.REFUSED) & set(field_support.INERT)
    assert set(field_support.NEWER_UPSTREAM) <= set(field_support.REFUSED) | set(field_support.INERT)
    cfg = apply_overrides(base_config(), ["profiling.profile_step_start=3", "tokenizer.vocab_file=/nowhere"])
    cfg.validate(world_size=2)


def test_batch_size_and_length_are_derived_as_upstream_does():
    cfg = base_config()
    cfg.train = TrainingConfig(micro_batch_size=2, train_samples=100)
    cfg.validate(world_size=2)
    assert (cfg.train.global_batch_size, cfg.train.train_iters) == (4, 25)  # 2 per replica, 2 replicas
    cfg.validate(world_size=1)  # derived values follow a new world size; nothing is stuck from the first call
    assert (cfg.train.global_batch_size, cfg.train.train_iters) == (2, 50)
    cfg = base_config()
    cfg.train.train_samples = 64
    _rejected(cfg, "train.train_samples: Cannot specify more than one of train_iters, train_samples, or num_epochs")
    cfg = base_config()
    cfg.train = TrainingConfig(global_batch_size=8)
    _rejected(cfg, "train.micro_batch_size: train.micro_batch_size must be set")
    cfg = base_config()
    cfg.train = TrainingConfig(micro_batch_size=2)
    _rejected(cfg, "train.train_iters: One of train_iters, train_samples, or num_epochs must be provided")
    cfg = base_config()
    cfg.train.num_epochs = 1.0  # Megatron-Bridge honours it only for its finite SFT datasets
    cfg.train.train_iters = None
    _rejected(cfg, "train.num_epochs: 1.0 is not supported here (epoch-based training needs a finite SFT dataset")


def test_deprecated_train_evaluation_fields_move_to_validation_with_a_warning():
    cfg = base_config()
    cfg.train.eval_interval, cfg.train.eval_iters = 5, 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg.validate(world_size=2)
    assert (cfg.validation.eval_interval, cfg.validation.eval_iters) == (5, 3)
    assert any("train.eval_interval is deprecated: use validation.eval_interval" in str(w.message) for w in caught)


def test_scheduler_lengths_are_computed_in_samples_and_build_megatron_cores_schedule():
    cfg = base_config()  # 100 steps of 8 samples
    cfg.scheduler = SchedulerConfig(lr_decay_style="linear", lr_warmup_iters=10, lr_warmup_init=1e-4)
    cfg.validate(world_size=2)
    s = cfg.scheduler
    assert (s.lr_warmup_steps, s.lr_decay_steps, s.wd_incr_steps, s.wsd_decay_steps) == (80, 800, 800, None)
    optimizer = type("Opt", (), {"param_groups": [{"params": [torch.zeros(1)]}]})()
    scheduler = build_scheduler(cfg, optimizer)
    assert scheduler.get_lr(optimizer.param_groups[0]) == pytest.approx(1e-4)  # the warmup starts at its init
    scheduler.step(increment=80)
    assert scheduler.get_lr(optimizer.param_groups[0]) == pytest.approx(1e-3)  # peak after 10 steps of 8
    scheduler.step(increment=720)
    assert scheduler.get_lr(optimizer.param_groups[0]) == pytest.approx(1e-5)  # min_lr at the end

    cfg.scheduler = SchedulerConfig(lr_warmup_fraction=0.25)
    cfg.validate(world_size=2)
    assert cfg.scheduler.lr_warmup_steps == 200


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"lr_warmup_fraction": 0.1, "lr_warmup_iters": 2}, "scheduler.lr_warmup_fraction: Cannot specify"),
        ({"lr_decay_samples": 400, "lr_warmup_iters": 2}, "scheduler.lr_decay_samples: Cannot mix iteration-based"),
        ({"lr_decay_samples": 400}, "scheduler.lr_decay_samples: Use lr_decay_iters for iteration-based training"),
        ({"override_opt_param_scheduler": True, "use_checkpoint_opt_param_scheduler": True}, "both override and"),
        ({"start_weight_decay": 0.1, "end_weight_decay": 0.01}, "scheduler.end_weight_decay"),
        ({"max_steps": 50}, "scheduler.max_steps: scheduler.max_steps (50) must be greater than or equal to"),
        ({"max_steps": 200, "lr_decay_iters": 150}, "scheduler.lr_decay_iters: 150 differs from scheduler.max_steps"),
    ],
)
def test_inconsistent_schedules_are_refused(fields, fragment):
    cfg = base_config()
    cfg.scheduler = SchedulerConfig(**fields)
    _rejected(cfg, fragment)


def test_schedule_defaults_follow_megatron_bridge():
    cfg = base_config()  # 100 steps of 8 samples
    cfg.scheduler = SchedulerConfig(lr_decay_style="WSD")
    cfg.validate(world_size=2)  # a WSD anneal defaults to the whole decay
    assert (cfg.scheduler.lr_decay_iters, cfg.scheduler.lr_wsd_decay_iters, cfg.scheduler.wsd_decay_steps) == (
        100,
        100,
        800,
    )
    cfg.scheduler = SchedulerConfig(lr_warmup_iters=100)  # as long as the decay: one step less, with a warning
    with pytest.warns(UserWarning, match="capping lr_warmup_steps to 799"):
        cfg.validate(world_size=2)
    assert (cfg.scheduler.lr_warmup_steps, cfg.scheduler.lr_decay_steps) == (799, 800)
    cfg.scheduler = SchedulerConfig(max_steps=400)  # a short run on the schedule of a 400-step one
    cfg.validate(world_size=2)
    s = cfg.scheduler
    assert (s.lr_decay_iters, s.lr_decay_steps, s.wd_incr_steps) == (400, 3200, 3200)
    cfg.train.train_iters = 500  # a derived value follows the run on the next validate()
    s.max_steps = None
    cfg.validate(world_size=2)
    assert (s.lr_decay_iters, s.lr_decay_steps) == (500, 4000)


def test_the_tokenizer_sizes_the_model_and_what_cannot_be_built_offline_is_refused(tmp_path):
    cfg = base_config()
    cfg.model.vocab_size = None
    cfg.validate(world_size=2)
    assert cfg.model.vocab_size == 128
    cfg = base_config()
    cfg.tokenizer = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=200)
    _rejected(cfg, "tokenizer.vocab_size: the tokenizer's vocabulary (200 ids) is larger than model.vocab_size=128")
    cfg = base_config()
    cfg.tokenizer = TokenizerConfig(metadata_path={"library": "byte-level"})  # 512 ids
    _rejected(cfg, "model.vocab_size: the tokenizer's vocabulary (512 ids) is larger than model.vocab_size=128")
    cfg.model.vocab_size = None
    cfg.validate(world_size=2)
    assert cfg.model.vocab_size == 512
    cfg = base_config()
    missing = tmp_path / "no-such-tokenizer"
    cfg.tokenizer = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(missing))
    _rejected(cfg, "tokenizer.tokenizer_model:", str(missing))
    cfg = base_config()
    cfg.tokenizer = TokenizerConfig(tokenizer_type="GPT2BPETokenizer")
    _rejected(cfg, "tokenizer.tokenizer_type: 'GPT2BPETokenizer' is not available here")
    cfg = base_config()
    cfg.tokenizer = TokenizerConfig()  # validate() accepts it, as Megatron-Bridge's does; pretrain() refuses it first
    cfg.model.vocab_size = None
    cfg.validate(world_size=2)
    runtime_config_update(cfg)
    assert cfg.model.vocab_size is None
    with pytest.raises(ValueError, match="tokenizer.tokenizer_type: is not set"):
        require_tokenizer(cfg)


def test_the_dataset_is_megatron_cores_config_checked_against_the_model():
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as CoreConfig

    cfg = base_config()
    assert isinstance(cfg.dataset, CoreConfig) and cfg.dataset.seq_length == cfg.dataset.sequence_length == 32
    cfg.validate(world_size=2)
    assert cfg.dataset.mock and cfg.dataset.split == "1,1,1"
    cfg = apply_overrides(base_config(), ["dataset.sequence_length=64"])
    _rejected(cfg, "dataset.sequence_length: 64 differs from model.seq_length=32")
    cfg = apply_overrides(base_config(), ["dataset.eod_mask_loss=True"])
    _rejected(cfg, "dataset.eod_mask_loss: the mock stream has no document boundaries")
    cfg = apply_overrides(base_config(), ["dataset.reset_position_ids=None"])
    _rejected(cfg, "dataset.reset_position_ids: reset_position_ids is not set")
    cfg = apply_overrides(base_config(), ["dataset.dataloader_type=cyclic"])
    _rejected(cfg, "dataset.dataloader_type: 'cyclic' (shuffled epochs) serves Megatron-Bridge's fine-tuning")
    cfg = apply_overrides(base_config(), ["dataset.dataloader_type=batch"])
    _rejected(cfg, "dataset.dataloader_type: 'batch' shuffles whole epochs, and the mock stream is endless")
    cfg = apply_overrides(base_config(), ["dataset.dataloader_type=external"])
    _rejected(cfg, "dataset.dataloader_type: 'external' takes the datasets as ready-made loaders")
    cfg = apply_overrides(base_config(), ["dataset.data_sharding=False", "dataset.dataloader_type=single"])
    cfg.validate(world_size=2)  # as upstream: only the "cyclic" sampler reads data_sharding
    cfg = base_config()
    cfg.dataset.blend = (["/data/corpus_text_document"], None)
    _rejected(cfg, "dataset: megatron-core rejects the dataset config: MockGPTDatasetConfig reads no data")


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["checkpoint.ckpt_step=5"], "checkpoint.ckpt_step: ckpt_step=5 specified but checkpoint.load is None"),
        (["checkpoint.dist_ckpt_strictness=return_all"], "checkpoint.dist_ckpt_strictness: 'return_all' hands"),
        (
            ["checkpoint.save=/tmp/x", "checkpoint.async_save=True", "checkpoint.async_strategy=mcore"],
            "checkpoint.async_strategy: 'mcore' is not supported",
        ),
    ],
)
def test_checkpoint_fields_of_megatron_bridge_are_checked(overrides, fragment):
    _rejected(apply_overrides(base_config(), overrides), fragment)


def test_the_field_reference_page_is_current():
    documented, installed = config_reference.documented_release(REFERENCE), config_reference.megatron_core_release()
    if documented != installed:  # megatron-core's own fields and docstrings differ between its releases
        pytest.skip(f"the page documents megatron-core {documented}'s config classes; {installed} is installed")
    assert config_reference.generated_part(REFERENCE) == config_reference.render(), (
        "docs/training/config-reference.md is stale: run python -m megatron.bridge.training.utils.config_reference"
    )
    page = REFERENCE.read_text()
    for dotted in set(field_support.REFUSED) - set(field_support.NEWER_UPSTREAM):  # those: on a newer release's page
        section, _, name = dotted.rpartition(".")
        assert (f"| `{name}` |" in page) if section else (f"## `{name}`" in page), dotted


def test_a_field_only_newer_upstream_declares_is_refused_there_and_skipped_before():
    cfg = base_config()
    assert "dataset.inter_document_masking" not in [f for f, *_ in field_support.refused_fields(cfg)]
    base = type(cfg.dataset)
    if "inter_document_masking" not in {f.name for f in dataclasses.fields(base)}:  # megatron-core < 0.19
        base = dataclasses.make_dataclass("Newer", [("inter_document_masking", bool, False)], bases=(base,))
        cfg.dataset.__class__ = base  # the same section, as a release that declares the field would build it
    cfg.dataset.inter_document_masking = True
    (refused,) = [f for f in field_support.refused_fields(cfg) if f[0] == "dataset.inter_document_masking"]
    assert refused[1:3] == (True, False) and "cu_seqlens" in refused[3]


def test_a_field_added_to_a_section_needs_nothing_but_its_dataclass():
    """The override parser, the type check and the reference page read the new field from the class alone."""
    cfg = apply_overrides(_with_new_field(base_config()), ["ft.drill_budget=5"])
    assert type(cfg.ft) is _FaultToleranceWithNewField and cfg.ft.drill_budget == 5  # the None section created
    assert not is_enabled(cfg.ft)  # present, its switch at its default: off
    with pytest.raises(ValueError, match=r"override 'ft.drill_budget=many': ft.drill_budget expects an integer"):
        apply_overrides(cfg, ["ft.drill_budget=many"])
    with pytest.raises(ValueError, match=r"ft has no field 'drill_budgte'; did you mean ft.drill_budget\?"):
        apply_overrides(cfg, ["ft.drill_budgte=5"])
    cfg.validate(world_size=2)
    cfg.ft.drill_budget = "5"
    _rejected(cfg, "ft.drill_budget: expects int, got '5' (str)")

    page = config_reference.render(_ContainerWithNewField)
    row = "| `drill_budget` | int | `3` | honoured | Faults a drill may inject before it stops. |"
    assert row in page.splitlines()
    assert "drill_budget" not in config_reference.render()  # nothing global was changed to get there


@pytest.mark.parametrize(
    "section, on",
    [
        (None, False),
        (FaultToleranceConfig(), False),
        (FaultToleranceConfig(enable_ft_package=True), True),
        (NVRxStragglerDetectionConfig(), False),
        (NVRxStragglerDetectionConfig(enabled=True), True),
        (InProcessRestartConfig(enabled=True), True),
        (StragglerDetectionConfig(), False),
        (StragglerDetectionConfig(log_straggler=True), True),
        (ProfilingConfig(), True),  # no switch of its own: present is on
    ],
)
def test_off_is_a_none_section_or_one_whose_own_switch_is_false(section, on):
    assert is_enabled(section) is on


def test_validation_takes_none_sections_as_off_and_checks_present_ones_even_when_off():
    cfg = base_config()
    cfg.profiling = cfg.ft = cfg.straggler = cfg.nvrx_straggler = cfg.inprocess_restart = None
    cfg.validate(world_size=2)
    assert cfg.profiling is None and cfg.ft is None  # validation fills no section in
    cfg.ft, cfg.straggler = FaultToleranceConfig(), StragglerDetectionConfig()
    cfg.nvrx_straggler, cfg.inprocess_restart = NVRxStragglerDetectionConfig(), InProcessRestartConfig()
    cfg.validate(world_size=2)
    cfg.ft.simulated_fault_rank = 5  # off, but its fields are still the user's to get right
    _rejected(cfg, "ft.simulated_fault_rank: 5 is not a rank of a world of 2")


def test_a_section_mocked_with_its_spec_is_read_by_its_switch():
    from unittest.mock import MagicMock

    section = MagicMock(spec=InProcessRestartConfig)
    section.enabled = False
    assert not is_enabled(section)
    section.enabled = True
    assert is_enabled(section)
