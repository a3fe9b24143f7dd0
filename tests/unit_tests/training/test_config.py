"""Every ``ConfigContainer.validate()`` check, and the dotted override parser."""

import os
import re
import signal
import typing

import pytest
import torch
from tests.unit_tests.configs import base_config

from megatron.bridge.training.config import ConfigContainer
from megatron.bridge.training.utils.overrides import apply_overrides

# (overrides, world_size, the field the error must name)
LOCAL_TIER = [
    "checkpoint.save=/tmp/g",
    "checkpoint.load=/tmp/g",
    "checkpoint.non_persistent_ckpt_type=local",
    "checkpoint.non_persistent_local_ckpt_dir=/tmp/l",
    "checkpoint.non_persistent_save_interval=5",
]

INVALID = [
    (["model.tensor_model_parallel_size=0"], 2, "model.tensor_model_parallel_size"),
    (["model.pipeline_model_parallel_size=0"], 2, "model.pipeline_model_parallel_size"),
    (["model.pipeline_model_parallel_size=2"], 3, "model.tensor_model_parallel_size"),
    (["model.pipeline_model_parallel_size=2", "model.num_layers=3"], 2, "model.num_layers"),
    (
        ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"],
        2,
        "model.num_layers",
    ),
    (["model.virtual_pipeline_model_parallel_size=2"], 1, "model.virtual_pipeline_model_parallel_size"),
    (["model.pipeline_model_parallel_size=2", "model.variable_seq_lengths=true"], 2, "model.variable_seq_lengths"),
    (["model.num_query_groups=3"], 1, "model.num_query_groups"),
    (["model.context_parallel_size=2"], 2, "model.context_parallel_size"),
    (
        ["model.num_query_groups=1", "model.tensor_model_parallel_size=2", "train.global_batch_size=4"],
        2,
        "model.num_query_groups",
    ),
    (["model.tensor_model_parallel_size=2"], 3, "model.tensor_model_parallel_size"),
    (["model.num_layers=0"], 1, "model.num_layers"),
    (["model.hidden_size=0"], 1, "model.hidden_size"),
    (["model.num_attention_heads=0"], 1, "model.num_attention_heads"),
    (["model.vocab_size=0"], 1, "model.vocab_size"),
    (["model.seq_length=0"], 1, "model.seq_length"),
    (["model.num_attention_heads=3"], 1, "model.num_attention_heads"),
    (
        ["model.num_attention_heads=2", "model.tensor_model_parallel_size=4", "train.global_batch_size=2"],
        4,
        "model.num_attention_heads",
    ),
    (
        [
            "model.vocab_size=127",
            "tokenizer.vocab_size=127",
            "model.tensor_model_parallel_size=2",
            "train.global_batch_size=2",
        ],
        2,
        "model.vocab_size",
    ),
    (
        ["model.ffn_hidden_size=255", "model.tensor_model_parallel_size=2", "train.global_batch_size=2"],
        2,
        "model.ffn_hidden_size",
    ),
    (["model.hidden_dropout=1.0"], 1, "model.hidden_dropout"),
    (["model.attention_dropout=-0.1"], 1, "model.attention_dropout"),
    (["model.params_dtype=float16"], 1, "model.params_dtype"),
    (["train.train_iters=0"], 1, "train.train_iters"),
    (["train.global_batch_size=0"], 1, "train.global_batch_size"),
    (["model.ffn_hidden_size=0"], 1, "model.ffn_hidden_size"),
    (["scheduler.lr_decay_iters=0"], 1, "scheduler.lr_decay_iters"),
    (["checkpoint.exit_on_missing_checkpoint=true"], 1, "checkpoint.exit_on_missing_checkpoint"),
    (["checkpoint.non_persistent_save_interval=5"], 1, "checkpoint.non_persistent_save_interval"),
    (["checkpoint.non_persistent_local_ckpt_dir=/tmp/l"], 1, "checkpoint.non_persistent_local_ckpt_dir"),
    (["rng.seed=-1"], 1, "rng.seed"),
    (["logger.logging_level=15"], 1, "logger.logging_level"),
    (["train.micro_batch_size=0"], 1, "train.micro_batch_size"),
    (["train.global_batch_size=6"], 2, "train.global_batch_size"),
    (["train.exit_interval=0"], 1, "train.exit_interval"),
    (["train.exit_duration_in_mins=0"], 1, "train.exit_duration_in_mins"),
    (["train.exit_signal=SIGKILL"], 1, "train.exit_signal"),
    (["train.exit_signal_handler_for_dataloader=true"], 1, "train.exit_signal_handler_for_dataloader"),
    (["optimizer.lr=0"], 1, "optimizer.lr"),
    (["optimizer.min_lr=1.0"], 1, "optimizer.min_lr"),
    (["optimizer.adam_beta1=1.0"], 1, "optimizer.adam_beta1"),
    (["optimizer.adam_beta2=-0.5"], 1, "optimizer.adam_beta2"),
    (["optimizer.clip_grad=-1"], 1, "optimizer.clip_grad"),
    (["optimizer.weight_decay=-1"], 1, "optimizer.weight_decay"),
    (["scheduler.lr_decay_style=step"], 1, "scheduler.lr_decay_style"),
    (["scheduler.max_steps=0"], 1, "scheduler.max_steps"),
    (["validation.eval_micro_batch_size=0"], 1, "validation.eval_micro_batch_size"),
    (["validation.eval_micro_batch_size=3"], 1, "validation.eval_global_batch_size"),
    (["checkpoint.ckpt_format=zarr"], 1, "checkpoint.ckpt_format"),
    (["checkpoint.save=/tmp/x", "checkpoint.save_interval=0"], 1, "checkpoint.save_interval"),
    (["checkpoint.save_interval=5"], 1, "checkpoint.save_interval"),
    (["checkpoint.async_save=true"], 1, "checkpoint.async_save"),
    (
        ["checkpoint.ckpt_format=torch", "checkpoint.async_save=true", "checkpoint.save=/tmp/x"],
        1,
        "checkpoint.ckpt_format",
    ),
    (["checkpoint.most_recent_k=0"], 1, "checkpoint.most_recent_k"),
    (["checkpoint.save=/etc/hostname"], 1, "checkpoint.save"),
    (["checkpoint.load=/etc/hostname"], 1, "checkpoint.load"),
    (["validation.eval_interval=0"], 1, "validation.eval_interval"),
    (["validation.eval_iters=0", "validation.eval_interval=5"], 1, "validation.eval_iters"),
    (["optimizer.optimizer=lamb"], 1, "optimizer.optimizer"),
    (["optimizer.bf16=True"], 1, "optimizer.bf16"),
    (["dist.distributed_timeout_minutes=0"], 1, "dist.distributed_timeout_minutes"),
    (["logger.log_interval=0"], 1, "logger.log_interval"),
    (["dataset.num_workers=-1"], 1, "dataset.num_workers"),
    (["ft.enable_ft_package=true"], 1, "ft.enable_ft_package"),  # not under ft_launcher
    (["ft.simulate_fault=true"], 1, "ft.simulate_fault"),
    (["ft.simulated_fault_type=rank_slow"], 1, "ft.simulated_fault_type"),
    (["ft.simulated_fault_rank=2"], 2, "ft.simulated_fault_rank"),
    (["ft.simulated_fault_base_delay=-1"], 1, "ft.simulated_fault_base_delay"),
    (["straggler.log_straggler=true"], 1, "straggler.log_straggler"),
    (["straggler.log_straggler=true", "nvrx_straggler.enabled=true"], 1, "straggler.log_straggler"),
    (
        ["nvrx_straggler.enabled=true", "nvrx_straggler.calc_relative_gpu_perf=false"]
        + ["nvrx_straggler.calc_individual_gpu_perf=false"],
        1,
        "nvrx_straggler.calc_relative_gpu_perf",
    ),
    (
        ["nvrx_straggler.enabled=true", "nvrx_straggler.gpu_relative_perf_threshold=0"],
        1,
        "nvrx_straggler.gpu_relative_perf_threshold",
    ),
    (
        ["nvrx_straggler.enabled=true", "nvrx_straggler.gpu_relative_perf_threshold=1.5"],
        1,
        "nvrx_straggler.gpu_relative_perf_threshold",
    ),
    (
        ["nvrx_straggler.enabled=true", "nvrx_straggler.gpu_individual_perf_threshold=-0.1"],
        1,
        "nvrx_straggler.gpu_individual_perf_threshold",
    ),
    (
        ["nvrx_straggler.enabled=true", "nvrx_straggler.report_time_interval=0"],
        1,
        "nvrx_straggler.report_time_interval",
    ),
    (["nvrx_straggler.enabled=true", "nvrx_straggler.profiling_interval=0"], 1, "nvrx_straggler.profiling_interval"),
    (
        ["nvrx_straggler.enabled=true", "nvrx_straggler.stop_after_consecutive_reports=0"],
        1,
        "nvrx_straggler.stop_after_consecutive_reports",
    ),
    (
        ["nvrx_straggler.enabled=true", "nvrx_straggler.num_gpu_perf_scores_to_print=-1"],
        1,
        "nvrx_straggler.num_gpu_perf_scores_to_print",
    ),
    (["rerun_state_machine.rerun_mode=validate_results"], 1, "rerun_state_machine.rerun_mode"),
    (
        ["rerun_state_machine.rerun_mode=validate_results", "checkpoint.save=/a", "checkpoint.load=/b"],
        1,
        "rerun_state_machine.rerun_mode",
    ),
    (["rerun_state_machine.rerun_mode=paranoid"], 1, "rerun_state_machine.rerun_mode"),
    (["rerun_state_machine.spiky_loss_factor=1.0"], 1, "rerun_state_machine.spiky_loss_factor"),
    (["rerun_state_machine.max_rerun_restarts=0"], 1, "rerun_state_machine.max_rerun_restarts"),
    (["rerun_state_machine.max_consecutive_nan_skips=-1"], 1, "rerun_state_machine.max_consecutive_nan_skips"),
    (
        ["rerun_state_machine.max_consecutive_nan_skips=3", "rerun_state_machine.check_for_nan_in_loss=false"],
        1,
        "rerun_state_machine.max_consecutive_nan_skips",
    ),
    (
        ["rerun_state_machine.max_consecutive_nan_skips=3", "rerun_state_machine.rerun_mode=report_determinism_stats"],
        1,
        "rerun_state_machine.max_consecutive_nan_skips",
    ),
    (["rerun_state_machine.on_rerun_limit=retry"], 1, "rerun_state_machine.on_rerun_limit"),
    (["rerun_state_machine.error_injection_type=cosmic_ray"], 1, "rerun_state_machine.error_injection_type"),
    (["train.exit_signal_deadline=0"], 1, "train.exit_signal_deadline"),
    (["checkpoint.non_persistent_ckpt_type=local"], 1, "checkpoint.non_persistent_local_ckpt_dir"),
    (["checkpoint.non_persistent_ckpt_type=global"], 1, "checkpoint.non_persistent_ckpt_type"),
    (["checkpoint.replication=true"], 1, "checkpoint.replication"),
    (["checkpoint.replication_factor=4"], 1, "checkpoint.replication_factor"),
    (
        LOCAL_TIER[:4],
        1,
        "checkpoint.non_persistent_save_interval",
    ),
    (
        [*LOCAL_TIER] + ["checkpoint.non_persistent_save_interval=0"],
        1,
        "checkpoint.non_persistent_save_interval",
    ),
    (
        [*LOCAL_TIER] + ["checkpoint.non_persistent_local_ckpt_algo=fast"],
        1,
        "checkpoint.non_persistent_local_ckpt_algo",
    ),
    (
        [x for x in LOCAL_TIER if not x.startswith("checkpoint.load")],
        1,
        "checkpoint.non_persistent_ckpt_type",
    ),  # no checkpoint.load: never loaded
    (
        [*LOCAL_TIER] + ["checkpoint.non_persistent_local_ckpt_dir=/etc/hostname"],
        1,
        "checkpoint.non_persistent_local_ckpt_dir",
    ),
    (
        [*LOCAL_TIER]
        + ["checkpoint.replication=true", "checkpoint.replication_jump=1", "checkpoint.replication_factor=3"],
        4,
        "checkpoint.replication_factor",
    ),
    (
        [*LOCAL_TIER] + ["checkpoint.replication=true", "checkpoint.replication_jump=0"],
        4,
        "checkpoint.replication_jump",
    ),
    (
        [*LOCAL_TIER]
        + ["checkpoint.replication=true", "checkpoint.replication_jump=1", "checkpoint.replication_factor=1"],
        4,
        "checkpoint.replication_factor",
    ),
    (["health.liveness_ping_interval=-1"], 2, "health.liveness_ping_interval"),
    (["health.liveness_ping_interval=5", "health.liveness_ping_timeout=0"], 2, "health.liveness_ping_timeout"),
    (["health.liveness_ping_interval=5", "health.liveness_ping_timeout=600"], 2, "health.liveness_ping_timeout"),
    (["health.stack_dump_after=-1"], 2, "health.stack_dump_after"),
]


