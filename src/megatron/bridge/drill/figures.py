"""The drill figures the README and the docs quote, rendered from one committed drill report.

A figure typed into a page by hand is believed long after the code that produced it has changed. So the pages quote
the drill only between markers, and what stands there is rendered from the report of one real run, committed under
``docs/measured/`` with the date, machine and commit it came from (:mod:`megatron.bridge.utils.provenance`). A unit
test fails when a page's block is not what this module renders from the committed report.

    python -m megatron.bridge.drill.figures [--from runs/main_job]   # copy that run's report in, rewrite the pages
    python -m megatron.bridge.drill.figures --check                  # exit 1 when a page is stale

Blocks (``<!-- BEGIN FIGURES: name -->`` ... ``<!-- END FIGURES -->``): ``drill-summary`` (README) and ``drill-report``
(``docs/training/resiliency.md``).
"""

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron.bridge.utils.provenance import Provenance

REPO = Path(__file__).resolve().parents[4]
MEASURED = Path("docs/measured")
"""Where the committed report lives, relative to the repository: ``drill_report.json`` and ``drill_report.md``."""
DEFAULT_RUN_DIR = "runs/main_job"
"""The drill's default ``--run-dir``: what a committed report says instead of the directory it ran in."""
_BLOCK = re.compile(r"(<!-- BEGIN FIGURES: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END FIGURES -->)", re.S)


@dataclass(frozen=True)
class Snapshot:
    """A drill report as committed: its JSON, its markdown, and where it was measured."""

    report: dict
    text: str
    provenance: Provenance

    @classmethod
    def load(cls, directory: Path) -> "Snapshot":
        """Read ``drill_report.json`` and ``.md`` from ``directory``; a report without provenance is refused."""
        report = json.loads((directory / "drill_report.json").read_text())
        if "provenance" not in report:
            raise ValueError(f"{directory / 'drill_report.json'} has no provenance: rerun the drill with this code")
        return cls(report, (directory / "drill_report.md").read_text(), Provenance.from_json(report["provenance"]))

    def source(self) -> str:
        """Where the figures come from, in words."""
        p = self.provenance
        return f"measured {p.date[:10]} on {p.machine()}, commit {p.commit}"


def _fault(report: dict, kind: str) -> Optional[dict]:
    return next((f for f in report["faults"] if f["kind"] == kind), None)


def _secs(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.2f} s"


def drill_summary(snap: Snapshot) -> str:
    """The README's paragraph: the verdict, the two layers' recovery times, the cost of the faults, goodput."""
    r = snap.report
    verdict = "passed" if r["passed"] else "FAILED"
    caught = sum(f["detected"] and f["recovered"] for f in r["faults"])
    parts = [
        f"The last committed drill report ({snap.source()}): {verdict}; {caught} of {len(r['faults'])} faults "
        f"detected and recovered; final state {'equal' if r['equal'] else 'NOT equal'} to the fault-free run"
    ]
    kill, stall = _fault(r, "kill"), _fault(r, "stall")
    if kill is not None:
        parts.append(f"the kill recovered by the launcher in {_secs(kill['recovery_time_s'])}")
    if stall is not None:
        parts.append(
            f"the stall detected in {_secs(stall['detection_latency_s'])} and recovered in place "
            f"{_secs(stall['recovery_time_s'])} later"
        )
    if r.get("reference_wall_s"):
        extra = r["wall_s"] - r["reference_wall_s"]
        parts.append(
            f"the drill took {r['wall_s']:.1f} s against {r['reference_wall_s']:.1f} s fault-free "
            f"({extra / max(1, len(r['faults'])):.1f} s per fault)"
        )
    if r.get("goodput") and r.get("reference_goodput"):
        parts.append(f"goodput {r['goodput']['goodput']:.3f} against {r['reference_goodput']['goodput']:.3f}")
    return "; ".join(parts) + ".\n"


def drill_report(snap: Snapshot) -> str:
    """The resiliency page's example: the report as the drill printed it, and where it was measured."""
    return f"From the last committed drill report ({snap.source()}):\n\n```text\n{snap.text.strip()}\n```\n"


RENDERERS: dict[str, Callable[[Snapshot], str]] = {"drill-summary": drill_summary, "drill-report": drill_report}
PAGES = (Path("README.md"), Path("docs/training/resiliency.md"))
"""The pages that quote the drill, relative to the repository."""


def render_page(text: str, snap: Snapshot) -> str:
    """``text`` with every figures block rendered anew; an unknown block name is a ``ValueError``."""

    def body(match: re.Match) -> str:
        name = match.group("name")
        if name not in RENDERERS:
            raise ValueError(f"unknown figures block {name!r}; known: {', '.join(RENDERERS)}")
        return f"{match.group(1)}{RENDERERS[name](snap)}{match.group(4)}"

    return _BLOCK.sub(body, text)


def blocks(text: str) -> list[str]:
    """The names of the figures blocks in ``text``, in order."""
    return [m.group("name") for m in _BLOCK.finditer(text)]


def scrub_paths(text: str, run_dir: Path) -> str:
    """``text`` with the run directory's absolute path written as the drill's default, ``runs/main_job``.

    A committed report names no path of the machine it ran on (the local tier's file names, say).
    """
    for form in {str(run_dir.resolve()), str(run_dir.absolute())}:
        text = text.replace(form, DEFAULT_RUN_DIR)
    return text


def stale_pages(repo: Path = REPO) -> list[Path]:
    """The pages whose blocks differ from what the committed report renders."""
    snap = Snapshot.load(repo / MEASURED)
    return [page for page in PAGES if render_page((repo / page).read_text(), snap) != (repo / page).read_text()]


def main(argv: Optional[list[str]] = None) -> int:
    """Copy a run's report in (``--from``) and rewrite the pages, or only check them (``--check``); exit code."""
    p = argparse.ArgumentParser(prog="python -m megatron.bridge.drill.figures", description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="run_dir", type=Path, help="a drill's run directory: commit its report first")
    p.add_argument("--check", action="store_true", help="only say whether the pages are current (exit 1 if not)")
    args = p.parse_args(argv)
    if args.check:
        stale = stale_pages()
        for page in stale:
            print(f"{page}: stale (python -m megatron.bridge.drill.figures)")
        return 1 if stale else 0
    if args.run_dir is not None:
        Snapshot.load(args.run_dir)  # refuse a report without provenance before copying anything
        (REPO / MEASURED).mkdir(parents=True, exist_ok=True)
        for name in ("drill_report.json", "drill_report.md"):
            text = scrub_paths((args.run_dir / name).read_text(), args.run_dir)
            (REPO / MEASURED / name).write_text(text)
    snap = Snapshot.load(REPO / MEASURED)
    for page in PAGES:
        path = REPO / page
        text = path.read_text()
        new = render_page(text, snap)
        if new != text:
            path.write_text(new)
        print(f"{page}: {'rewritten' if new != text else 'up to date'} ({', '.join(blocks(text)) or 'no block'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
