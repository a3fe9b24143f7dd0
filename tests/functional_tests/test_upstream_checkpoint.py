"""Checkpoints move both ways between Megatron-Bridge and this package.

A checkpoint written the way Megatron-Bridge writes it (megatron-core's ``dist_checkpointing``, its file names and
content, no manifest: ``upstream_writer.py``) resumes here bit-identically to an uninterrupted run, with a warning
naming what could not be verified; the checkpoints this package then writes into the same directory have
Megatron-Bridge's layout, which its readers (``checkpoint_utils``) read.
"""

import os

import pytest
import torch
from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.harness import REPO, assert_same_state, checkpoint_state, tail, torchrun

from megatron.bridge.training.checkpoint.verify_cli import main as verify_main
from megatron.bridge.training.config import ConfigContainer
from megatron.bridge.training.utils.checkpoint_utils import (
    checkpoint_exists,
    get_checkpoint_name,
    get_checkpoint_run_config_filename,
    get_checkpoint_train_state_filename,
    read_run_config,
    read_train_state,
)

WRITER = REPO / "tests" / "functional_tests" / "upstream_writer.py"


@pytest.mark.timeout(300)
def test_megatron_bridge_checkpoint_resumes_bit_identically(reference_tp1, tmp_path):
    reference, reference_ckpt = reference_tp1
    upstream = tmp_path / "upstream"
    writer = torchrun(
        tmp_path / "scratch", "train.exit_interval=6", entry=[str(WRITER), "--dir", str(upstream), "--at", "6"]
    )
    assert writer.exit_code == 20, tail(writer)
    written = upstream / "iter_0000006"
    assert {"run_config.yaml", "train_state.pt", "metadata.json", ".metadata"} <= {p.name for p in written.iterdir()}
    assert not (written / "manifest.json").exists()
    assert (upstream / "latest_checkpointed_iteration.txt").read_text() == "6"
    common = {key for key in checkpoint_state(written) if key.startswith("common.")}
    assert not common & {"common.megatron_bridge_resiliency", "common.rng_bytes"}, common  # nothing of ours
    assert verify_main([str(upstream)]) == 3  # written elsewhere: unverifiable, not damaged

    resumed = torchrun(upstream)
    assert resumed.exit_code == 0, tail(resumed)
    assert resumed.loaded() == [6]
    assert_doc_log_lines(resumed.output)  # the warning naming what could not be verified, and the load
    assert resumed.losses() == {i: reference.losses()[i] for i in range(7, 13)}, tail(resumed)
    assert_same_state(checkpoint_state(upstream / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))

    # What this package wrote there is in Megatron-Bridge's layout, with the manifest on top.
    ours = get_checkpoint_name(str(upstream), 12)
    assert {"run_config.yaml", "train_state.pt", "manifest.json"} <= set(os.listdir(ours))
    assert checkpoint_exists(str(upstream))
    latest = read_train_state(get_checkpoint_train_state_filename(str(upstream), prefix="latest"))
    assert latest.step == 12 and latest.consumed_train_samples == 12 * 8
    assert read_train_state(get_checkpoint_train_state_filename(ours)).step == 12
    run_config = read_run_config(get_checkpoint_run_config_filename(ours))
    assert run_config["checkpoint"]["save_interval"] == 3 and run_config["train"]["train_iters"] == 12
    assert ConfigContainer.from_yaml(get_checkpoint_run_config_filename(ours)).to_dict() == run_config
    assert verify_main([ours]) == 0
    os.remove(os.path.join(ours, "manifest.json"))  # ours without its manifest is damaged, never "foreign"
    assert verify_main([ours]) == 1
    saved = torch.load(get_checkpoint_train_state_filename(ours), weights_only=True)
    assert all(isinstance(value, torch.Tensor) for value in saved.values())