def test_defaults_validate():
    base_config().validate(world_size=1)
    base_config().validate(world_size=2)


@pytest.mark.parametrize("overrides,world_size,field_name", INVALID, ids=[" ".join(c[0]) for c in INVALID])
def test_invalid_config_names_the_field(overrides, world_size, field_name):
    with pytest.raises(ValueError) as err:  # by the override parser (a value of the wrong type), else by validate()
        apply_overrides(base_config(), overrides).validate(world_size=world_size)
    message = str(err.value)
    if message.startswith("override "):
        assert f": {field_name} expects " in message, message
    else:
        assert message.startswith(field_name + ":"), message
        assert "Fix:" in message


def test_nccl_runs_on_gloo_without_cuda(caplog):
    from megatron.bridge.utils.cpu_shims import process_group_backend

    cfg = base_config()
    assert cfg.dist.distributed_backend == "nccl"  # Megatron-Bridge's default
    cfg.validate(world_size=1)
    if torch.cuda.is_available():
        pytest.skip("CUDA present: nccl is used as asked")
    with caplog.at_level("INFO"):
        assert process_group_backend("nccl") == "gloo"
    assert "needs CUDA; using gloo" in caplog.text
    assert process_group_backend("gloo") == "gloo"


def test_megatron_bridge_names_and_the_deprecated_one():
    from megatron.core.distributed import DistributedDataParallelConfig as CoreDDP
    from megatron.core.optimizer import OptimizerConfig as CoreOptimizer

    from megatron.bridge.training.config import (
        DistributedDataParallelConfig,
        OptimizerConfig,
        TrainConfig,
        TrainingConfig,
    )

    assert OptimizerConfig is CoreOptimizer and DistributedDataParallelConfig is CoreDDP
    with pytest.warns(DeprecationWarning, match="use TrainingConfig"):
        old = TrainConfig(train_iters=3)
    assert isinstance(old, TrainingConfig) and old.train_iters == 3
    with pytest.raises(TypeError, match="model"):
        ConfigContainer(optimizer=CoreOptimizer(lr=1e-3))  # the model is required, as in Megatron-Bridge


