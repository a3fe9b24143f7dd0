"""Straggler reports: score selection, flagging, the report text and TensorBoard scalars; one real Detector run."""

import math
import time
from types import SimpleNamespace

import pytest
import torch

from megatron.bridge.training.config import NVRxStragglerDetectionConfig
from megatron.bridge.training.nvrx_straggler import (
    FORWARD_SECTION,
    KERNEL_SOURCE,
    WALL_TIME_SOURCE,
    NVRxStragglerDetectionManager,
    ScoreBlock,
    StragglerReport,
    check_nvrx_straggler_detection,
    safe_shutdown_nvrx_straggler_manager,
)

NAN = float("nan")


def _raw(gpu_rel=None, gpu_ind=None, sec_rel=None, sec_ind=None):
    """What nvidia-resiliency-ext's ``Report`` carries, for our report building only."""
    return SimpleNamespace(
        gpu_relative_perf_scores=gpu_rel or {},
        gpu_individual_perf_scores=gpu_ind or {},
        section_relative_perf_scores={FORWARD_SECTION: sec_rel or {}, "train_step": {0: 0.1, 1: 0.1}},
        section_individual_perf_scores={FORWARD_SECTION: sec_ind or {}},
        rank_to_node={0: "node-a", 1: "node-b", 2: "node-b"},
    )


def _manager(**cfg) -> NVRxStragglerDetectionManager:
    return NVRxStragglerDetectionManager(NVRxStragglerDetectionConfig(enabled=True, **cfg))


def test_without_kernel_timing_scores_come_from_the_forward_section():
    raw = _raw(gpu_rel={0: NAN, 1: NAN}, gpu_ind={0: NAN, 1: NAN}, sec_rel={0: 1.0, 1: 0.5}, sec_ind={0: 1.0, 1: 0.9})
    report = _manager()._build_report(raw, iteration=40)
    assert report.source == WALL_TIME_SOURCE
    assert [b.scores for b in report.blocks] == [{0: 1.0, 1: 0.5}, {0: 1.0, 1: 0.9}]
    assert report.flagged() == [
        "Rank=1 Node=node-b GPU relative performance Score=0.50 < nvrx_straggler.gpu_relative_perf_threshold=0.7"
    ]


def test_kernel_scores_win_when_present_and_disabled_kinds_are_left_out():
    raw = _raw(gpu_rel={0: 0.6, 1: 1.0}, sec_rel={0: 1.0, 1: 1.0})
    report = _manager(calc_individual_gpu_perf=False, gpu_relative_perf_threshold=0.65)._build_report(raw, 7)
    assert report.source == KERNEL_SOURCE
    assert [b.title for b in report.blocks] == ["GPU relative performance"]
    assert report.blocks[0].flagged() == [0]


def test_report_text_has_the_documented_format():
    block = ScoreBlock("GPU relative performance", "x", {0: 1.0, 1: 0.42, 2: 0.97}, 0.7)
    report = StragglerReport(12, WALL_TIME_SOURCE, [block], {0: "a", 1: "b", 2: "b"}, processing_time=0.0421)
    assert report.format(num_to_print=2).splitlines() == [
        f"Straggler report at iteration 12 (scores from {WALL_TIME_SOURCE}):",
        "GPU relative performance:",
        "Worst performing 2/3 ranks:",
        "Rank=1 Node=b Score=0.42",
        "Rank=2 Node=b Score=0.97",
        "Best performing 2/3 ranks:",
        "Rank=0 Node=a Score=1.00",
        "Rank=2 Node=b Score=0.97",
        "Straggler report processing time: 0.042 sec.",
    ]


def test_nan_scores_are_listed_last_and_never_flagged():
    block = ScoreBlock("GPU individual performance", "x", {0: NAN, 1: 0.5, 2: 0.9}, 0.7)
    assert block.flagged() == [1]
    assert block.stats() == {"min": 0.5, "median": 0.7, "max": 0.9}
    lines = StragglerReport(1, KERNEL_SOURCE, [block], {}).format(3).splitlines()
    assert [line.split()[0] for line in lines[3:6]] == ["Rank=1", "Rank=2", "Rank=0"]  # worst first
    assert [line.split()[0] for line in lines[7:10]] == ["Rank=2", "Rank=1", "Rank=0"]  # best first, NaN last
    assert lines[9] == "Rank=0 Node=<unk> Score=nan"


def test_scalars_summarise_each_score_kind():
    blocks = [
        ScoreBlock("GPU relative performance", "x", {0: 1.0, 1: 0.4, 2: 0.8}, 0.7),
        ScoreBlock("GPU individual performance", "y", {0: 0.6, 1: 0.5, 2: 1.0}, 0.7),
    ]
    scalars = StragglerReport(3, KERNEL_SOURCE, blocks, {}).scalars()
    assert scalars == {
        "straggler/relative_perf_score_min": 0.4,
        "straggler/relative_perf_score_median": 0.8,
        "straggler/relative_perf_score_max": 1.0,
        "straggler/individual_perf_score_min": 0.5,
        "straggler/individual_perf_score_median": 0.6,
        "straggler/individual_perf_score_max": 1.0,
        "straggler/flagged_ranks": 2.0,  # rank 1 in both kinds counts once, rank 0 once
    }


