"""Real faults on demand, for drills and tests: a rank hangs, dies or raises at a chosen training step.

``MBRIDGE_FAULTS="<kind>@<iteration>:<rank>[:always],..."`` with kind ``hang`` (the process stops itself with
SIGSTOP, as a hung GPU or a deadlock would look from outside), ``kill`` (SIGKILL) or ``exception`` (an uncaught
``RuntimeError``). A fault strikes when the given rank *starts* that iteration, in the first attempt of a job
only (``TORCHELASTIC_RESTART_COUNT`` unset or 0) unless ``always`` is given, so that a restarted job can recover.
"""

import logging
import os
import signal
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV = "MBRIDGE_FAULTS"
KINDS = ("hang", "kill", "exception")


@dataclass(frozen=True)
class Fault:
    """One scheduled fault."""

    kind: str
    iteration: int
    rank: int
    always: bool = False


def parse(spec: str) -> list[Fault]:
    """Parse a ``MBRIDGE_FAULTS`` value.

    Raises:
        ValueError: an item is malformed or names an unknown kind.
    """
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            kind, rest = item.split("@")
            parts = rest.split(":")
            iteration, rank = int(parts[0]), int(parts[1])
            always = parts[2:] == ["always"]
            if kind not in KINDS or len(parts) > 3 or (len(parts) == 3 and not always):
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(
                f"{ENV}: bad item {item!r}; expected <kind>@<iteration>:<rank>[:always] with kind in {KINDS}"
            ) from None
        faults.append(Fault(kind, iteration, rank, always))
    return faults


def strike(kind: str, where: str) -> None:
    """Make this process fail the way ``kind`` says."""
    logger.error("fault injection: %s at %s (pid %d)", kind, where, os.getpid())
    for handler in logging.getLogger().handlers:
        handler.flush()
    if kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        raise RuntimeError(f"fault injection: exception at {where}")


class StepFaults:
    """The faults scheduled for this rank, checked at the start of every iteration."""

    def __init__(self, rank: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self._at = {
            f.iteration: f.kind
            for f in parse(os.environ.get(ENV, ""))
            if f.rank == rank and (f.always or first_attempt)
        }

    def before_step(self, iteration: int) -> None:
        """Strike if a fault is scheduled for ``iteration`` (the iteration about to run, 1-based)."""
        kind = self._at.get(iteration)
        if kind is not None:
            strike(kind, f"iteration {iteration}")