def test_straggler_detection_accepts_its_documented_settings():
    overrides = ["nvrx_straggler.enabled=true", "nvrx_straggler.gpu_relative_perf_threshold=1.0"]
    overrides += ["nvrx_straggler.calc_relative_gpu_perf=false", "checkpoint.save=/tmp/x"]
    cfg = apply_overrides(base_config(), overrides + ["nvrx_straggler.stop_if_detected=true"])
    cfg.validate(world_size=2)


def test_stop_on_straggler_without_checkpoints_warns(caplog):
    cfg = apply_overrides(
        base_config(),
        ["nvrx_straggler.enabled=true", "nvrx_straggler.stop_if_detected=true"],
    )
    with caplog.at_level("WARNING"):
        cfg.validate(world_size=2)
    assert "checkpoint.save is not set" in caplog.text


def test_ft_valid_under_ft_launcher(monkeypatch):
    monkeypatch.setenv("FT_RANK_MONITOR_IPC_SOCKET", "/tmp/rmon.sock")
    cfg = apply_overrides(base_config(), ["ft.enable_ft_package=true", "ft.simulate_fault=true"])
    cfg.validate(world_size=2)


def test_ft_outside_ft_launcher_says_what_to_do(monkeypatch):
    monkeypatch.delenv("FT_RANK_MONITOR_IPC_SOCKET", raising=False)
    cfg = apply_overrides(base_config(), ["ft.enable_ft_package=true"])
    with pytest.raises(ValueError, match="launch with ft_launcher"):
        cfg.validate(world_size=2)


