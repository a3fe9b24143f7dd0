"""Run every benchmark and print one markdown table of their ratios, followed by the machine they ran on.

Every ``benchmarks/*.py`` script except this one and private modules (``_*.py``) is discovered and run, one after
the other, as a subprocess of the same Python with its default arguments. Each ends by printing one
``BENCHMARK_RESULT {...}`` line per measured ratio (see ``benchmarks/_result.py``); those lines become the rows of
the table. A script that fails, times out or prints no result line gets a row saying so, and this script then exits
with status 1. What a benchmark has no result for (a drill that could not set up its fault here, or that failed,
with why) is a row marked "not tried" and is listed again under the table, so a shorter table never goes
unexplained. Each figure is compared with the last one recorded on this machine and then recorded
(``benchmarks/history.jsonl``, ``_history.py``); one worse by more than its run-to-run spread is marked **WORSE**.
Progress (which script, elapsed seconds) and each script's human-readable output go to stderr; the markdown goes to
stdout (and to ``--output`` when given). A whole run takes 10-25 minutes on a 2-core CPU machine.

    python benchmarks/report.py [--only save_blocking,hang_detection] [--output report.md] [--timeout 1800]
    python benchmarks/report.py --list
    bash scripts/run_benchmarks.sh [same options]     # sets up .venv first and puts ft_launcher on PATH
"""

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import _history as history
from _process import kill_tree
from _result import FIELDS, PREFIX, parse_result

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
COLUMNS = ("benchmark", "metric", "measured", "baseline", "ratio", "target", "met", history.COMPARISON)


@dataclass
class ScriptRun:
    """The outcome of running one benchmark script.

    Attributes:
        name: The script's file name without ``.py``.
        returncode: Its exit status, or None when it was killed after the timeout.
        stdout: Everything it printed to stdout.
        stderr: Everything it printed to stderr.
        seconds: Wall time of the run.
    """

    name: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


def discover(bench_dir: Path = BENCH_DIR) -> list[Path]:
    """The benchmark scripts in ``bench_dir``: every ``*.py`` except private modules (``_*``) and this report.

    Args:
        bench_dir: The folder to search (not recursively).

    Returns:
        The scripts, sorted by name.
    """
    return sorted(p for p in bench_dir.glob("*.py") if not p.name.startswith("_") and p.name != Path(__file__).name)


def select(scripts: list[Path], only: list[str] | None) -> list[Path]:
    """The scripts named in ``only`` (file names with or without ``.py``), in discovery order; all when None.

    Raises:
        ValueError: A name in ``only`` matches no script.
    """
    if not only:
        return scripts
    wanted = {name.strip().removesuffix(".py") for item in only for name in item.split(",") if name.strip()}
    unknown = wanted - {p.stem for p in scripts}
    if unknown:
        raise ValueError(f"unknown benchmark(s) {sorted(unknown)}; available: {[p.stem for p in scripts]}")
    return [p for p in scripts if p.stem in wanted]


def run_script(script: Path, label: str, timeout: float, log: TextIO | None = None) -> ScriptRun:
    """Run ``script`` with this Python from the repository root, reporting progress on ``log``.

    Args:
        script: The benchmark script.
        label: Prefix of the progress lines, e.g. ``"[2/7] save_blocking"``.
        timeout: Seconds after which the script and its descendants are killed.
        log: Where progress goes (default stderr): updated in place every second on a terminal, a line every
            30 s otherwise.

    Returns:
        Its outcome.
    """
    log = log or sys.stderr
    tty = log.isatty()
    every, back = (1.0, "\r") if tty else (30.0, "")
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    returncode: int | None = None
    while True:
        elapsed = time.monotonic() - start
        try:
            out, err = proc.communicate(timeout=max(0.1, min(every, timeout - elapsed)))
            returncode = proc.returncode
            break
        except subprocess.TimeoutExpired:
            elapsed = time.monotonic() - start
            if elapsed >= timeout:
                kill_tree(proc.pid)
                out, err = proc.communicate()
                break
            print(f"{back}{label}: running, {elapsed:.0f} s", end="" if tty else "\n", file=log)
            log.flush()
    seconds = time.monotonic() - start
    status = "timed out" if returncode is None else f"exit {returncode}"
    print(f"{back}{label}: done in {seconds:.0f} s ({status})", file=log, flush=True)
    return ScriptRun(script.stem, returncode, out, err, seconds)


def failure_row(name: str, reason: str) -> dict[str, Any]:
    """A table row saying that benchmark ``name`` produced no (valid) result, and why."""
    row: dict[str, Any] = dict.fromkeys(FIELDS, "")
    row.update(benchmark=name, metric=f"FAILED: {reason}", ratio=None, target="", met=False, tried=True, failed=True)
    return row


