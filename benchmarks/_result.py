"""The machine-readable result line every benchmark prints, one per measured ratio.

A benchmark keeps its human-readable output and ends by printing, for each ratio it measured, one line made of a
fixed prefix and a JSON object::

    BENCHMARK_RESULT {"benchmark": "save_blocking", "metric": "async / sync save blocking", "ratio": 0.07,
                      "measured": "0.012 s (async save)", "baseline": "0.171 s (sync save)", "target": "<= 0.10",
                      "met": true}

(on one line). ``benchmarks/report.py`` runs every benchmark and collects these lines into one table. Usage from a
benchmark script (run as ``python benchmarks/NAME.py``, so this module is importable as ``_result``)::

    from _result import emit_result

    emit_result("save_blocking", "async / sync save blocking", a / s, f"{a:.3f} s", f"{s:.3f} s (sync)", "<= 0.10")

``met`` is computed from ``target`` when it has the form ``<= X`` or ``>= X``; a target of ``"n/a"`` (no explicit
target) gives ``met = None``. A ratio that could not be measured is passed as ``None`` and reported as not met when
there is a target.

A ratio is always against a baseline measured in the same run. Two other kinds of line have no ratio:

- :func:`format_goal`: a figure held to a fixed goal (a number chosen beforehand, not measured), reported in seconds
  with the goal as its target (``"<= 3 s"``) and ``baseline`` saying that it is a fixed goal;
- :func:`format_not_tried`: something the benchmark has no result for, with why (``tried`` is false): it could not
  be tried on this machine, or trying it failed; a report lists it instead of silently having one row fewer.
"""

import json
import math
import re
from typing import Any

PREFIX = "BENCHMARK_RESULT "
NO_TARGET = "n/a"
FIELDS = ("benchmark", "metric", "ratio", "measured", "baseline", "target", "met", "tried", "spread")
FIXED_GOAL = "fixed goal, not measured in this run"
"""The ``baseline`` of a line held to a fixed goal (:func:`format_goal`)."""
_LINE = re.compile(r"^" + PREFIX.strip() + r"\s+(.*)$")
_TARGET = re.compile(r"^\s*(<=|>=|<|>)\s*([-+]?[\d.]+(?:[eE][-+]?\d+)?)\s*$")


def target_met(ratio: float | None, target: str) -> bool | None:
    """Whether ``ratio`` meets ``target``.

    Args:
        ratio: The measured ratio, or None when it could not be measured.
        target: ``"<= X"``, ``">= X"``, ``"< X"``, ``"> X"`` or ``"n/a"``.

    Returns:
        None when there is no target (or it has another form), False when the ratio is missing or not finite,
        otherwise the comparison.
    """
    match = _TARGET.match(target)
    if match is None:
        return None
    if ratio is None or not math.isfinite(ratio):
        return False
    op, bound = match.group(1), float(match.group(2))
    return {"<=": ratio <= bound, ">=": ratio >= bound, "<": ratio < bound, ">": ratio > bound}[op]


def _round(ratio: float | None) -> float | None:
    """Four significant digits (JSON has no NaN or infinity: those become None)."""
    if ratio is None or not math.isfinite(ratio):
        return None
    return float(f"{ratio:.4g}")


def format_result(
    benchmark: str,
    metric: str,
    ratio: float | None,
    measured: str,
    baseline: str,
    target: str = NO_TARGET,
    met: bool | None = None,
    tried: bool = True,
    spread: float | None = None,
) -> str:
    """One result line: ``PREFIX`` followed by a JSON object with the fields of ``FIELDS``.

    Args:
        benchmark: Name of the benchmark (the script's file name without ``.py``).
        metric: What the ratio is, e.g. ``"async / sync save blocking"``.
        ratio: The ratio, or None when it could not be measured.
        measured: The measured value with its unit, e.g. ``"0.012 s (async save)"``.
        baseline: The baseline it is divided by (or divides), with its unit.
        target: ``"<= X"``, ``">= X"`` or ``"n/a"`` when the script has no explicit target.
        met: Whether the target is met; computed from ``target`` when None.
        tried: False for something the benchmark could not try (:func:`format_not_tried`).
        spread: How much the ratio moves between runs of the same code on the same machine, in the ratio's units,
            when the benchmark measured it (several rounds); the report's history check uses it.

    Returns:
        The line, without a trailing newline.
    """
    if met is None:
        met = target_met(ratio, target)
    record = {
        "benchmark": benchmark,
        "metric": metric,
        "ratio": _round(ratio),
        "measured": measured,
        "baseline": baseline,
        "target": target,
        "met": met,
        "tried": tried,
        "spread": _round(spread),
    }
    return PREFIX + json.dumps(record)


