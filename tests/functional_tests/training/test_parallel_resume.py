"""Exact resume of the CPU Llama on real data, per parallel layout, from the global and from the local tier.

For tensor parallel 2, pipeline parallel 2 and data parallel 2 with the distributed optimizer: an uninterrupted
8-iteration run is the reference (batches read in the training process); a second run (a data-loader worker per
rank, a global checkpoint every 4 iterations, a local one every 2) has rank 1 SIGKILLed at iteration 7, in the
middle of the corpus's first pass. A restart resumes from the local checkpoint of iteration 6; a restart from a
copy without the local files (a lost node's) resumes from the global one of iteration 4. Both must log the
reference's losses and end with its model, optimizer and RNG state bit for bit. (Loader workers are fresh
interpreters, ~5 CPU-s each on this machine: only the killed run has them; the sampler, not the worker count,
decides which samples a step reads.)
"""

import shutil
from pathlib import Path

import pytest
from tests.functional_tests.harness import assert_same_state, checkpoint_state, tail, torchrun

from megatron.bridge.data.offline_corpus import write_corpus
from megatron.bridge.data.preprocess import preprocess
from megatron.bridge.data.tokenization import build_tokenizer
from megatron.bridge.training.tokenizers.config import TokenizerConfig

RECIPE = ["-m", "megatron.bridge.recipes.run", "llama3_tiny_pretrain_config"]
LAYOUTS = {
    "tp2": ["model.tensor_model_parallel_size=2", "train.global_batch_size=4"],
    "pp2": ["model.pipeline_model_parallel_size=2"],
    "dp2-distributed-optimizer": [],  # the recipe's default: data parallel 2, distributed optimizer
}
LAYOUT_LINES = {
    "tp2": "tensor parallel 2, pipeline parallel 1, data parallel 1",
    "pp2": "tensor parallel 1, pipeline parallel 2, data parallel 1",
    "dp2-distributed-optimizer": "tensor parallel 1, pipeline parallel 1, data parallel 2",
}
STRIKE = 7


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A 300 kB corpus of standard library sources, byte-level tokenized: about 1,500 sequences of 64 tokens."""
    data = tmp_path_factory.mktemp("corpus")
    write_corpus(str(data / "corpus.jsonl"), max_bytes=300_000)
    prefix = str(data / "stdlib")
    preprocess(
        str(data / "corpus.jsonl"),
        prefix,
        build_tokenizer(TokenizerConfig(metadata_path={"library": "byte-level"})),
        append_eod=True,
    )
    return prefix


def _run(ckpt: Path, corpus: str, layout: list[str], *extra: str, workers: int = 0, env: dict | None = None):
    return torchrun(
        ckpt,
        f"dataset.blend=[[{corpus!r}],None]",
        "train.train_iters=8",
        "dataset.split=100,0,0",
        "checkpoint.save_interval=4",
        f"dataset.num_workers={workers}",
        f"checkpoint.non_persistent_local_ckpt_dir={ckpt.parent / (ckpt.name + '-local')}",
        "checkpoint.non_persistent_ckpt_type=local",
        f"logger.tensorboard_dir={ckpt.parent / (ckpt.name + '-tensorboard')}",  # not the recipe's ./nemo_experiments
        "checkpoint.non_persistent_save_interval=2",
        *layout,
        *extra,
        entry=RECIPE,
        env=env,
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_killed_run_resumes_bit_identically_from_either_tier(layout, corpus, tmp_path):
    overrides = LAYOUTS[layout]
    reference = _run(tmp_path / "ref", corpus, overrides)
    assert reference.exit_code == 0, tail(reference)
    ref_losses = reference.losses()
    assert sorted(ref_losses) == list(range(1, 9)), tail(reference)
    assert LAYOUT_LINES[layout] in reference.output

    killed = _run(tmp_path / "ckpt", corpus, overrides, workers=1, env={"MBRIDGE_FAULTS": f"kill@{STRIKE}:1"})
    assert killed.exit_code != 0, tail(killed)
    assert killed.losses() == {i: ref_losses[i] for i in range(1, STRIKE)}, tail(killed)
    shutil.copytree(tmp_path / "ckpt", tmp_path / "global-only")  # the same job with its node-local files lost

    from_local = _run(tmp_path / "ckpt", corpus, overrides)
    assert from_local.exit_code == 0, tail(from_local)
    assert "loaded verified local checkpoint at iteration 6" in from_local.output, tail(from_local)
    assert from_local.losses() == {i: ref_losses[i] for i in range(7, 9)}, tail(from_local)
    assert_same_state(
        checkpoint_state(tmp_path / "ckpt" / "iter_0000008"), checkpoint_state(tmp_path / "ref" / "iter_0000008")
    )

    from_global = _run(tmp_path / "global-only", corpus, overrides)
    assert from_global.exit_code == 0, tail(from_global)
    assert "successfully loaded verified checkpoint" in from_global.output and "at iteration 4" in from_global.output
    assert from_global.losses() == {i: ref_losses[i] for i in range(5, 9)}, tail(from_global)
    assert_same_state(
        checkpoint_state(tmp_path / "global-only" / "iter_0000008"), checkpoint_state(tmp_path / "ref" / "iter_0000008")
    )


def test_interleaved_pipeline_stages_train_and_resume_bit_identically(corpus, tmp_path):
    """Two pipeline stages of two virtual stages each: one model chunk per layer, each with its own data iterator."""
    vp = ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"]
    reference = _run(tmp_path / "ref", corpus, vp)
    assert reference.exit_code == 0, tail(reference)
    ref_losses = reference.losses()
    assert sorted(ref_losses) == list(range(1, 9)), tail(reference)
    first = _run(tmp_path / "ckpt", corpus, vp, "train.exit_interval=4")
    assert first.exit_code == 20, tail(first)
    second = _run(tmp_path / "ckpt", corpus, vp)
    assert second.exit_code == 0, tail(second)
    assert second.losses() == {i: ref_losses[i] for i in range(5, 9)}, tail(second)
    state = checkpoint_state(tmp_path / "ckpt" / "iter_0000008")
    # Every layer of the 4 chunks (2 stages x 2 virtual stages) is in the checkpoint under its global number.
    assert all(any(f"/shard_{layer}_4." in key for key in state) for layer in range(4))
    assert_same_state(state, checkpoint_state(tmp_path / "ref" / "iter_0000008"))
