"""Goodput projected to cluster scale: what the costs measured in a small run come to on 1k to 100k GPUs.

A drill on a few ranks measures what a fault costs here (detection, restart, checkpoint save and load), but what
decides a configuration is the goodput those costs give on a job of thousands of GPUs, where an interruption comes
every few hours, and how often to checkpoint there. This module projects it with the first-order model of periodic
checkpointing (Young 1974, Daly 2006), next to a plain torchrun job that requeues on every failure, and recommends
``checkpoint.save_interval`` (global tier) and ``checkpoint.non_persistent_save_interval`` (local tier) in steps.

    python -m megatron.bridge.drill.projection [--from runs/main_job/drill_report.json] [--gpus 1024,4096,16384,100000]
        [--mtbf-gpu-hours H] [--rule daly|young] [--json] [--step-s S --global-save-s C ...]

The model (seconds of wall time; an interval is the compute time between two saves of a tier):

- Failures are a Poisson process whose rate is linear in the GPU count: job MTBF ``M(N) = M_gpu / N``. Preset: the
  Llama 3 405B pre-training, 419 unexpected interruptions in 54 days on 16,384 GPUs: ``M(16384) = 54 * 86400 / 419
  = 11135.1 s`` and ``M_gpu = 16384 * M(16384)`` (50,677 GPU-hours).
- A failure is handled by in-process restart (share ``f_ip``), in-job restart (``f_ij``) or a requeue of the whole job
  (``f_rq = 1 - f_ip - f_ij``). It costs that layer's detection ``D`` and restart ``S`` (a requeue: ``Q``, the
  scheduler queue plus start-up), the load ``L`` of the tier it rolls back to, and the work since that tier's last
  save: half an interval on average. A share ``p`` of failures (default ``f_ip + f_ij``: the process died, its node
  lives) rolls back to the local tier, saved every ``tau_l`` at a blocking cost ``C_l``; the rest to the global tier,
  every ``tau_g`` at ``C_g``.
- Waste: ``W = C_g/tau_g + C_l/tau_l + (R + p tau_l/2 + (1 - p) tau_g/2) / M`` with ``R = f_ip (D_ip + S_ip) +
  f_ij (D_ij + S_ij) + f_rq (D_rq + Q) + p L_l + (1 - p) L_g``; goodput ``G = max(0, 1 - W)``.
- ``dW/dtau = 0`` gives Young's ``tau = sqrt(2 C M_k)`` for each tier, where ``M_k`` is the MTBF of the failures that
  roll back to it: ``M_g = M / (1 - p)``, ``M_l = M / p``. Daly's higher-order form (the default) is ``tau =
  sqrt(2 C M_k) [1 + sqrt(C / (2 M_k)) / 3 + C / (18 M_k)] - C`` for ``C < 2 M_k``, else ``M_k``. An interval becomes
  ``n = max(1, round(tau / step))`` steps (halves up) and the goodput is that of ``n * step``, what the job runs. A
  tier no failure rolls back to has no interval. The local tier is left off (``p = 0``, every load from the global
  tier) when its interval is not shorter than the global one or it does not raise the goodput.
- Baseline: torchrun with global checkpoints only, every failure a requeue: ``R_b = D_b + Q + L_g`` (``D_b``: its
  detection, default ``D_rq``), ``tau_b`` by the same rule with ``M`` (or a given interval),
  ``W_b = C_g/tau_b + (tau_b/2 + R_b) / M``.

Restart phases: a drill report splits each restart cycle (detection to first step) into phases (teardown,
rendezvous, process start, process group, health checks, model build, checkpoint load, data build, first step;
``docs/training/events.md``). With ``--from`` a report that has them, a layer's ``S`` is the sum of its mean phases
(plus the mean time no phase covered): the mean cycle. ``--phase injob.rendezvous=40`` replaces one phase's
measured cost with another (say, a rendezvous of thousands of nodes), and ``S`` follows.

Limits: failures are independent of each other and of the checkpoints, none strikes during a restart or a save, and
an async save counts as loadable at once (its background write is not modelled); the costs do not grow with the job
size (a save of this CPU model is no estimate of a 405B model's: pass your own run's figures). Documented in
docs/training/goodput-projection.md.
"""

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron.bridge.training.events.stream import CyclePhase
from megatron.bridge.utils.fields import fail