def test_exit_signal_that_is_no_signal():
    cfg = base_config()
    cfg.train.exit_signal = 999  # set in Python; a dotted override is already rejected by the parser
    with pytest.raises(ValueError, match=r"^train\.exit_signal: expects Signals, got 999 \(int\)"):
        cfg.validate(world_size=1)


def test_bf16_rejected_on_cpu():
    # Validation reads dist.device, never CUDA: the same verdict on any machine (auto: checked at initialization).
    cfg = apply_overrides(base_config(), ["model.params_dtype=bfloat16", "dist.device=cpu"])
    with pytest.raises(ValueError, match=r"^model\.params_dtype: bfloat16 needs CUDA .* but dist\.device=cpu"):
        cfg.validate(world_size=1)


def test_tensor_parallel_two_is_valid():
    cfg = apply_overrides(base_config(), ["model.tensor_model_parallel_size=2", "train.global_batch_size=4"])
    cfg.validate(world_size=2)


def test_pipeline_parallel_and_the_distributed_optimizer_are_valid():
    cfg = apply_overrides(
        base_config(),
        [
            "model.pipeline_model_parallel_size=2",
            "model.num_layers=4",
            "model.virtual_pipeline_model_parallel_size=2",
            "optimizer.use_distributed_optimizer=true",
            "ddp.use_distributed_optimizer=true",
        ],
    )
    cfg.validate(world_size=4)
    assert cfg.model.pipeline_dtype is None  # validate() finalizes a copy; the build sets it from params_dtype
    model = cfg.model.for_device(torch.device("cpu"))
    assert model.pipeline_dtype == torch.float32


