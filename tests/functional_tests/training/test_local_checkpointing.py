"""Local checkpoint tier drills: a lost node's shards come back from a replica; a bad local tier falls back to global.

"Two nodes" on one machine: two ft_launcher agents (``--nnodes=2``, one rank each) sharing a c10d rendezvous, each
with its own node-local directory (``NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE=1``: nvidia-resiliency-ext 0.6 and later
refuse two agents on one host otherwise). A node is lost by SIGKILLing its agent and worker and deleting its
directory; a replacement agent joins the job, as a spare node would.
"""

import dataclasses
import re
import shutil
import sys
import time
import uuid
import zipfile
from pathlib import Path

import pytest
from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.harness import (
    KEEP_SCHEDULE,
    Run,
    assert_same_state,
    checkpoint_state,
    free_port,
    tail,
    torchrun,
)
from tests.functional_tests.nodes import LOCAL, Job, agent, wait_for_files, wait_until_hosting

from megatron.bridge.drill import events
from megatron.bridge.training.events.stream import CyclePhase, EventKind, Mechanism
from megatron.bridge.training.exit_codes import ExitCode

# Global saves at 3, 6, 9 (harness BASE); local saves every 2 iterations, so the local tier holds iteration 8 when the
# drill strikes at the start of iteration 9, newer than the global checkpoint at 6.
STRIKE = 9


@pytest.fixture(scope="module")
def two_node_reference(tmp_path_factory) -> tuple[Run, Path]:
    """The uninterrupted run on the same two-node layout (gloo reduces across "nodes" in another order than
    within one, so a one-node run is not a bit-exact reference)."""
    root = tmp_path_factory.mktemp("two_node_reference")
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    a = agent(endpoint, run_id, root / "ckpt", root / "node_a", root / "a.log")
    wait_until_hosting(a, endpoint)
    b = agent(endpoint, run_id, root / "ckpt", root / "node_b", root / "b.log")
    codes = [a.wait(timeout=300), b.wait(timeout=60)]
    output = a.output() + b.output()
    assert codes == [0, 0], output[-6000:]
    return Run(0, output, root / "ckpt" / "events"), root / "ckpt"


def _lose_a_node(
    tmp_path: Path,
    damage_replica: bool,
    extra: tuple = (),
    spare: bool = False,
    spare_extra: tuple = (),
    codes: tuple = (0, 0),
) -> tuple[Run, Path, float]:
    """Run on two nodes, lose node B after the local save at 8 (optionally damaging its replica): a hot spare started
    with A and B (with ``spare_extra`` overrides) takes its place, or else a replacement node joins after the loss.
    Returns the run, its checkpoint directory and the time node B was lost; node A and the spare or replacement
    must exit with ``codes``."""
    ckpt, node_a, node_b = tmp_path / "ckpt", tmp_path / "node_a", tmp_path / "node_b"
    endpoint, run_id, started = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8], time.time()
    # The launchers' restarts, phase by phase, beside the ranks' events.
    launcher_events = (f"--event-dir={ckpt / 'events'}",)

    def node(local_dir: Path, log: str, faults: str = "", more: tuple = ()) -> Job:
        job = agent(
            endpoint, run_id, ckpt, local_dir, tmp_path / log, faults, (*extra, *more), launcher_args=launcher_events
        )
        agents.append(job)
        return job

    agents: list[Job] = []
    try:
        a = node(node_a, "a.log")
        wait_until_hosting(a, endpoint)  # node A hosts the rendezvous store: it must outlive node B
        b = node(node_b, "b.log", faults=f"stall@{STRIKE}:0,stall@{STRIKE}:1")
        if spare:  # a third node for a job of two (--nnodes=2:2), once B is in: the rendezvous keeps it waiting
            b.wait_for("initialized gloo", timeout=240)
            node(tmp_path / "node_c", "c.log", more=spare_extra)
        b.wait_for("fault injection: stall", timeout=240)
        # Each node holds its own shard of 8 and its peer's replica (async: once the background writers finish).
        wait_for_files("local_ckpt/*/*/*/iter_0000008_*_local.pt", [node_a, node_b], count=2)
        # The global tier is older than 8. Its save at 6 is committed; an async one only if a step's non-blocking
        # finalization saw its write done before the stall at 9.
        committed = sorted(int(p.name[len("iter_") :]) for p in ckpt.glob("iter_*"))
        assert committed and committed[-1] < 8, committed
        assert 6 in committed or "checkpoint.async_save=true" in extra, committed
        lost_at = time.time()
        b.kill()
        shutil.rmtree(node_b)
        assert not any(node_b.parent.glob("node_b/**/*.pt"))
        if damage_replica:
            _flip_a_byte_in_the_replica_of_node_b(node_a, b.output())
        if not spare:
            node(node_b, "b2.log")
        ended = (a.wait(timeout=300), agents[-1].wait(timeout=60))
    finally:
        for job in agents:
            job.kill()
    output = "".join(job.output() for job in agents)
    assert ended == codes, output[-6000:]
    return Run(0, output, ckpt / "events", started), ckpt, lost_at