DAY_S = 86400.0
DEFAULT_GPUS = (1024, 4096, 16384, 100000)
RULES = ("daly", "young")
LAYER_KINDS = {"inproc": ("stall",), "injob": ("kill", "hang")}
"""Drill faults each layer recovers: ``stall`` (a rank stuck inside a step, its threads alive) in-process; ``kill``
and ``hang`` (a process that died or answers nothing, its node alive) by the in-job restart (ft_launcher)."""
CYCLE_LAYERS = {"in_process": "inproc", "in_job": "injob"}
"""A drill report's restart layers (``cycles[].layer``), by the prefix of their cost fields."""
RESTART_PHASES = tuple(p.value for p in CyclePhase if p != CyclePhase.DETECTION) + ("unaccounted",)
"""What a layer's restart cost ``S`` adds up: each phase after the detection, and what no phase covered."""


@dataclass(frozen=True)
class FailureRate:
    """The unexpected interruptions a published training run counted: the source of the per-GPU failure rate."""

    name: str
    """The run and who reported it."""
    interruptions: int
    """Unexpected interruptions counted (planned maintenance left out)."""
    days: float
    """Over this many days."""
    gpus: int
    """On this many GPUs."""

    @property
    def job_mtbf_s(self) -> float:
        """Mean seconds between interruptions of that job."""
        return self.days * DAY_S / self.interruptions

    @property
    def mtbf_gpu_s(self) -> float:
        """Mean seconds between failures of one GPU (the job's MTBF times its GPUs: rates add up)."""
        return self.job_mtbf_s * self.gpus


LLAMA3_405B = FailureRate("Llama 3 405B pre-training (Meta, The Llama 3 Herd of Models, 2024)", 419, 54, 16384)


@dataclass
class MeasuredCosts:
    """What a failure and a checkpoint cost; defaults measured on 2 CPU cores (drill, benchmarks) or assumed."""

    step_s: float = 0.317
    """Seconds per training step."""
    global_save_s: float = 0.049
    """Seconds the loop blocks on one global (persistent) save."""
    local_save_s: float = 0.176
    """Seconds the loop blocks on one local-tier save."""
    global_load_s: float = 0.0
    """Seconds to load a checkpoint from the global tier (not counted in the restart times)."""
    local_load_s: float = 0.0
    """Seconds to load a checkpoint from the local tier (not counted in the restart times)."""
    inproc_detect_s: float = 2.84
    """In-process restart: seconds from the fault to its detection."""
    inproc_restart_s: float = 1.28
    """In-process restart: seconds from the detection to training again, the load aside."""
    inproc_fraction: float = 0.0
    """Share of failures the in-process restart recovers (no new processes)."""
    injob_detect_s: float = 2.84
    """In-job restart (ft_launcher; a process died or hung): seconds from the fault to its detection."""
    injob_restart_s: float = 1.28
    """In-job restart: seconds from the detection to training again, the load aside."""
    injob_fraction: float = 0.5
    """Share of failures the in-job restart recovers; the rest are requeued."""
    requeue_detect_s: Optional[float] = None
    """Requeue (the job resubmitted, e.g. a node lost): seconds to detection (``None``: as ``injob_detect_s``)."""
    requeue_s: float = 300.0
    """Requeue: seconds from the detection to training again (scheduler queue and start-up), the load aside."""
    local_fraction: Optional[float] = None
    """Share of failures that roll back to the local tier (``None``: ``inproc_fraction + injob_fraction``)."""
    baseline_detect_s: Optional[float] = None
    """Baseline torchrun job: seconds to detect a failure (``None``: as ``requeue_detect_s``)."""

    @property
    def requeue_fraction(self) -> float:
        """Share of failures requeued: ``1 - inproc_fraction - injob_fraction``."""
        return max(0.0, 1.0 - self.inproc_fraction - self.injob_fraction)

    @property
    def local_share(self) -> float:
        """``p``: share of failures that roll back to the local tier."""
        return self.inproc_fraction + self.injob_fraction if self.local_fraction is None else self.local_fraction

    @property
    def requeue_detect(self) -> float:
        """``D_rq``."""
        return self.injob_detect_s if self.requeue_detect_s is None else self.requeue_detect_s

    @property
    def baseline_detect(self) -> float:
        """``D_b``."""
        return self.requeue_detect if self.baseline_detect_s is None else self.baseline_detect_s


