"""What the logs say happened: steps over time, restarts, resumes, and for each fault its detection and recovery.

Timestamps come from the log lines themselves (the training processes' and the launcher's loggers) and from the
fault ledger, all wall-clock seconds since the epoch on the one machine that ran the drill.
"""

import datetime
import re
from dataclasses import dataclass, field
from typing import Optional

from megatron.bridge.drill.schedule import RESTARTING, DrillFault, ledger_kind

_WORKER_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank(\d+)\] ")
_LAUNCHER_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] ")
_STEP = re.compile(r"\[rank0\] INFO \S+: iteration (\d+)/\d+ \|.*\| step time ([\d.]+) s")
_RESTART = re.compile(r"Worker group \w+\. \d+/\d+ attempts left; will restart worker group")
_RESUMED = re.compile(
    r"\[rank0\] .*(?:successfully loaded verified checkpoint \S+|loaded verified local checkpoint) at iteration (\d+)"
    r"|\[rank0\] .*(training starts at iteration 0)"
)
_LOCAL_REJECTED = re.compile(r"local checkpoint at iteration (\d+) failed verification")
_STRAGGLER_REPORT = re.compile(r"\[rank0\] INFO \S+: Straggler report at iteration (\d+) ")
_SCORE = re.compile(r"^Rank=(\d+) Node=\S+ Score=([\d.]+|nan)$")
_SLACK = 0.001
"""Log timestamps are cut to the millisecond: a line stamped up to 1 ms before a ledger time may follow it."""


def _detection_patterns(fault: DrillFault) -> list[re.Pattern]:
    """Log lines that show the mechanism meant for ``fault`` noticed it (on a single node local rank = rank)."""
    killed = re.compile(rf"failed \(exitcode: -9\) local_rank: {fault.rank} ")
    # A hung rank's peers block in a collective with it, so every rank's section times out at about the same time:
    # the first rank monitor to fire (often a peer's) stops the group, and the others may never log theirs.
    timed_out = re.compile(r"\[RankMonServer\d+@[^:\]]+:\d+\] Section '\w+' has been open for")
    return {
        "kill": [killed],
        "hang": [timed_out, killed],
        "stall": [re.compile(r"RankShouldRestart\('Interruption\.SOFT_TIMEOUT")],
        "preempt": [re.compile(r"Preemption detected, saving checkpoint and exiting")],
        "nan": [re.compile(rf"Unexpected result nan on rank {fault.rank} at iteration #{fault.iteration}\b")],
        "slow": [re.compile(rf"Straggler detected: Rank={fault.rank} ")],
        "corrupt-local": [re.compile(rf"local checkpoint at iteration {fault.iteration} failed verification")],
    }[fault.kind]


DETECTED_BY = {
    "kill": "ft_launcher: worker exited (signal 9)",
    "hang": "rank monitor: section timeout",
    "stall": "in-process restart: no progress for soft_timeout",
    "preempt": "signal handler: all ranks agree to stop",
    "nan": "re-run state machine: NaN loss",
    "slow": "straggler detector: score below threshold",
    "corrupt-local": "local tier: content hash mismatch at load",
}
RECOVERED_BY = {
    "kill": "in-job restart, resume from newest verified checkpoint",
    "hang": "in-job restart, resume from newest verified checkpoint",
    "stall": "in-process restart in the same processes, resume from newest verified checkpoint",
    "preempt": "save, exit 18, restart, resume",
    "nan": "step re-run in place (transient)",
    "slow": "save, exit 21, restart, resume",
    "corrupt-local": "discarded, fell back to the global tier",
}


