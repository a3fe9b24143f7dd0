"""In-process restart drills: real faults in a 2-rank gloo run wrapped by nvidia-resiliency-ext's inprocess.Wrapper.

The faulty rank raises or stalls; every rank restarts inside the same process, resumes from the newest verified
checkpoint and finishes with the state of an uninterrupted run. When the wrapper gives up, the processes exit with 22
and an outer ft_launcher restarts the job.
"""

import re

from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.harness import Run, assert_same_state, checkpoint_state, ft_launcher, tail, torchrun

from megatron.bridge.training.events.stream import EventKind, Mechanism, Process, RestartLayer

ENV = {"TORCH_CPP_LOG_LEVEL": "error", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0"}
# Timeouts for a 2-core machine: a step takes ~0.03 s and a save up to a few seconds.
IPR = [
    "inprocess_restart.enabled=true", "inprocess_restart.soft_timeout=8", "inprocess_restart.hard_timeout=40",
    "inprocess_restart.heartbeat_interval=2", "inprocess_restart.heartbeat_timeout=10",
    "inprocess_restart.barrier_timeout=90", "inprocess_restart.completion_timeout=90",
]  # fmt: skip


def _pids(run: Run) -> dict[int, list[tuple[int, int]]]:
    """Per initial rank, the (restart iteration, pid) of every start of the training function (its events)."""
    starts: dict[int, list[tuple[int, int]]] = {}
    for e in run.events(EventKind.ATTEMPT_STARTED):
        starts.setdefault(e.rank, []).append((e.inprocess_iteration, e.pid))
    return starts


def _detected(run: Run, mechanism: Mechanism) -> set[int]:
    """The ranks the in-process interruption records of ``mechanism`` name."""
    return {e.rank for e in run.events(EventKind.FAULT_DETECTED) if e.mechanism == mechanism}


def test_exception_restarts_in_the_same_processes_and_finishes_bit_identical(reference_tp1, tmp_path):
    reference, reference_ckpt = reference_tp1
    logdir = tmp_path / "monitor_logs"
    run = torchrun(
        tmp_path / "ckpt", *IPR, f"inprocess_restart.monitor_process_logdir={logdir}",
        env={**ENV, "MBRIDGE_FAULTS": "exception@5:1"},
    )  # fmt: skip
    assert run.exit_code == 0, tail(run, 80)
    assert [(e.fault_kind, e.iteration, e.rank) for e in run.events(EventKind.FAULT_INJECTED)] == [("exception", 5, 1)]
    starts = _pids(run)
    assert sorted(starts) == [0, 1], tail(run, 80)
    for rank, seen in starts.items():
        assert [i for i, _ in seen] == [0, 1], (rank, seen)  # exactly one in-process restart
        assert len({pid for _, pid in seen}) == 1, (rank, seen)  # in the same process
    # Rank 1's exception; rank 0's collective with it fails at once (its connections were shut down), not at a timeout.
    assert 1 in _detected(run, Mechanism.INPROCESS_EXCEPTION), tail(run, 80)
    assert not _detected(run, Mechanism.INPROCESS_SOFT_TIMEOUT) | _detected(run, Mechanism.INPROCESS_HARD_TIMEOUT)
    assert "Connection closed by peer" in run.output and "Timed out" not in run.output
    restarts = [e for e in run.events(EventKind.RESTART_ENDED) if e.layer == RestartLayer.IN_PROCESS]
    assert {e.inprocess_iteration for e in restarts} == {1}
    assert [e.iteration for e in run.events(EventKind.CHECKPOINT_LOADED) if e.rank == 0] == [3]
    assert "[NestedRestarter] name=[InProcess] state=finalized" in run.output
    assert {p.name for p in logdir.iterdir()} == {"monitor_process_0.log", "monitor_process_1.log"}
    # Resumed from 3 and trained on: the losses and the final state are those of the uninterrupted run.
    assert run.losses() == reference.losses()
    assert_same_state(
        checkpoint_state(tmp_path / "ckpt" / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012")
    )


def test_stalled_rank_times_out_softly_and_restarts_in_process(reference_tp1, tmp_path):
    reference, reference_ckpt = reference_tp1
    run = torchrun(tmp_path / "ckpt", *IPR, env={**ENV, "MBRIDGE_FAULTS": "stall@5:1"})
    assert run.exit_code == 0, tail(run, 80)
    assert [(e.fault_kind, e.iteration, e.rank) for e in run.events(EventKind.FAULT_INJECTED)] == [("stall", 5, 1)]
    assert _detected(run, Mechanism.INPROCESS_SOFT_TIMEOUT), tail(run, 80)  # no exception anywhere: the watchdog
    assert not _detected(run, Mechanism.INPROCESS_HARD_TIMEOUT) | _detected(run, Mechanism.INPROCESS_EXCEPTION)
    # Hang attribution: the stalled rank wrote its stack before the soft timeout; the next iteration sums it up.
    first_attempt = re.compile(r"\[rank0\].*\[attribution\] attempt_\S+_0_0_0:")
    summary = [x for x in run.output.splitlines() if first_attempt.search(x)]
    assert len(summary) == 1 and "rank 1 in stall_forever (injection.py:" in summary[0], tail(run, 80)
    starts = _pids(run)
    for rank in (0, 1):
        assert [i for i, _ in starts[rank]] == [0, 1] and len({pid for _, pid in starts[rank]}) == 1, starts
    assert run.losses() == reference.losses()
    assert_same_state(
        checkpoint_state(tmp_path / "ckpt" / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012")
    )


def test_max_iterations_used_up_stops_with_22(tmp_path):
    run = torchrun(
        tmp_path / "ckpt", *IPR, "inprocess_restart.max_iterations=1",
        env={**ENV, "MBRIDGE_FAULTS": "exception@5:1:always"},
    )  # fmt: skip
    assert run.exit_code == 22, tail(run, 80)
    assert len(run.events(EventKind.FAULT_INJECTED)) == 2  # the first run and the one restart
    assert [i for i, _ in _pids(run)[0]] == [0, 1]
    assert "in-process restart gave up" in run.output and "inprocess_restart.max_iterations=1" in run.output
    assert_doc_log_lines(run.output)
    assert "[NestedRestarter] name=[InProcess] state=aborted" in run.output


def test_nested_under_ft_launcher_in_job_restart_takes_over_when_in_process_gives_up(tmp_path):
    run = ft_launcher(
        tmp_path / "ckpt", *IPR, "inprocess_restart.max_iterations=1", max_restarts=1,
        env={**ENV, "MBRIDGE_FAULTS": "exception@5:1:always"},
    )  # fmt: skip
    assert run.exit_code != 0, tail(run, 80)
    # Two in-job attempts (new processes), each with one in-process restart: 4 strikes, then ft_launcher stops.
    assert len(run.events(EventKind.FAULT_INJECTED)) == 4, tail(run, 80)
    rank0 = _pids(run)[0]
    assert [i for i, _ in rank0] == [0, 1, 0, 1], rank0
    assert rank0[0][1] == rank0[1][1] != rank0[2][1] == rank0[3][1]  # in-process: same pid; in-job: a new one
    assert run.output.count("in-process restart gave up") >= 2
    exits = [e.exit_code for e in run.events(EventKind.WORKER_EXITED)]
    assert exits.count(22) >= 2, exits  # each attempt's workers exited 22 (ft_launcher exits 1)
    assert [e.layer for e in run.events(EventKind.RESTART_BEGUN) if e.process == Process.LAUNCHER] == [
        RestartLayer.IN_JOB
    ]