DEFAULT_SOURCES = {
    "step_s": "the drill on 2 CPU cores (31.7 s productive over 100 steps)",
    "global_save_s": "benchmarks/save_blocking.py on 2 CPU cores, 146 MiB checkpoint: async save, median",
    "local_save_s": "benchmarks/local_checkpoint_save.py on 2 CPU cores, 146 MiB checkpoint: median",
    "global_load_s": "assumed 0: measured restart times include their load",
    "local_load_s": "assumed 0: measured restart times include their load",
    "inproc_detect_s": "the in-job default (a drill report gives it from its stall faults)",
    "inproc_restart_s": "the in-job default (a drill report gives it from its stall faults)",
    "inproc_fraction": "assumed 0 (in-process restart is experimental)",
    "injob_detect_s": "the drill on 2 CPU cores: mean of kill 0.10 s and hang 5.58 s",
    "injob_restart_s": "the drill on 2 CPU cores: mean recovery of kill 1.04 s and hang 1.52 s",
    "injob_fraction": "assumed (not a published figure)",
    "requeue_detect_s": "as injob_detect_s",
    "requeue_s": "assumed: scheduler queue and job start-up",
    "local_fraction": "inproc_fraction + injob_fraction",
    "baseline_detect_s": "as requeue_detect_s",
}
FRACTIONS = ("inproc_fraction", "injob_fraction", "local_fraction")


def flag(name: str) -> str:
    """The command-line flag of a :class:`MeasuredCosts` field: ``step_s`` -> ``--step-s``."""
    return "--" + name.replace("_", "-")


def validate(costs: MeasuredCosts) -> None:
    """Reject costs the model cannot use.

    Raises:
        ValueError: naming the flag and the fix.
    """
    for f in dataclasses.fields(costs):
        value = getattr(costs, f.name)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            fail(flag(f.name), f"{value!r} is not a finite number", "give a number")
        if f.name in FRACTIONS and not 0.0 <= value <= 1.0:
            fail(flag(f.name), f"{value} is a share of failures, outside [0, 1]", "give a value from 0 to 1")
        if value < 0:
            fail(flag(f.name), f"{value} is negative", "give a cost of 0 seconds or more")
    if costs.step_s <= 0:
        fail("--step-s", f"{costs.step_s} s: a step takes time", "give the measured seconds per step, > 0")
    if costs.inproc_fraction + costs.injob_fraction > 1.0 + 1e-9:
        fail(
            "--inproc-fraction/--injob-fraction",
            f"{costs.inproc_fraction} + {costs.injob_fraction} exceeds 1 (the rest are requeued)",
            "make the two shares add up to at most 1",
        )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _from_summary(g: dict[str, Any], what: str) -> tuple[dict[str, float], dict[str, str]]:
    """Step time and, for a job that restarted, in-job restart costs, from a goodput summary."""
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    if int(g["iteration"]) > 0 and float(g["productive_s"]) > 0:
        values["step_s"] = float(g["productive_s"]) / int(g["iteration"])
        sources["step_s"] = f"{what}: productive_s / iteration"
    attempts = int(g["attempts"])
    if attempts > 1:
        values["injob_detect_s"] = float(g["lost_s"]["restart"]) / (attempts - 1)
        values["injob_restart_s"] = float(g["lost_s"]["startup"]) / attempts
        sources["injob_detect_s"] = f"{what}: lost_s.restart / (attempts - 1)"
        sources["injob_restart_s"] = f"{what}: lost_s.startup / attempts"
    return values, sources


_FIX = "run the drill (python -m megatron.bridge.drill) or a training job, or pass the costs as flags"


def _load(path: Path) -> Any:
    """The JSON of ``path``; ``ValueError`` naming the path and the fix."""
    fix = _FIX
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        fail(str(path), "does not exist", fix)
    except (OSError, UnicodeDecodeError) as err:
        fail(str(path), f"cannot be read ({err})", fix)
    except ValueError as err:
        fail(str(path), f"is not valid JSON ({err})", f"{fix}; a truncated file comes from an interrupted write")
    return data


def _cycles(data: Any) -> dict[str, list[dict[str, Any]]]:
    """A drill report's measured restart cycles by layer prefix, of the faults that layer recovers (LAYER_KINDS).

    A preemption or a straggler's stop is planned, not one of the failures the rate counts: left out.
    """
    found: dict[str, list[dict[str, Any]]] = {}
    for cycle in (data.get("cycles") or []) if isinstance(data, dict) else []:
        layer = CYCLE_LAYERS.get(cycle.get("layer"))
        if cycle.get("cycle_s") is not None and layer is not None and cycle.get("kind") in LAYER_KINDS[layer]:
            found.setdefault(layer, []).append(cycle)
    return found


