"""Straggler reports: score selection, flagging, the report text and TensorBoard scalars; one real Detector run."""

import importlib
import math
import time
from types import SimpleNamespace

import pytest
import torch

from megatron.bridge.training import nvrx_straggler
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
_REPORTING = importlib.import_module(nvrx_straggler.straggler.__name__ + ".reporting")
"""nvidia-resiliency-ext's ``reporting`` module of the package layout in use (0.4: ``straggler``, 0.6+: under
``attribution``), taken before any test replaces ``nvrx_straggler.straggler``."""


def _raw(gpu_rel=None, gpu_ind=None, sec_rel=None, sec_ind=None):
    """nvidia-resiliency-ext's ``Report`` as rank 0 gets it (its ``identify_stragglers`` is the real one)."""
    return _REPORTING.Report(
        gpu_relative_perf_scores=gpu_rel or {},
        section_relative_perf_scores={FORWARD_SECTION: sec_rel or {}, "train_step": {0: 0.1, 1: 0.1}},
        gpu_individual_perf_scores=gpu_ind or {},
        section_individual_perf_scores={FORWARD_SECTION: sec_ind or {}},
        rank_to_node={0: "node-a", 1: "node-b", 2: "node-b"},
        local_section_summaries={},
        local_kernel_summaries={},
        generate_report_elapsed_time=0.0,
        gather_on_rank0=True,
        rank=None,
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


@pytest.fixture
def scripted(monkeypatch):
    """Installs a scripted detector in place of nvidia-resiliency-ext's for one test."""

    def install(reports):
        monkeypatch.setattr(nvrx_straggler, "straggler", SimpleNamespace(Detector=_ScriptedDetector(reports)))

    return install


def _stops(manager, relative_scores, scripted):
    scripted(_raw(sec_rel=s) for s in relative_scores)
    manager.initialized = True  # the scripted detector needs no initialization
    return [manager.check(i).stop_reason for i in range(1, len(relative_scores) + 1)]


def test_stop_waits_for_the_same_rank_flagged_in_consecutive_reports(caplog, scripted):
    healthy, rank1_slow, rank0_slow = {0: 1.0, 1: 1.0}, {0: 1.0, 1: 0.1}, {0: 0.1, 1: 1.0}
    stops = _stops(_manager(stop_if_detected=True), [healthy, rank1_slow], scripted)
    assert [r is not None for r in stops] == [False, True]
    manager = _manager(stop_if_detected=True, stop_after_consecutive_reports=2)
    with caplog.at_level("WARNING"):
        stops = _stops(manager, [rank1_slow, healthy, rank1_slow, rank0_slow, rank1_slow, rank1_slow], scripted)
    assert stops[:5] == [None] * 5  # a passing slowdown, then two different ranks: never twice in a row
    assert stops[5].startswith("straggler detected at iteration 6 in 2 reports in a row (Rank=1 ")
    assert "flagged so far: rank 1 x1" in caplog.text
    assert _stops(_manager(stop_after_consecutive_reports=2), [rank1_slow] * 3, scripted) == [None] * 3


def test_reports_go_to_the_configured_logger(caplog, scripted):
    rank1_slow = {0: 1.0, 1: 0.1}
    with caplog.at_level("INFO"):
        _stops(_manager(logger_name="my.job.stragglers", stop_if_detected=True), [rank1_slow], scripted)
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
    assert "Error shutting down NVRx straggler detection: detector gone" in caplog.text
    assert "Traceback" in caplog.text  # where it failed, for the teardown's log


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


def test_a_restart_frees_the_detector_for_the_next_iterations_manager():
    from tests.unit_tests.configs import base_config

    from megatron.bridge.training.state import GlobalState

    if not torch.cuda.is_available():  # the detector's CUDA profiling then runs on the CPU stand-ins
        from megatron.bridge.utils.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
    cfg = base_config()
    cfg.nvrx_straggler = NVRxStragglerDetectionConfig(enabled=True, report_time_interval=0.02)
    state = GlobalState()
    state.cfg = cfg
    first = state.nvrx_straggler_manager
    first.initialize()
    second = None
    try:
        step = first.wrap_train_step_function(lambda: "stepped")
        assert step is not None and step() == "stepped"
        state.reset_for_restart()  # an in-process restart: the aborted iteration's manager is shut down
        assert not first.initialized and first.wrapped_function is None
        assert not nvrx_straggler.straggler.Detector.initialized
        first.shutdown()  # idempotent: the run's own teardown may shut it down again
        second = state.nvrx_straggler_manager
        assert second is not first
        second.initialize()  # the detector allows one initialization per process until it is shut down
        assert second.initialized and second.wrap_train_step_function(lambda: 3)() == 3
    finally:
        safe_shutdown_nvrx_straggler_manager(second)
        safe_shutdown_nvrx_straggler_manager(first)
    assert not nvrx_straggler.straggler.Detector.initialized


def test_initialize_twice_and_missing_package(monkeypatch):
    manager = _manager()
    manager.initialized = True
    with pytest.raises(RuntimeError, match="already initialized"):
        manager.initialize()
    monkeypatch.setattr(nvrx_straggler, "HAVE_NVRX", False)
    with pytest.raises(ImportError, match="nvidia-resiliency-ext is not available"):
        _manager()
    NVRxStragglerDetectionManager(NVRxStragglerDetectionConfig())  # off: the package is not needed


def test_finalize_checks_an_enabled_section_and_changes_nothing():
    off = NVRxStragglerDetectionConfig(report_time_interval=-1.0)
    off.finalize()  # disabled: nothing to check
    cfg = NVRxStragglerDetectionConfig(enabled=True, num_gpu_perf_scores_to_print=2)
    before = NVRxStragglerDetectionConfig(**vars(cfg))
    cfg.finalize()
    cfg.finalize()
    assert cfg == before
    cfg.report_time_interval = -100.0
    with pytest.raises(ValueError, match=r"^nvrx_straggler\.report_time_interval: .*must be positive"):
        cfg.finalize()
    cfg.report_time_interval, cfg.calc_relative_gpu_perf, cfg.calc_individual_gpu_perf = 1.0, False, False
    with pytest.raises(ValueError, match=r"^nvrx_straggler\.calc_relative_gpu_perf: both score kinds are off"):
        cfg.finalize()
