"""The pretraining sampler and loader: resumable positions, data-parallel slices, and safe tails."""

import pytest
import torch

from megatron.bridge.data.samplers import UNBOUNDED_SAMPLES, MegatronPretrainingSampler, build_pretraining_data_loader


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


def test_loader_reads_an_unbounded_sampler_lazily_and_passes_external_through():
    data = [torch.tensor(i) for i in range(100)]
    loader = build_pretraining_data_loader(
        data, 6, "single", 2, 0, data_parallel_rank=0, data_parallel_size=2, total_samples=UNBOUNDED_SAMPLES
    )
    batches = iter(loader)
    assert next(batches).tolist() == [6, 7]
    assert next(batches).tolist() == [10, 11]
    assert build_pretraining_data_loader(data, 0, "external", 1, 0) is data
    assert build_pretraining_data_loader(None, 0, "single", 1, 0) is None
    with pytest.raises(ValueError, match="cyclic"):
        build_pretraining_data_loader(data, 0, "cyclic", 1, 0)
