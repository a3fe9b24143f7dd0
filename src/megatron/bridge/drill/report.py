"""The drill's results: the fault table, restart phases and cycles, goodput, the verdict, as text, JSON, TensorBoard.

Everything comes from the typed outcomes and timeline ``events.py`` built from the job's event stream; lines of the
event files that could not be read are listed, with file and line number, under the tables.
"""

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from megatron.bridge.drill.events import DETECTED_BY, Cycle, Outcome, Restart, Timeline, cycles, recovered_by
from megatron.bridge.training.events.stream import CyclePhase, Mechanism, RestartLayer
from megatron.bridge.training.events.stream import to_json as to_event_json
from megatron.bridge.utils.provenance import Provenance

if TYPE_CHECKING:  # the comparison imports torch
    from megatron.bridge.training.checkpoint.compare import PartCount

logger = logging.getLogger(__name__)


@dataclass
class DrillResult:
    """Everything the drill measured."""

    outcomes: list[Outcome]
    timeline: Timeline
    exit_code: int
    wall_s: float
    """Seconds from the launch of the drill's training job to its end, as the drill measured them."""
    reference_wall_s: Optional[float]
    goodput: Optional[dict[str, Any]]
    """The training job's own goodput summary (``<checkpoint.save>/goodput/summary.json``)."""
    equal: Optional[bool]
    differences: list[str] = field(default_factory=list)
    """What differs from the reference's final state, or is missing from either (``<part>: …``)."""
    compared: list["PartCount"] = field(default_factory=list)
    """What the comparison compared, per part of the training state."""
    unexplained_restarts: list[float] = field(default_factory=list)
    final_iteration: Optional[int] = None
    reference_goodput: Optional[dict[str, Any]] = None
    """The fault-free run's goodput summary."""
    mutations: list[Outcome] = field(default_factory=list)
    """The schedule's mutations (``schedule.MUTATIONS``) and when each struck."""
    provenance: Optional[Provenance] = None
    """When, on what machine and from which commit the drill ran (the figures the docs quote name it)."""

    @property
    def passed(self) -> bool:
        """Finished, every fault detected and recovered, no unexplained restart, the final state equal (compared).

        A restart no fault explains is a false alarm, and costs a restart on a real cluster too. A mutation that never
        struck fails it too (the schedule did not play out); one that struck should leave the state unequal.
        """
        return (
            self.exit_code == 0
            and all(o.ok for o in self.outcomes)
            and all(m.struck is not None for m in self.mutations)
            and not self.unexplained_restarts
            and self.equal is True
        )

    @property
    def tensors_compared(self) -> int:
        """Tensors the comparison compared."""
        return sum(p.tensors for p in self.compared)

    @property
    def entries_compared(self) -> int:
        """Plain values (not tensors) the comparison compared."""
        return sum(p.entries for p in self.compared)


def _secs(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.2f} s"


def fault_table(result: DrillResult) -> str:
    """The fault table (one row per fault), the restart phases and cycles, start-ups, any skipped event lines."""
    sections = [faults_only_table(result), "", "Restarts (seconds of each phase):", "", restart_table(result), "",
                "Restart cycles (seconds of each phase; a cycle runs from the detection to the first step after the "
                "restart, the detection before it):", "", cycle_table(result), *startup_lines(result)]  # fmt: skip
    problems = problem_lines(result)
    return "\n".join(sections + ([""] + problems if problems else []))


