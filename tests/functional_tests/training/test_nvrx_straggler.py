"""Straggler drills: a real 2-rank run scores its ranks; a rank slowed 4x is flagged, stops the run, and it resumes.

Reports come every ``report_time_interval`` seconds; nvidia-resiliency-ext first spends 16 steps measuring the step
time to turn that into a number of steps. On CPU the scores come from the wall time of the forward step, so the model
here is wider and its sequences longer than the tiny recipe's (forward ~20 ms, step ~60 ms, ~8 reports in 150 steps):
with the recipe's ~4 ms forward step a single OS scheduling hiccup on a busy 2-core machine moves a median by 30%
and flags a healthy rank.
"""

import re
from pathlib import Path

import pytest
from tests.functional_tests.harness import Run, assert_same_state, checkpoint_state, tail, torchrun

from megatron.bridge.training.events.stream import Mechanism

# Scores compare the ranks' step times: other drills on the same 2 cores load one rank's core more than the other's
# (a healthy rank scored 0.54 beside two other test runs), so these run alone, after the parallel ones.
pytestmark = pytest.mark.serial

STRAGGLER = [
    "train.train_iters=150",
    "checkpoint.save_interval=150",  # no save inside a scored window: rank 0's share of a commit slowed it to 0.68 once
    "nvrx_straggler.enabled=true",
    "nvrx_straggler.report_time_interval=1.0",
    "model.hidden_size=128",
    "model.seq_length=128",
    "dataset.sequence_length=128",
]
# Healthy runs are judged on the relative score (ranks against each other) at 0.4: the lowest healthy score seen on
# a busy 2-core machine was 0.54 (beside two other test runs; 0.68 alone, always rank 0, which also logs and writes
# TensorBoard), and the slowed rank below runs 4x slower (about 0.25; 2x gave up to 0.59, too close). The individual
# score (a rank against its own past) is reported but flags only a near-stopped rank here (0.05): on a shared CPU
# machine it follows the machine's load, and a healthy rank fell to 0.55 when another test run started beside it (the
# drill turns it off for the same reason). The slowed run keeps the default 0.7 for both.
HEALTHY_THRESHOLDS = [
    "nvrx_straggler.gpu_relative_perf_threshold=0.4",
    "nvrx_straggler.gpu_individual_perf_threshold=0.05",
]
_REPORT_RE = re.compile(r"Straggler report at iteration (\d+) \(scores from ([^)]*)\):\n((?:.*\n)*?)Straggler report")
_SCORE_RE = re.compile(r"Rank=(\d+) Node=\S+ Score=(\S+)")


def reports(run: Run) -> list[tuple[int, str, dict[str, dict[int, float]]]]:
    """Every report rank 0 logged: (iteration, score source, {block title: {rank: score}})."""
    out = []
    for match in _REPORT_RE.finditer(run.output):
        blocks: dict[str, dict[int, float]] = {}
        title = None
        for line in match.group(3).splitlines():
            if line.startswith("GPU "):
                title = line.rstrip(":")
                blocks[title] = {}
            elif title is not None and (score := _SCORE_RE.match(line)):
                blocks[title][int(score.group(1))] = float(score.group(2))
        out.append((int(match.group(1)), match.group(2), blocks))
    return out


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> tuple[Run, Path, Path]:
    """150 steps with straggler detection and no slowed rank; TensorBoard on."""
    root = tmp_path_factory.mktemp("straggler_healthy")
    run = torchrun(root / "ckpt", *STRAGGLER, *HEALTHY_THRESHOLDS, f"logger.tensorboard_dir={root / 'tb'}")
    assert run.exit_code == 0, tail(run)
    return run, root / "ckpt", root / "tb"


def test_no_rank_is_flagged_without_a_straggler(healthy):
    run = healthy[0]
    found = reports(run)
    assert len(found) >= 4, tail(run)
    for iteration, source, blocks in found:
        assert "wall time of the forward step" in source  # no CUDA here, and the report says so
        assert set(blocks) == {"GPU relative performance", "GPU individual performance"}
        for title, scores in blocks.items():
            assert set(scores) == {0, 1}, (iteration, title)
            low = 0.4 if title == "GPU relative performance" else 0.05  # see HEALTHY_THRESHOLDS
            assert all(low <= s <= 1.0 for s in scores.values()), (iteration, title, scores)
    assert "Straggler detected" not in run.output
    assert re.search(r"Straggler report processing time: \d+\.\d{3} sec\.", run.output)


def test_scores_are_written_to_tensorboard(healthy):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _, tb = healthy
    events = EventAccumulator(str(tb))
    events.Reload()
    report_steps = [iteration for iteration, _, _ in reports(run)]
    for kind in ("relative", "individual"):
        for stat in ("min", "median", "max"):
            scalars = events.Scalars(f"straggler/{kind}_perf_score_{stat}")
            assert [s.step for s in scalars] == report_steps
            assert all(0.0 < s.value <= 1.0 for s in scalars)
    assert [s.value for s in events.Scalars("straggler/flagged_ranks")] == [0.0] * len(report_steps)


def test_slowed_rank_is_flagged_stops_all_ranks_and_training_resumes(healthy, tmp_path):
    reference, reference_ckpt, _ = healthy
    ckpt = tmp_path / "ckpt"
    slowed = torchrun(ckpt, *STRAGGLER, "nvrx_straggler.stop_if_detected=true", env={"MBRIDGE_FAULTS": "slow@1:1:x4"})
    assert slowed.exit_code == 21, tail(slowed)  # ExitCode.STRAGGLER_STOP
    (stop_at, _, blocks), *_ = reports(slowed)
    assert blocks["GPU relative performance"][1] < 0.4, blocks  # below the healthy runs' threshold, too
    assert blocks["GPU relative performance"][0] == 1.0, blocks
    assert {e.rank for e in slowed.detected(Mechanism.STRAGGLER_SCORE)} == {1}
    for rank in (0, 1):
        assert f"[rank{rank}] INFO megatron.bridge.training.pretrain: training stopped at iteration {stop_at}: " in (
            slowed.output
        ), tail(slowed)
    assert (ckpt / f"iter_{stop_at:07d}").is_dir()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stop_at)

    resumed = torchrun(ckpt, *STRAGGLER)
    assert resumed.exit_code == 0, tail(resumed)
    assert f"at iteration {stop_at}" in resumed.output
    ref_losses = reference.losses()
    assert resumed.losses() == {i: ref_losses[i] for i in range(stop_at + 1, 151)}
    assert_same_state(checkpoint_state(ckpt / "iter_0000150"), checkpoint_state(reference_ckpt / "iter_0000150"))