def phase_costs(data: Any) -> dict[str, dict[str, float]]:
    """Mean seconds of each restart phase per layer (``inproc``, ``injob``) over a drill report's ``cycles``.

    A phase a cycle did not measure counts 0 there: its time is in that cycle's ``unaccounted``, so the phases of a
    layer add up to its mean cycle. A report without cycles (older, or no restart) gives ``{}``.
    """
    means = {}
    for layer, measured in _cycles(data).items():
        seconds = [{**c["phases_s"], "unaccounted": c["unaccounted_s"]} for c in measured]
        means[layer] = {name: _mean([float(s.get(name) or 0.0) for s in seconds]) for name in RESTART_PHASES}
    return means


def read_phases(path: Path) -> dict[str, dict[str, float]]:
    """:func:`phase_costs` of the drill report at ``path`` (``{}`` for a goodput summary).

    Raises:
        ValueError: the file is missing or unreadable, or its cycles lack a field (naming the path and the fix).
    """
    try:
        return phase_costs(_load(path))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        fail(str(path), f"has cycles this reader cannot use ({err!r})", _FIX)


def read_costs(path: Path) -> tuple[dict[str, float], dict[str, str]]:
    """What a drill report (``drill_report.json``) or a goodput summary (``summary.json``) measured, and from where.

    A drill report with restart cycles gives each layer's restart cost as the sum of its mean phases
    (:func:`phase_costs`), else as the mean recovery time of its faults.

    Raises:
        ValueError: the file is missing, unreadable, not JSON, or neither kind of file (naming the path and the fix).
    """
    fix = _FIX
    data = _load(path)
    try:
        if isinstance(data, dict) and "faults" in data:
            values, sources = {}, {}
            if data["goodput"] is not None:
                values, sources = _from_summary(data["goodput"], f"{path} (goodput)")
            for layer, kinds in LAYER_KINDS.items():
                faults = [f for f in data["faults"] if f["kind"] in kinds]
                for key, name, what in (
                    ("detection_latency_s", f"{layer}_detect_s", "detection latency"),
                    ("recovery_time_s", f"{layer}_restart_s", "recovery time"),
                ):
                    measured = [float(f[key]) for f in faults if f[key] is not None]
                    if measured:
                        values[name] = _mean(measured)
                        seen = "/".join(sorted({f["kind"] for f in faults if f[key] is not None}))
                        sources[name] = f"{path}: mean {what} of {len(measured)} {seen} fault(s)"
            counts = {layer: len(measured) for layer, measured in _cycles(data).items()}
            for layer, means in phase_costs(data).items():
                values[f"{layer}_restart_s"] = sum(means.values())
                sources[f"{layer}_restart_s"] = f"{path}: sum of the mean phases of {counts[layer]} restart cycle(s)"
            return values, sources
        if isinstance(data, dict) and "productive_s" in data:
            return _from_summary(data, str(path))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        fail(str(path), f"lacks a field this reader needs or has a wrong value ({err!r})", fix)
    fail(str(path), "is neither a drill report nor a goodput summary (no 'faults', no 'productive_s')", fix)


def young(c: float, m: float) -> float:
    """Young's optimal interval: ``sqrt(2 C M)``."""
    return math.sqrt(2.0 * c * m)


