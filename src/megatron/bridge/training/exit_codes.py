"""Process exit codes: how a training process tells its launcher or scheduler what happened.

Every way training ends maps to one code, chosen so that a launcher (``ft_launcher``, ``torchrun``) or a Slurm
epilog can decide between *restart*, *requeue* and *stop* from the code alone. The table is documented in
``docs/training/resiliency.md``; keep both in sync (a test checks that).

Codes 16 and 17 are megatron-core's re-run state machine codes and keep their upstream meaning.
"""

import enum
from collections.abc import Sequence
from typing import Optional


class ExitCode(enum.IntEnum):
    """Exit codes of a training process, with the action a launcher should take."""

    FINISHED = 0
    """``train.train_iters`` reached. Action: stop, the job is done."""

    UNEXPECTED_ERROR = 1
    """An uncaught exception (crash). Action: restart from the last checkpoint (in-job restart)."""

    CONFIG_ERROR = 2
    """The configuration failed ``validate()`` or an override was unknown. Action: stop; fix the config."""

    NO_VALID_CHECKPOINT = 3
    """``checkpoint.load`` holds checkpoints but none passes verification. Action: stop; a human must look."""

    RERUN_RESUME = 16
    """Re-run state machine: a checkpoint was saved to re-run a step on other hardware (or a fallback to an older
    checkpoint was set up). Action: requeue, on other nodes if possible."""

    RERUN_FAILED_VALIDATION = 17
    """A NaN/Inf loss (all ranks agree), a result that failed validation reproducibly, or the re-run restart limit
    was reached. Action: stop; a human must look (ft_launcher is asked not to restart)."""

    PREEMPTED = 18
    """``train.exit_signal`` received; a checkpoint was saved. Action: requeue and resume."""

    DURATION_LIMIT = 19
    """``train.exit_duration_in_mins`` reached; a checkpoint was saved. Action: requeue and resume."""

    EXIT_INTERVAL = 20
    """``train.exit_interval`` reached; a checkpoint was saved. Action: stop (the user asked for it)."""

    STRAGGLER_STOP = 21
    """A straggler was detected with ``nvrx_straggler.stop_if_detected``; a checkpoint was saved. Action: requeue
    on other nodes."""

    INPROCESS_RESTART_EXHAUSTED = 22
    """In-process restart gave up (``inprocess_restart.max_iterations`` used up, too few healthy ranks, or a rank
    past ``max_rank_faults``). Action: restart the job from the newest checkpoint (in-job restart, on other nodes
    if a node was retired)."""

    LOCAL_CHECKPOINT_REJECTED = 23
    """A non-finite loss within a few steps of loading a local-tier checkpoint: that checkpoint was deleted on every
    node. Action: restart the job (in-job restart); it loads the global checkpoint."""

    PEER_UNRESPONSIVE = 24
    """The liveness ping (``health.liveness_ping_interval``) lost a rank: it died or did not answer within
    ``health.liveness_ping_timeout``; the log names it. Action: restart the job (in-job restart), on other nodes
    if the named rank's node is suspect."""

    DEVICE_UNHEALTHY = 25
    """A device health check failed before training started (a CUDA context that does not synchronize, a GPU that
    NVML says needs a reset or reboot, a degraded NVLink), or ``dist.device`` found no usable GPU (``cuda`` on a node
    without one, a visible GPU that does not work). Action: restart on other nodes (exclude this one)."""

    STORAGE_FULL = 26
    """A checkpoint directory has too little free space for the next save (the preflight, from the last save's size
    with a margin) or filled up during one (``ENOSPC``/``EDQUOT``). The partial save was removed; the newest committed
    checkpoint stays loadable. Action: stop; free space or raise the quota, then requeue (it resumes)."""

    STORAGE_UNAVAILABLE = 27
    """A checkpoint directory is read-only, not writable, gone, or fails with an I/O error. Nothing committed was
    lost. Action: stop; fix the mount or permissions, then requeue (it resumes)."""

    LAUNCH_FAILED = 28
    """The launcher could not start the workers: the rendezvous port is in use or the rendezvous endpoint cannot be
    reached. Nothing ran. Action: requeue (another port, or once the other job is gone)."""

    NO_PROGRESS = 29
    """The last ``ft.max_no_progress_restarts`` restarts of the job each failed without committing a newer checkpoint
    or completing a step beyond those reached before (the same crash, hang or kill every time); the log line and the
    ``fault_detected`` event (mechanism ``no_progress``) name the rank, the exception or signal and the iteration.
    Action: stop; fix the cause, then relaunch (it resumes from the newest checkpoint)."""

    WEIGHTS_DIVERGED = 30
    """The weight-hash check (``train.check_weight_hash_across_dp_replicas_interval``) found data-parallel replicas
    holding different weights, and a rank it named (on the same host) had been named before in this job: that rank's
    hardware corrupts data silently. Nothing of the corrupt state was saved. Action: stop; requeue excluding the named
    rank's node (the log and the ``fault_detected`` events name it)."""

    WEIGHT_HASH_ROLLBACK = 31
    """The weight-hash check found data-parallel replicas holding different weights (the log names the ranks), for
    the first time on those ranks: nothing of the corrupt state was saved. Action: restart the job (in-job restart):
    it loads the newest checkpoint, whose weights were checked when it was saved."""

    NODE_MISMATCH = 32
    """Ranks of the job run other code or another config than the others (a spare or replacement node started from
    another build or command line): at set-up, before anything was loaded or trained, the log names each such rank,
    its host and every difference (``training/health/same_job.py``). Action: stop; start that node with the job's
    code and command line, then requeue (it resumes from the newest checkpoint)."""


