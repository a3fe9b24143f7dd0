"""Preemption drills: SIGTERM reaches one rank; every rank stops at the same step, saves, exits 18 and resumes.

The signal is real (``MBRIDGE_FAULTS=preempt@<iteration>:<rank>``: the rank's process receives SIGTERM from the
kernel while it trains); the resumed run must end bit-identical to one that was never interrupted.
"""

import os
import re
import signal
import subprocess
import sys
import time

from tests.functional_tests.harness import (
    ENTRY,
    assert_same_state,
    checkpoint_state,
    free_port,
    kill_processes_with_marker,
    tail,
    torchrun,
)

from megatron.bridge.training.events.stream import Mechanism

HANDLER = "train.exit_signal_handler=true"


def _stopped_at(run, iteration: int) -> None:
    for rank in (0, 1):
        line = f"[rank{rank}] INFO megatron.bridge.training.pretrain: training stopped at iteration {iteration}: "
        assert line in run.output, tail(run)


def _resumes_like_reference(ckpt, reference_tp1, resumed_from: int) -> None:
    reference, reference_ckpt = reference_tp1
    resumed = torchrun(ckpt, HANDLER)
    assert resumed.exit_code == 0, tail(resumed)
    assert f"at iteration {resumed_from}" in resumed.output
    ref = reference.losses()
    assert resumed.losses() == {i: ref[i] for i in range(resumed_from + 1, 13)}
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


def test_sigterm_to_one_rank_stops_all_ranks_at_the_same_step(reference_tp1, tmp_path):
    ckpt = tmp_path / "ckpt"
    run = torchrun(ckpt, HANDLER, env={"MBRIDGE_FAULTS": "preempt@5:1"})
    assert run.exit_code == 18, tail(run)  # ExitCode.PREEMPTED
    assert "[rank1] WARNING megatron.bridge.training.utils.sig_utils: Received signal 15, initiating graceful stop" in (
        run.output
    )
    # Rank 0 learned of the signal from rank 1 at step 5 (its own handler may still log torchrun's SIGTERM, sent to it
    # when rank 1 exits first, so the log cannot tell).
    stops = {e.rank: (e.iteration, e.detail) for e in run.detected(Mechanism.PREEMPTION_SIGNAL)}
    assert stops == {0: (5, "received by another rank"), 1: (5, "received here")}, stops
    _stopped_at(run, 5)  # the signal arrived at the start of step 5: both finish it, save, exit
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert run.losses() == {i: reference_tp1[0].losses()[i] for i in range(1, 6)}
    _resumes_like_reference(ckpt, reference_tp1, resumed_from=5)


def test_async_saves_in_flight_are_finished_before_the_preemption_save(reference_tp1, tmp_path):
    ckpt = tmp_path / "ckpt"
    # The async save of 3 is scheduled right before the signal reaches rank 1 at the start of step 4.
    run = torchrun(ckpt, HANDLER, "checkpoint.async_save=true", env={"MBRIDGE_FAULTS": "preempt@4:1"})
    assert run.exit_code == 18, tail(run)
    _stopped_at(run, 4)
    lines = [x for x in run.output.splitlines() if x.startswith("20") and "[rank0]" in x]
    order = [i for i, x in enumerate(lines) if "finalized async checkpoint save at iteration 3" in x]
    scheduled = [i for i, x in enumerate(lines) if "Scheduling async checkpoint save at iteration 4" in x]
    finished = [i for i, x in enumerate(lines) if "finalized async checkpoint save at iteration 4" in x]
    assert order and scheduled and finished and order[0] < scheduled[0] < finished[0], tail(run)
    for iteration in (3, 4):  # both committed, each with its manifest
        assert (ckpt / f"iter_{iteration:07d}" / "manifest.json").is_file()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert not list(ckpt.glob(".tmp_iter_*")), "no save left half-written"
    _resumes_like_reference(ckpt, reference_tp1, resumed_from=4)


def test_without_the_handler_the_signal_is_not_trapped(tmp_path):
    run = torchrun(tmp_path / "ckpt", env={"MBRIDGE_FAULTS": "preempt@5:1"})
    assert run.exit_code == 128 + 15, tail(run)  # killed by SIGTERM, as without this framework
    assert "Preemption detected" not in run.output


def test_save_past_the_deadline_exits_and_the_previous_checkpoint_stays(reference_tp1, tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {"MBRIDGE_FAULTS": "preempt@5:1,stall@5:1:save.during_write"}
    run = torchrun(ckpt, HANDLER, "train.exit_signal_deadline=4", env=env)
    assert run.exit_code == 18, tail(run)
    assert "did not finish within train.exit_signal_deadline=4.0 s" in run.output, tail(run)
    assert "newest committed checkpoint is iteration 3" in run.output
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert not (ckpt / "iter_0000005").exists()
    _resumes_like_reference(ckpt, reference_tp1, resumed_from=3)


def test_signal_to_the_whole_process_tree_still_saves_when_workers_are_protected(tmp_path):
    workers = ("dataset.num_workers=1", HANDLER)
    unprotected = torchrun(tmp_path / "a", *workers, env={"MBRIDGE_FAULTS": "preempt-tree@5:1"})
    # Crashed: its data-loader worker died on the signal; the signal, which no step boundary could act on any more,
    # then ends the process as it would without the handler.
    assert unprotected.exit_code == 128 + 15, tail(unprotected)
    assert "torch/utils/data/dataloader.py" in unprotected.output, tail(unprotected)
    protected = torchrun(
        tmp_path / "b",
        *workers,
        "train.exit_signal_handler_for_dataloader=true",
        env={"MBRIDGE_FAULTS": "preempt-tree@5:1"},
    )
    assert protected.exit_code == 18, tail(protected)
    _stopped_at(protected, 5)


def test_signal_to_the_launcher_reaches_the_ranks_which_save(tmp_path):
    """A scheduler stopping ``megatron.bridge.launch``: torchrun passes SIGTERM on, the ranks save, it exits 143."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "out.log"
    marker = os.urandom(8).hex()
    cmd = [
        sys.executable, "-m", "megatron.bridge.launch", "--nproc-per-node=2", f"--master-port={free_port()}",
        str(ENTRY), "train.train_iters=100000", f"checkpoint.save={ckpt}", HANDLER,
    ]  # fmt: skip
    env = {**os.environ, "MBRIDGE_TEST_RUN": marker, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 180
            while "iteration 20/" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)  # to the launcher only
            proc.wait(timeout=120)
        finally:
            proc.kill()
            kill_processes_with_marker(marker)
    output = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    stopped = {int(i) for i in re.findall(r"training stopped at iteration (\d+): a rank received SIGTERM", output)}
    assert len(stopped) == 1, output[-3000:]  # both ranks, same step
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped.pop())
