"""Entry of ``llama_throughput.py``'s framework run: ``python -m megatron.bridge.recipes.run`` with data waits timed.

The framework logs no data-loading time, so this entry runs ``megatron.bridge.recipes.run.main`` (same recipe lookup,
same GPT forward step, same ``pretrain.main``) after wrapping the iterator that ``gpt_step.get_batch`` receives: every
``next(data_iterator)`` of the forward step (the loader's iterator behind the re-run state machine's wrapper) is
timed with two ``perf_counter`` calls. Nothing else changes. With ``LLAMA_THROUGHPUT_WAITS=<dir>`` each rank writes
the seconds of every ``next()`` to ``<dir>/framework_rank<N>.json`` at exit.

    python -m megatron.bridge.launch --standalone --nproc-per-node=2 benchmarks/_recipe_run_timed.py \\
        llama3_tiny_pretrain_config key=value ...
"""

import atexit
import sys

from _plain_mcore_loop import TimedIterator, write_waits


def main() -> None:
    from megatron.bridge.recipes import run
    from megatron.bridge.training import gpt_step

    waits: list[float] = []
    get_batch = gpt_step.get_batch

    def timed_get_batch(data_iterator, *args, **kwargs):
        return get_batch(TimedIterator(data_iterator, waits), *args, **kwargs)

    gpt_step.get_batch = timed_get_batch  # forward_step looks it up in its module at every call
    atexit.register(write_waits, waits, "framework")  # pretrain.main leaves through sys.exit: atexit runs
    run.main(sys.argv[1:])


if __name__ == "__main__":  # the guard matters: loader workers and checkpoint writers are spawned and import this
    main()
