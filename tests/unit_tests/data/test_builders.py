"""Datasets and iterators: megatron-core GPTDatasets from real files, exact resume, disjoint ranks, splits, mock."""

import functools
import gc
import os
import signal
import time
from multiprocessing import resource_tracker
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from tests import processes
from tests.unit_tests.data.helpers import texts, write_jsonl

from megatron.bridge.data import builders
from megatron.bridge.data.config import GPTDatasetConfig, MockGPTDatasetConfig
from megatron.bridge.data.loaders import build_train_valid_test_data_iterators
from megatron.bridge.data.mock import MockGPTDataset
from megatron.bridge.data.preprocess import preprocess
from megatron.bridge.data.tokenization import build_tokenizer
from megatron.bridge.data.utils import pretrain_train_valid_test_datasets_provider
from megatron.bridge.training.config import TokenizerConfig
from megatron.bridge.training.state import TrainState

SEQ = 32


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TokenizerConfig(metadata_path={"library": "byte-level"}))


@pytest.fixture(scope="module")
def data(tmp_path_factory, tokenizer):
    """Two byte-level datasets (~12k and ~3k tokens) in one directory."""
    root = tmp_path_factory.mktemp("data")
    prefixes = []
    for name, docs in (("a", texts(40)), ("b", [t.upper() for t in texts(10)])):
        source = write_jsonl(root / f"{name}.jsonl", [{"text": t} for t in docs])
        preprocess(source, str(root / name), tokenizer, append_eod=True, log=lambda _line: None)
        prefixes.append(str(root / name))
    return prefixes


def _config(blend, **fields) -> GPTDatasetConfig:
    defaults = {"seq_length": SEQ, "random_seed": 1234, "split": "80,20,0", "num_workers": 0}
    flags = {"reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False}
    cfg = GPTDatasetConfig(blend=blend, **{**defaults, **flags, **fields})
    cfg.finalize()
    return cfg


def _iterators(cfg, tokenizer, *, train_samples=200, valid_samples=8, micro_batch_size=4, dp_rank=0, dp_size=1,
               consumed_train_samples=0, consumed_valid_samples=0):  # fmt: skip
    """The loaders' iterators for dataset config ``cfg`` on data-parallel rank ``dp_rank`` of ``dp_size``."""
    gbs = micro_batch_size * dp_size
    run = SimpleNamespace(
        dataset=cfg,
        rng=SimpleNamespace(seed=0),
        train=SimpleNamespace(train_samples=train_samples, train_iters=train_samples // gbs, global_batch_size=gbs,
                              micro_batch_size=micro_batch_size, num_epochs=None, exit_signal=signal.SIGTERM,
                              exit_signal_handler_for_dataloader=False),
        validation=SimpleNamespace(eval_interval=10**9, eval_iters=valid_samples // gbs, skip_train=False,
                                   eval_global_batch_size=None, eval_micro_batch_size=None),
    )  # fmt: skip
    state = TrainState(consumed_train_samples=consumed_train_samples, consumed_valid_samples=consumed_valid_samples)
    provider = functools.partial(pretrain_train_valid_test_datasets_provider, tokenizer=tokenizer)
    with mock.patch("torch.distributed.get_rank", return_value=dp_rank):
        with mock.patch("torch.distributed.get_world_size", return_value=dp_size):
            return build_train_valid_test_data_iterators(run, state, provider, dp_group=None)


def _take(iterator, count: int) -> list[dict]:
    return [next(iterator) for _ in range(count)]


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def test_real_data_batches_have_the_keys_and_shapes_of_the_mock_stream(data, tokenizer):
    cfg = _config(([data[0]], None), create_attention_mask=False)
    train, valid, test = _iterators(cfg, tokenizer)
    batch = next(train)
    assert sorted(batch) == ["labels", "loss_mask", "position_ids", "tokens"]
    assert batch["tokens"].shape == batch["labels"].shape == batch["position_ids"].shape == (4, SEQ)
    assert batch["tokens"].dtype == batch["labels"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])  # next-token targets
    assert int(batch["tokens"].max()) < tokenizer.vocab_size
    mock_sample = MockGPTDataset(vocab_size=512, seq_length=SEQ, seed=0)[0]
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        k: ((4, *v.shape), v.dtype) for k, v in mock_sample.items()
    }
    assert sorted(next(valid)) == sorted(batch) and test is None
    with_mask = next(_iterators(_config(([data[0]], None)), tokenizer)[0])
    assert with_mask["attention_mask"].shape == (4, 1, SEQ, SEQ) and with_mask["attention_mask"].dtype == torch.bool