def daly(c: float, m: float) -> float:
    """Daly's higher-order optimal interval: ``sqrt(2CM) [1 + sqrt(C/2M)/3 + C/(18M)] - C`` for ``C < 2M``, else M."""
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return young(c, m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def to_steps(tau_s: float, step_s: float) -> int:
    """An interval in steps: the nearest whole number (halves up), at least 1."""
    return max(1, math.floor(tau_s / step_s + 0.5))


def waste(tiers: Sequence[tuple[float, float, float]], restart_s: float, mtbf_s: float) -> float:
    """First-order waste ``sum_k (C_k / tau_k + q_k tau_k / 2M) + R / M`` for tiers ``(C_k, tau_k, q_k)``.

    ``q_k``: share of failures that roll back to tier ``k`` (they add up to 1); ``R``: mean restart cost.
    """
    return sum(c / tau + q * tau / (2.0 * mtbf_s) for c, tau, q in tiers) + restart_s / mtbf_s


def goodput(w: float) -> float:
    """``max(0, 1 - W)``."""
    return max(0.0, 1.0 - w)


@dataclass
class Projection:
    """One job size: its failure rate, the optimal intervals, and the projected goodput with and without the layers."""

    gpus: int
    """GPUs of the job."""
    mtbf_s: float
    """Job MTBF ``M``."""
    failures_per_day: float
    """``86400 / M``."""
    global_s: Optional[float]
    """Optimal global interval (``None``: no failure rolls back to the global tier)."""
    global_steps: Optional[int]
    """Recommended ``checkpoint.save_interval``."""
    local_s: Optional[float]
    """Optimal local interval (``None``: local tier off)."""
    local_steps: Optional[int]
    """Recommended ``checkpoint.non_persistent_save_interval`` (``None``: local tier off)."""
    goodput: float
    """Projected goodput with the layers."""
    baseline_s: float
    """The baseline's global interval."""
    baseline_steps: int
    """The baseline's interval in steps."""
    baseline_goodput: float
    """Projected goodput of the baseline."""


def _plan(costs: MeasuredCosts, m: float, p: float, rule: str) -> Optional[tuple[float, ...]]:
    """(goodput, tau_g, n_g, tau_l, n_l) with a share ``p`` of failures rolling back to the local tier."""
    pick = daly if rule == "daly" else young
    s = costs.step_s
    tau_g = pick(costs.global_save_s, m / (1.0 - p)) if p < 1.0 else None
    tau_l = pick(costs.local_save_s, m / p) if p > 0.0 else None
    n_g = None if tau_g is None else to_steps(tau_g, s)
    n_l = None if tau_l is None else to_steps(tau_l, s)
    if n_g is not None and n_l is not None and n_l >= n_g:
        return None  # local saves no more often than global ones: the local tier buys nothing
    layers = (
        costs.inproc_fraction * (costs.inproc_detect_s + costs.inproc_restart_s)
        + costs.injob_fraction * (costs.injob_detect_s + costs.injob_restart_s)
        + costs.requeue_fraction * (costs.requeue_detect + costs.requeue_s)
    )
    r = layers + p * costs.local_load_s + (1.0 - p) * costs.global_load_s
    tiers = [(costs.global_save_s, n_g * s, 1.0 - p)] if n_g is not None else []
    tiers += [(costs.local_save_s, n_l * s, p)] if n_l is not None else []
    return (goodput(waste(tiers, r, m)), tau_g, n_g, tau_l, n_l)


def project(
    costs: MeasuredCosts, gpus: int, mtbf_gpu_s: float, rule: str = "daly", baseline_steps: Optional[int] = None
) -> Projection:
    """Project goodput and the optimal intervals for a job of ``gpus`` GPUs (see the module docstring)."""
    validate(costs)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus <= 0:
        fail("--gpus", f"{gpus!r} is not a number of GPUs", "give whole numbers > 0, e.g. 1024,4096")
    if not math.isfinite(mtbf_gpu_s) or mtbf_gpu_s <= 0:
        fail("--mtbf-gpu-hours", f"a per-GPU MTBF of {mtbf_gpu_s / 3600:g} h", "give a positive number of hours")
    if rule not in RULES:
        fail("--rule", f"{rule!r} is not a rule", f"use one of {', '.join(RULES)}")
    if baseline_steps is not None and baseline_steps < 1:
        fail("--baseline-interval-steps", f"{baseline_steps} steps", "give 1 or more, or leave it out")
    m = mtbf_gpu_s / gpus
    plans = [_plan(costs, m, 0.0, rule)]
    if costs.local_share > 0:
        plans.append(_plan(costs, m, costs.local_share, rule))
    best = max((plan for plan in plans if plan is not None), key=lambda plan: plan[0])
    if baseline_steps is None:
        tau_b = (daly if rule == "daly" else young)(costs.global_save_s, m)
        n_b = to_steps(tau_b, costs.step_s)
    else:
        n_b = baseline_steps
        tau_b = n_b * costs.step_s
    r_b = costs.baseline_detect + costs.requeue_s + costs.global_load_s
    w_b = waste([(costs.global_save_s, n_b * costs.step_s, 1.0)], r_b, m)
    g, tau_g, n_g, tau_l, n_l = best
    return Projection(gpus, m, DAY_S / m, tau_g, n_g, tau_l, n_l, g, tau_b, n_b, goodput(w_b))
