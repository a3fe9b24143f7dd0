"""Elastic node ranges (``--nnodes=MIN:MAX``): which launches can shrink, and what the workers are told.

With ``--nnodes=MIN:MAX`` and no spare, a job that loses a node re-forms its rendezvous with the nodes left (as long
as there are at least MIN of them) and goes on with a smaller data-parallel size. That needs a rendezvous that forms
a world of whatever number of nodes joined: torch's ``c10d`` (or etcd) dynamic rendezvous, which torchrun and
nvidia-resiliency-ext 0.4's ft_launcher (``--ft-rdzv-impl legacy`` on 0.6) use. The others cannot shrink:

- torchrun's ``static`` rendezvous (its default) waits for MAX nodes and never re-forms with fewer;
- ``--standalone`` draws a private endpoint on this host: no other node can ever join, so a range means nothing;
- nvidia-resiliency-ext's barrier rendezvous (the default from 0.6, the only one in 0.7) always runs MIN nodes and
  keeps the others as hot spares: the world never shrinks below MIN or grows above it. (0.6's ``--ft-rdzv-impl
  legacy`` would be elastic, but 0.6.0's agent calls barrier-only methods on it and ends at its first start with an
  ``AttributeError``.)

The first two are refused before anything starts (:func:`refusal`, exit code ``CONFIG_ERROR``); the barrier
rendezvous is accepted with a line saying what MIN:MAX means there (:func:`notice`). The launcher exports the range
the workers will really see (:data:`NNODES_ENV`): training reads it (``launch_env``) to check at start that every
node count of the range gives a layout it can train on and to tell a shrink from a misconfiguration.
"""

import importlib.util
import os
from typing import Any, Optional

NNODES_ENV = "MBRIDGE_NNODES"
"""Set by ``megatron.bridge.launch`` and ``megatron.bridge.ft_launch`` for their workers: ``MIN:MAX`` nodes."""

ELASTIC_BACKENDS = ("c10d", "etcd", "etcd-v2")
"""torchrun rendezvous backends that form a world of any size from MIN to MAX nodes."""

_BARRIER = "nvidia_resiliency_ext.fault_tolerance.ft_rendezvous_barrier"
_IMPL_FLAGS = ("--ft-rdzv-impl", "--ft-rdzv_impl")


def node_range(nnodes: Any) -> tuple[int, int]:
    """``(MIN, MAX)`` of a ``--nnodes`` value (``N`` or ``MIN:MAX``).

    Raises:
        ValueError: not one or two whole numbers, or MIN above MAX, or below 1.
    """
    text = str(nnodes).strip()
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        low, high = 0, -1
    if not 1 <= low <= high:
        raise ValueError(f"--nnodes={text} is not N or MIN:MAX with 1 <= MIN <= MAX")
    return low, high


def barrier_rendezvous(argv: list[str]) -> bool:
    """Whether ft_launcher with ``argv`` uses nvidia-resiliency-ext's barrier rendezvous (MIN active, rest spares)."""
    if importlib.util.find_spec(_BARRIER) is None:  # 0.4: the compare-and-set rendezvous only, elastic
        return False
    for i, arg in enumerate(argv):
        if arg in ("-m", "--module"):
            break
        for flag in _IMPL_FLAGS:
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1] != "legacy"
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1] != "legacy"
    return True


def refusal(args: Any, launcher: str) -> Optional[str]:
    """Why the launch with parsed torchrun-style ``args`` cannot honour its ``--nnodes=MIN:MAX`` (``None``: it can).

    Args:
        args: torchrun's (or ft_launcher's) parsed arguments: ``nnodes``, ``standalone``, ``rdzv_backend``.
        launcher: the launcher's name, for the message.
    """
    try:
        low, high = node_range(args.nnodes)
    except ValueError as err:
        return f"{launcher}: {err}. Fix: --nnodes=N, or --nnodes=MIN:MAX for an elastic job"
    if low == high:
        return None
    given = f"--nnodes={args.nnodes}"
    if getattr(args, "standalone", False):
        return (
            f"{launcher}: {given} with --standalone: a standalone rendezvous is private to this host, so no other node "
            f"can join and the job cannot grow or shrink. Fix: drop --standalone and give every node the same "
            f"--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-id=ID, or use --nnodes={high}"
        )
    backend = getattr(args, "rdzv_backend", "static")
    if backend not in ELASTIC_BACKENDS:
        return (
            f"{launcher}: {given} with --rdzv-backend={backend}: that rendezvous waits for exactly {high} nodes and "
            f"never re-forms with fewer, so the job cannot shrink to {low}. Fix: --rdzv-backend=c10d with "
            f"--rdzv-endpoint=HOST:PORT and --rdzv-id=ID on every node (an elastic rendezvous), or --nnodes={high}"
        )
    return None


def notice(args: Any, argv: list[str]) -> Optional[str]:
    """What ``--nnodes=MIN:MAX`` means under ft_launcher's barrier rendezvous (``None``: it is elastic there)."""
    low, high = node_range(args.nnodes)
    if low == high or not barrier_rendezvous(argv):
        return None
    return (
        f"ft_launch: --nnodes={args.nnodes} under nvidia-resiliency-ext's barrier rendezvous: the job trains on {low} "
        f"node(s) and keeps up to {high - low} more as hot spares; it never shrinks below or grows above {low} "
        "(for a job that goes on with fewer nodes: nvidia-resiliency-ext 0.4's ft_launcher, or "
        "python -m megatron.bridge.launch with --rdzv-backend=c10d)"
    )


def workers_range(args: Any, argv: Optional[list[str]] = None) -> tuple[int, int]:
    """The node counts the workers can see: ``(MIN, MAX)``, or ``(MIN, MIN)`` under the barrier rendezvous."""
    low, high = node_range(args.nnodes)
    if argv is not None and barrier_rendezvous(argv):
        return low, low
    return low, high


def export(node_counts: tuple[int, int]) -> None:
    """Tell the workers started from this process the node counts they may run on (:data:`NNODES_ENV`)."""
    os.environ[NNODES_ENV] = f"{node_counts[0]}:{node_counts[1]}"
