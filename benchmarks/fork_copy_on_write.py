"""What a forked checkpoint writer costs the training process's next writes: copy-on-write, measured in one run.

A writer forked from the rank per save (on CPU before ``training/checkpoint/snapshot_writer.py``; still the fallback
there, and the GPU local tier's writer) makes every page the rank writes for the first time while the fork lives a
copy by the kernel: the step after an async save pays for its whole working set (``save_blocking.py``'s "next step
+" column).
This times an in-place update of ``--mib`` MiB of tensors (like an optimizer step) with no fork, then right after a
fork whose child only sleeps, and prints the ratio. Then the alternative: a persistent writer (forked once, before
the rounds) fed through shared memory: per save, the state is copied once into buffers shared with it (allocated at
the first save), and the update after that copy runs at full speed. Printed: the copy's time and the update's.

    python benchmarks/fork_copy_on_write.py [--mib 375]
"""

import argparse
import os
import signal
import statistics
import time

import torch
from _result import emit_result


def _update(tensors: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for t in tensors:
        t.add_(1.0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=375, help="MiB of tensors updated in place")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tensors = [torch.ones(2**20 // 4) for _ in range(args.mib)]  # 1 MiB each, like a model's many parameters
    _update(tensors)
    plain = statistics.median(_update(tensors) for _ in range(args.rounds))
    after_fork = []
    for _ in range(args.rounds):
        child = os.fork()
        if child == 0:  # the writer's stand-in: it only keeps the pages shared
            time.sleep(60)
            os._exit(0)
        try:
            after_fork.append(_update(tensors))
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    forked = statistics.median(after_fork)
    print(f"in-place update of {args.mib} MiB: {plain * 1000:.1f} ms; the first after a fork: {forked * 1000:.1f} ms")
    shared = [
        torch.empty_like(t).share_memory_() for t in tensors
    ]  # the writer's view, mapped shared: no copy-on-write
    writer = os.fork()
    if writer == 0:  # a persistent writer: alive through every round
        time.sleep(120)
        os._exit(0)
    try:
        _update(tensors)  # the one copy-on-write the persistent writer's fork costs
        copies, updates = [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for src, dst in zip(tensors, shared):
                dst.copy_(src)
            copies.append(time.perf_counter() - start)
            updates.append(_update(tensors))
    finally:
        os.kill(writer, signal.SIGKILL)
        os.waitpid(writer, 0)
    copy, update = statistics.median(copies), statistics.median(updates)
    print(f"persistent writer through shared memory: copy {copy * 1000:.1f} ms, then the update {update * 1000:.1f} ms")
    emit_result(
        "fork_copy_on_write", f"first in-place update of {args.mib} MiB after a fork / without one", forked / plain,
        f"{forked * 1000:.1f} ms (a child alive)", f"{plain * 1000:.1f} ms (no fork)",
    )  # fmt: skip
    emit_result(
        "fork_copy_on_write", "shared-memory copy + the update after it / the first update after a fork",
        (copy + update) / forked, f"{(copy + update) * 1000:.1f} ms (copy {copy * 1000:.1f} ms + update)",
        f"{forked * 1000:.1f} ms (update after a fork)",
    )  # fmt: skip


if __name__ == "__main__":
    main()