def _last_line(text: str, width: int = 160) -> str:
    """The last non-empty line of ``text``, shortened to ``width`` characters."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "no output"
    return lines[-1] if len(lines[-1]) <= width else lines[-1][: width - 3] + "..."


def rows_for(run: ScriptRun) -> list[dict[str, Any]]:
    """The table rows of one run: its result lines, plus a failure row when it failed or printed no result.

    Args:
        run: The outcome of a benchmark script.

    Returns:
        One row per valid result line (dicts with the keys of ``FIELDS``); failure rows also carry
        ``failed=True``. Never empty.
    """
    rows: list[dict[str, Any]] = []
    for line in run.stdout.splitlines():
        try:
            record = parse_result(line)
        except ValueError as exc:
            rows.append(failure_row(run.name, str(exc)))
            continue
        if record is not None:
            rows.append(record)
    if run.returncode is None:
        rows.append(failure_row(run.name, f"timed out after {run.seconds:.0f} s"))
    elif run.returncode != 0:
        rows.append(failure_row(run.name, f"exit code {run.returncode}: {_last_line(run.stderr or run.stdout)}"))
    elif not rows:
        rows.append(failure_row(run.name, f"no {PREFIX.strip()} line in its output"))
    return rows


def _cell(value: Any) -> str:
    """A value as a markdown table cell (pipes escaped, no line breaks)."""
    return " ".join(str(value).split()).replace("|", "\\|")


def _format_ratio(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.3g}"


def _format_met(row: dict[str, Any]) -> str:
    if row.get("failed"):
        return "**FAILED**"
    if not row.get("tried", True):
        return "**not tried**"
    return {True: "yes", False: "**no**", None: "n/a"}[row.get("met")]


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as one markdown table with the columns of ``COLUMNS``.

    Args:
        rows: Rows from :func:`rows_for`.

    Returns:
        The table, lines joined by newlines (no trailing newline).
    """
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = {key: _cell(row.get(key, "")) for key in COLUMNS}
        cells.update(ratio=_format_ratio(row.get("ratio")), met=_format_met(row))
        lines.append("| " + " | ".join(cells[key] for key in COLUMNS) + " |")
    return "\n".join(lines)


def machine_info() -> list[tuple[str, str]]:
    """(name, value) pairs describing this machine, its software and the commit (``utils.provenance``'s record)."""
    from megatron.bridge.utils.provenance import collect

    record = collect(REPO)
    info = [("CPU", record.cpu), ("RAM", record.ram), ("GPU", record.gpu), ("OS", record.os), ("python", record.python)]
    info += list(record.packages.items())
    return [*info, ("git commit", record.commit), ("date", record.date)]


def _machine_key(info: list[tuple[str, str]]) -> str:
    """What makes figures comparable across runs: the CPU and the GPU."""
    values = dict(info)
    return f"{values.get('CPU', '?')} / {values.get('GPU', '?')}"


def not_tried(rows: list[dict[str, Any]]) -> list[str]:
    """One line per row a benchmark could not try: ``benchmark: what: why``."""
    return [f"{row['benchmark']}: {row['metric']}: {row['measured']}" for row in rows if not row.get("tried", True)]


def format_report(rows: list[dict[str, Any]], runs: list[ScriptRun], info: list[tuple[str, str]]) -> str:
    """The whole markdown: the results table, what was not tried and why, the run times and the machine section."""
    total = sum(run.seconds for run in runs)
    times = ", ".join(f"{run.name} {run.seconds:.0f} s" for run in runs)
    untried = not_tried(rows)
    parts = [
        "## Benchmark results",
        "",
        format_table(rows),
        "",
        *(
            [f"Not tried here, or failed ({len(untried)}):", "", *(f"- {_cell(line)}" for line in untried), ""]
            if untried
            else []
        ),
        f"Wall time: {total:.0f} s for {len(runs)} benchmark(s) ({times}).",
        "",
        "## Machine",
        "",
        *(f"- {name}: {value}" for name, value in info),
    ]
    return "\n".join(parts) + "\n"


def _echo_output(run: ScriptRun, log: TextIO) -> None:
    """Echo a run's human-readable output (and on failure the tail of its stderr) to ``log``."""
    for line in run.stdout.splitlines():
        if not line.startswith(PREFIX.strip()):
            print(f"    {line}", file=log)
    if run.returncode != 0:
        for line in run.stderr.splitlines()[-20:]:
            print(f"    stderr: {line}", file=log)
    log.flush()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", metavar="NAME[,NAME]", help="run only these benchmarks")
    parser.add_argument("--output", type=Path, help="also write the markdown report to this file")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a benchmark is killed")
    parser.add_argument("--list", action="store_true", help="list the discovered benchmarks and exit")
    parser.add_argument("--history", type=Path, default=history.HISTORY, help="the history file (_history.py)")
    parser.add_argument("--no-record", action="store_true", help="compare with the history, but add nothing to it")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the selected benchmarks, print the report and return the exit status (1 when any failed)."""
    args = _parse_args(argv)
    try:
        scripts = select(discover(), args.only)
    except ValueError as exc:
        print(f"report.py: {exc}", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(p.stem for p in scripts))
        return 0
    runs, rows = [], []
    for i, script in enumerate(scripts, 1):
        run = run_script(script, f"[{i}/{len(scripts)}] {script.stem}", args.timeout)
        _echo_output(run, sys.stderr)
        runs.append(run)
        rows += rows_for(run)
    info = machine_info()
    machine, commit, date = _machine_key(info), dict(info).get("git commit", "?"), dict(info).get("date", "?")
    past = history.load(args.history)
    for row in rows:
        row[history.COMPARISON] = history.compare(row, past, machine)
    report = format_report(rows, runs, info)
    print(report, end="")
    if args.output:
        args.output.write_text(report)
    if not args.no_record:
        count = history.record(rows, machine, commit, date, args.history)
        print(f"report.py: {count} figure(s) recorded in {args.history}", file=sys.stderr)
    worse = [row for row in rows if str(row.get(history.COMPARISON, "")).startswith("**WORSE**")]
    if worse:
        names = ", ".join(f"{row['benchmark']}: {row['metric']}" for row in worse)
        print(
            f"report.py: {len(worse)} figure(s) worse than last recorded beyond their spread: {names}", file=sys.stderr
        )
    untried = not_tried(rows)
    if untried:
        print(f"report.py: {len(untried)} thing(s) not tried here, or failed (under the table)", file=sys.stderr)
    failed = sorted({row["benchmark"] for row in rows if row.get("failed")})
    if failed:
        print(
            f"report.py: {len(failed)} benchmark(s) failed or printed no result: {', '.join(failed)}", file=sys.stderr
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