def test_world_size_from_environment(monkeypatch):
    cfg = apply_overrides(base_config(), ["model.tensor_model_parallel_size=2"])
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="model.tensor_model_parallel_size"):
        cfg.validate()


def test_overrides_apply_types():
    cfg = apply_overrides(
        base_config(),
        [
            "train.train_iters=7",
            "train.exit_signal=SIGUSR1",
            "checkpoint.save=/tmp/c",
            "checkpoint.async_save=true",
            "model.ffn_hidden_size=null",
            "optimizer.lr=3e-4",
        ],
    )
    assert cfg.train.train_iters == 7
    assert cfg.train.exit_signal == signal.SIGUSR1
    assert cfg.checkpoint.save == "/tmp/c" and cfg.checkpoint.async_save is True
    assert cfg.model.ffn_hidden_size is None
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert isinstance(cfg, ConfigContainer)


@pytest.mark.parametrize(
    "item,needle",
    [
        ("train.train_iter=5", "train_iters"),  # typo: the message suggests the right name
        ("nosuch.field=1", "nosuch"),
        ("train.train_iters=abc", "train.train_iters=abc"),
        ("train.train_iters", "key=value"),
    ],
)
def test_bad_overrides_are_named(item, needle):
    with pytest.raises(ValueError) as err:
        apply_overrides(base_config(), [item])
    assert needle in str(err.value)
    assert item in str(err.value)


def test_overrides_do_not_mutate_input():
    base = base_config()
    apply_overrides(base, ["train.train_iters=3"])
    assert base.train.train_iters == 100


def test_local_tier_with_replication_across_nodes_is_valid(monkeypatch, caplog):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = apply_overrides(base_config(), [*LOCAL_TIER, "checkpoint.replication=true"])
    cfg.validate(world_size=4)  # two nodes of two ranks: jump 2 (ranks per node), factor 2
    assert "replica" not in caplog.text


def test_replication_jump_defaults_to_ranks_per_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cfg = apply_overrides(base_config(), [*LOCAL_TIER, "checkpoint.replication=true"])
    with pytest.raises(ValueError, match="not divisible by replication_jump \\* replication_factor = 4 \\* 2"):
        cfg.validate(world_size=4)  # one node of four ranks: its replicas would need a second node


def test_replication_without_ranks_per_node_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = apply_overrides(base_config(), [*LOCAL_TIER, "checkpoint.replication=true"])
    with pytest.raises(ValueError, match="^checkpoint.replication_jump: defaults to ranks per node"):
        cfg.validate(world_size=2)


def test_replicas_on_their_owners_node_warn(monkeypatch, caplog):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = apply_overrides(
        base_config(),
        [*LOCAL_TIER, "checkpoint.replication=true", "checkpoint.replication_jump=1"],
    )
    cfg.validate(world_size=2)
    assert "kept on their owner's node" in caplog.text
    assert "single node" in caplog.text


def test_local_interval_not_shorter_than_global_warns(caplog):
    cfg = apply_overrides(base_config(), [*LOCAL_TIER, "checkpoint.save_interval=5"])
    cfg.validate(world_size=1)
    assert "a global save replaces the local one" in caplog.text