def faults_only_table(result: DrillResult) -> str:
    """The markdown table: one row per fault."""
    t0 = result.timeline.start or 0.0
    rows = [
        "| fault | struck (s, iteration) | detected by | detection latency | recovered by | recovery time "
        "| resumed from | steps lost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in result.outcomes:
        struck = "never struck" if o.struck is None else f"{o.struck - t0:.1f} s, it {o.fault.iteration}"
        detected = _detected_by(o) if o.detection is not None else "**not detected**"
        recovered = recovered_by(o) if o.recovered is not None else "**not recovered**"
        resumed = "—" if o.resumed_from is None else f"iteration {o.resumed_from}"
        lost = "—" if o.steps_lost is None else str(o.steps_lost)
        rows.append(
            f"| {o.fault.label} | {struck} | {detected} | {_secs(o.detection_s)} | {recovered} "
            f"| {_secs(o.recovery_s)} | {resumed} | {lost} |"
        )
    return "\n".join(rows + _undetected_stragglers(result))


def _detected_by(o: Outcome) -> str:
    e = o.detection
    assert e is not None and e.mechanism is not None
    text = DETECTED_BY.get(e.mechanism, e.mechanism.value)
    if e.mechanism == Mechanism.LAUNCHER_WORKER_EXIT:
        text += f" ({f'signal {e.signal}' if e.signal else f'exit code {e.exit_code}'})"
    elif e.section is not None:
        text += f" ({e.section})"
    return text if e.rank is None or e.mechanism == Mechanism.PREEMPTION_SIGNAL else f"{text}, rank {e.rank}"


def _cause(result: DrillResult, restart: Restart) -> str:
    for o in result.outcomes:
        if any(r is restart for r in o.restarts):
            return o.fault.label
    return "**unexplained**"


def restart_table(result: DrillResult) -> str:
    """The markdown table of every restart and the seconds of each of its phases."""
    t0 = result.timeline.start or 0.0
    rows = [
        "| restart | at | layer | cause | teardown | spawn | setup | load (resumed from) | first step | total |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, r in enumerate(result.timeline.restarts, start=1):
        p = r.phases()
        resumed = "" if r.resumed_from is None else f" (it {r.resumed_from}{', ' + r.tier if r.tier else ''})"
        rows.append(
            f"| {n} | {r.begun - t0:.1f} s | {r.layer.value} | {_cause(result, r)} | {_secs(p['teardown'])} "
            f"| {_secs(p['spawn'])} | {_secs(p['setup'])} | {_secs(p['load'])}{resumed} | {_secs(p['first_step'])} "
            f"| {_secs(p['total'])} |"
        )
    if not result.timeline.restarts:
        rows.append("| — | | | no restart | | | | | | |")
    return "\n".join(rows)


def result_cycles(result: DrillResult) -> list[Cycle]:
    """The run's restart cycles (``events.cycles``), each fault's by its outcome."""
    return cycles(result.timeline, result.outcomes)


def _title(name: str) -> str:
    return name.replace("_", " ")


def cycle_table(result: DrillResult) -> str:
    """The markdown table of every restart cycle: the seconds of each phase, the cycle, what no phase covers."""
    names = [p.value for p in CyclePhase]
    rows = [
        f"| cycle | cause | layer | {' | '.join(map(_title, names))} | total | unaccounted |",
        "|---" * (len(names) + 5) + "|",
    ]
    for n, c in enumerate(result_cycles(result), start=1):
        phases = c.phases()
        cells = " | ".join(_secs(phases[name]) for name in names)
        rows.append(f"| {n} | {c.cause} | {c.layer.value} | {cells} | {_secs(c.seconds)} | {_secs(c.unaccounted_s)} |")
    if len(rows) == 2:
        rows.append("| — | no restart cycle |" + " |" * (len(names) + 3))
    return "\n".join(rows)


def startup_lines(result: DrillResult) -> list[str]:
    """Each attempt's start-up split by phase, as the goodput ledger kept it (none without a summary)."""
    startups = (result.goodput or {}).get("startups") or []
    if not startups:
        return []
    seen = {name for s in startups for name in s["phases_s"]}
    order = [p.value for p in CyclePhase] + ["to_first_step"]  # a summary's keys are sorted by name
    names = [name for name in order if name in seen] + sorted(seen - set(order))
    rows = ["", "Start-up of each attempt by phase (the goodput ledger, rank 0):", "",
            f"| attempt | start-up | {' | '.join(map(_title, names))} |", "|---" * (len(names) + 2) + "|"]  # fmt: skip
    for s in startups:
        cells = " | ".join(_secs(s["phases_s"].get(name)) for name in names)
        rows.append(f"| {s['attempt']} | {_secs(s['startup_s'])} | {cells} |")
    return rows


def _cycle_json(c: Cycle, t0: float) -> dict[str, Any]:
    spans = c.spans()
    return {
        "cause": c.cause,
        "kind": c.kind,
        "layer": c.layer.value,
        "struck_s": None if c.struck is None else c.struck - t0,
        "detected_s": c.detected - t0,
        "cycle_s": c.seconds,
        "unaccounted_s": c.unaccounted_s,
        "resumed_from": c.restart.resumed_from,
        "tier": c.restart.tier,
        "phases_s": c.phases(),
        "spans_s": {p.value: None if span is None else [span[0] - t0, span[1] - t0] for p, span in spans.items()},
    }


def problem_lines(result: DrillResult) -> list[str]:
    """The event-file lines the reader skipped (truncated, not JSON, unknown version or kind), if any."""
    problems = result.timeline.problems
    if not problems:
        return []
    shown = [f"  {p}" for p in problems[:20]]
    more = [f"  ... and {len(problems) - 20} more"] if len(problems) > 20 else []
    return [f"event stream: {len(problems)} line(s) skipped:", *shown, *more]


def _undetected_stragglers(result: DrillResult) -> list[str]:
    """Why a slowed rank went unnoticed: the relative scores the straggler reports after it gave that rank."""
    lines = []
    for o in result.outcomes:
        if o.fault.kind != "slow" or o.struck is None or o.detected is not None:
            continue
        scores = [
            f"it {it} {ranks[o.fault.rank]:.2f}"
            for t, it, ranks in result.timeline.straggler_reports
            if t >= o.struck and o.fault.rank in ranks
        ]
        lines.append(
            f"\n{o.fault.label}: rank {o.fault.rank}'s relative scores in the straggler reports after it: "
            f"{', '.join(scores) or 'no report'}"
        )
    return lines


def goodput_lines(result: DrillResult) -> list[str]:
    """How the job's time was spent, from its own accounting, next to the drill's outside view."""
    lines = []
    g = result.goodput
    if g is None:
        lines.append("goodput: the training job wrote no goodput summary")
    else:
        lost = ", ".join(f"{cause} {secs:.1f} s" for cause, secs in sorted(g.get("lost_s", {}).items()))
        lines.append(
            f"goodput: {g['goodput']:.3f} (productive {g['productive_s']:.1f} s of {g['wall_s']:.1f} s wall, "
            f"{g.get('attempts', '?')} attempts) | lost: {lost}"
        )
    layers = [r.layer for r in result.timeline.restarts]
    counts = ", ".join(f"{layers.count(layer)} {layer.value}" for layer in RestartLayer if layer in layers)
    line = f"drill wall time {result.wall_s:.1f} s, {len(layers)} restart(s){f' ({counts})' if counts else ''}"
    if result.reference_wall_s:
        line += (
            f"; the fault-free reference took {result.reference_wall_s:.1f} s "
            f"(faults cost {result.wall_s - result.reference_wall_s:.1f} s, "
            f"{result.wall_s / result.reference_wall_s:.2f}x)"
        )
    if result.reference_goodput is not None:
        line += f"; its goodput {result.reference_goodput['goodput']:.3f}"
    lines.append(line)
    if result.unexplained_restarts:
        t0 = result.timeline.start or 0.0
        at = ", ".join(f"{t - t0:.1f} s" for t in result.unexplained_restarts)
        lines.append(f"restarts no scheduled fault explains (spurious detections?): at {at}")
    return lines


def compared_text(result: DrillResult) -> str:
    """How many tensors and entries of each part of the training state were compared."""
    parts = "; ".join(p.describe() for p in result.compared) or "nothing"
    return f"{result.tensors_compared} tensors and {result.entries_compared} entries: {parts}"


def equality_line(result: DrillResult) -> str:
    """The verdict on the final training state, with what was compared (unequal: then one line per difference)."""
    if result.equal is None:
        return "final state: NOT COMPARED (--no-reference): the drill cannot pass without the comparison"
    if result.equal:
        return (
            f"final state EQUAL to the fault-free run with the same seed: {compared_text(result)}; bit for bit, at "
            f"iteration {result.final_iteration}"
        )
    listed = [f"  - {line}" for line in result.differences]
    return "\n".join([f"final state DIFFERS from the fault-free run (compared {compared_text(result)}):", *listed])


def mutation_lines(result: DrillResult) -> list[str]:
    """One line per mutation: whether it struck, and what the comparison made of it."""
    t0 = result.timeline.start or 0.0
    lines = []
    for m in result.mutations:
        if m.struck is None:
            lines.append(f"mutation {m.fault.label}: never struck (no restart loaded iteration {m.fault.iteration})")
            continue
        verdict = {True: "yet the final state is EQUAL: the comparison missed it", False: "the final state differs",
                   None: "not compared"}[result.equal]  # fmt: skip
        lines.append(f"mutation {m.fault.label}: struck at {m.struck - t0:.1f} s; {verdict}")
    return lines


def to_json(result: DrillResult) -> dict[str, Any]:
    """A machine-readable report."""
    t0 = result.timeline.start or 0.0
    return {
        "provenance": None if result.provenance is None else result.provenance.to_json(),
        "passed": result.passed,
        "exit_code": result.exit_code,
        "wall_s": result.wall_s,
        "reference_wall_s": result.reference_wall_s,
        "equal": result.equal,
        "differences": result.differences,
        "tensors_compared": result.tensors_compared,
        "entries_compared": result.entries_compared,
        "compared": [
            {"part": p.part, "tensors": p.tensors, "entries": p.entries, "detail": p.detail} for p in result.compared
        ],
        "mutations": [
            {
                "mutation": m.fault.label,
                "kind": m.fault.kind,
                "iteration": m.fault.iteration,
                "rank": m.fault.rank,
                "struck_s": None if m.struck is None else m.struck - t0,
            }
            for m in result.mutations
        ],
        "final_iteration": result.final_iteration,
        "goodput": result.goodput,
        "reference_goodput": result.reference_goodput,
        "restarts_s": [r.begun - t0 for r in result.timeline.restarts_of(RestartLayer.IN_JOB)],
        "inprocess_restarts_s": [r.begun - t0 for r in result.timeline.restarts_of(RestartLayer.IN_PROCESS)],
        "unexplained_restarts_s": [t - t0 for t in result.unexplained_restarts],
        "restart_phases": [
            {
                "at_s": r.begun - t0,
                "layer": r.layer.value,
                "cause": _cause(result, r),
                "resumed_from": r.resumed_from,
                "tier": r.tier,
                **{f"{name}_s": seconds for name, seconds in r.phases().items()},
            }
            for r in result.timeline.restarts
        ],  # fmt: skip
        "cycles": [_cycle_json(c, t0) for c in result_cycles(result)],
        "event_problems": [str(p) for p in result.timeline.problems],
        "faults": [
            {
                "fault": o.fault.label,
                "kind": o.fault.kind,
                "iteration": o.fault.iteration,
                "rank": o.fault.rank,
                "struck_s": None if o.struck is None else o.struck - t0,
                "detected": o.detected is not None,
                "recovered": o.recovered is not None,
                "detection_latency_s": o.detection_s,
                "recovery_time_s": o.recovery_s,
                "resumed_from": o.resumed_from,
                "steps_lost": o.steps_lost,
                "restarted": o.relaunched,
                "restart_layers": [r.layer.value for r in o.restarts],
                "detection": None if o.detection is None else to_event_json(o.detection),
                "detection_line": o.detection_line,
            }
            for o in result.outcomes
        ],
    }


def write_tensorboard(result: DrillResult, log_dir: Path) -> bool:
    """Drill scalars under ``drill/…`` (per fault: latency, recovery, cycle phases; goodput); False: no TensorBoard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        logger.warning("TensorBoard is not installed: drill scalars not written (pip install tensorboard)")
        return False
    writer = SummaryWriter(log_dir=str(log_dir))
    try:
        for o in result.outcomes:
            name = o.fault.label.replace("@", "_at_").replace(":", "_")
            if o.detection_s is not None:
                writer.add_scalar(f"drill/detection_latency_s/{name}", o.detection_s, o.fault.iteration)
            if o.recovery_s is not None:
                writer.add_scalar(f"drill/recovery_time_s/{name}", o.recovery_s, o.fault.iteration)
            if o.steps_lost is not None:
                writer.add_scalar(f"drill/steps_lost/{name}", o.steps_lost, o.fault.iteration)
        for c in result_cycles(result):
            name = c.cause.replace("@", "_at_").replace(":", "_").replace(" ", "")
            for phase, seconds in c.phases().items():
                if seconds is not None:
                    writer.add_scalar(f"drill/cycle_phase_s/{name}/{phase}", seconds, c.restart.resumed_from or 0)
        if result.goodput is not None:
            writer.add_scalar("drill/goodput", result.goodput["goodput"], result.final_iteration or 0)
        writer.add_scalar("drill/wall_s", result.wall_s, result.final_iteration or 0)
    finally:
        writer.close()
    return True


def save_json(result: DrillResult, path: Path) -> None:
    """Write :func:`to_json` to ``path``."""
    path.write_text(json.dumps(to_json(result), indent=2) + "\n")
