"""A checkpoint directory in Megatron-Bridge's layout: its files, read back with Megatron-Bridge's readers."""

import dataclasses
import enum
import os
import signal

import torch
import yaml

from megatron.bridge.training.checkpoint import contents, layout, manifest
from megatron.bridge.training.state import TrainState
from megatron.bridge.training.utils.checkpoint_utils import (
    checkpoint_exists,
    get_checkpoint_name,
    get_checkpoint_run_config_filename,
    get_checkpoint_train_state_filename,
    read_run_config,
    read_train_state,
)
from megatron.bridge.training.utils.config_utils import to_plain, yaml_text


def _save(root: str, iteration: int, run_config=None, with_train_state: bool = True) -> None:
    """A save as the manager makes it: payload, per-checkpoint files, manifest, commit."""
    tmp = layout.tmp_dir(root, iteration, "a1")
    os.makedirs(tmp)
    with open(os.path.join(tmp, "__0_0.distcp"), "wb") as f:
        f.write(b"payload-%d" % iteration)
    if with_train_state:
        state = TrainState(step=iteration, consumed_train_samples=8 * iteration, floating_point_operations_so_far=7)
        layout.write_iteration_files(tmp, state.state_dict(), yaml_text(run_config) if run_config else None)
    manifest.write_manifest(tmp, iteration, manifest.hash_share(tmp, manifest.list_files(tmp), 0, 1))
    layout.commit(root, iteration, "a1")


def _latest(root) -> bytes:
    with open(get_checkpoint_train_state_filename(str(root), prefix="latest"), "rb") as f:
        return f.read()


def test_a_save_has_megatron_bridges_files_and_its_readers_read_them(tmp_path):
    root = str(tmp_path)
    _save(root, 3, run_config={"checkpoint": {"save_interval": 3}, "model": {"num_layers": 2}})
    ckpt = get_checkpoint_name(root, 3)
    assert ckpt == layout.iter_dir(root, 3)
    assert sorted(os.listdir(ckpt)) == ["__0_0.distcp", "manifest.json", "run_config.yaml", "train_state.pt"]
    assert manifest.verify_dir(ckpt) == []  # the manifest covers the new files too
    assert set(manifest.read_manifest(ckpt)) == {"__0_0.distcp", "run_config.yaml", "train_state.pt"}
    saved = torch.load(get_checkpoint_train_state_filename(ckpt), weights_only=True)
    assert saved["step"].dtype == torch.int64 and saved["floating_point_operations_so_far"].dtype == torch.float64
    assert read_train_state(get_checkpoint_train_state_filename(ckpt)).consumed_train_samples == 24
    assert read_run_config(get_checkpoint_run_config_filename(ckpt))["checkpoint"]["save_interval"] == 3
    latest = get_checkpoint_train_state_filename(root, prefix="latest")
    assert read_train_state(latest).step == 3
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert checkpoint_exists(root) and checkpoint_exists(ckpt)


def test_latest_train_state_follows_the_tracker(tmp_path):
    root = str(tmp_path)
    _save(root, 3)
    three = _latest(root)
    _save(root, 6)
    assert _latest(root) != three
    layout.write_tracker(root, 3)  # the re-run state machine moves the tracker back
    assert _latest(root) == three


def test_recovery_repairs_a_stale_latest_train_state(tmp_path):
    root = str(tmp_path)
    _save(root, 3)
    three = _latest(root)
    _save(root, 6)
    six = _latest(root)
    with open(get_checkpoint_train_state_filename(root, prefix="latest"), "wb") as f:
        f.write(three)  # a crash between the tracker and its copy
    (tmp_path / ".latest_train_state.pt.x1.tmp").write_bytes(b"torn")
    layout.recover(root)
    assert _latest(root) == six
    assert not (tmp_path / ".latest_train_state.pt.x1.tmp").exists()


def test_a_checkpoint_without_train_state_leaves_no_stale_copy(tmp_path):
    root = str(tmp_path)
    _save(root, 3)
    _save(root, 6, with_train_state=False)  # e.g. saved by an older release of this package
    assert not os.path.exists(get_checkpoint_train_state_filename(root, prefix="latest"))


class _Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class _Inner:
    dtype: torch.dtype = torch.bfloat16
    colour: _Colour = _Colour.RED


@dataclasses.dataclass
class _Outer:
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    init: object = torch.nn.init.normal_
    sizes: tuple = (1, 2)
    path: object = None
    signal: object = signal.SIGTERM


def test_run_config_is_plain_yaml_with_targets():
    plain = to_plain(_Outer())
    assert yaml.safe_load(yaml.safe_dump(plain)) == plain
    assert plain["_target_"].endswith("_Outer")
    assert plain["inner"]["dtype"] == {"_target_": "torch.bfloat16", "_call_": False}
    assert plain["inner"]["colour"] == "red"
    assert plain["init"] == {"_target_": "torch.nn.init.normal_", "_call_": False}
    assert plain["sizes"] == [1, 2] and plain["path"] is None
    assert plain["signal"] == 15 and type(plain["signal"]) is int


def test_own_checkpoints_are_told_from_foreign_ones():
    assert contents.written_here({contents.WRITER_KEY: 1})
    assert contents.written_here({"rng_bytes": 100, "checkpoint_version": 1})  # saved before the marker existed
    assert not contents.written_here({"checkpoint_version": 3.0, "iteration": 6, "opt_param_scheduler": {}})


def _checkpoint_with_common(path, common: dict, with_manifest: bool = False) -> str:
    os.makedirs(path)
    with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
        f.write(b"shard")
    torch.save(common, os.path.join(path, "common.pt"))
    if with_manifest:
        manifest.write_manifest(str(path), 6, manifest.hash_share(str(path), manifest.list_files(str(path)), 0, 1))
    return str(path)


def _read_common(monkeypatch):
    from megatron.core import dist_checkpointing

    def load_common_state_dict(ckpt_dir):
        return torch.load(os.path.join(ckpt_dir, "common.pt"), weights_only=False)

    monkeypatch.setattr(dist_checkpointing, "load_common_state_dict", load_common_state_dict)
    return contents.foreign_without_manifest


def test_only_a_foreign_checkpoint_without_manifest_loads_unverified(tmp_path, monkeypatch):
    foreign_without_manifest = _read_common(monkeypatch)
    theirs = _checkpoint_with_common(tmp_path / "theirs", {"checkpoint_version": 3.0, "iteration": 6})
    warning = foreign_without_manifest(theirs)
    assert "was not written by this package and has no manifest.json" in warning
    assert "2 files (__0_0.distcp, common.pt)" in warning and "unverified" in warning
    # Ours without its manifest is damaged, never foreign: verification runs and reports the missing manifest.
    ours = _checkpoint_with_common(tmp_path / "ours", {contents.WRITER_KEY: 1, "rng_bytes": 10})
    assert foreign_without_manifest(ours) is None
    assert manifest.verify_dir(ours) == [f"{ours}/manifest.json is missing"]
    older_ours = _checkpoint_with_common(tmp_path / "older", {"checkpoint_version": 1, "rng_bytes": 10})
    assert foreign_without_manifest(older_ours) is None
    # A manifest is verified wherever it comes from.
    with_manifest = _checkpoint_with_common(tmp_path / "manifested", {"iteration": 6}, with_manifest=True)
    assert foreign_without_manifest(with_manifest) is None
    # An unreadable common part is damage too.
    os.remove(os.path.join(theirs, "common.pt"))
    assert foreign_without_manifest(theirs) is None
