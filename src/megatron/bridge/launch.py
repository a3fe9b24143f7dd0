"""``python -m megatron.bridge.launch``: torchrun that exits with the training processes' exit code.

torchrun exits 1 whenever a worker fails, hiding *why* training stopped. This launcher accepts every torchrun
argument and, when workers fail, exits with the code of the first one that did (see ``training/exit_codes.py``),
so a Slurm script or scheduler policy can tell "preempted, requeue" (18) from "bad config, stop" (2).
A worker killed by a signal maps to 128 + signal number, as a shell reports it. When the launcher itself gets a
signal (a scheduler stopping the job), torchrun passes it to the workers and waits for them (up to 30 s; with
``train.exit_signal_handler`` they save and exit 18), then this launcher exits 128 + signal number.
"""

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from megatron.bridge import standby
from megatron.bridge.utils.fast_exit import exit_without_final_collection


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; return the exit code of the first failed worker, or 0."""
    args = parse_args(standby.install("torch", sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        print(err.format_msg(), file=sys.stderr)
        code = failure.exitcode
        return 128 - code if code < 0 else (code or 1)
    except SignalException as err:
        print(
            f"launcher stopped by {err.sigval.name}; its workers were given the signal and waited for", file=sys.stderr
        )
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    exit_without_final_collection(main())
