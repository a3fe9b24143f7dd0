"""Leave the process without the interpreter's final garbage collection.

A process that imported torch and megatron-core holds millions of objects; at exit CPython collects them all before
it returns the exit code, which took 3-10 s per process on a loaded 2-core machine (py-spy: ``gc_collect_main`` in
finalization), and a launcher waits for every rank. That is time a restart or a requeue spends doing nothing. Once
the run's own teardown has finished (files closed, writers joined, process groups destroyed), the collection frees
nothing that matters: :func:`exit_without_final_collection` freezes the heap out of the collector's reach and exits
normally, so ``atexit`` handlers (multiprocessing's managers, logging) still run.
"""

import gc
import sys
from typing import NoReturn


def exit_without_final_collection(code: int) -> NoReturn:
    """``sys.exit(code)`` with every live object moved out of the garbage collector's reach first."""
    gc.freeze()
    sys.exit(code)