def _rank_of(output: str) -> int:
    return 0 if "[rank0]" in output else 1


def _flip_a_byte_in_the_replica_of_node_b(node_a: Path, node_b_output: str) -> Path:
    """Flip one byte inside the largest tensor of node A's copy of node B's shard at iteration 8."""
    lost_rank = _rank_of(node_b_output)
    (replica,) = node_a.glob(f"local_ckpt/*/*/*/iter_0000008_{lost_rank}_local.pt")
    with zipfile.ZipFile(replica) as zf:
        member = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(replica, "r+b") as f:
        f.seek(member.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        where = member.header_offset + 30 + name_len + extra_len + member.file_size // 2
        f.seek(where)
        byte = f.read(1)[0]
        f.seek(where)
        f.write(bytes([byte ^ 0x10]))
    return replica


def _assert_recovered_from_the_replica(run: Run, ckpt: Path, reference: tuple[Run, Path]) -> None:
    """Both ranks resumed from the local tier at 8, one shard fetched from its replica; the end is bit-identical."""
    reference_run, reference_ckpt = reference
    assert run.loads(0)[-1] == run.loads(1)[-1] == ("local", 8), run.loads(0)
    assert "(1 of 2 ranks' shards fetched from replicas)" in run.output  # the line an operator reads
    assert_doc_log_lines(run.output)
    assert not run.detected(Mechanism.LOCAL_CHECKPOINT_HASH)
    resumed = {i: loss for i, loss in run.losses().items() if i > 8}
    assert resumed == {i: reference_run.losses()[i] for i in range(9, 13)}
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


@pytest.mark.timeout(300)
def test_spare_takes_the_lost_nodes_place_and_its_shard_from_the_replica_bit_identically(two_node_reference, tmp_path):
    run, ckpt, lost_at = _lose_a_node(tmp_path, damage_replica=False, spare=True)
    _assert_recovered_from_the_replica(run, ckpt, two_node_reference)
    timeline = events.read_run(ckpt / "events")
    assert not timeline.problems, timeline.problems
    # The spare waited: its launcher started with A's and B's, but no rank of it set up before node B was lost.
    starts = sorted(
        (e.time, e.restart_count)
        for e in timeline.events
        if e.kind == EventKind.PHASE and e.cycle_phase == CyclePhase.PROCESS_START and e.rank == 1
    )
    assert [t < lost_at for t, _ in starts] == [True, False], (starts, lost_at)
    assert (tmp_path / "c.log").read_text().count("training stopped at iteration 12") == 1, tail(run)
    # Node loss to the first step after it, phase by phase: the survivor's in-job restart that took the spare in.
    (cycle,) = [c for c in events.cycles(timeline) if c.detected >= lost_at]
    cycle = dataclasses.replace(cycle, struck=lost_at)
    phases = cycle.phases()
    missing = [name for name, seconds in phases.items() if seconds is None]
    assert not missing, (missing, phases)
    assert all(seconds >= 0 for seconds in phases.values()), phases
    assert abs(cycle.unaccounted_s) <= 0.05, (cycle.unaccounted_s, phases)
    total = cycle.detected - lost_at + cycle.seconds
    print(f"node loss to first step {total:.2f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))


@pytest.mark.timeout(300)
def test_spare_with_another_config_is_refused_naming_the_difference(tmp_path):
    mismatch = int(ExitCode.NODE_MISMATCH)
    run, ckpt, lost_at = _lose_a_node(
        tmp_path, damage_replica=False, spare=True, spare_extra=("optimizer.lr=0.0123",), codes=(mismatch, mismatch)
    )
    # Every rank of the new world says which rank, on which host, differs from the job, and in what.
    lines = [line for line in run.output.splitlines() if "optimizer.lr=0.0123 (the job: " in line]
    named = [re.search(r"rank [01] on \S+: optimizer.lr=0.0123", line) for line in lines]
    assert len(lines) == 2 and all(named), tail(run)
    assert_doc_log_lines(run.output)
    # Refused at set-up, before a step: nothing trained or saved after the loss, the newest checkpoint is 6's.
    timeline = events.read_run(ckpt / "events")
    steps_after = [e for e in timeline.events if e.kind == EventKind.STEP_COMPLETED and e.time > lost_at]
    assert not steps_after, steps_after
    assert sorted(p.name for p in ckpt.glob("iter_*"))[-1] == "iter_0000006"


@pytest.mark.timeout(300)
def test_lost_node_replaced_later_is_recovered_from_its_replica_with_async_saves(two_node_reference, tmp_path):
    run, ckpt, _ = _lose_a_node(tmp_path, damage_replica=False, extra=("checkpoint.async_save=true",))
    assert "Scheduling async local checkpoint at iteration 8" in run.output, tail(run)
    _assert_recovered_from_the_replica(run, ckpt, two_node_reference)


def test_damaged_replica_is_detected_and_the_global_checkpoint_is_loaded(two_node_reference, tmp_path):
    reference, reference_ckpt = two_node_reference
    run, ckpt, _ = _lose_a_node(tmp_path, damage_replica=True)
    failed = run.detected(Mechanism.LOCAL_CHECKPOINT_HASH)
    assert failed and failed[0].iteration == 8, tail(run)
    assert "_local.pt" in failed[0].detail and "content differs" in failed[0].detail, failed[0]
    assert run.loads(0) == run.loads(1) == [("global", 6)]  # node B's replacement: its first start
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


def test_async_local_saves_resume_and_without_local_files_the_global_tier_is_used(reference_tp1, tmp_path):
    reference, reference_ckpt = reference_tp1
    ckpt, local_dir = tmp_path / "ckpt", tmp_path / "local"
    tier = [f"checkpoint.non_persistent_local_ckpt_dir={local_dir}", "checkpoint.async_save=true"]
    launcher = [sys.executable, "-m", "megatron.bridge.launch", "--nproc-per-node=2", f"--master-port={free_port()}"]
    job = Job(launcher, ckpt, tier, tmp_path / "first.log", faults=f"stall@{STRIKE}:0,stall@{STRIKE}:1")
    try:
        job.wait_for("fault injection: stall", timeout=240)
        deadline = time.monotonic() + 60  # the background writers finish the local save of iteration 8
        while len(list(local_dir.glob("local_ckpt/*/*/*/iter_0000008_*_local.pt"))) < 2:
            assert time.monotonic() < deadline, sorted(local_dir.rglob("*"))
            time.sleep(0.2)
    finally:
        job.kill()
    assert "Scheduling async local checkpoint at iteration 8" in job.output()
    shutil.copytree(ckpt, tmp_path / "ckpt_backup")
    shutil.copytree(local_dir, tmp_path / "local_backup")

    shutil.rmtree(local_dir)  # every local shard gone: the job resumes from the global tier
    from_global = torchrun(ckpt, *LOCAL, *tier)
    assert from_global.exit_code == 0, tail(from_global)
    resumed = from_global.losses()  # from 3 or 6: whether the async commit of 6 finished before the stall
    assert from_global.loads() == [("global", min(resumed) - 1)]
    assert min(resumed) in (4, 7) and resumed == {i: reference.losses()[i] for i in range(min(resumed), 13)}
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))

    shutil.rmtree(ckpt)  # back to the interrupted job, its local tier intact
    shutil.rmtree(local_dir)
    shutil.copytree(tmp_path / "ckpt_backup", ckpt)
    shutil.copytree(tmp_path / "local_backup", local_dir)
    from_local = torchrun(ckpt, *LOCAL, *tier)
    assert from_local.exit_code == 0, tail(from_local)
    assert from_local.loads() == [("local", 8)]
    assert from_local.losses() == {i: reference.losses()[i] for i in range(9, 13)}
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