STOP_CODES = frozenset(
    {
        ExitCode.CONFIG_ERROR,
        ExitCode.NO_VALID_CHECKPOINT,
        ExitCode.RERUN_FAILED_VALIDATION,
        ExitCode.EXIT_INTERVAL,
        ExitCode.STORAGE_FULL,
        ExitCode.STORAGE_UNAVAILABLE,
        ExitCode.NO_PROGRESS,
        ExitCode.WEIGHTS_DIVERGED,
        ExitCode.NODE_MISMATCH,
    }
)
"""The codes whose action is *stop*: restarting the job cannot help."""


def job_exit_code(worker_codes: Sequence[int]) -> int:
    """The one exit code for a job whose workers failed with ``worker_codes`` (in the order they failed).

    A worker's code is its process exit code, negative for a signal (as ``subprocess`` reports it); the result is the
    shell's form (128 + signal). The first code that says *stop* (:data:`STOP_CODES`) wins: when one rank finds a full
    disk and its peers then fail in a broken collective, the job must not be requeued into the same full disk. Else
    the first failure's code. A worker that failed with 0 (it should not) counts as 1.
    """
    if not worker_codes:
        return int(ExitCode.FINISHED)
    stops = [code for code in worker_codes if code in STOP_CODES]
    code = stops[0] if stops else worker_codes[0]
    return 128 - code if code < 0 else (code or int(ExitCode.UNEXPECTED_ERROR))


class TrainingExit(SystemExit):
    """Raised to end training with a specific :class:`ExitCode` after cleanup ran."""

    def __init__(self, code: ExitCode, reason: str) -> None:
        super().__init__(int(code))
        self.exit_code = code
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.exit_code.name} (exit code {int(self.exit_code)}): {self.reason}"


def exit_code_of(err: BaseException) -> Optional[int]:
    """The exit code ``err`` ends the process with (``None`` when an outer layer may still catch it)."""
    code = getattr(err, "exit_code", None)
    if code is not None:
        return int(code)
    if isinstance(err, SystemExit):
        return err.code if isinstance(err.code, int) else 1
    return None
