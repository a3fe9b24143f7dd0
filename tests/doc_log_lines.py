"""The log lines the docs quote, and the functional test that finds each one in the output of a real run.

The convention (``docs/**/*.md``, ``skills/**/*.md``, ``README.md``): a quoted log line sits in a fenced block whose
info string is ``log``, one log line per line, never inline. A line is the message as the run prints it, or any part
of it (the timestamp, rank and logger prefix may be left out); ``…`` stands for a variable part (any text on that
line), and a line of just ``…`` for lines left out. Every other fenced block names what it holds (``text`` for sample
output that is not checked, such as a report with one run's timings), so a log quote cannot hide in an unlabelled one.

Where upstream releases print a line differently, each spelling sits in a block whose info string adds the releases
it holds for, as a requirement: ```` ```log nvidia-resiliency-ext<0.6 ````. A run checks only the lines of the
releases it has installed (and every line of an unconditioned block).

A quoted line is found in a run's output when one line of the output contains it, each ``…`` standing for any text.
:data:`CHECKS` says which functional test checks which quoted lines: that test calls :func:`assert_doc_log_lines` on
its run's output. ``tests/unit_tests/docs/test_log_lines.py`` fails fast when a doc quotes a line that no test
checks, when a test checks a line no doc quotes any more, or when a named test does not call the check.
"""

import os
import re
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
ELLIPSIS = "…"


def docs() -> list[Path]:
    """Every doc the convention applies to."""
    return sorted([*REPO.glob("docs/**/*.md"), *REPO.glob("skills/**/*.md"), REPO / "README.md"])


_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def fenced_blocks(markdown: str) -> list[tuple[int, str, list[str]]]:
    """``(line number, info string, body lines)`` of every fenced block, the body without the fence's indent."""
    blocks = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening or (opening["fence"][0] == "`" and "`" in opening["info"]):
            i += 1
            continue
        indent, fence, info = len(opening["indent"]), opening["fence"], opening["info"].strip()
        body, i = [], i + 1
        start = i
        while i < len(lines) and not re.fullmatch(rf"[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*", lines[i]):
            line = lines[i]
            body.append(line[min(indent, len(line) - len(line.lstrip())) :])
            i += 1
        blocks.append((start, info, body))
        i += 1
    return blocks


def log_condition(info: str) -> Optional[str]:
    """The releases a fenced block with info string ``info`` quotes log lines for: ``""`` for every release,
    a requirement such as ``"nvidia-resiliency-ext>=0.6"``; ``None`` when it is not a log block."""
    kind, _, condition = info.partition(" ")
    return condition.strip() if kind == "log" else None


def quoted_lines(markdown: str) -> list[str]:
    """The log lines quoted in the text's ```log blocks (of any release), stripped, in order, without elisions and
    repeats."""
    return list(quote_conditions(markdown))


def quote_conditions(markdown: str) -> dict[str, set[str]]:
    """Each quoted log line -> the conditions of the blocks that quote it (``""``: every release)."""
    found: dict[str, set[str]] = {}
    for _, info, body in fenced_blocks(markdown):
        condition = log_condition(info)
        if condition is None:
            continue
        for line in body:
            line = line.strip()
            if line and line != ELLIPSIS:
                found.setdefault(line, set()).add(condition)
    return found


def holds(condition: str) -> bool:
    """Whether the installed releases meet ``condition`` (a requirement; ``""`` always holds)."""
    if not condition:
        return True
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    requirement = Requirement(condition)
    try:
        return requirement.specifier.contains(version(requirement.name), prereleases=True)
    except PackageNotFoundError:
        return False


def for_installed_releases(lines) -> list[str]:
    """The lines (quoted in the docs) that a run with the installed releases prints: those of an unconditioned block,
    or of a block whose condition holds."""
    conditions: dict[str, set[str]] = {}
    for doc in docs():
        for line, found in quote_conditions(doc.read_text()).items():
            conditions.setdefault(line, set()).update(found)
    return [line for line in lines if any(holds(c) for c in conditions.get(line, {""}))]


def pattern(line: str) -> re.Pattern:
    """The quoted line as a regular expression: literal text, with ``…`` matching any text within one line."""
    return re.compile(".*?".join(re.escape(part) for part in line.strip().split(ELLIPSIS)))