def _stamp(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


@dataclass
class Line:
    """A timestamped log line."""

    time: float
    text: str


@dataclass
class Timeline:
    """The run as parsed from its log."""

    steps: list[tuple[float, int, float]] = field(default_factory=list)
    """(time, iteration, step seconds) of every step rank 0 logged, in log order (repeated iterations after a
    rollback appear again)."""
    restarts: list[float] = field(default_factory=list)
    """When the launcher decided to restart the workers."""
    resumes: list[tuple[float, int]] = field(default_factory=list)
    """(time, iteration) of every start's checkpoint load (0: started from scratch)."""
    straggler_reports: list[tuple[float, int, dict[int, float]]] = field(default_factory=list)
    """(time, iteration, rank -> relative score) of every straggler report rank 0 logged."""
    lines: list[Line] = field(default_factory=list)
    start: Optional[float] = None
    end: Optional[float] = None


def parse_log(text: str) -> Timeline:
    """Parse a drill's log (training processes and launcher, interleaved)."""
    timeline = Timeline()
    block = ""  # the score block of the straggler report being read ("" outside a report)
    for raw in text.splitlines():
        found = _WORKER_TIME.match(raw) or _LAUNCHER_TIME.match(raw)
        if found is None:
            block = _read_report_line(raw, block, timeline)
            continue
        block = ""
        line = Line(_stamp(found.group(1)), raw)
        timeline.lines.append(line)
        timeline.start = line.time if timeline.start is None else min(timeline.start, line.time)
        timeline.end = line.time if timeline.end is None else max(timeline.end, line.time)
        step = _STEP.search(raw)
        report = _STRAGGLER_REPORT.search(raw)
        if step is not None:
            timeline.steps.append((line.time, int(step.group(1)), float(step.group(2))))
        elif report is not None:
            timeline.straggler_reports.append((line.time, int(report.group(1)), {}))
            block = "report"
        elif _RESTART.search(raw):
            timeline.restarts.append(line.time)
        else:
            resumed = _RESUMED.search(raw)
            if resumed is not None:
                timeline.resumes.append((line.time, int(resumed.group(1) or 0)))
    return timeline


def _read_report_line(raw: str, block: str, timeline: Timeline) -> str:
    """One untimestamped line of a straggler report: keep the relative scores; return the block it is in."""
    if not block:
        return ""
    if raw.endswith("performance:"):
        return raw
    score = _SCORE.match(raw.strip())
    if score is not None and block == "GPU relative performance:":
        timeline.straggler_reports[-1][2][int(score.group(1))] = float(score.group(2))
    return block


@dataclass
class Outcome:
    """What happened to one fault."""

    fault: DrillFault
    struck: Optional[float] = None
    detected: Optional[float] = None
    recovered: Optional[float] = None
    resumed_from: Optional[int] = None
    steps_lost: Optional[int] = None
    restart: Optional[float] = None
    """When the launcher restarted the workers for this fault (``None``: recovered in place)."""
    detection_line: Optional[str] = None
    """The log line taken as the detection."""

    @property
    def detection_s(self) -> Optional[float]:
        """Seconds from the strike to the detection."""
        return None if self.struck is None or self.detected is None else self.detected - self.struck

    @property
    def recovery_s(self) -> Optional[float]:
        """Seconds from the detection to the first completed step after it."""
        return None if self.detected is None or self.recovered is None else self.recovered - self.detected

    @property
    def ok(self) -> bool:
        """Struck, detected and recovered."""
        return None not in (self.struck, self.detected, self.recovered)


def _first(lines: list[Line], after: float, patterns: list[re.Pattern]) -> Optional[Line]:
    return next((x for x in lines if x.time >= after - _SLACK and any(p.search(x.text) for p in patterns)), None)


def outcomes(timeline: Timeline, faults: list[DrillFault], ledger: list[dict]) -> list[Outcome]:
    """Match each scheduled fault with its strike (from the ledger), detection, restart and recovery.

    A restarting fault claims the first restart after its detection and before the next restarting fault struck;
    a restart is claimed once. A NaN counts as recovered in place only if no restart came between it and the
    completed step.

    Args:
        timeline: the parsed log of the run with faults.
        faults: the schedule, sorted by iteration.
        ledger: the fault ledger's records (when each fault struck).

    Returns:
        One :class:`Outcome` per fault, in schedule order; what could not be matched stays ``None``.
    """
    result = [Outcome(fault) for fault in faults]
    for outcome in result:
        fault = outcome.fault
        record = next((r for r in ledger if _is_record_of(r, fault)), None)
        if record is not None:
            outcome.struck = float(record["time"])
    claimed: set[float] = set()
    for i, outcome in enumerate(result):
        fault = outcome.fault
        if outcome.struck is None:
            continue
        detected = _first(timeline.lines, outcome.struck, _detection_patterns(fault))
        if detected is None:
            continue
        outcome.detected = detected.time
        outcome.detection_line = detected.text.strip()
        if fault.kind == "nan":
            _recovered_in_place(outcome, timeline)
        elif fault.kind == "corrupt-local":
            _after_load(outcome, timeline, detected.time)
            if outcome.resumed_from is not None:
                outcome.steps_lost = fault.iteration - outcome.resumed_from
        elif fault.kind == "stall":  # restarted in the same processes: no launcher restart to claim
            _after_load(outcome, timeline, detected.time)
            done = [it for t, it, _ in timeline.steps if t <= detected.time]
            if outcome.resumed_from is not None and done:
                rejected = [
                    int(m.group(1)) for t, m in _matches(timeline, _LOCAL_REJECTED, detected.time, outcome.recovered)
                ]
                outcome.steps_lost = done[-1] - max([outcome.resumed_from, *rejected])
        else:
            later = [o.struck for o in result[i + 1 :] if o.fault.kind in RESTARTING and o.struck is not None]
            until = min(later, default=float("inf"))
            restart = next((t for t in timeline.restarts if detected.time - _SLACK <= t < until), None)
            if restart is None or restart in claimed:
                continue
            claimed.add(restart)
            outcome.restart = restart
            _after_load(outcome, timeline, restart)
            done = [it for t, it, _ in timeline.steps if t <= restart]
            if outcome.resumed_from is not None and done:
                # A local checkpoint rejected on the way counts as the one resumed: what the fallback cost
                # beyond it is the corruption's loss, not this fault's.
                rejected = [int(m.group(1)) for t, m in _matches(timeline, _LOCAL_REJECTED, restart, outcome.recovered)]
                outcome.steps_lost = done[-1] - max([outcome.resumed_from, *rejected])
    return result


def _is_record_of(record: dict, fault: DrillFault) -> bool:
    return (record.get("kind"), record.get("iteration"), record.get("rank")) == (
        ledger_kind(fault),
        fault.iteration,
        fault.rank,
    )


def _matches(
    timeline: Timeline, pattern: re.Pattern, since: float, until: Optional[float]
) -> list[tuple[float, re.Match]]:
    end = float("inf") if until is None else until
    found = ((x.time, pattern.search(x.text)) for x in timeline.lines if since <= x.time <= end)
    return [(t, m) for t, m in found if m is not None]


def _recovered_in_place(outcome: Outcome, timeline: Timeline) -> None:
    """A NaN: recovered when its iteration completes with no restart in between (else it was not in place)."""
    assert outcome.detected is not None
    done = next((t for t, it, _ in timeline.steps if t >= outcome.detected and it == outcome.fault.iteration), None)
    if done is None or any(outcome.detected <= t <= done for t in timeline.restarts):
        return
    outcome.recovered, outcome.steps_lost = done, 0


def _after_load(outcome: Outcome, timeline: Timeline, since: float) -> None:
    """Fill in the first checkpoint load after ``since`` and the first step completed after it."""
    load = next(((t, it) for t, it in timeline.resumes if t >= since), None)
    if load is None:
        return
    outcome.resumed_from = load[1]
    outcome.recovered = next((t for t, _, _ in timeline.steps if t >= load[0]), None)


def unexplained_restarts(timeline: Timeline, found: list[Outcome]) -> list[float]:
    """Restarts no scheduled fault caused (a spurious timeout, say): reported, never hidden."""
    explained = {o.restart for o in found if o.restart is not None}
    return [t for t in timeline.restarts if t not in explained]
