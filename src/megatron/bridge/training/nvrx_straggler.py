"""NVRx straggler detection: per-rank performance scores from nvidia-resiliency-ext's straggler ``Detector``.

Every rank times two detection sections per step: the whole training step (wrapped by the detector's
``wrap_callables``; its CUDA kernels are profiled, which gives the "GPU" scores) and each forward step (CPU wall
time). Every ``report_time_interval`` seconds, turned by the
detector into a number of steps that is the same on every rank, all ranks build a report together:

* a *relative* score is the fastest rank's time over this rank's time (0.5: this rank is 2x slower than the best);
* an *individual* score is this rank's best time so far over its current time (0.5: 2x slower than it used to be).

Rank 0 logs the report in the format NeMo users know (``GPU relative performance:``, ``Worst performing N/M
ranks:``, ``Rank=… Node=… Score=…``, ``Straggler report processing time: … sec.``) and flags every rank whose score
is below its threshold (and writes the scores as a ``straggler_report`` event, each flagged rank as a
``fault_detected`` one: ``events/stream.py``); nvidia-resiliency-ext's own verdict on the kernel scores is logged as
Megatron-Bridge logs it (``STRAGGLER DETECTION WARNING: …``). With ``stop_if_detected`` rank 0 broadcasts the
decision (a one-element tensor), so all ranks stop after the same step (the train loop then saves and exits with
``ExitCode.STRAGGLER_STOP``).

Without CUDA there are no kernel timings: the scores then come from the forward step's wall time, which excludes
the gradient all-reduce (in the whole step every rank waits for the slowest one, so all would look alike), and
the report says so.

The detector is process-global (nvidia-resiliency-ext allows one ``Detector.initialize`` per process until its
``shutdown``): :meth:`NVRxStragglerDetectionManager.shutdown` is idempotent, and an in-process restart shuts the
aborted iteration's manager down (``GlobalState.reset_for_restart``) so that the next iteration's manager can
initialize the detector again.

Example:
    >>> manager = NVRxStragglerDetectionManager(cfg.nvrx_straggler)
    >>> manager.initialize()  # after torch.distributed is initialized
    >>> forward_step = manager.wrap_forward_step(forward_step)
    >>> timed_step = manager.wrap_train_step_function(train_step)
    >>> timed_step()
    >>> result = manager.check(iteration)  # every step, on every rank
"""

import functools
import importlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron.bridge.training.components import Component, Run
from megatron.bridge.training.config_sections.resiliency import NVRxStragglerDetectionConfig
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind, Mechanism
from megatron.bridge.training.exit_codes import ExitCode
from megatron.bridge.utils.fields import is_enabled
from megatron.bridge.utils.optional_imports import STRAGGLER_PACKAGES


def _import_straggler_package() -> tuple[Any, Optional[str]]:
    """nvidia-resiliency-ext's straggler package (newest layout first) and ``None``, or ``None`` and why not.

    Any exception counts as "not available", not only ``ImportError``: the newer layout lives under
    ``nvidia_resiliency_ext.attribution``, whose package imports log-analysis dependencies that can fail in other
    ways (a version conflict raising at import). This module is imported by the training loop, so such a failure
    must only switch straggler detection off, not break training without it.
    """
    errors = []
    for name in STRAGGLER_PACKAGES:
        try:
            return importlib.import_module(name), None
        except Exception as err:  # noqa: BLE001 - see above
            errors.append(f"{name}: {type(err).__name__}: {err}")
    return None, "; ".join(errors)


straggler, _STRAGGLER_IMPORT_ERROR = _import_straggler_package()
"""nvidia-resiliency-ext's straggler package (``Detector``, ``CallableId``), or ``None`` when not importable."""
HAVE_NVRX = straggler is not None
"""Whether nvidia-resiliency-ext's straggler detector can be used in this environment."""
MISSING_NVRX_MSG = (
    "nvidia-resiliency-ext is not available, and nvrx_straggler.enabled=true needs its straggler detector: "
    "pip install 'nvidia-resiliency-ext>=0.4' (or set nvrx_straggler.enabled=false)"
)