def missing(lines, text: str) -> list[str]:
    """The quoted lines that no line of ``text`` contains."""
    return [line for line in lines if not pattern(line).search(text)]


def _near(line: str, text: str) -> list[str]:
    """Output lines sharing the longest literal part of ``line``: what a quote that went stale probably was."""
    part = max(line.split(ELLIPSIS), key=len).strip()
    words = part.split()
    for size in range(len(words), 0, -1):
        for start in range(len(words) - size + 1):
            probe = " ".join(words[start : start + size])
            near = [x.strip()[:300] for x in text.splitlines() if probe in x]
            if near and (size >= 3 or size == len(words)):
                return near[:3]
    return []


def current_test() -> str:
    """The running test's node id without its parameters (``tests/...py::test_name``)."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    assert current, "assert_doc_log_lines is called from a test"
    return re.sub(r"\[.*\]$", "", current.rsplit(" ", 1)[0])


def assert_doc_log_lines(text: str) -> None:
    """Assert that ``text``, the output of the calling test's run, has every quoted line :data:`CHECKS` gives it."""
    test = current_test()
    lines = CHECKS.get(test)
    assert lines, f"{test} checks no quoted log line: give it its lines in CHECKS of tests/doc_log_lines.py"
    absent = missing(for_installed_releases(lines), text)
    report = "\n".join(f"  {line!r}\n    similar output lines: {_near(line, text)}" for line in absent)
    assert not absent, (
        f"the docs quote log lines this run did not print (fix the doc, or the log line if the doc is right):\n{report}"
    )


_MAIN_JOB = "tests/functional_tests/test_main_job.py"
_TRAINING = "tests/functional_tests/training"
_SLURM = "tests/functional_tests/recipes/test_preemption_slurm.py"
_JOB_INFO = (  # the second start of a requeued Slurm job
    "job info:",
    "launcher: ft_launcher on …",
    "world size 2, 2 rank(s) per node, device cpu",
    "restarts: in-job 0, in-process 0, requeue 1",
    "slurm: job_id=…, restart_count=1, nodelist=…, num_nodes=1, partition=…",
    "checkpoints: save=…, load=…",
    "resumed from: global tier, iteration …, …/iter_… (newest verified checkpoint in checkpoint.load)",
)

_FETCHED_FROM_REPLICAS = (
    "loaded verified local checkpoint at iteration 8 from … (1 of 2 ranks' shards fetched from replicas)",
    "loaded verified local checkpoint at iteration … from … (1 of 2 ranks' shards fetched from replicas)",
    # The main job resumes from the local tier only when its async local save finished before the kill.
    "loaded verified local checkpoint at iteration … from … (… of … ranks' shards fetched from replicas)",
)
"""A lost node's shard comes back from its replica (a spare's, or a later replacement's)."""