def test_inprocess_restart_layers_with_ft_preemption_and_liveness_ping(monkeypatch):
    for name, value in {
        "TORCH_CPP_LOG_LEVEL": "error", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "LOCAL_WORLD_SIZE": "2",
        "FT_RANK_MONITOR_IPC_SOCKET": "/tmp/ft.socket",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    layered = [
        "inprocess_restart.enabled=true", "ft.enable_ft_package=true", "train.exit_signal_handler=true",
        "health.liveness_ping_interval=5", "health.liveness_ping_timeout=30",
    ]  # fmt: skip
    apply_overrides(base_config(), layered).validate(world_size=2)  # one run configuration, every layer on


def test_liveness_ping_settings_validate():
    cfg = apply_overrides(
        base_config(),
        ["health.liveness_ping_interval=5", "health.liveness_ping_timeout=10"],
    )
    cfg.validate(world_size=2)
    assert cfg.health.liveness_ping_interval == 5 and cfg.health.liveness_ping_timeout == 10.0


def test_overrides_in_megatron_bridge_forms():
    import dataclasses

    cfg = base_config()
    cfg.ft = None  # an optional section that is off
    cfg = apply_overrides(
        cfg,
        [
            "+ft.enable_ft_package=True",  # the section is created with its defaults
            "checkpoint.most_recent_k=-1",
            "logger.tensorboard_dir=123",  # text field: digits stay text
            "ft.simulated_fault_rank=None",
            "checkpoint.async_save=yes",
        ],
    )
    assert cfg.ft.enable_ft_package is True and cfg.ft.calc_ft_timeouts is False
    assert cfg.logger.tensorboard_dir == "123" and cfg.checkpoint.async_save is True
    cleared = apply_overrides(cfg, ["~checkpoint.save", "~ft.simulated_fault_rank"])
    assert cleared.checkpoint.save is None
    with pytest.raises(ValueError, match=r"'~train.exit_signal_handler'.*cannot be None"):
        apply_overrides(cfg, ["~train.exit_signal_handler"])

    @dataclasses.dataclass
    class Typed:
        mode: typing.Literal["a", "b"] = "a"
        dtype: torch.dtype = torch.float32
        ranks: list[int] = dataclasses.field(default_factory=list)
        fn: typing.Callable = print

    typed = apply_overrides(Typed(), ["mode=b", "dtype=bf16", "ranks=[0, 3]"])
    assert (typed.mode, typed.dtype, typed.ranks) == ("b", torch.bfloat16, [0, 3])
    for item, needle in [
        ("mode=c", "mode expects one of 'a', 'b', got 'c'"),
        ("dtype=int3", "dtype expects a dtype"),
        ("ranks=3", "ranks expects a list literal"),
        ("fn=len", "cannot be given on the command line: set it in Python"),
        ("mod=a", "did you mean mode?"),
    ]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            apply_overrides(Typed(), [item])


@pytest.mark.parametrize(
    "item,needle",
    [
        ("checkpoint.sav=/x", "checkpoint has no field 'sav'; did you mean checkpoint.save?"),
        ("checkpoint.most_recent_k=2.5", "checkpoint.most_recent_k expects an integer, got '2.5'"),
        ("checkpoint.async_save=maybe", "checkpoint.async_save expects True or False"),
        ("checkpoint.save.dir=/x", "checkpoint.save is a value, not a section"),
        ("trian.train_iters=3", "did you mean train?"),
        ("dist.distributed_backend=mpi", "dist.distributed_backend expects one of 'nccl', 'gloo', got 'mpi'"),
    ],
)
def test_bad_overrides_name_the_field_and_the_fix(item, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        apply_overrides(base_config(), [item])


def test_distributed_optimizer_flags_are_turned_on_in_both_with_a_warning():
    for overrides in (["optimizer.use_distributed_optimizer=True"], ["ddp.use_distributed_optimizer=True"]):
        cfg = apply_overrides(base_config(), overrides)
        with pytest.warns(UserWarning, match="Distributed optimizer settings were not in sync"):
            cfg.validate(world_size=1)
        assert cfg.optimizer.use_distributed_optimizer and cfg.ddp.use_distributed_optimizer
    cfg = apply_overrides(base_config(), ["ddp.overlap_param_gather=True", "ddp.use_distributed_optimizer=True"])
    with pytest.warns(UserWarning, match="overlap_param_gather settings were not in sync"):
        cfg.validate(world_size=1)
    assert cfg.optimizer.overlap_param_gather and cfg.data_parallel_size == 1


def test_deterministic_mode_needs_a_fixed_nccl_algorithm_and_turns_torch_deterministic(monkeypatch):
    cfg = apply_overrides(base_config(), ["model.deterministic_mode=True", "model.cross_entropy_loss_fusion=False"])
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    with pytest.raises(ValueError, match="model.deterministic_mode: NCCL_ALGO must be one of"):
        cfg.validate(world_size=1)
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    calls = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", calls.append)
    cfg.validate(world_size=1)
    assert calls == [True]
    cfg.model.cross_entropy_loss_fusion = True
    with pytest.raises(AssertionError, match="model.cross_entropy_loss_fusion: Cross Entropy Fusion"):
        cfg.validate(world_size=1)  # a ConfigError is also an AssertionError, as Megatron-Bridge's checks are


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["checkpoint.save_retain_interval=0"], "checkpoint.save_retain_interval: must be >= 1 or None"),
        (["checkpoint.save_retain_interval=150"], "150 is not a multiple of save_interval 100"),
        (["checkpoint.most_recent_k=2"], "cannot be combined with most_recent_k=2"),
    ],
)
def test_save_retain_interval_is_a_positive_multiple_of_the_save_interval_without_most_recent_k(
    tmp_path, overrides, needle
):
    base = [f"checkpoint.save={tmp_path}", "checkpoint.save_interval=100"]
    with pytest.raises(ValueError, match=re.escape(needle)):
        apply_overrides(base_config(), [*base, "checkpoint.save_retain_interval=1000", *overrides]).validate(
            world_size=1
        )
    cfg = apply_overrides(base_config(), [*base, "checkpoint.save_retain_interval=1000"])
    cfg.validate(world_size=1)
    assert cfg.checkpoint.save_retain_interval == 1000


