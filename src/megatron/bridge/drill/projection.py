"""``python -m megatron.bridge.drill.projection``: the goodput projection as a markdown table or JSON.

The model is :mod:`megatron.bridge.drill.projection`; this module reads the inputs (built-in defaults, then a drill
report or goodput summary given with ``--from``, then one flag per :class:`MeasuredCosts` field, each overriding the
one before), prints one row per job size, the recommended checkpoint overrides, and every input with where it came
from. A drill report's restart cycles give each layer's restart cost phase by phase; ``--phase LAYER.PHASE=SECONDS``
replaces one phase's cost (``injob.rendezvous=40``) and the layer's restart cost follows. Bad input (a missing or
garbled file, a negative cost, a share outside [0, 1], a step time or MTBF or GPU count of 0 or less) exits 2
with one message naming the flag or file and the fix, and no traceback.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

from megatron.bridge.drill import projection_model as projection
from megatron.bridge.drill.projection_model import (
    DEFAULT_GPUS,
    DEFAULT_SOURCES,
    LLAMA3_405B,
    RESTART_PHASES,
    RULES,
    MeasuredCosts,
    Projection,
    flag,
    project,
    read_costs,
    read_phases,
    validate,
)
from megatron.bridge.utils.fields import fail

PROG = "python -m megatron.bridge.drill.projection"


def _interval(tau: Optional[float], steps: Optional[int]) -> str:
    return "off" if tau is None or steps is None else f"{tau:.0f} s ({steps} steps)"


def overrides(p: Projection) -> str:
    """The recommendation for one job size as dotted overrides."""
    parts = [f"checkpoint.save_interval={p.global_steps}" if p.global_steps else "(no global save needed)"]
    if p.local_steps is not None:
        local = f"checkpoint.non_persistent_save_interval={p.local_steps}"
        parts += [local, "checkpoint.non_persistent_ckpt_type=local"]
    else:
        parts.append("(local tier off: at these costs it does not raise the goodput)")
    return " ".join(parts)


def table(projections: list[Projection], rule: str) -> str:
    """The markdown table: one row per job size."""
    rows = [
        f"| GPUs | job MTBF | failures/day | global interval ({rule}) | local interval | goodput, layered "
        "| goodput, torchrun + requeue | baseline interval | save_interval | non_persistent_save_interval |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in projections:
        rows.append(
            f"| {p.gpus:,} | {p.mtbf_s / 3600:.2f} h | {p.failures_per_day:.1f} "
            f"| {_interval(p.global_s, p.global_steps)} | {_interval(p.local_s, p.local_steps)} "
            f"| {p.goodput:.4f} | {p.baseline_goodput:.4f} | {_interval(p.baseline_s, p.baseline_steps)} "
            f"| {p.global_steps or '—'} | {p.local_steps or 'off'} |"
        )
    return "\n".join(rows)


def gpu_counts(text: str) -> list[int]:
    """``--gpus``: comma-separated whole numbers > 0.

    Raises:
        ValueError: naming the flag and the fix.
    """
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or any(n <= 0 for n in counts):
        fail("--gpus", f"{text!r} is not a list of GPU counts", "give whole numbers > 0, e.g. --gpus 1024,4096,16384")
    return counts


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    """The command line (argparse exits 2 on a malformed flag)."""
    doc = "The model, its inputs and limits: docs/training/goodput-projection.md"
    p = argparse.ArgumentParser(prog=PROG, description=projection.__doc__.splitlines()[0], epilog=doc)
    p.add_argument(
        "--from", dest="source", type=Path, metavar="PATH", help="a drill_report.json or a goodput summary.json to read"
    )
    p.add_argument(
        "--gpus", metavar="N,N,...", default=",".join(map(str, DEFAULT_GPUS)), help="job sizes, comma-separated"
    )
    p.add_argument("--mtbf-gpu-hours", type=float, metavar="H", help=f"per-GPU MTBF (default: {LLAMA3_405B.name})")
    p.add_argument("--rule", choices=RULES, default="daly", help="optimal interval formula (default daly)")
    p.add_argument(
        "--baseline-interval-steps", type=int, metavar="STEPS", help="fixed baseline interval (default: its optimum)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument(
        "--phase",
        action="append",
        default=[],
        metavar="LAYER.PHASE=S",
        help=f"a restart phase's cost in seconds (LAYER: inproc or injob; PHASE: {', '.join(RESTART_PHASES)}); "
        "the layer's restart cost is then the sum of its phases (repeatable)",
    )
    for f in dataclasses.fields(MeasuredCosts):
        p.add_argument(
            flag(f.name), type=float, dest=f.name, metavar="X", help=f"default {f.default}: {DEFAULT_SOURCES[f.name]}"
        )
    return p.parse_args(argv)


def phase_override(item: str) -> tuple[str, str, float]:
    """``--phase``: ``LAYER.PHASE=SECONDS`` as (layer, phase, seconds).

    Raises:
        ValueError: naming the flag and the fix.
    """
    name, _, text = item.partition("=")
    layer, _, phase = name.partition(".")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if layer not in ("inproc", "injob") or phase not in RESTART_PHASES or not 0 <= seconds < float("inf"):
        fail("--phase", f"{item!r} is not LAYER.PHASE=SECONDS", f"e.g. --phase injob.rendezvous=40; PHASE is one of "
             f"{', '.join(RESTART_PHASES)} (the detection has --inproc-detect-s and --injob-detect-s)")  # fmt: skip
    return layer, phase, seconds


def restart_phases(args: argparse.Namespace, values: dict, sources: dict) -> dict[str, dict[str, float]]:
    """Each layer's restart phases (the file's means, then ``--phase``); a layer's restart cost becomes their sum.

    Raises:
        ValueError: a bad ``--phase`` or an unreadable file, naming it and the fix.
    """
    phases = read_phases(args.source) if args.source is not None else {}
    given: dict[str, list[str]] = {}
    for item in args.phase:
        layer, phase, seconds = phase_override(item)
        phases.setdefault(layer, dict.fromkeys(RESTART_PHASES, 0.0))[phase] = seconds
        given.setdefault(layer, []).append(phase)
    for layer, names in given.items():
        values[f"{layer}_restart_s"] = sum(phases[layer].values())
        measured = f"the rest measured in {args.source}" if args.source is not None else "the rest 0"
        sources[f"{layer}_restart_s"] = f"sum of its phases: {', '.join(names)} from --phase, {measured}"
    return phases


def run(
    args: argparse.Namespace,
) -> tuple[MeasuredCosts, dict[str, str], float, list[Projection], dict[str, dict[str, float]]]:
    """Costs, their sources, the per-GPU MTBF (s), one projection per size, and each layer's restart phases.

    Costs: the defaults, then the file, then the phases (``--phase``), then the flags.

    Raises:
        ValueError: bad input, naming the flag or file and the fix.
    """
    values, sources = read_costs(args.source) if args.source is not None else ({}, {})
    phases = restart_phases(args, values, sources)
    for f in dataclasses.fields(MeasuredCosts):
        if getattr(args, f.name) is not None:
            values[f.name], sources[f.name] = getattr(args, f.name), f"flag {flag(f.name)}"
        sources.setdefault(f.name, f"default: {DEFAULT_SOURCES[f.name]}")
    costs = MeasuredCosts(**values)
    validate(costs)
    if args.mtbf_gpu_hours is not None and not args.mtbf_gpu_hours > 0:
        fail("--mtbf-gpu-hours", f"{args.mtbf_gpu_hours} h: an MTBF must be positive", "give hours > 0")
    mtbf = LLAMA3_405B.mtbf_gpu_s if args.mtbf_gpu_hours is None else args.mtbf_gpu_hours * 3600.0
    found = [project(costs, n, mtbf, args.rule, args.baseline_interval_steps) for n in gpu_counts(args.gpus)]
    return costs, sources, mtbf, found, phases


def phase_table(phases: dict[str, dict[str, float]]) -> str:
    """The markdown table of each layer's restart phases and their sum, the restart cost."""
    rows = [f"| layer | {' | '.join(name.replace('_', ' ') for name in RESTART_PHASES)} | restart cost |",
            "|---" * (len(RESTART_PHASES) + 2) + "|"]  # fmt: skip
    for layer, seconds in sorted(phases.items()):
        cells = " | ".join(f"{seconds[name]:.2f} s" for name in RESTART_PHASES)
        rows.append(f"| {layer} | {cells} | {sum(seconds.values()):.2f} s |")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    """Print the projection; 0, or 2 for bad input (one message on stderr, no traceback)."""
    args = parse_args(argv)
    try:
        costs, sources, mtbf, found, phases = run(args)
    except ValueError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    rate = "--mtbf-gpu-hours" if args.mtbf_gpu_hours is not None else LLAMA3_405B.name
    if args.json:
        inputs = {**dataclasses.asdict(costs), "requeue_fraction": costs.requeue_fraction, "p": costs.local_share}
        out = {"failure_rate": rate, "mtbf_gpu_hours": mtbf / 3600, "rule": args.rule, "inputs": inputs,
               "sources": sources, "restart_phases": phases,
               "projections": [dataclasses.asdict(p) for p in found]}  # fmt: skip
        print(json.dumps(out, indent=2))
        return 0
    print(f"Failure rate: {rate}; per-GPU MTBF {mtbf / 3600:,.0f} h; job MTBF = per-GPU MTBF / GPUs.\n")
    print(table(found, args.rule) + "\n\nRecommended:")
    for p in found:
        print(f"  {p.gpus:,} GPUs: {overrides(p)}")
    print("\nInputs:")
    for f in dataclasses.fields(costs):
        value = getattr(costs, f.name)
        print(f"  {f.name} = {'—' if value is None else f'{value:g}'}  ({sources[f.name]})")
    print(f"  requeue share = {costs.requeue_fraction:g}, local-tier share p = {costs.local_share:g}")
    if phases:
        print("\nRestart phases (seconds; the report's mean per cycle, or --phase):\n\n" + phase_table(phases))
    if args.source is not None:
        lacked = [f.name for f in dataclasses.fields(costs) if sources[f.name].startswith("default")]
        print(f"\n{args.source} lacks {', '.join(lacked) or 'nothing'}: the defaults above were used for them.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