CHECKS: dict[str, tuple[str, ...]] = {
    # Elastic shrink: the local checkpoint of the larger world skipped, the smaller world's layout; a refused layout.
    f"{_TRAINING}/test_shrink.py::test_shrink_goes_on_alone_from_the_global_checkpoint_with_the_same_global_batch": (
        "local checkpoint at iteration … was saved under another parallel layout (world size 2, tensor parallel 1, "
        "pipeline parallel 1; this run: world size 1, tensor parallel 1, pipeline parallel 1): the local tier cannot "
        "reshard, so it is skipped and the global checkpoint is loaded instead",
        "initialized gloo on cpu: world size 1, tensor parallel 1, pipeline parallel 1, data parallel 1 (global batch "
        "8: 4 micro-batch(es) of 2 per data-parallel rank and step)",
    ),
    f"{_TRAINING}/test_shrink.py::test_shrink_refuses_a_checkpoint_of_another_tensor_parallel_size": (
        "… was saved with the distributed optimizer under another model-parallel layout "
        "(model.tensor_model_parallel_size 1 in the checkpoint, 2 now): …",
    ),
    # The main job's drill (stdout, and the log of both runs): most lines come from here.
    f"{_MAIN_JOB}::test_the_log_lines_the_docs_quote_are_in_its_output": (
        # ft_launcher, its rank monitors and our fault tolerance
        "[FaultTolerance] section timeouts (from the launcher): setup=…, step=…, checkpointing=…, out-of-section=…",
        "[FaultTolerance] section timeouts (loaded from ft_state.json): setup=…, step=…, checkpointing=…, "
        "out-of-section=…",
        "[FaultTolerance] section timeouts (calculated): setup=…, step=…, checkpointing=…, out-of-section=…",
        "[FaultTolerance] section timeouts (from the launcher): …",
        "[FaultTolerance] section timeouts (loaded from ft_state.json): …",
        "[FaultTolerance] section timeouts (calculated): …",
        "[FaultTolerance] … raised to inprocess_restart.hard_timeout=…: in-process restart recovers a hang first, the "
        "rank monitor only what it cannot abort",
        "… will restart worker group",
        "will restart worker group",
        # preemption
        "Received signal 15, initiating graceful stop",
        "Preemption detected, saving checkpoint and exiting",
        "training stopped at iteration …: a rank received SIGTERM (train.exit_signal) (exit code 18)",
        # in-process restart
        "in-process restart: iteration … starts in pid … as rank … of …",
        # checkpoints, global and local
        "successfully loaded verified checkpoint … at iteration …",
        "successfully loaded verified checkpoint …/iter_… at iteration …",
        "Scheduling async checkpoint save at iteration … to … (blocking … s)",
        "finalized async checkpoint save at iteration … (commit … s)",
        "no complete local checkpoint on the nodes of this job; using the global tier",
        "local checkpoint at iteration 45 failed verification",
        "local checkpoint at iteration 45 failed verification (1 problem(s)): rank 1's shard …",
        "local checkpoint at iteration 45 failed verification (1 problem(s)): rank 1's shard "
        "…/local_ckpt/…/1/iter_0000045_1_local.pt on …: tensor …: content differs from what its owner saved; "
        "discarding the local tier's iteration 45 and loading the global checkpoint instead",
        "local checkpoint at iteration … failed verification (… problem(s)): rank …'s shard …: tensor …: content "
        "differs from what its owner saved; discarding the local tier's iteration … and loading the global checkpoint "
        "instead",
        "resume from: … (…)",
        # health
        "device health: no device checks on this machine (…)",
        "[attribution] rank 1 in stall_forever (injection.py:…) [step open for … s]; all stacks in …",
        "[attribution] rank … in … (…:…) [step open for … s]; all stacks in …",
        "[attribution] attempt_…: rank 0 in … (…) [step open for … s], waiting in a collective; rank 1 in "
        "stall_forever (injection.py:…) [step open for … s] — stacks in …/attempt_…",
        "[attribution] attempt_…: … rank 1 in stall_forever …",
        "[attribution] attempt_…: …",
        # the drill's own report
        "[drill] faults: nan@12:1, kill@27:1, …",
        "fault injection: …",
        "| kill@27:1 | … |",
        "| corrupt-local@45:1 | … | local tier: content hash mismatch at load | … | discarded, fell back to the global "
        "tier | … |",
        "goodput: 0.…",
        "final state EQUAL to the fault-free run with the same seed: …",
        "final state EQUAL to the fault-free run with the same seed: … bit for bit, at iteration 100",
        "training job exit code 0; drill PASSED",
        "drill PASSED",
    ),
    f"{_MAIN_JOB}::test_the_plot_tensorboard_and_checkpoints_are_written": (
        "OK     runs/main_job/checkpoints/iter_0000100 (… files)",
    ),
    # Lines the main job cannot print: each from the functional test whose run prints it.
    "tests/functional_tests/test_upstream_checkpoint.py::test_megatron_bridge_checkpoint_resumes_bit_identically": (
        "checkpoint …/iter_0000006 was not written by this package and has no manifest.json: the sizes and SHA-256 "
        "hashes of its … files (.metadata, __0_0.distcp, …) cannot be verified, so a truncated or corrupted file is "
        "not detected before the load; loading it unverified",
        "successfully loaded unverified checkpoint …/iter_0000006 at iteration 6",
    ),
    f"{_TRAINING}/test_fault_tolerance.py::test_fault_detected_restarted_resumed_identical": (  # the hang in a step
        "[RankMonServer…] Section 'step' has been open for … seconds. Timeout is … seconds.",  # nvrx < 0.6
        "[RankMonServer…] Section 'step' has been open for …",
        "[Cycle …] Section 'step' has been open for … seconds. Timeout is … seconds.",  # nvrx >= 0.6
        "[Cycle …] Section 'step' has been open for …",
    ),
    f"{_TRAINING}/test_fault_tolerance.py::test_restart_budget_is_bounded": (
        "Some rank(s) exited with non-zero exit code: …. Agent's exit code = 1",
        "ft_launch: the workers failed with exit code 137 (killed by a signal); the launcher exits with it, not with "
        "ft_launcher's 1",
    ),
    f"{_TRAINING}/test_no_progress.py::test_no_progress_stops_a_crash_loop_after_the_guard_not_the_budget": (
        "no-progress guard: no progress in the last … attempts of job … (ft.max_no_progress_restarts=…): …; the same "
        "failure each time: rank … at iteration …: …",
    ),
    f"{_TRAINING}/test_fault_tolerance.py::test_a_config_error_under_ft_launcher_is_not_restarted": (
        "ft_launch: a worker exited with exit code 2 (CONFIG_ERROR), whose action is stop: the worker group is not "
        "restarted",
    ),
    f"{_TRAINING}/test_fault_tolerance_example.py::test_timeouts_come_from_the_launcher_then_are_learned": (
        "[FaultTolerance] section timeouts (from the launcher): setup=180.0s, step=10.0s, checkpointing=120.0s, "
        "out-of-section=60.0s",
        "training stopped at iteration …: reached train.train_iters=… (exit code 0)",
        "Agent exits with exit code = 0.",
    ),
    f"{_TRAINING}/test_fault_tolerance_example.py::test_simulated_hang_is_detected_restarted_and_training_completes": (
        "fault injection: hang at 4 s into training on rank 1",
    ),
    f"{_TRAINING}/test_straggler_example.py::test_example_prints_both_score_kinds_for_every_rank": (
        "Straggler report at iteration … (scores from wall time of the forward step; …)",
        "Straggler report at iteration … (scores from wall time of the forward step; CUDA kernel timing is not "
        "available here):",
        "GPU relative performance:",
        "GPU individual performance:",
        "Rank=0 Node=… Score=…",
        "Rank=1 Node=… Score=…",
        "Rank=… Node=… Score=…",
        "Straggler report processing time: … sec.",
    ),
    f"{_TRAINING}/test_straggler_example.py::test_example_slow_rank_is_flagged": (
        "Worst performing 2/2 ranks:",
        "Best performing 2/2 ranks:",
        "Rank=1 Node=… Score=0.…",
        "Rank=0 Node=… Score=1.00",
        "Straggler detected: Rank=1 Node=… GPU relative performance Score=0.… < "
        "nvrx_straggler.gpu_relative_perf_threshold=0.7",
        "Straggler detected: Rank=1 Node=… GPU relative performance …",
        "Straggler detected: …",
    ),
    f"{_TRAINING}/test_rerun_state_machine.py::test_persistent_nan_under_ft_launcher_stops_after_bounded_restarts": (
        "Got rescheduled on the same GPU. Need to resume again from the same checkpoint (node: …, gpu: …)",
    ),
    f"{_TRAINING}/test_weight_hash.py::test_weight_hash_bitflip_found_rolled_back_ends_as_fault_free": (
        "weight hash check after iteration …: data-parallel replicas hold different weights: rank(s) … differ …",
    ),
    f"{_TRAINING}/test_rerun_state_machine.py::test_spiky_loss_is_flagged_only_when_checked": (
        "Unexpected result … (message='Spiky loss')",
    ),
    f"{_TRAINING}/test_rerun_state_machine.py::test_report_determinism_stats_reruns_every_step_and_reports": (
        "determinism stats at iteration …, '…' (all ranks, since start): …",
    ),
    f"{_TRAINING}/test_local_checkpointing.py::"
    "test_spare_takes_the_lost_nodes_place_and_its_shard_from_the_replica_bit_identically": _FETCHED_FROM_REPLICAS,
    f"{_TRAINING}/test_local_checkpointing.py::"
    "test_lost_node_replaced_later_is_recovered_from_its_replica_with_async_saves": _FETCHED_FROM_REPLICAS,
    f"{_TRAINING}/test_local_checkpointing.py::test_spare_with_another_config_is_refused_naming_the_difference": (
        "1 of 2 ranks run other code or another config than the job's (rank … on … and the ranks like it); they are "
        "refused:",
    ),
    f"{_TRAINING}/test_local_checkpointing.py::"
    "test_atomic_algorithm_saves_and_loads_and_an_older_local_checkpoint_yields_to_the_global_one": (
        "saved local checkpoint at iteration … in … (blocking … s)",
    ),
    f"{_TRAINING}/test_checkpoint_faults.py::test_corrupt_newest_checkpoint_falls_back": (  # the flipped byte
        "checkpoint …/iter_0000006 failed verification (1 problems): __1_0.distcp: sha256 …; trying an older one",
        "fell back to checkpoint at iteration 3 (newest was 6)",
    ),
    f"{_TRAINING}/test_health.py::test_stalled_peer_is_named_with_its_stack": (
        "training stopped: PEER_UNRESPONSIVE (exit code 24): liveness ping at iteration 5: rank 1 (last ping at "
        "iteration 4; stack: rank 1 in stall_forever (injection.py:…) [step open for … s]) did not answer within "
        "health.liveness_ping_timeout=4.0 s (dead or stuck; noticed after … s: …)",
        "liveness ping at iteration …: rank … (last ping at iteration …; stack: …) did not answer within "
        "health.liveness_ping_timeout=… s (dead or stuck; noticed after … s: …)",
    ),
    f"{_TRAINING}/test_goodput.py::test_goodput_of_a_job_with_a_killed_rank": (
        "goodput: 0.… (productive … s of … s wall) | lost: startup … s, checkpoint_save … s, rollback … s, "
        "restart … s, rerun … s, other … s",
    ),
    f"{_TRAINING}/test_inprocess_restart.py::test_max_iterations_used_up_stops_with_22": (
        "in-process restart gave up (…); inprocess_restart.max_iterations=…, max_rank_faults=…. Under ft_launcher the "
        "job restarts in-job from the newest checkpoint",
    ),
    f"{_TRAINING}/test_storage_faults.py::test_too_little_space_stops_before_writing_at_a_save_and_at_start": (
        "training stopped: STORAGE_FULL (exit code 26): checkpoint.save=…/ckpt: not enough free space for the global "
        "checkpoint of iteration 6: … bytes (… MiB) free (seen by rank 0 on …), about … bytes (… MiB) needed (the "
        "last global checkpoint was … bytes (… MiB); plus 10% and 1,048,576 bytes (1.0 MiB)). Nothing was written. The "
        "tracker still names iteration 3, the newest committed checkpoint, which a restart loads. Fix: free space in "
        "…/ckpt or raise its quota (checkpoint.most_recent_k keeps fewer checkpoints), then requeue the job …",
        "not enough free space for the next global checkpoint (checked at start)",
    ),
    f"{_TRAINING}/test_storage_faults.py::test_disk_full_during_a_global_save": (
        "training stopped: STORAGE_FULL (exit code 26): checkpoint.save=…/ckpt: the file system is full: the global "
        "checkpoint of iteration 6 could not be written (…, seen by rank 0; … free now, a checkpoint of this run needs "
        "about … bytes (… MiB)). Its partial files (.tmp_iter_0000006.…) were removed: a loader never sees them. The "
        "tracker still names iteration 3, the newest committed checkpoint, which a restart loads. Fix: free space in …",
    ),
    f"{_TRAINING}/test_storage_faults.py::test_save_dir_deleted_mid_run_is_recreated_and_a_restart_resumes_from_it": (
        "The checkpoints this run saved there before are gone from this path. The training state in memory is the "
        "best copy left: the directory is created again and the global checkpoint of iteration 6 is saved into it, "
        "and saving goes on there. Find out what removed it.",
    ),
    f"{_TRAINING}/test_storage_faults.py::test_a_save_slower_than_its_section_timeout_is_a_slow_save_not_a_hung_step": (
        "rank … (pid …): slow checkpoint save, not a hung step: the save has been running … s, past the checkpointing "
        "section timeout of … s; the rank is stopped and restarted, and the run resumes from the newest committed "
        "checkpoint. Fix: check the checkpoint storage's write bandwidth, or raise the checkpointing timeout "
        "(--ft-rank-section-timeouts checkpointing:<s>, or ft.calc_ft_timeouts=true)",
    ),
    f"{_SLURM}::test_time_limit_signal_saves_requeues_and_resumes": _JOB_INFO,
    f"{_SLURM}::test_higher_priority_job_preempts_and_training_resumes": _JOB_INFO,
}
"""``{test node id: quoted lines it checks}``: every line of a ```log block in the docs is here at least once."""