def test_sections_finalize_alone_and_twice():
    from megatron.bridge.training.config import CheckpointConfig, ProfilingConfig, SchedulerConfig, TrainingConfig

    t = TrainingConfig(micro_batch_size=1, global_batch_size=4, train_samples=40)
    t.finalize()
    t.finalize()
    assert t.train_iters == 10
    with pytest.raises(ValueError, match="Cannot specify lr_warmup_fraction=0.1 with lr_warmup_iters=5"):
        SchedulerConfig(lr_warmup_fraction=0.1, lr_warmup_iters=5).finalize()
    with pytest.raises(ValueError, match="profile_step_end \\(1\\) must be >= profile_step_start \\(5\\)"):
        ProfilingConfig(profile_step_start=5, profile_step_end=1).finalize()
    with pytest.raises(ValueError, match="ckpt_step=3 specified but checkpoint.load is None"):
        CheckpointConfig(ckpt_step=3).finalize()


def test_lazy_init_is_megatron_bridges_other_name_of_lazy_mpu_init():
    from megatron.bridge.training.config import DistributedInitConfig

    dist_cfg = DistributedInitConfig(lazy_mpu_init=True)
    assert dist_cfg.lazy_init
    dist_cfg.lazy_init = False
    assert not dist_cfg.lazy_mpu_init
    cfg = apply_overrides(base_config(), ["dist.lazy_mpu_init=True"])
    with pytest.raises(ValueError, match="dist.lazy_mpu_init: True is not supported here"):
        cfg.validate(world_size=1)


def test_runtime_config_update_sets_env_vars_the_process_lacks(monkeypatch):
    from megatron.bridge.training.config import apply_environment_variables, runtime_config_update

    cfg = base_config()
    cfg.env_vars = {"MBRIDGE_TEST_A": 16, "MBRIDGE_TEST_B": "recipe"}
    monkeypatch.delenv("MBRIDGE_TEST_A", raising=False)
    monkeypatch.setenv("MBRIDGE_TEST_B", "launcher")
    runtime_config_update(cfg)
    assert (os.environ["MBRIDGE_TEST_A"], os.environ["MBRIDGE_TEST_B"]) == ("16", "launcher")
    cfg.env_vars = {"MBRIDGE_TEST_C": ["not", "scalar"]}
    with pytest.raises(TypeError, match="env_vars.MBRIDGE_TEST_C"):
        apply_environment_variables(cfg)


