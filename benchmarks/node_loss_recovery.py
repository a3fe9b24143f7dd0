"""A lost node replaced by a hot spare, against an in-job restart of one process: seconds from fault to next step.

Both runs train the GPT example on two "nodes" on this machine (two ft_launcher agents with one rank each, in one c10d
rendezvous, local checkpoints every 2 iterations with replicas; ``tests/functional_tests/nodes.py``), and strike at
iteration 9:

- **spare**: a third agent waits as a hot spare (``--nnodes=2``: the rendezvous keeps it out of the job). Node B
  (its agent and its rank) is SIGKILLed while its rank is held at iteration 9; the survivor's rank fails on the lost
  peer, its agent restarts, and the spare takes B's place, fetching B's local shard from A's replica.
- **in_job**: no spare; rank 1 SIGKILLs itself at iteration 9 (fault ``kill@9:1``); both agents restart their
  workers in a new rendezvous round, every node still there.

Each figure is read from the job's event stream (``drill/events.py``'s restart cycle, phase by phase): from the loss
(the kill) or the fault's strike to the first step completed after the restart. The ratio spare / in-job is printed
(goal: at most 1.5), with both runs' phases. What a lost node adds is the rendezvous noticing it is gone: its agent
stops sending keep-alive heartbeats, and the legacy rendezvous (nvidia-resiliency-ext before 0.6) drops it once
they are overdue: 3 missed heartbeats of 5 s by default. Both runs pass
``--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3`` (``--rdzv-conf`` to change it); a third run, the spare
with the default heartbeats, is printed beside them (no target). The barrier rendezvous (0.6 and later) does not drop
nodes by heartbeats: there the setting has no effect and the two spare runs measure the same thing.

    python benchmarks/node_loss_recovery.py [--rounds 1] [--rdzv-conf keep_alive_interval=1,keep_alive_max_attempt=3]
"""

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _process import free_port
from _result import NO_TARGET, emit_result
from tests.functional_tests.nodes import Job, agent, wait_for_files, wait_until_hosting

from megatron.bridge.drill import events, schedule
from megatron.bridge.utils.upstream import installed_version

NAME = "node_loss_recovery"
TARGET = "<= 1.5"
FAST_DROP = "keep_alive_interval=1,keep_alive_max_attempt=3"
"""Heartbeats every second, a node dropped after 3 missed (``utils/rendezvous_keep_alive.py``)."""
STRIKE = 9


def _cycle(root: Path, spare: bool, rdzv_conf: str) -> tuple[float, dict[str, float]]:
    """One run; (seconds from the loss or strike to the first step after it, that cycle's phases)."""
    ckpt = root / "ckpt"
    root.mkdir(parents=True)
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    args = (f"--event-dir={ckpt / 'events'}", *((f"--rdzv-conf={rdzv_conf}",) if rdzv_conf else ()))
    jobs: list[Job] = []

    def node(name: str, faults: str = "") -> Job:
        job = agent(endpoint, run_id, ckpt, root / name, root / f"{name}.log", faults=faults, launcher_args=args)
        jobs.append(job)
        return job

    try:
        a = node("node_a")
        wait_until_hosting(a, endpoint)
        fault = f"stall@{STRIKE}:0,stall@{STRIKE}:1" if spare else f"kill@{STRIKE}:1"
        b = node("node_b", faults=fault)
        lost_at = None
        if spare:
            b.wait_for("initialized gloo", timeout=240)
            node("node_c")
            b.wait_for("fault injection: stall", timeout=240)
            wait_for_files("local_ckpt/*/*/*/iter_0000008_*_local.pt", [root / "node_a", root / "node_b"], count=2)
            lost_at = time.time()
            b.kill()
        codes = [a.wait(timeout=300), jobs[-1].wait(timeout=60)]
    finally:
        for job in jobs:
            job.kill()
    if codes != [0, 0]:
        sys.exit(f"{'spare' if spare else 'in-job'} run failed {codes}:\n{''.join(j.output() for j in jobs)[-4000:]}")
    timeline = events.read_run(ckpt / "events")
    if spare:
        (cycle,) = [c for c in events.cycles(timeline) if c.detected >= lost_at]
        cycle = dataclasses.replace(cycle, struck=lost_at)
    else:
        (cycle,) = events.cycles(timeline, events.outcomes(timeline, schedule.parse(f"kill@{STRIKE}:1")))
    if cycle.seconds is None or cycle.struck is None:
        sys.exit(f"no first step after the restart in the events of {ckpt / 'events'}")
    return cycle.detected - cycle.struck + cycle.seconds, {k: v for k, v in cycle.phases().items() if v is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="runs of each kind, alternating")
    parser.add_argument("--rdzv-conf", default=FAST_DROP, help=f"the launchers' --rdzv-conf (default {FAST_DROP})")
    args = parser.parse_args()
    runs = {"spare": (True, args.rdzv_conf), "spare_default": (True, ""), "in_job": (False, args.rdzv_conf)}
    seconds: dict[str, list[float]] = {kind: [] for kind in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for kind, (spare, conf) in runs.items():
                total, phases = _cycle(Path(tmp) / f"{kind}-{round_}", spare, conf)
                seconds[kind].append(total)
                shown = ", ".join(f"{name} {s:.2f}" for name, s in phases.items())
                print(f"{kind} {round_}: {total:.2f} s from the fault to the first step ({shown})", flush=True)
    median = {kind: statistics.median(values) for kind, values in seconds.items()}
    in_job = median["in_job"]
    release = installed_version("nvidia-resiliency-ext")
    print(f"RATIO node loss with a spare / in-job restart = {median['spare'] / in_job:.2f} (target {TARGET})")
    baseline = f"{in_job:.2f} s (one rank killed, in-job restart)"
    emit_result(
        NAME, f"node loss to first step, hot spare ({args.rdzv_conf or 'default heartbeats'}) / in-job restart of one "
        f"process (nvidia-resiliency-ext {release})", median["spare"] / in_job,
        f"{median['spare']:.2f} s (node lost, spare joins)", baseline, TARGET,
    )  # fmt: skip
    emit_result(
        NAME, f"the same with the rendezvous's default heartbeats (5 s x 3; nvidia-resiliency-ext {release})",
        median["spare_default"] / in_job, f"{median['spare_default']:.2f} s (node lost, spare joins)", baseline,
        NO_TARGET,
    )  # fmt: skip


if __name__ == "__main__":
    main()
