"""Every figure a benchmark report measured, with its machine and commit, in one file; and whether one got worse.

``benchmarks/history.jsonl`` holds one JSON line per figure: the result line's fields plus ``machine`` (CPU and GPU,
from ``utils.provenance``), ``commit`` and ``date``. ``report.py`` appends what it measured (``--no-record`` not) and
compares each figure with the last one recorded for the same benchmark, metric and machine:

- the figure is its ratio, or, for a time held to a fixed goal, the seconds its ``measured`` starts with;
- which way is worse follows its target (``<= X``: higher is worse; ``>= X``: lower is worse; none: not judged);
- the run-to-run spread is the result's own ``spread`` when the benchmark measured one (several rounds), else the
  range of the last :data:`SPREAD_WINDOW` recorded values on that machine (at least two are needed);
- a figure worse than the last one by more than that spread is marked ``WORSE``; a smaller move is ``same``.

A guard for people, not a timed test: machines are noisy, and the mark says so only past the noise measured.
"""

import json
import re
from pathlib import Path
from typing import Any, Optional

HISTORY = Path(__file__).resolve().parent / "history.jsonl"
"""The history file (committed with the code it measured)."""
COMPARISON = "vs last recorded"
"""The report's column for :func:`compare`'s verdict (not recorded)."""
SPREAD_WINDOW = 5
"""Recorded values of one figure on one machine whose range is its spread when the result gives none."""
_SECONDS = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*s\b")


def value_of(row: dict[str, Any]) -> Optional[float]:
    """The row's figure: its ratio, else the seconds of a fixed-goal time; ``None`` when it has neither."""
    if row.get("ratio") is not None:
        return float(row["ratio"])
    match = _SECONDS.match(str(row.get("measured", "")))
    return float(match.group(1)) if match else None


def higher_is_worse(target: str) -> Optional[bool]:
    """Which way the figure gets worse, from its target; ``None`` when the target says nothing."""
    target = str(target).strip()
    if target.startswith("<"):
        return True
    if target.startswith(">"):
        return False
    return None


def load(path: Path = HISTORY) -> list[dict[str, Any]]:
    """The recorded figures, oldest first (a missing file is an empty history; a bad line names the file)."""
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number} is not a JSON line ({err}); fix or remove it") from err
    return records


def _same_figure(record: dict[str, Any], row: dict[str, Any], machine: str) -> bool:
    return (record.get("benchmark"), record.get("metric"), record.get("machine")) == (
        row.get("benchmark"),
        row.get("metric"),
        machine,
    )


def compare(row: dict[str, Any], history: list[dict[str, Any]], machine: str) -> str:
    """How ``row`` compares with the last recorded value of the same figure on ``machine`` (see the module doc)."""
    value = value_of(row)
    if value is None or not row.get("tried", True) or row.get("failed"):
        return ""
    past = [r for r in history if _same_figure(r, row, machine) and value_of(r) is not None]
    if not past:
        return "first record"
    last = value_of(past[-1])
    recent = [value_of(r) for r in past[-SPREAD_WINDOW:]]
    spread = row.get("spread")
    if spread is None and len(recent) >= 2:
        spread = max(recent) - min(recent)
    worse_up = higher_is_worse(str(row.get("target", "")))
    shown = f"last {last:.4g} ({past[-1].get('commit', '?')[:8]})"
    if worse_up is None:
        return f"{shown}; no target, not judged"
    worse_by = (value - last) if worse_up else (last - value)
    if spread is None:
        return f"{shown}; spread unknown (needs two records)"
    if worse_by > spread:
        return f"**WORSE**: {shown}, worse by {worse_by:.3g} > spread {spread:.3g}"
    if -worse_by > spread:
        return f"better: {shown}, by {-worse_by:.3g} > spread {spread:.3g}"
    return f"same: {shown}, within spread {spread:.3g}"


def record(rows: list[dict[str, Any]], machine: str, commit: str, date: str, path: Path = HISTORY) -> int:
    """Append the rows that hold a figure to the history; return how many were recorded."""
    lines = [
        json.dumps(
            {**{k: v for k, v in row.items() if k != COMPARISON}, "machine": machine, "commit": commit, "date": date}
        )
        for row in rows
        if value_of(row) is not None and row.get("tried", True) and not row.get("failed")
    ]
    if lines:
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n")
    return len(lines)