FORWARD_SECTION = "forward_step"
"""Detection section around each forward step; its wall time gives the scores when there is no kernel timing."""

KERNEL_SOURCE = "CUDA kernel timing"
WALL_TIME_SOURCE = "wall time of the forward step; CUDA kernel timing is not available here"


@dataclass(frozen=True)
class ScoreBlock:
    """One kind of score for every rank, with the threshold below which a rank is flagged."""

    title: str
    """``"GPU relative performance"`` or ``"GPU individual performance"``."""
    setting: str
    """The config field holding the threshold, for messages."""
    scores: Mapping[int, float]
    """Rank -> score in (0, 1]; NaN when the rank has no timing for this report."""
    threshold: float

    def flagged(self) -> list[int]:
        """Ranks scoring below the threshold, worst first (NaN scores are never flagged)."""
        low = [r for r, s in self.scores.items() if not math.isnan(s) and s < self.threshold]
        return sorted(low, key=lambda r: self.scores[r])

    def stats(self) -> dict[str, float]:
        """Minimum, median and maximum over the ranks that have a score."""
        values = [s for s in self.scores.values() if not math.isnan(s)]
        if not values:
            return {}
        return {"min": min(values), "median": statistics.median(values), "max": max(values)}


@dataclass
class StragglerReport:
    """What rank 0 learned from one report."""

    iteration: int
    source: str
    """Where the scores come from: :data:`KERNEL_SOURCE` or :data:`WALL_TIME_SOURCE`."""
    blocks: list[ScoreBlock]
    rank_to_node: Mapping[int, str]
    processing_time: float = 0.0
    """Seconds spent building the report (all ranks take part)."""

    def flagged_ranks(self) -> set[int]:
        """Ranks flagged by any score kind."""
        return {rank for block in self.blocks for rank in block.flagged()}

    def flagged(self) -> list[str]:
        """One line per flagged (rank, score kind)."""
        lines = []
        for block in self.blocks:
            for rank in block.flagged():
                lines.append(
                    f"Rank={rank} Node={self.rank_to_node.get(rank, '<unk>')} {block.title} "
                    f"Score={block.scores[rank]:.2f} < {block.setting}={block.threshold}"
                )
        return lines

    def format(self, num_to_print: int) -> str:
        """The report text: per score kind the worst and the best ranks (NaN, no timing, listed last), then the time."""
        lines = [f"Straggler report at iteration {self.iteration} (scores from {self.source}):"]
        for block in self.blocks:
            lines.append(f"{block.title}:")
            scores = NVRxStragglerDetectionManager._format_gpu_scores(
                block.scores, self.rank_to_node, num_best=num_to_print, num_worst=num_to_print
            )
            lines += scores.splitlines()
        lines.append(f"Straggler report processing time: {self.processing_time:.3f} sec.")
        return "\n".join(lines)

    def scalars(self) -> dict[str, float]:
        """TensorBoard scalars: min/median/max of each score kind and the number of flagged ranks."""
        out: dict[str, float] = {}
        for block in self.blocks:
            kind = "relative" if "relative" in block.title else "individual"
            for stat, value in block.stats().items():
                out[f"straggler/{kind}_perf_score_{stat}"] = value
        out["straggler/flagged_ranks"] = float(len(self.flagged_ranks()))
        return out


@dataclass
class StragglerCheck:
    """The outcome of a report step on this rank."""

    report: Optional[StragglerReport] = None
    """The report (rank 0 only)."""
    stop_reason: Optional[str] = None
    """Set on every rank when training must stop (``stop_if_detected`` and a rank was flagged)."""
    scalars: dict[str, float] = field(default_factory=dict)
    """Score statistics to log (rank 0, ``enable_logging``)."""


