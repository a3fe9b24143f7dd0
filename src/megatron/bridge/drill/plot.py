"""The drill's timeline as a PNG: iteration against wall time, faults and restarts marked."""

from pathlib import Path
from typing import Optional

from megatron.bridge.drill.events import Outcome, Timeline
from megatron.bridge.training.events.stream import RestartLayer
from megatron.bridge.utils.optional_imports import require

_COLORS = {"kill": "tab:red", "hang": "tab:purple", "stall": "tab:pink", "preempt": "tab:orange", "nan": "tab:brown",
           "slow": "tab:olive"}  # fmt: skip
_RESTART_STYLE = {RestartLayer.IN_JOB: ("black", ":", "in-job restart"),
                  RestartLayer.IN_PROCESS: ("tab:gray", "--", "in-process restart"),
                  RestartLayer.REQUEUE: ("black", "-.", "requeue")}  # fmt: skip


def timeline_png(
    path: Path, drill: Timeline, outcomes: list[Outcome], reference: Optional[Timeline] = None, title: str = ""
) -> None:
    """Plot steps (iteration vs seconds since the drill started), faults (struck → recovered), restarts by layer.

    Args:
        path: the PNG to write.
        drill: the run with faults.
        outcomes: what happened to each fault.
        reference: the fault-free run, drawn dashed on the same time axis (from its own start), when given.
        title: the figure title.
    """
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = drill.start or 0.0
    fig, ax = plt.subplots(figsize=(11, 5.5))
    if reference is not None and reference.steps:
        r0 = reference.start or 0.0
        ax.plot([t - r0 for t, _, _ in reference.steps], [it for _, it, _ in reference.steps], "--", color="gray",
                lw=1.2, label="fault-free reference")  # fmt: skip
    ax.plot([t - t0 for t, _, _ in drill.steps], [it for _, it, _ in drill.steps], ".", ms=3, color="tab:blue",
            label="drill: completed steps (rank 0)")  # fmt: skip
    labelled: set[RestartLayer] = set()
    for r in drill.restarts:
        color, style, label = _RESTART_STYLE[r.layer]
        ax.axvline(r.begun - t0, color=color, lw=0.8, ls=style, label=None if r.layer in labelled else label)
        labelled.add(r.layer)
    top = max((it for _, it, _ in drill.steps), default=1)
    span = max((drill.end or t0) - t0, 1.0)
    last_label_x, low = float("-inf"), False
    for o in outcomes:
        if o.struck is None:
            continue
        color = _COLORS.get(o.fault.kind, "tab:green")
        end = o.recovered if o.recovered is not None else (drill.end or o.struck)
        ax.axvspan(o.struck - t0, end - t0, color=color, alpha=0.15)
        ax.axvline(o.struck - t0, color=color, lw=1.5)
        low = not low and o.struck - t0 - last_label_x < 0.03 * span  # labels of faults close in time: staggered
        last_label_x = o.struck - t0
        ax.annotate(o.fault.label, (o.struck - t0, top * (0.72 if low else 1.02)), rotation=90, va="bottom",
                    ha="right", fontsize=8, color=color)  # fmt: skip
        if o.detected is not None:
            ax.plot([o.detected - t0], [o.fault.iteration], "x", color=color, ms=8)
    ax.set_xlabel("wall time since launch (s)")
    ax.set_ylabel("iteration")
    ax.set_ylim(0, top * 1.3)
    ax.set_title(title or "resiliency drill: faults (shaded: strike to recovery, x: detection) and restarts")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