def _data_iterators(cfg, dp_rank=0, dp_size=1, consumed=0):
    """The run's data iterators as training set-up builds them, on rank ``dp_rank`` of ``dp_size`` (patched in)."""
    from unittest import mock

    from megatron.bridge.data.loaders import build_train_valid_test_data_iterators
    from megatron.bridge.data.tokenization import build_tokenizer
    from megatron.bridge.data.utils import bind_provider_context, get_dataset_provider
    from megatron.bridge.training.state import TrainState

    provider = bind_provider_context(
        get_dataset_provider(cfg.dataset), tokenizer=build_tokenizer(cfg.tokenizer), pg_collection=None
    )
    with mock.patch("torch.distributed.get_rank", return_value=dp_rank):
        with mock.patch("torch.distributed.get_world_size", return_value=dp_size):
            state = TrainState(consumed_train_samples=consumed)
            return build_train_valid_test_data_iterators(cfg, state, provider, dp_group=None)


def test_a_dataset_provider_builds_the_splits_the_loader_reads(tmp_path):
    import dataclasses

    from megatron.bridge.training.config import DatasetBuildContext, DatasetProvider

    seen = []

    @dataclasses.dataclass(kw_only=True)
    class Provider(DatasetProvider):
        length: int = 8

        def build_datasets(self, context: DatasetBuildContext):
            seen.append(context)

            def sample(i: int) -> dict:
                ids = torch.full((self.length,), i, dtype=torch.long)
                return {"tokens": ids, "labels": ids, "loss_mask": torch.ones(self.length), "position_ids": ids}

            return [sample(i) for i in range(context.train_samples)], None, None

    cfg = base_config()
    cfg.dataset = Provider(num_workers=0)
    cfg.validate(world_size=1)  # a provider is checked for its loader fields only
    train, valid, test = _data_iterators(cfg)
    assert valid is None and test is None and seen[0].train_samples == 100 * 8
    assert seen[0].tokenizer.vocab_size == 128
    assert next(train)["tokens"][:, 0].tolist() == [0, 1]
    cfg.dataset.dataloader_type = "batch"  # one global batch loaded at once, cut into the loop's micro-batches
    train = _data_iterators(cfg)[0]
    firsts = [next(train)["tokens"][:, 0].tolist() for _ in range(4)]
    assert all(len(rows) == 2 for rows in firsts)
    assert len({i for rows in firsts for i in rows}) == 8  # the 8 samples of one global batch, each once
    uninterrupted = [next(train)["tokens"][:, 0].tolist() for _ in range(8)]  # global batches 2 and 3
    resumed = _data_iterators(cfg, consumed=8)[0]  # a run resumed after its first step (8 samples)
    assert [next(resumed)["tokens"][:, 0].tolist() for _ in range(8)] == uninterrupted


def test_evaluation_batch_sizes_default_to_training_and_reach_the_validation_loader():
    cfg = base_config()
    cfg.validate(world_size=2)
    assert (cfg.validation.eval_global_batch_size, cfg.validation.eval_micro_batch_size) == (8, 2)
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 16, 4  # defaults follow the training values
    cfg.validate(world_size=2)
    assert (cfg.validation.eval_global_batch_size, cfg.validation.eval_micro_batch_size) == (16, 4)
    cfg.validation.eval_global_batch_size, cfg.validation.eval_micro_batch_size = 4, 1
    cfg.validation.eval_interval, cfg.validation.eval_iters = 50, 1
    cfg.validate(world_size=2)
    assert (cfg.validation.eval_global_batch_size, cfg.validation.eval_micro_batch_size) == (4, 1)
    train, valid, test = _data_iterators(cfg, dp_rank=1, dp_size=2)
    assert next(train)["tokens"].shape[0] == 4 and next(valid)["tokens"].shape[0] == 1
    assert next(test)["tokens"].shape[0] == 1


def test_data_parallel_size_counts_the_active_ranks_only(monkeypatch):
    for name, value in {
        "TORCH_CPP_LOG_LEVEL": "error", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "LOCAL_WORLD_SIZE": "2",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    cfg = apply_overrides(base_config(), ["train.global_batch_size=4"])
    cfg.validate(world_size=2)
    assert cfg.data_parallel_size == 2
    restart = ["inprocess_restart.enabled=true", "inprocess_restart.granularity=rank"]
    cfg = apply_overrides(base_config(), [*restart, "inprocess_restart.active_world_size=1"])
    cfg.validate(world_size=2)  # one warm reserve: one replica trains
    assert cfg.data_parallel_size == 1
