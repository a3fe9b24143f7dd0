"""Every rank runs the job's code and config: a node that joins with others (a spare started wrong) is refused.

The failure: a hot spare or a replacement node is started by hand, or from another image, at 3 a.m. It joins the
rendezvous and its ranks train beside the others with another model width, another batch size or another release of
the code. The collectives may even line up: then the run goes on silently wrong, or it hangs or crashes later with an
error that names nothing of the cause.

What this does: once the process group exists, every rank hashes what makes it the same job (the installed releases
of the stack, the source of this package, and the resolved config without the settings that are meant to differ
between nodes or ranks) and the ranks compare the hashes (one small all-gather). When they differ, the ranks gather
the whole fingerprints (only then) and every rank ends with ``NODE_MISMATCH`` (exit 32, action stop) and the same
report: which ranks on which hosts differ from the job, and in what (each config field with both values, each
release, or the source). The job's own ranks are the larger group; on a tie, the group of the rank that has
restarted most (a survivor of the job rather than a newcomer), then rank 0's.

Its limit: the check runs once the process groups exist. A spare started with other tensor or pipeline parallel sizes
builds other model-parallel groups, and may hang or fail there before it is compared.
"""

import functools
import hashlib
import json
import logging
import re
import socket
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from megatron.bridge.training.components.base import Component, Run
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.utils import launch_env
from megatron.bridge.utils.provenance import PACKAGES, package_version

logger = logging.getLogger(__name__)

MAY_DIFFER = frozenset({"checkpoint.non_persistent_local_ckpt_dir", "dist.local_rank"})
"""Config fields meant to differ between nodes or ranks: the node's local disk, the rank's place on its node."""
MAY_DIFFER_SECTIONS = ("fault_injection.",)
"""Config sections that may differ too: a fault drill can strike one node only."""
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
"""The memory address in a default ``repr`` (``<function f at 0x7f...>``): it differs from process to process."""
_SHOWN = 8
"""Differences listed per rank in the report (the rest are counted)."""


@dataclass(frozen=True)
class Fingerprint:
    """What makes a rank part of the job, and where it runs."""

    rank: int
    host: str
    restart_count: int
    releases: dict[str, str]
    """Package -> installed version."""
    source: str
    """SHA-256 of this package's Python source."""
    config: dict[str, str] = field(default_factory=dict)
    """Dotted config field -> its value, as text (:func:`may_differ` fields left out)."""

    def digest(self) -> str:
        """One hash of the releases, the source and the config."""
        text = json.dumps([self.releases, self.source, self.config], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def source_digest(root: Optional[str] = None) -> str:
    """SHA-256 of every ``.py`` file of this package (path and content), in path order; computed once per process."""
    base = Path(root) if root else Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for path in sorted(base.rglob("*.py")):
        h.update(str(path.relative_to(base)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """``{"a.b.c": text}`` for every leaf of a nested dict (a run config's ``to_dict()``)."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: _ADDRESS.sub("", repr(value))}


def may_differ(field_name: str) -> bool:
    """Whether the dotted config field may differ between the job's ranks (:data:`MAY_DIFFER`, its sections)."""
    return field_name in MAY_DIFFER or field_name.startswith(MAY_DIFFER_SECTIONS)


def fingerprint(cfg: Any, rank: int) -> Fingerprint:
    """The fingerprint of rank ``rank`` running the run config ``cfg``."""
    config = {k: v for k, v in flatten(cfg.to_dict()).items() if not may_differ(k)}
    return Fingerprint(
        rank=rank,
        host=socket.gethostname(),
        restart_count=launch_env.current().restart_count,
        releases={package: package_version(package) for package in PACKAGES},
        source=source_digest(),
        config=config,
    )


def reference(prints: list[Fingerprint]) -> str:
    """The job's digest: the most ranks'; on a tie, the group with the most restarted rank, then rank 0's."""
    digests = [p.digest() for p in prints]
    counts = Counter(digests)
    most = max(counts.values())
    tied = {d for d, n in counts.items() if n == most}
    if len(tied) == 1:
        return tied.pop()
    restarts = {d: max(p.restart_count for p, pd in zip(prints, digests) if pd == d) for d in tied}
    top = max(restarts.values())
    survivors = {d for d in tied if restarts[d] == top}
    return digests[0] if digests[0] in survivors else min(survivors)


def differences(job: Fingerprint, other: Fingerprint) -> list[str]:
    """What ``other`` runs differently from ``job``, one line each."""
    lines = [
        f"{package} {other.releases.get(package)} (the job: {version})"
        for package, version in job.releases.items()
        if other.releases.get(package) != version
    ]
    if other.source != job.source:
        lines.append(f"the source of megatron.bridge differs (sha256 {other.source[:12]}, the job: {job.source[:12]})")
    for key in sorted(set(job.config) | set(other.config)):
        if job.config.get(key) != other.config.get(key):
            lines.append(f"{key}={other.config.get(key, '(absent)')} (the job: {job.config.get(key, '(absent)')})")
    return lines


def report(prints: list[Fingerprint]) -> Optional[str]:
    """The refusal, naming each odd rank and its differences; ``None`` when every rank runs the same job."""
    job_digest = reference(prints)
    job = next(p for p in prints if p.digest() == job_digest)
    odd = [p for p in prints if p.digest() != job_digest]
    if not odd:
        return None
    lines = [f"{len(odd)} of {len(prints)} ranks run other code or another config than the job's (rank {job.rank} "
             f"on {job.host} and the ranks like it); they are refused:"]  # fmt: skip
    for p in odd:
        found = differences(job, p)
        more = f"; and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
        lines.append(f"  rank {p.rank} on {p.host}: " + "; ".join(found[:_SHOWN]) + more)
    local = ", ".join([*sorted(MAY_DIFFER), *(f"{section}*" for section in MAY_DIFFER_SECTIONS)])
    lines.append(f"Fix: start that node with the job's code and command line (these may differ: {local}), "
                 "then requeue the job: it resumes from its newest checkpoint.")  # fmt: skip
    return "\n".join(lines)


class SameJobCheck(Component):
    """The check as the run's component: at set-up, before anything is built or loaded."""

    def setup(self, run: Run) -> None:
        """Compare this rank's fingerprint with every other rank's; all ranks end with ``NODE_MISMATCH`` on a mismatch.

        Raises:
            TrainingExit: ``NODE_MISMATCH``, with the report, when ranks differ.
        """
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        mine = fingerprint(run.cfg, run.rank)
        digests: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(digests, mine.digest())
        if len(set(digests)) == 1:
            return
        prints: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(prints, mine)  # the whole fingerprints: only when they differ
        refused = report(prints)
        if refused is None:  # the digests differed but the fingerprints agree: cannot happen, say so rather than stop
            logger.warning("same-job check: the ranks' digests differ but their fingerprints agree; going on")
            return
        logger.error(refused)
        raise TrainingExit(ExitCode.NODE_MISMATCH, refused.splitlines()[0])
