"""``python -m megatron.bridge.launch``: torchrun that exits with the training processes' exit code.

torchrun exits 1 whenever a worker fails, hiding *why* training stopped. This launcher accepts every torchrun
argument and, when workers fail, exits with the code of the first one that did (see ``training/exit_codes.py``),
so a Slurm script or scheduler policy can tell "preempted, requeue" (18) from "bad config, stop" (2). A code that
says *stop* wins over an earlier one: a rank that found a full disk (26) is not hidden by a peer that crashed in the
broken collective after it (1).
A worker killed by a signal maps to 128 + signal number, as a shell reports it. When the launcher itself gets a
signal (a scheduler stopping the job), torchrun passes it to the workers and waits for them (up to 30 s; with
``train.exit_signal_handler`` they save and exit 18), then this launcher exits 128 + signal number.

Host and launch faults: a rendezvous port another process listens on is found before anything starts (a bind probe,
``utils/rendezvous_port.py``), and so is the store's own bind or connection error if it surfaces later: one paragraph
naming the host and port and the fix, exit code 28 (``LAUNCH_FAILED``). A worker killed by SIGKILL is looked up in
the kernel's out-of-memory records (``utils/oom.py``): if the OOM killer killed it, a line says so, with the fix.

Elastic ranges: ``--nnodes=MIN:MAX`` with MIN < MAX on a rendezvous that cannot re-form with fewer nodes (``static``,
torchrun's default, or ``--standalone``) is refused before anything starts, exit code 2 (``CONFIG_ERROR``); the range
is passed to the workers as ``MBRIDGE_NNODES`` (``utils/elastic.py``).
"""

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from megatron.bridge import standby
from megatron.bridge.training.exit_codes import ExitCode, job_exit_code
from megatron.bridge.utils import elastic, oom, rendezvous_port
from megatron.bridge.utils.fast_exit import exit_without_final_collection


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; return the failed workers' exit code (:func:`job_exit_code`), or 0."""
    argv = sys.argv[1:] if argv is None else argv
    parsed = parse_args([a for a in argv if a != standby.OPT_OUT])
    refused = elastic.refusal(parsed, "megatron.bridge.launch")
    if refused is not None:  # before anything starts: a range this rendezvous cannot honour
        print(refused, file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    elastic.export(elastic.workers_range(parsed))
    store = rendezvous_port.hosted_store(parsed)
    taken = rendezvous_port.port_taken(store, rendezvous_port.TORCHRUN)  # before the standby starts importing
    if taken is not None:
        print(taken, file=sys.stderr)
        return int(ExitCode.LAUNCH_FAILED)
    args = parse_args(standby.install("torch", argv))
    memory = oom.OomWatch()
    try:
        run(args)
    except ChildFailedError as err:
        print(err.format_msg(), file=sys.stderr)
        for failed_rank, each in sorted(err.failures.items()):
            verdict = memory.verdict(each.pid) if each.exitcode == -signal.SIGKILL else None
            if verdict is not None:
                print(oom.message(failed_rank, verdict), file=sys.stderr)
        in_order = sorted(err.failures.values(), key=lambda failure: failure.timestamp)
        return job_exit_code([failure.exitcode for failure in in_order])
    except SignalException as err:
        print(
            f"launcher stopped by {err.sigval.name}; its workers were given the signal and waited for", file=sys.stderr
        )
        return 128 + int(err.sigval)
    except Exception as err:  # noqa: BLE001 - a rendezvous error becomes exit 28; any other is re-raised
        failed = rendezvous_port.launch_error(err, store, rendezvous_port.endpoint(args), rendezvous_port.TORCHRUN)
        if failed is None:
            raise
        print(failed, file=sys.stderr)
        return int(ExitCode.LAUNCH_FAILED)
    return 0


if __name__ == "__main__":
    exit_without_final_collection(main())
