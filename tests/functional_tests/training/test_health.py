"""Health drills on real 2-rank runs: liveness ping, hang attribution under ft_launcher, job info, resume source."""

import json
import re

from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.harness import KEEP_SCHEDULE, ft_launcher, tail, torchrun, without_launcher

from megatron.bridge.training.events.stream import EventKind, Mechanism

PING = ["health.liveness_ping_interval=1", "health.liveness_ping_timeout=4"]


def test_killed_peer_is_reported_by_the_survivor_within_the_ping_timeout(tmp_path):
    # No launcher: nothing kills the survivor for it, so what rank 0 does on its own is what is tested.
    runs = without_launcher(tmp_path / "ckpt", *PING, env={"MBRIDGE_FAULTS": "kill@5:1"}, timeout=180)
    assert runs.exit_codes[1] == -9, runs.outputs[1][-3000:]
    survivor = runs.outputs[0]
    assert runs.exit_codes[0] == 24, survivor[-3000:]
    message = re.search(r"training stopped: PEER_UNRESPONSIVE \(exit code 24\): (.*)", survivor)
    assert message, survivor[-3000:]
    assert "liveness ping at iteration 5: rank 1 (last ping at iteration 4" in message.group(1)
    assert "did not answer within health.liveness_ping_timeout=4.0 s" in message.group(1)
    # Reported within the ping timeout of the survivor's ping, not after the collectives' 10-minute timeout. Measured
    # from the survivor's own end of step 4 (its ping for 5 follows at once), so that how far it lags the killed rank
    # on a busy machine does not count.
    (died,) = [e.time for e in runs.events(EventKind.FAULT_INJECTED) if e.rank == 1]
    (step_4,) = [e.time for e in runs.events(EventKind.STEP_COMPLETED) if e.rank == 0 and e.iteration == 4]
    (lost,) = [e for e in runs.events(EventKind.FAULT_DETECTED) if e.mechanism == Mechanism.LIVENESS_PING]
    assert (lost.rank, lost.iteration) == (1, 5), lost
    assert lost.time > died and 4.0 <= lost.time - step_4 <= 4.0 + 1.0, (lost.time - died, lost.time - step_4)


def test_with_four_ranks_every_survivor_reports_the_same_verdict(tmp_path):
    # Only the first rank to notice searches; the others wait for its verdict instead of exiting under it.
    runs = without_launcher(tmp_path / "ckpt", *PING, env={"MBRIDGE_FAULTS": "kill@5:3"}, timeout=240, nproc=4)
    assert runs.exit_codes[3] == -9, runs.outputs[3][-3000:]
    assert runs.exit_codes[:3] == [24, 24, 24], [o[-2000:] for o in runs.outputs[:3]]
    verdicts = {re.search(r"PEER_UNRESPONSIVE \(exit code 24\): (.*)", o).group(1) for o in runs.outputs[:3]}
    assert len(verdicts) == 1, verdicts
    lost = [e for e in runs.events(EventKind.FAULT_DETECTED) if e.mechanism == Mechanism.LIVENESS_PING]
    assert [(e.rank, e.iteration) for e in lost] == [(3, 5)], lost  # one event, from the rank that searched
    assert verdicts.pop().startswith("liveness ping at iteration 5: rank 3 (last ping at iteration 4) did not answer")


def test_stalled_peer_is_named_with_its_stack(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = torchrun(ckpt, *PING, env={"MBRIDGE_FAULTS": "stall@5:1"}, timeout=180)
    assert run.exit_code == 24, tail(run)
    line = next(x for x in run.output.splitlines() if "PEER_UNRESPONSIVE (exit code 24)" in x)
    assert "rank 1 (last ping at iteration 4; stack: rank 1 in stall_forever (injection.py:" in line, line
    assert "rank 0" not in line.split("did not answer")[0], "the waiting survivor is not blamed"
    assert_doc_log_lines(run.output)
    (stacks_file,) = (ckpt / "attribution").glob("attempt_*_0_0_0/rank1.stacks")
    stacks = stacks_file.read_text()
    assert "in stall_forever" in stacks and "--- step open for" in stacks
    # The dump came from the stalled rank itself, before the survivor gave up.
    assert (
        "[rank1] WARNING megatron.bridge.training.health.hang_attribution: [attribution] rank 1 in stall_forever"
        in (run.output)
    )


def test_hang_attribution_names_the_stuck_function_after_an_ft_restart(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = ft_launcher(ckpt, "ft.enable_ft_package=true", max_restarts=1, env={"MBRIDGE_FAULTS": "stall@5:1"})
    assert run.exit_code == 0, tail(run, 120)
    hung = run.detected(Mechanism.RANK_MONITOR_SECTION_TIMEOUT)  # the rank monitor killed the hung step
    assert hung and {e.section for e in hung} == {"step"}, tail(run, 120)
    first_attempt = re.compile(r"\[rank0\].*\[attribution\] attempt_\S+_0_0_0:")
    summary = [x for x in run.output.splitlines() if first_attempt.search(x)]
    assert len(summary) == 1, tail(run, 120)
    assert "rank 1 in stall_forever (injection.py:" in summary[0], summary[0]
    assert re.search(r"rank 0 in \S+ \([\w.]+:\d+\) \[step open for [\d.]+ s\], waiting in a collective", summary[0])
    (folder,) = (ckpt / "attribution").glob("attempt_*_0_0_0")
    assert (folder / "summary.txt").read_text().strip() in summary[0]
    assert not list((ckpt / "attribution").glob("attempt_*_0_1_0")), "the clean second attempt leaves no files"


def test_job_info_says_how_the_run_started_and_what_it_resumed_from(interrupted_copy):
    # checkpoint.load is set by the harness; a second start resumes the interrupted run's checkpoint of 6.
    run = torchrun(interrupted_copy, "train.train_iters=7", KEEP_SCHEDULE)
    assert run.exit_code == 0, tail(run)
    block = run.output[run.output.index("job info:") :].splitlines()[1:7]
    assert block[0].strip().startswith("launcher: torchrun on "), block
    assert block[1].strip() == "world size 2, 2 rank(s) per node, device cpu", block
    assert block[2].strip() == "restarts: in-job 0, in-process 0, requeue 0", block
    assert block[3].strip() == "slurm: not under Slurm", block
    assert block[5].strip().startswith(f"resumed from: global tier, iteration 6, {interrupted_copy / 'iter_0000006'}")
    records = [json.loads(x) for x in (interrupted_copy / "job_info.jsonl").read_text().splitlines()]
    assert [r["resumed"]["iteration"] for r in records] == [None, 6]
    assert records[1]["resumed"]["why"] == "newest verified checkpoint in checkpoint.load"


def test_without_load_the_run_resumes_its_own_saves(interrupted_copy):
    run = torchrun(interrupted_copy, "checkpoint.load=null", "train.train_iters=7", KEEP_SCHEDULE)  # no harness load
    assert run.exit_code == 0, tail(run)
    assert f"resume from: {interrupted_copy} (checkpoint.load is unset;" in run.output, tail(run)
    assert run.loads() == [("global", 6)]
