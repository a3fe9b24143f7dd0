"""The pretraining sampler and loader: resumable positions, data-parallel slices, and safe tails."""

import signal

import pytest
import torch

from megatron.bridge.data.loaders import ignore_signal_in_worker
from megatron.bridge.data.mock import MockGPTDataset
from megatron.bridge.data.samplers import (
    MegatronPretrainingBatchSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)


def test_resumes_at_consumed_samples_with_each_rank_taking_its_slice():
    sampler = MegatronPretrainingSampler(
        total_samples=20, consumed_samples=8, micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2
    )
    assert list(sampler) == [[10, 11], [14, 15], [18, 19]]


def test_partial_tail_kept_on_one_rank_and_refused_on_several():
    one = MegatronPretrainingSampler(7, 0, 3, 0, 1, drop_last=False)
    assert list(one) == [[0, 1, 2], [3, 4, 5], [6]]
    several = MegatronPretrainingSampler(7, 0, 3, 0, 2, drop_last=False)
    with pytest.raises(ValueError, match="drop_last=False"):
        list(several)
    assert list(MegatronPretrainingSampler(7, 0, 3, 1, 2, drop_last=True)) == [[3, 4, 5]]


def test_rejects_nothing_to_read():
    with pytest.raises(ValueError, match="no sample"):
        MegatronPretrainingSampler(4, 4, 1, 0, 1)


def test_loader_reads_the_endless_mock_stream_lazily_and_passes_external_through():
    data = MockGPTDataset(vocab_size=50, seq_length=4, seed=3)
    loader = build_pretraining_data_loader(data, 6, "single", 2, 0, data_parallel_rank=0, data_parallel_size=2)
    batches = iter(loader)
    assert torch.equal(next(batches)["tokens"], torch.stack([data[6]["tokens"], data[7]["tokens"]]))
    assert torch.equal(next(batches)["tokens"], torch.stack([data[10]["tokens"], data[11]["tokens"]]))
    assert build_pretraining_data_loader(data, 0, "external", 1, 0) is data
    assert build_pretraining_data_loader(None, 0, "single", 1, 0) is None
    with pytest.raises(ValueError, match="cyclic"):
        build_pretraining_data_loader(data, 0, "cyclic", 1, 0)
    with pytest.raises(RuntimeError, match="global_batch_size"):
        build_pretraining_data_loader(data, 0, "batch", 1, 0)


def _batches(sampler, count):
    it = iter(sampler)
    return [next(it) for _ in range(count)]


def test_batch_sampler_interleaves_ranks_and_reshuffles_each_epoch_reproducibly():
    ranks = [MegatronPretrainingBatchSampler(8, 0, 1, 4, r, 2, seed=7) for r in range(2)]
    first = [list(sampler) for sampler in ranks]  # one epoch: two global batches of 4, two indices per rank
    assert [len(b) for b in first[0]] == [2, 2]
    epoch = sorted(i for rank in first for batch in rank for i in batch)
    assert epoch == list(range(8))  # every sample once per epoch, the ranks disjoint
    assert ranks[0].consumed_samples == 8
    second = [list(sampler) for sampler in ranks]  # iterated again: the next epoch, in another order
    assert sorted(i for rank in second for batch in rank for i in batch) == list(range(8))
    assert second != first and ranks[0].consumed_samples == 16
    unshuffled = MegatronPretrainingBatchSampler(8, 0, 1, 4, 1, 2, shuffle=False)
    assert list(unshuffled) == [[1, 3], [5, 7]]


def test_batch_sampler_resumed_mid_epoch_reads_what_an_uninterrupted_one_would():
    uninterrupted = _batches(MegatronPretrainingBatchSampler(12, 0, 2, 4, 0, 1, seed=1), 3)
    assert _batches(MegatronPretrainingBatchSampler(12, 8, 2, 4, 0, 1, seed=1), 1) == uninterrupted[2:]
    next_epoch = _batches(MegatronPretrainingBatchSampler(12, 12, 2, 4, 0, 1, seed=1), 1)
    assert next_epoch != uninterrupted[:1] and len(next_epoch[0]) == 4


def test_batch_sampler_pads_or_drops_a_partial_global_batch():
    padding = {"drop_last": False, "pad_samples_to_global_batch_size": True, "shuffle": False}
    padded = list(MegatronPretrainingBatchSampler(6, 0, 1, 4, 0, 2, **padding))
    assert padded == [[0, 2], [4, -1]]
    assert list(MegatronPretrainingBatchSampler(6, 0, 1, 4, 0, 1, drop_last=True, shuffle=False)) == [[0, 1, 2, 3]]
    with pytest.raises(RuntimeError, match="not divisible"):
        MegatronPretrainingBatchSampler(8, 0, 3, 4, 0, 1)
    with pytest.raises(ValueError, match="full global batch"):
        MegatronPretrainingBatchSampler(3, 0, 1, 4, 0, 1)


def test_a_loader_worker_ignores_the_exit_signal():
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        ignore_signal_in_worker(signal.SIGUSR1, worker_id=0)
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, previous)