def format_goal(benchmark: str, metric: str, seconds: float | None, goal_s: float, note: str = "") -> str:
    """A line for a time held to a fixed goal: reported in seconds, not as a ratio (the goal is not a measurement).

    Args:
        benchmark: Name of the benchmark.
        metric: What was timed, e.g. ``"kill recovery"``.
        seconds: The time measured, or None when the run did not produce it (then not met).
        goal_s: The fixed goal in seconds; met when ``seconds <= goal_s``.
        note: Added to the measured column, e.g. what the time runs from.

    Returns:
        The line: ratio None, target ``"<= {goal_s} s"``, baseline :data:`FIXED_GOAL`.
    """
    shown = "not measured" if seconds is None else f"{seconds:.2f} s"
    met = seconds is not None and math.isfinite(seconds) and seconds <= goal_s
    measured = f"{shown} ({note})" if note else shown
    return format_result(benchmark, f"{metric} (s)", None, measured, FIXED_GOAL, f"<= {goal_s:g} s", met=met)


def format_not_tried(benchmark: str, what: str, reason: str) -> str:
    """A line for something the benchmark has no result for (``tried`` false, not met), with why in ``measured``:
    it could not be tried here (e.g. ``"skipped: needs root"``), or trying it failed (``"failed: ..."``)."""
    return format_result(benchmark, what, None, reason, "", NO_TARGET, met=False, tried=False)


def emit_goal(*args: Any, **kwargs: Any) -> None:
    """Print the line of :func:`format_goal` (same arguments), flushed."""
    print(format_goal(*args, **kwargs), flush=True)


def emit_not_tried(*args: Any, **kwargs: Any) -> None:
    """Print the line of :func:`format_not_tried` (same arguments), flushed."""
    print(format_not_tried(*args, **kwargs), flush=True)


def emit_result(*args: Any, **kwargs: Any) -> None:
    """Print the result line of :func:`format_result` (same arguments) to stdout, flushed."""
    print(format_result(*args, **kwargs), flush=True)


def parse_result(line: str) -> dict[str, Any] | None:
    """The record of one result line, or None when ``line`` is not one.

    Args:
        line: A line of a benchmark's stdout (surrounding whitespace is ignored).

    Returns:
        The record with every field of ``FIELDS`` (missing optional ones filled in; ``tried`` defaults to true),
        or None when the line does not start with ``PREFIX``.

    Raises:
        ValueError: The line starts with ``PREFIX`` but its JSON is invalid or lacks ``benchmark`` or ``metric``.
    """
    match = _LINE.match(line.strip())
    if match is None:
        return None
    payload = match.group(1)
    try:
        record = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON in result line: {payload[:200]!r}") from exc
    if not isinstance(record, dict) or not record.get("benchmark") or not record.get("metric"):
        raise ValueError(f"result line lacks 'benchmark' or 'metric': {payload[:200]!r}")
    ratio = record.get("ratio")
    if ratio is not None and not isinstance(ratio, int | float):
        raise ValueError(f"result line has a non-numeric ratio: {payload[:200]!r}")
    record.setdefault("ratio", None)
    for key in ("measured", "baseline"):
        record.setdefault(key, "")
    record.setdefault("target", NO_TARGET)
    record.setdefault("met", None)
    if not isinstance(record.setdefault("tried", True), bool):
        raise ValueError(f"result line has a non-boolean 'tried': {payload[:200]!r}")
    spread = record.setdefault("spread", None)
    if spread is not None and not isinstance(spread, int | float):
        raise ValueError(f"result line has a non-numeric spread: {payload[:200]!r}")
    return {key: record[key] for key in FIELDS}