def test_nan_right_after_a_local_load_discards_it_and_the_restart_loads_the_global_one(reference_tp1, tmp_path):
    reference, reference_ckpt = reference_tp1
    ckpt, local_dir = tmp_path / "ckpt", tmp_path / "local"
    tier = [*LOCAL, f"checkpoint.non_persistent_local_ckpt_dir={local_dir}"]
    # The local checkpoint of 8 is intact byte for byte (its hashes match) but its weights are NaN.
    first = torchrun(ckpt, *tier, env={"MBRIDGE_FAULTS": f"nan@8:0:local_save,nan@8:1:local_save,kill@{STRIKE}:1"})
    assert first.exit_code != 0 and "saved with NaN" in first.output, tail(first)
    second = torchrun(ckpt, *tier)
    assert second.exit_code == 23, tail(second)
    assert second.loads() == [("local", 8)]
    assert {e.iteration for e in second.detected(Mechanism.NAN_GUARD)} == {9}, tail(second)
    assert "1 step(s) after loading the local checkpoint of iteration 8" in second.output  # why the exit is 23
    assert not list(local_dir.rglob("iter_0000008_*_local.pt"))
    third = torchrun(ckpt, *tier)
    assert third.exit_code == 0, tail(third)
    assert third.loads() == [("global", 6)]
    assert third.losses() == {i: reference.losses()[i] for i in range(7, 13)}
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