def test_resume_at_consumed_samples_gives_exactly_the_batches_of_an_uninterrupted_run(data, tokenizer):
    cfg = _config(([data[0]], None), reset_position_ids=True, eod_mask_loss=True)
    uninterrupted = _take(_iterators(cfg, tokenizer)[0], 6)
    resumed = _take(_iterators(cfg, tokenizer, consumed_train_samples=12)[0], 3)  # 3 batches of 4 consumed
    assert _same(resumed, uninterrupted[3:])
    assert not _same(uninterrupted[:1], uninterrupted[1:2])
    valid_from_8 = _take(_iterators(cfg, tokenizer, valid_samples=16, consumed_valid_samples=8)[1], 1)
    assert _same(valid_from_8, _take(_iterators(cfg, tokenizer, valid_samples=16)[1], 3)[2:])


def test_data_parallel_ranks_read_disjoint_slices_of_each_global_batch(data, tokenizer):
    cfg = _config(([data[0]], None))
    one_rank = _take(_iterators(cfg, tokenizer, micro_batch_size=4, consumed_train_samples=8)[0], 2)
    ranks = [_take(_iterators(cfg, tokenizer, micro_batch_size=2, dp_rank=r, dp_size=2, consumed_train_samples=8)[0], 2)
             for r in range(2)]  # fmt: skip
    for step in range(2):
        a, b = ranks[0][step]["tokens"], ranks[1][step]["tokens"]
        assert not any(torch.equal(x, y) for x in a for y in b)
        assert torch.equal(torch.cat([a, b]), one_rank[step]["tokens"])  # rank r takes the r-th slice


def test_train_and_validation_splits_come_from_disjoint_documents(data, tokenizer):
    cfg = _config(([data[0]], None))
    train, valid, test = builders.build_gpt_datasets(cfg, tokenizer, 200, 8, 0)
    assert test is None and len(train) >= 200 and len(valid) >= 8
    assert set(train.indices) | set(valid.indices) == set(range(40)) and not set(train.indices) & set(valid.indices)
    assert max(train.indices) < min(valid.indices)
    assert cfg.tokenizer is None and cfg.path_to_cache is None  # the caller's config is not changed
    cache = os.path.join(os.path.dirname(data[0]), "index-cache")
    assert any(name.endswith("-GPTDataset-train-shuffle_index.npy") for name in os.listdir(cache))
    assert builders.build_gpt_datasets(cfg, tokenizer, 200, 8, 4)[2] is None  # the loop never reads the test split
    no_valid = _config(([data[0]], None), split="100,0,0")
    with pytest.raises(ValueError, match=r"dataset.split: '100,0,0' gives the validation split no data, but 8 valid"):
        builders.build_gpt_datasets(no_valid, tokenizer, 200, 8, 0)


def test_blend_per_split_reads_each_split_from_its_own_files(data, tokenizer):
    cfg = _config(None, split=None, blend_per_split=[([data[0]], None), ([data[1]], None), None])
    train, valid, test = builders.build_gpt_datasets(cfg, tokenizer, 50, 8, 0)
    assert train.dataset.path_prefix == data[0] and valid.dataset.path_prefix == data[1] and test is None
    batch = next(_iterators(cfg, tokenizer)[1])
    assert not any(ord("a") <= t <= ord("z") for t in batch["tokens"].flatten().tolist())  # data[1] is upper case


def test_a_weighted_blend_draws_from_both_datasets_and_needs_a_process_group(data, tokenizer, tmp_path):
    cfg = _config(([data[0], data[1]], [0.25, 0.75]), path_to_cache=str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="blending several datasets needs torch.distributed initialized"):
        builders.build_gpt_datasets(cfg, tokenizer, 100, 0, 0)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        train, _valid, _test = builders.build_gpt_datasets(cfg, tokenizer, 100, 0, 0)
        share = float((torch.as_tensor(train.dataset_index[:100]) == 1).float().mean())
        assert len(train) == 100 and 0.7 <= share <= 0.8
        assert sorted(next(_iterators(cfg, tokenizer, train_samples=100, valid_samples=0)[0])) == [
            "attention_mask", "labels", "loss_mask", "position_ids", "tokens"
        ]  # fmt: skip
        assert any("BlendedDataset" in name for name in os.listdir(tmp_path / "cache"))
    finally:
        torch.distributed.destroy_process_group()


