"""Shared by the tests of async saves: a one-rank CPU world for megatron-core's async queue, and a bounded wait."""

import contextlib
import time
from collections.abc import Callable, Iterator

import torch


@contextlib.contextmanager
def one_world_on_cpu() -> Iterator[None]:
    """megatron-core's async queue all-reduces and logs over the default group: a world of one, gloo, CPU shims."""
    import torch.distributed as dist

    from megatron.bridge.utils.cpu_shims import apply_cpu_shims

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    apply_cpu_shims(torch.device("cpu"))
    try:
        yield
    finally:
        dist.destroy_process_group()


def until(predicate: Callable[[], bool], seconds: float = 20.0) -> bool:
    """Whether ``predicate`` became true within ``seconds`` (polled every 20 ms)."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