def test_atomic_algorithm_saves_and_loads_and_an_older_local_checkpoint_yields_to_the_global_one(
    reference_tp1, tmp_path
):
    reference, reference_ckpt = reference_tp1
    ckpt, local_dir = tmp_path / "ckpt", tmp_path / "local"
    tier = [*LOCAL, f"checkpoint.non_persistent_local_ckpt_dir={local_dir}"]
    tier.append("checkpoint.non_persistent_local_ckpt_algo=atomic")
    first = torchrun(ckpt, *tier, env={"MBRIDGE_FAULTS": f"kill@{STRIKE}:1"})
    assert first.exit_code != 0 and "saved local checkpoint at iteration 8" in first.output, tail(first)
    assert_doc_log_lines(first.output)
    resumed = torchrun(ckpt, *tier)
    assert resumed.exit_code == 0, tail(resumed)
    assert "loaded verified local checkpoint at iteration 8" in resumed.output, tail(resumed)
    assert resumed.losses() == {i: reference.losses()[i] for i in range(9, 13)}
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))
    # The local tier now holds 10 (at 12 the global save was due, and a local save never replaces it): older.
    again = torchrun(ckpt, *tier, "train.train_iters=13", KEEP_SCHEDULE)
    assert again.exit_code == 0, tail(again)
    assert "local checkpoint at iteration 10 is not newer than the global one at 12" in again.output, tail(again)
    assert re.search(r"successfully loaded verified checkpoint \S+iter_0000012 at iteration 12", again.output)