def test_a_split_read_to_its_end_is_an_error_naming_it_not_a_silent_stop(data, tokenizer):
    cfg = _config(([data[0]], None))
    train, _valid, _test = _iterators(cfg, tokenizer, train_samples=8, valid_samples=0)
    built = builders.build_gpt_datasets(cfg, tokenizer, 8, 0, 0)[0]
    _take(train, len(built) // 4)  # every full micro-batch of the built samples
    with pytest.raises(RuntimeError, match=f"the train data ran out: all {len(built)} samples of the train split"):
        next(train)


def test_mock_config_keeps_the_mock_stream(tokenizer):
    cfg = MockGPTDatasetConfig(seq_length=16, random_seed=5, reset_position_ids=False, reset_attention_mask=False,
                               eod_mask_loss=False, num_workers=0)  # fmt: skip
    cfg.finalize()
    null = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=100))
    train, valid, test = _iterators(cfg, null, consumed_train_samples=6, consumed_valid_samples=2, micro_batch_size=2)

    def mock_batches(seed, first):  # the stream's samples from ``first`` on, two per batch
        stream = MockGPTDataset(vocab_size=100, seq_length=16, seed=seed)
        rows = [[stream[first + 2 * b + r] for r in range(2)] for b in range(2)]
        return [{k: torch.stack([row[k] for row in batch]) for k in batch[0]} for batch in rows]

    assert _same(_take(train, 2), mock_batches(5, 6))
    assert _same(_take(valid, 2), mock_batches(6, 2))
    assert _same(_take(test, 1), mock_batches(7, 0)[:1])  # the test split starts at 0, seeded random_seed + 2
    assert _iterators(cfg, null, train_samples=0, valid_samples=0) == (None, None, None)


def test_a_spawned_loader_worker_serves_the_same_batches(data, tokenizer, monkeypatch):
    # multiprocessing's resource tracker serves this whole pytest process (it ends with it), not this test: start it
    # without the test's tag so that the harness does not count it as a process the test left behind.
    for tag in (processes.TEST_ID, processes.RUN):
        monkeypatch.delenv(tag, raising=False)
    resource_tracker.ensure_running()
    monkeypatch.undo()
    cfg = _config(([data[0]], None))
    expected = _take(_iterators(cfg, tokenizer, consumed_train_samples=4)[0], 2)
    cfg.num_workers, cfg.persistent_workers = 1, False
    start = time.monotonic()
    iterator = _iterators(cfg, tokenizer, consumed_train_samples=4)[0]  # the dataset and tokenizer are pickled
    assert _same(_take(iterator, 2), expected)
    assert time.monotonic() - start < 40
    del iterator
    gc.collect()  # the worker stops with its iterator


def test_an_index_cache_truncated_by_a_killed_build_is_rebuilt_not_a_restart_loop(data, tokenizer, tmp_path):
    cfg = _config(([data[0]], None), path_to_cache=str(tmp_path / "cache"))
    expected = _take(_iterators(cfg, tokenizer)[0], 2)
    shuffle = next(p for p in (tmp_path / "cache").iterdir() if p.name.endswith("-train-shuffle_index.npy"))
    with open(shuffle, "r+b") as f:  # rank 0 killed while numpy.save wrote it
        f.truncate(shuffle.stat().st_size - 16)
    assert len(builders.repair_index_cache(str(tmp_path / "cache"))) == 4  # the set: description and 3 indices
    with open(shuffle.with_name(shuffle.name.replace("shuffle", "sample")), "wb") as f:
        f.write(b"\x93NUMPY")  # a set cut inside a header
    assert _same(_take(_iterators(cfg, tokenizer)[0], 2), expected)
    assert builders.repair_index_cache(str(tmp_path / "cache")) == []
