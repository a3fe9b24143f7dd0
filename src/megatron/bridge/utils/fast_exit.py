"""Leave the process without the interpreter's finalization.

A process that imported torch and megatron-core holds millions of objects. At exit CPython first collected them all
(3-10 s per process on a loaded 2-core machine; py-spy: ``gc_collect_main`` in finalization), then clears every
module, deallocating them one by one (0.25-0.4 s per process on an idle one), before the launcher sees the exit
code. A restart, a requeue or the next job step waits for the slowest rank meanwhile. Once the run's own teardown has
finished (files closed, writers joined, process groups destroyed) neither frees anything that matters.

:func:`exit_without_final_collection` does what finalization does that others can see, in its order: it waits for
the threads that are not daemons, runs the ``atexit`` handlers (logging's flush, multiprocessing's children) and
flushes standard output and error; then it ends the process with ``os._exit``. Files a user's code left open are not
flushed by the interpreter then: close them (Python never promised finalizers at exit).
"""

import atexit
import gc
import os
import sys
import threading
from typing import NoReturn


def exit_without_final_collection(code: int) -> NoReturn:
    """End the process with exit ``code`` after threads, ``atexit`` handlers and standard streams, skipping the rest."""
    gc.freeze()  # nothing the handlers below free is worth a full collection of the heap
    for thread in threading.enumerate():  # what ``sys.exit`` waits for first
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # stdlib, stable since Python 3.0: each handler's error is printed and the rest run
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced streams: nothing left to flush
            pass
    os._exit(code)
