"""Which directory a run resumes from: one precedence, used by every entry point.

1. ``checkpoint.load`` when it holds a committed checkpoint (an explicit choice wins);
2. else ``checkpoint.save`` when it holds one (a restarted or requeued job resumes its own saves even when the
   job script set no ``load``);
3. else nowhere: training starts at iteration 0.

Only directories are chosen here; which checkpoint inside the directory is loaded (the newest one that passes
verification, or a newer local-tier one) is the loader's business.
"""

import logging
from dataclasses import dataclass
from typing import Optional

from megatron.bridge.training.checkpoint import layout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumeSource:
    """Where a run resumes from, and why."""

    directory: Optional[str]
    """The checkpoint directory to load from; ``None``: start from scratch."""
    field: Optional[str]
    """``"checkpoint.load"`` or ``"checkpoint.save"``: the config field that named ``directory``."""
    reason: str
    """One sentence for the log and the job-info block."""


def _has_checkpoints(directory: Optional[str]) -> bool:
    return directory is not None and bool(layout.committed_iterations(directory))


def resolve_resume_path(load: Optional[str], save: Optional[str]) -> ResumeSource:
    """Pick the directory to resume from by the precedence above; logs the decision.

    Args:
        load: ``checkpoint.load``.
        save: ``checkpoint.save``.
    """
    if _has_checkpoints(load):
        source = ResumeSource(load, "checkpoint.load", f"checkpoint.load={load} holds committed checkpoints")
    elif load is not None and load != save and _has_checkpoints(save):
        source = ResumeSource(
            save, "checkpoint.save", f"checkpoint.load={load} holds none; checkpoint.save={save} does"
        )
    elif load is None and _has_checkpoints(save):
        source = ResumeSource(save, "checkpoint.save", f"checkpoint.load is unset; checkpoint.save={save} holds some")
    elif load is not None:
        # Keep the explicit directory: the loader applies checkpoint.exit_on_missing_checkpoint to it.
        source = ResumeSource(load, "checkpoint.load", f"checkpoint.load={load} holds no committed checkpoint")
    else:
        source = ResumeSource(None, None, "neither checkpoint.load nor checkpoint.save holds a committed checkpoint")
    logger.info("resume from: %s (%s)", source.directory or "nothing, iteration 0", source.reason)
    return source