class NVRxStragglerDetectionManager:
    """Owns the process-global ``Detector`` for one training run; every method is a no-op when disabled.

    Args:
        config: the ``nvrx_straggler`` section.

    Raises:
        ImportError: detection is enabled but nvidia-resiliency-ext is not importable (a disabled manager needs
            nothing).
    """

    def __init__(self, config: NVRxStragglerDetectionConfig) -> None:
        if config.enabled and not HAVE_NVRX:
            raise ImportError(f"{MISSING_NVRX_MSG} ({_STRAGGLER_IMPORT_ERROR})")
        self.config = config
        self.logger = logging.getLogger(config.logger_name)
        """Where the reports, flagged ranks and stop decisions go (``nvrx_straggler.logger_name``)."""
        self.initialized = False
        """This manager holds the initialized ``Detector`` (from :meth:`initialize` until :meth:`shutdown`)."""
        self.wrapped_function: Any = None
        """The timed training step :meth:`wrap_train_step_function` returned, until :meth:`shutdown`."""
        self.scores_to_compute: list[str] = []
        """The score kinds the detector computes (``Detector.initialize``'s ``scores_to_compute``)."""
        if config.calc_relative_gpu_perf:
            self.scores_to_compute.append("relative_perf_scores")
        if config.calc_individual_gpu_perf:
            self.scores_to_compute.append("individual_perf_scores")
        self._checks = 0
        self._streaks: dict[int, int] = {}
        """Rank -> reports in a row that flagged it (rank 0), for ``stop_after_consecutive_reports``."""
        self.last_check: Optional[StragglerCheck] = None
        """What the latest :meth:`check` found (``None`` when no report was due)."""

    @property
    def enabled(self) -> bool:
        """``nvrx_straggler.enabled``."""
        return self.config.enabled

    @property
    def active(self) -> bool:
        """Enabled and initialized: the detector times sections and reports."""
        return self.enabled and self.initialized

    def initialize(self) -> None:
        """Set up the detector; call on every rank after ``torch.distributed`` is initialized.

        Raises:
            RuntimeError: this manager is initialized already (call :meth:`shutdown` first).
        """
        if self.initialized:
            raise RuntimeError("NVRxStragglerDetectionManager is already initialized; shut it down first")
        if not self.enabled:
            self.logger.debug("NVRx straggler detection is off (nvrx_straggler.enabled=false)")
            return
        straggler.Detector.initialize(
            scores_to_compute=self.scores_to_compute,
            gather_on_rank0=True,
            profiling_interval=self.config.profiling_interval,
            report_time_interval=self.config.report_time_interval,
        )
        self.initialized = True
        self.logger.info(
            "NVRx straggler detection on: report every %.1f s, thresholds relative %s / individual %s, "
            "stop_if_detected=%s",
            self.config.report_time_interval,
            self.config.gpu_relative_perf_threshold if self.config.calc_relative_gpu_perf else "off",
            self.config.gpu_individual_perf_threshold if self.config.calc_individual_gpu_perf else "off",
            self.config.stop_if_detected,
        )

    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        """Time every call of ``forward_step`` in the forward detection section (CPU wall time only)."""
        if not self.active:
            return forward_step

        @functools.wraps(forward_step)
        def timed_forward_step(*args: Any, **kwargs: Any) -> Any:
            with straggler.Detector.detection_section(FORWARD_SECTION, profile_cuda=False):
                return forward_step(*args, **kwargs)

        return timed_forward_step

    def wrap_train_step_function(self, train_step_func: Callable) -> Callable:
        """``train_step_func`` timed as one detection section whose CUDA kernels are profiled (the GPU scores).

        nvidia-resiliency-ext wraps methods of an object (``Detector.wrap_callables``), so the step becomes the
        ``train_step`` method of a small callable holder; the detector's ``shutdown`` puts the original back. The
        holder is returned and kept until :meth:`shutdown`; a second call returns it again (with a warning).

        Returns:
            The callable to use instead of ``train_step_func``; ``train_step_func`` itself when detection is off,
            not initialized, or the detector cannot wrap it (logged).
        """
        if not self.active:
            return train_step_func
        if self.wrapped_function is not None:
            self.logger.warning("the training step is already wrapped for straggler detection; reusing that wrapper")
            return self.wrapped_function
        holder = _StepHolder(train_step_func)
        try:
            straggler.Detector.wrap_callables(callable_ids=[straggler.CallableId(holder, "train_step")])
        except Exception as err:  # noqa: BLE001 - training goes on untimed rather than failing
            self.logger.warning("straggler detection cannot time the training step (%s); it runs untimed", err)
            return train_step_func
        self.wrapped_function = holder
        return holder

    def check_stragglers(self, global_rank: int) -> bool:
        """Count this step; when a report is due, report and return whether to stop (``stop_if_detected``).

        Megatron-Bridge's form of :meth:`check` (a collective, every rank after every step); the outcome is kept in
        :attr:`last_check`.
        """
        del global_rank  # rank 0 is the rank the detector hands the gathered report to
        result = self.check(None)
        return result is not None and result.stop_reason is not None

    def check(self, iteration: Optional[int]) -> Optional[StragglerCheck]:
        """Count this step; when a report is due, build it on all ranks and decide whether to stop.

        Call on every rank after every step: the report and the stop decision are collective.

        Args:
            iteration: the step just finished, for the report; ``None``: the steps this manager has counted.

        Returns:
            ``None`` when no report was due (or detection is off), else the outcome for this rank.
        """
        self.last_check = None
        if not self.active:
            return None
        self._checks += 1
        iteration = iteration if iteration is not None else self._checks
        start = time.monotonic()
        raw = straggler.Detector.generate_report_if_interval_elapsed()
        if not straggler.Detector.is_interval_elapsed():
            return None
        result = StragglerCheck()
        if raw is not None:  # rank 0: the detector gathers every rank's scores there
            result.report = self._handle_straggler_report(raw, iteration, result)
            result.report.processing_time = time.monotonic() - start
            self.logger.info("%s", result.report.format(self.config.num_gpu_perf_scores_to_print))
        if self.config.stop_if_detected:
            if self._gather_flag_from_rank0(result.stop_reason is not None) and result.stop_reason is None:
                result.stop_reason = (
                    f"straggler detected at iteration {iteration} (rank 0's report names the ranks) "
                    "with nvrx_straggler.stop_if_detected=true"
                )
            if result.stop_reason is not None:
                self.logger.error("Detected stragglers: training stops after this step (%s)", result.stop_reason)
        self.last_check = result
        return result

    def _handle_straggler_report(self, raw: Any, iteration: int, result: StragglerCheck) -> StragglerReport:
        """Rank 0: build the report, flag and log the stragglers, and set ``result``'s stop reason and scalars."""
        report = self._build_report(raw, iteration)
        # nvidia-resiliency-ext's own verdict on the kernel scores, logged as Megatron-Bridge logs it; the per-rank
        # lines and the stop decision below come from the scores actually reported (kernel or wall time).
        gpu_stragglers = raw.identify_stragglers(
            gpu_rel_threshold=self.config.gpu_relative_perf_threshold,
            gpu_indiv_threshold=self.config.gpu_individual_perf_threshold,
        )
        self._print_stragglers(gpu_stragglers)
        for line in report.flagged():
            self.logger.warning("Straggler detected: %s", line)
        _emit_report(report)
        if self.config.enable_logging:
            result.scalars = report.scalars()
        flagged = report.flagged_ranks()
        self._streaks = {r: self._streaks.get(r, 0) + 1 for r in flagged}
        needed = self.config.stop_after_consecutive_reports
        if self.config.stop_if_detected and flagged:
            if max(self._streaks.values()) >= needed:
                in_a_row = f" in {needed} reports in a row" if needed > 1 else ""
                result.stop_reason = (
                    f"straggler detected at iteration {iteration}{in_a_row} ({'; '.join(report.flagged())}) "
                    "with nvrx_straggler.stop_if_detected=true"
                )
            else:
                self.logger.warning(
                    "Not stopping yet: a rank must be flagged in %d reports in a row "
                    "(nvrx_straggler.stop_after_consecutive_reports); flagged so far: %s",
                    needed,
                    ", ".join(f"rank {r} x{n}" for r, n in sorted(self._streaks.items())),
                )
        return report

    def _print_stragglers(self, stragglers: Mapping[str, Any]) -> None:
        """Megatron-Bridge's warnings for the GPU stragglers of ``Report.identify_stragglers``."""
        if relative := stragglers.get("straggler_gpus_relative"):
            self.logger.warning(
                "STRAGGLER DETECTION WARNING: Some GPUs have worse relative performance. Affected ranks: %s",
                relative,
            )
        if individual := stragglers.get("straggler_gpus_individual"):
            self.logger.warning(
                "STRAGGLER DETECTION WARNING: Some GPUs performance dropped. Affected ranks: %s", individual
            )

    @staticmethod
    def _format_gpu_scores(
        rank_to_score: Mapping[int, float], rank_to_node: Mapping[int, str], num_best: int = 3, num_worst: int = 3
    ) -> str:
        """The worst and the best ranks of one score kind, one ``Rank=… Node=… Score=…`` line each.

        NaN scores (no timing) sort last in both lists. A rank may appear in both when there are fewer ranks than
        ``num_best + num_worst``.
        """
        num_ranks = len(rank_to_score)
        worst = sorted(rank_to_score, key=lambda r: (math.isnan(rank_to_score[r]), rank_to_score[r]))
        best = sorted(rank_to_score, key=lambda r: (math.isnan(rank_to_score[r]), -rank_to_score[r]))
        lines = []
        for label, ranks in (("Worst", worst[:num_worst]), ("Best", best[:num_best])):
            lines.append(f"{label} performing {len(ranks)}/{num_ranks} ranks:")
            lines += [f"Rank={r} Node={rank_to_node.get(r, '<unk>')} Score={rank_to_score[r]:.2f}" for r in ranks]
        return "\n".join(lines)

    def _gather_flag_from_rank0(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (a one-element broadcast; ``flag`` itself without a process group)."""
        if not torch.distributed.is_initialized():
            return flag
        # NCCL needs the tensor on this rank's GPU; gloo (CPU training) takes a CPU tensor.
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        flag_tensor = torch.tensor([1.0 if flag else 0.0], device=device, dtype=torch.float32)
        torch.distributed.broadcast(flag_tensor, 0)
        return bool(flag_tensor.item() > 0.0)

    def _build_report(self, raw: Any, iteration: int) -> StragglerReport:
        """Pick kernel scores when any rank has them, else the forward section's wall-time scores."""
        use_kernels = any(
            not math.isnan(s)
            for s in [*raw.gpu_relative_perf_scores.values(), *raw.gpu_individual_perf_scores.values()]
        )
        blocks = []
        kinds = (
            ("relative", self.config.calc_relative_gpu_perf, self.config.gpu_relative_perf_threshold),
            ("individual", self.config.calc_individual_gpu_perf, self.config.gpu_individual_perf_threshold),
        )
        for kind, on, threshold in kinds:
            if not on:
                continue
            if use_kernels:
                scores = getattr(raw, f"gpu_{kind}_perf_scores")
            else:
                scores = getattr(raw, f"section_{kind}_perf_scores").get(FORWARD_SECTION, {})
            blocks.append(
                ScoreBlock(
                    title=f"GPU {kind} performance",
                    setting=f"nvrx_straggler.gpu_{kind}_perf_threshold",
                    scores=dict(scores),
                    threshold=threshold,
                )
            )
        return StragglerReport(
            iteration=iteration,
            source=KERNEL_SOURCE if use_kernels else WALL_TIME_SOURCE,
            blocks=blocks,
            rank_to_node=dict(raw.rank_to_node),
        )

    def shutdown(self) -> None:
        """Release the process-global detector (and the wrapped step) so that a new manager can initialize it.

        Idempotent: a manager that is not initialized (never, or shut down already) does nothing.
        """
        if not self.active:
            return
        straggler.Detector.shutdown()
        self.initialized = False
        self.wrapped_function = None


class _StepHolder:
    """Holds the training step as its ``train_step`` method, which ``Detector.wrap_callables`` replaces."""

    def __init__(self, train_step: Callable) -> None:
        self.train_step = train_step

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.train_step(*args, **kwargs)


def _emit_report(report: StragglerReport) -> None:
    """Rank 0: the report's scores as a ``straggler_report`` event, and a ``fault_detected`` per flagged rank."""
    by_kind = {("relative" if "relative" in b.title else "individual"): b for b in report.blocks}
    scores = {f"{kind}_scores": dict(block.scores) for kind, block in by_kind.items()}
    flagged = sorted(report.flagged_ranks())
    event_stream.emit(
        EventKind.STRAGGLER_REPORT, iteration=report.iteration, flagged=flagged, detail=report.source, **scores
    )
    for block in report.blocks:
        for rank in block.flagged():
            event_stream.emit(
                EventKind.FAULT_DETECTED,
                mechanism=Mechanism.STRAGGLER_SCORE,
                rank=rank,
                local_rank=None,  # the flagged rank's is not known here (rank 0 writes)
                iteration=report.iteration,
                score=block.scores[rank],
                threshold=block.threshold,
                detail=block.title,
            )


class StragglerCallback(Component):
    """Straggler detection as a run's component: times each step, scores the ranks when a report is due.

    Off (no component) when ``nvrx_straggler`` is ``None`` or not enabled. It wraps the forward step and the whole
    training step with its timers, counts each step and, when a report is due, logs the scores; a stop it asks for
    ends the run after the step.

    Args:
        manager: the run's detection manager.
        log_scalars: writes the report's scalars (``straggler/...``) at an iteration (to TensorBoard).
    """

    def __init__(self, manager: NVRxStragglerDetectionManager, log_scalars: Callable[[dict, int], None]) -> None:
        self.manager = manager
        self.log_scalars = log_scalars

    @classmethod
    def build(cls, run: Run) -> Optional["StragglerCallback"]:
        """The state's manager (``GlobalState.nvrx_straggler_manager``), or ``None`` when detection is off.

        A present but disabled section still gets a manager from the state (as in Megatron-Bridge), which the
        state's reset shuts down; the run has no component for it.
        """
        if not is_enabled(run.cfg.nvrx_straggler):
            return None
        manager = run.global_state.nvrx_straggler_manager
        return cls(manager, lambda scalars, iteration: run.metrics.log_scalars(scalars, iteration))

    def setup(self, run: Run) -> None:
        """Start the detector (process-global in nvidia-resiliency-ext)."""
        self.manager.initialize()

    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        """Time each forward (the detector's per-section scores)."""
        return self.manager.wrap_forward_step(forward_step)

    def wrap_train_step(self, train_step: Callable) -> Callable:
        """Time the whole step on the device (the detector's kernel scores)."""
        return self.manager.wrap_train_step_function(train_step)

    def on_train_step_end(self, context: Any) -> None:
        """Count the step; on a report step, log the scores and pass on a stop request."""
        iteration = context.state.train_state.step + 1  # the step that just ran (counted after this event)
        result = self.manager.check(iteration)
        if result is None:
            return
        if result.scalars:
            self.log_scalars(result.scalars, iteration)
        if result.stop_reason is not None:  # on every rank alike: rank 0's decision is broadcast
            context.state.request_stop(ExitCode.STRAGGLER_STOP, result.stop_reason)

    def close(self) -> None:
        """Shut the detector down: it is process-global, a later run in this process needs it free."""
        self.manager.shutdown()


def check_nvrx_straggler_detection(nvrx_straggler_manager: Optional[NVRxStragglerDetectionManager]) -> bool:
    """Whether straggler detection asks every rank to stop after this step (``False`` without a manager).

    A collective when detection is on: every rank calls it after every step.
    """
    if nvrx_straggler_manager is None:
        return False
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return nvrx_straggler_manager.check_stragglers(rank)


def safe_shutdown_nvrx_straggler_manager(
    manager: Optional[NVRxStragglerDetectionManager], logger_name: str = "nvrx_straggler"
) -> None:
    """Shut ``manager`` down, logging (not raising) a failure: teardown must go on."""
    if manager is None:
        return
    try:
        manager.shutdown()
    except Exception as err:  # noqa: BLE001 - the rest of the teardown still has to run
        logging.getLogger(logger_name).error("Error shutting down NVRx straggler detection: %s", err, exc_info=True)
