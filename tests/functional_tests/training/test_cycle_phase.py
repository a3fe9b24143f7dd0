"""A restart cycle phase by phase, under a real ft_launcher: a rank killed, the launcher's restart, the new workers'
set-up and their first step, each phase from the event stream, back to back, adding up to the measured cycle."""

import json
import time

import pytest
from tests.functional_tests.harness import ft_launcher, tail

from megatron.bridge.drill import events, schedule
from megatron.bridge.training.events.stream import CyclePhase, EventKind, RestartLayer

TOLERANCE_S = 0.05
"""How far the phases may fall short of (or beyond) the cycle: they are back to back, but measured by two
processes (the launcher and rank 0) with clocks read separately."""


@pytest.mark.timeout(120)
def test_cycle_phase_of_an_in_job_restart(tmp_path):
    began = time.monotonic()
    ckpt = tmp_path / "ckpt"
    overrides = ("ft.enable_ft_package=true", "train.train_iters=6", "logger.log_interval=1")
    run = ft_launcher(ckpt, *overrides, max_restarts=1, env={"MBRIDGE_FAULTS": "kill@5:1"}, timeout=100)
    wall = time.monotonic() - began
    assert run.exit_code == 0, tail(run, 120)
    timeline = events.read_run(run.event_dir)
    assert not timeline.problems, timeline.problems
    found = events.outcomes(timeline, schedule.parse("kill@5:1"))
    (cycle,) = events.cycles(timeline, found)
    assert (cycle.cause, cycle.layer) == ("kill@5:1", RestartLayer.IN_JOB)
    spans = cycle.spans()
    assert list(spans) == list(CyclePhase)
    missing = [p.value for p, span in spans.items() if span is None]
    assert not missing, (missing, cycle.phases())
    seconds = cycle.phases()
    assert all(s >= 0 for s in seconds.values()), seconds
    starts = [span[0] for span in spans.values()]
    assert starts == sorted(starts), spans  # in order: each phase starts where (or after) the one before did
    assert cycle.seconds == pytest.approx(found[0].recovery_s, abs=1e-6)  # the cycle is the fault's recovery
    assert abs(cycle.unaccounted_s) <= TOLERANCE_S, (cycle.unaccounted_s, seconds, cycle.seconds)
    wanted = {(count, phase) for count in (0, 1) for phase in (CyclePhase.PROCESS_START, CyclePhase.DATA_BUILD)}
    for rank in (0, 1):  # every rank of both attempts timed its own set-up
        written = {
            (e.restart_count, e.cycle_phase) for e in timeline.events if e.kind == EventKind.PHASE and e.rank == rank
        }
        assert written >= wanted, (rank, written)
    startups = json.loads((ckpt / "goodput" / "summary.json").read_text())["startups"]  # the ledger's, per attempt
    assert len(startups) == 2 and all({"process_start", "model_build", "checkpoint_load"} <= set(s["phases_s"])
                                      for s in startups), startups  # fmt: skip
    print(f"cycle {cycle.seconds:.2f} s: {seconds}; test wall {wall:.1f} s")