class _ScriptedDetector:
    """Hands out one scripted report per check, as nvidia-resiliency-ext's Detector does on rank 0."""

    def __init__(self, reports):
        self.reports = list(reports)

    def generate_report_if_interval_elapsed(self):
        return self.reports.pop(0)

    def is_interval_elapsed(self):
        return True


def _stops(manager, relative_scores):
    manager._detector = _ScriptedDetector(_raw(sec_rel=s) for s in relative_scores)
    return [manager.check(i).stop_reason for i in range(1, len(relative_scores) + 1)]


def test_stop_waits_for_the_same_rank_flagged_in_consecutive_reports(caplog):
    healthy, rank1_slow, rank0_slow = {0: 1.0, 1: 1.0}, {0: 1.0, 1: 0.1}, {0: 0.1, 1: 1.0}
    assert [r is not None for r in _stops(_manager(stop_if_detected=True), [healthy, rank1_slow])] == [False, True]
    manager = _manager(stop_if_detected=True, stop_after_consecutive_reports=2)
    with caplog.at_level("WARNING"):
        stops = _stops(manager, [rank1_slow, healthy, rank1_slow, rank0_slow, rank1_slow, rank1_slow])
    assert stops[:5] == [None] * 5  # a passing slowdown, then two different ranks: never twice in a row
    assert stops[5].startswith("straggler detected at iteration 6 in 2 reports in a row (Rank=1 ")
    assert "flagged so far: rank 1 x1" in caplog.text
    assert _stops(_manager(stop_after_consecutive_reports=2), [rank1_slow] * 3) == [None] * 3  # no stop_if_detected


def test_reports_go_to_the_configured_logger(caplog):
    rank1_slow = {0: 1.0, 1: 0.1}
    with caplog.at_level("INFO"):
        _stops(_manager(logger_name="my.job.stragglers", stop_if_detected=True), [rank1_slow])
    by_logger = {(r.name, r.levelname) for r in caplog.records}
    assert ("my.job.stragglers", "INFO") in by_logger, "the report"
    assert ("my.job.stragglers", "WARNING") in by_logger, "the flagged rank"
    assert {name for name, _ in by_logger} == {"my.job.stragglers"}, by_logger


def test_disabled_manager_changes_nothing():
    manager = NVRxStragglerDetectionManager(NVRxStragglerDetectionConfig())
    manager.initialize()

    def step():
        return 1

    assert manager.wrap_forward_step(step) is step
    assert manager.wrap_train_step_function(step) is step
    with manager.step_section():
        pass
    assert manager.check(1) is None
    assert check_nvrx_straggler_detection(manager) is False and manager.last_check is None
    assert check_nvrx_straggler_detection(None) is False
    manager.shutdown()


def test_safe_shutdown_logs_a_failure_and_goes_on(caplog):
    manager = NVRxStragglerDetectionManager(NVRxStragglerDetectionConfig())

    def broken():
        raise RuntimeError("detector gone")

    manager.shutdown = broken
    with caplog.at_level("ERROR"):
        safe_shutdown_nvrx_straggler_manager(manager, logger_name="test_straggler")
        safe_shutdown_nvrx_straggler_manager(None)
    assert "shutdown failed" in caplog.text and "detector gone" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the CPU path of the detector")
def test_real_detector_reports_on_one_process(caplog):
    from megatron.bridge.utils.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    manager = _manager(report_time_interval=0.02, enable_logging=True)
    manager.initialize()
    try:
        forward = manager.wrap_forward_step(lambda: time.sleep(0.001))
        train_step = manager.wrap_train_step_function(forward)  # Megatron-Bridge's way of timing the step
        results = []
        with caplog.at_level("INFO"):
            for _ in range(1, 60):
                train_step()
                assert check_nvrx_straggler_detection(manager) is False  # no stop without stop_if_detected
                results.append(manager.last_check)
    finally:
        manager.shutdown()
    done = [r for r in results if r is not None]
    assert done, "the detector never reported"
    first = done[0].report
    assert first.source == WALL_TIME_SOURCE
    assert set(first.blocks[0].scores) == {0} and math.isclose(first.blocks[0].scores[0], 1.0, rel_tol=1e-6)
    assert math.isclose(done[0].scalars["straggler/relative_perf_score_min"], 1.0, rel_tol=1e-6)
    assert done[0].stop_reason is None
    assert "GPU relative performance:" in caplog.text
