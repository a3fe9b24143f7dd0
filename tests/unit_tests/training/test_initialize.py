"""CPU ranks get disjoint core slices of the cores the process may use, and nothing changes when cores are short."""

import os

import pytest

from megatron.bridge.training.initialize import bind_cpu_cores


@pytest.fixture
def restore_affinity():
    before = os.sched_getaffinity(0)
    yield sorted(before)
    os.sched_setaffinity(0, before)


def test_local_ranks_get_disjoint_slices(restore_affinity):
    cores = restore_affinity
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    slices = []
    for rank in range(2):
        os.sched_setaffinity(0, cores)
        slices.append(bind_cpu_cores(rank, 2))
        assert sorted(os.sched_getaffinity(0)) == slices[-1]
    assert slices[0] and slices[1] and not set(slices[0]) & set(slices[1])
    assert set(slices[0]) | set(slices[1]) <= set(cores)


def test_more_ranks_than_cores_leaves_affinity_alone(restore_affinity):
    cores = restore_affinity
    assert bind_cpu_cores(0, len(cores) + 1) == cores
    assert bind_cpu_cores(0, 1) == cores
    assert sorted(os.sched_getaffinity(0)) == cores
