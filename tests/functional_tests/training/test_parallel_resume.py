"""Exact resume of the CPU Llama on real data, per parallel layout, from the global and from the local tier.

For tensor parallel 2, pipeline parallel 2 with interleaved (virtual) stages and data parallel 2 with the
distributed optimizer: an uninterrupted 8-iteration run is the reference; a second run (a global checkpoint every
4 iterations, a local one every 2) has rank 1 SIGKILLed at iteration 7, in the middle of the corpus's first pass.
A restart resumes from the local checkpoint of iteration 6; a restart from a copy without the local files (a lost
node's) resumes from the global one of iteration 4. Both must log the reference's losses and end with its model,
optimizer and RNG state bit for bit. The data-parallel layout's killed run reads its batches through a loader
worker per rank (fresh interpreters, ~5 CPU-s each here: the other runs read in-process; the sampler, not the
worker count, decides which samples a step reads). Plain 1F1B pipeline stages resume from both tiers in the main
job's drill (``test_main_job.py``).
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
    # 2 stages x 2 virtual stages: one model chunk per layer, each reading its own copy of the data stream.
    "pp2-interleaved": ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"],
    "dp2-distributed-optimizer": [],  # the recipe's default: data parallel 2, distributed optimizer
}
LAYOUT_LINES = {
    "tp2": "tensor parallel 2, pipeline parallel 1, data parallel 1",
    "pp2-interleaved": "tensor parallel 1, pipeline parallel 2, data parallel 1",
    "dp2-distributed-optimizer": "tensor parallel 1, pipeline parallel 1, data parallel 2",
}
WORKERS = {"dp2-distributed-optimizer": 1}
"""Loader workers per rank in the killed run."""
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


def _run(ckpt: Path, corpus: str, layout: list[str], *extra: str, workers: int = 0, local: bool = True, env=None):
    tier = [
        f"checkpoint.non_persistent_local_ckpt_dir={ckpt.parent / (ckpt.name + '-local')}",
        "checkpoint.non_persistent_ckpt_type=local",
        "checkpoint.non_persistent_save_interval=2",
    ]
    return torchrun(
        ckpt,
        f"dataset.blend=[[{corpus!r}],None]",
        "train.train_iters=8",
        "dataset.split=100,0,0",
        "checkpoint.save_interval=4",
        f"dataset.num_workers={workers}",
        f"logger.tensorboard_dir={ckpt.parent / (ckpt.name + '-tensorboard')}",  # not the recipe's ./nemo_experiments
        *(tier if local else []),
        *layout,
        *extra,
        entry=RECIPE,
        env=env,
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_killed_run_resumes_bit_identically_from_either_tier(layout, corpus, tmp_path):
    overrides = LAYOUTS[layout]
    reference = _run(tmp_path / "ref", corpus, overrides, local=False)
    assert reference.exit_code == 0, tail(reference)
    ref_losses = reference.losses()
    assert sorted(ref_losses) == list(range(1, 9)), tail(reference)
    assert LAYOUT_LINES[layout] in reference.output

    workers = WORKERS.get(layout, 0)
    killed = _run(tmp_path / "ckpt", corpus, overrides, workers=workers, env={"MBRIDGE_FAULTS": f"kill@{STRIKE}:1"})
    assert killed.exit_code != 0, tail(killed)
    assert killed.losses() == {i: ref_losses[i] for i in range(1, STRIKE)}, tail(killed)
    shutil.copytree(tmp_path / "ckpt", tmp_path / "global-only")  # the same job with its node-local files lost

    from_local = _run(tmp_path / "ckpt", corpus, overrides)
    assert from_local.exit_code == 0, tail(from_local)
    assert "loaded verified local checkpoint at iteration 6" in from_local.output, tail(from_local)
    assert from_local.losses() == {i: ref_losses[i] for i in range(7, 9)}, tail(from_local)
    state = checkpoint_state(tmp_path / "ckpt" / "iter_0000008")
    if layout == "pp2-interleaved":  # every layer of the 4 chunks is saved under its global number
        assert all(any(f"/shard_{layer}_4." in key for key in state) for layer in range(4))
    assert_same_state(state, checkpoint_state(tmp_path / "ref" / "iter_0000008"))

    from_global = _run(tmp_path / "global-only", corpus, overrides, local=False)
    assert from_global.exit_code == 0, tail(from_global)
    assert "successfully loaded verified checkpoint" in from_global.output and "at iteration 4" in from_global.output
    assert from_global.losses() == {i: ref_losses[i] for i in range(5, 9)}, tail(from_global)
    assert_same_state(
        checkpoint_state(tmp_path / "global-only" / "iter_0000008"), checkpoint_state(tmp_path / "ref" / "iter_0000008")
    )
