"""Who this process is in the job, and which job: the launcher's and scheduler's variables, read in one place.

The confusion this prevents: each module that needed the rank, the world size, the ranks per node, the restart count
or the job's identity read ``os.environ`` itself, with its own default and its own parsing. ``LOCAL_WORLD_SIZE`` was
1 in some modules, 0 ("unknown") in one and the GPU count in another, the job id rule was written out more than
once, and ``int()`` on the raw text made a stray ``RANK=abc`` a bare ``invalid literal for int()`` raised by
whichever module happened to read it first.

How: :func:`current` reads every launch variable into one frozen :class:`LaunchEnv`, whose fields each say which
variable they come from and their value when it is unset (an empty value counts as unset). A value that is not a
whole number in range is a ``ValueError`` naming the variable and the fix. Nothing is cached: nvidia-resiliency-ext's
in-process restart renumbers the ranks (``RANK``, ``WORLD_SIZE``) between iterations of the same process, and tests
set the variables with ``monkeypatch``, so ask again wherever the answer must be the current one.
"""

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from megatron.bridge.utils.elastic import NNODES_ENV, node_range

LAUNCHERS = "torchrun, python -m megatron.bridge.launch and ft_launcher"
"""The launchers that set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``."""

MAX_PORT = 65535
"""The highest TCP port."""


@dataclass(frozen=True)
class LaunchEnv:
    """The launch identity of this process, as its launcher and scheduler set it (see :func:`current`).

    ``LaunchEnv()`` is a process started without a launcher: rank 0 of 1, alone on its node, first attempt.
    """

    rank: int = 0
    """``RANK``: this process's global rank; 0 when unset."""
    local_rank: int = 0
    """``LOCAL_RANK``: this process's rank on its node (it picks the GPU); 0 when unset."""
    world_size: int = 1
    """``WORLD_SIZE``: the number of ranks in the job; 1 when unset."""
    local_world_size: Optional[int] = None
    """``LOCAL_WORLD_SIZE``: the number of ranks on this node; ``None`` when unset (no launcher said it: checks that
    need the real count refuse, :attr:`ranks_per_node` counts this process alone)."""
    restart_count: int = 0
    """``TORCHELASTIC_RESTART_COUNT``: in-job restarts (the launcher restarting its workers) before this attempt; 0
    when unset."""
    requeue_count: int = 0
    """``SLURM_RESTART_COUNT``: the times Slurm requeued the job before this attempt; 0 when unset."""
    job_id: str = "local"
    """``SLURM_JOB_ID``, else ``TORCHELASTIC_RUN_ID`` (torchrun's ``--standalone`` draws a new one per launch), else
    ``"local"``: the job this attempt belongs to."""
    master_addr: Optional[str] = None
    """``MASTER_ADDR``: the host of the launcher's rendezvous store; ``None`` when unset."""
    master_port: Optional[int] = None
    """``MASTER_PORT``: the port of the launcher's rendezvous store (0 to 65535); ``None`` when unset."""
    slurm_procid: Optional[int] = None
    """``SLURM_PROCID``: the Slurm task's global rank (set by ``srun``); ``None`` when unset (not under Slurm)."""
    slurm_localid: Optional[int] = None
    """``SLURM_LOCALID``: the Slurm task's rank on its node; ``None`` when unset (not under Slurm)."""
    node_range: Optional[tuple[int, int]] = None
    """``MBRIDGE_NNODES``: the node counts ``(MIN, MAX)`` the job may run on (``megatron.bridge.launch`` and
    ``ft_launch`` set it from ``--nnodes``, ``utils/elastic.py``); ``None`` when unset (no elastic range known)."""

    @property
    def elastic(self) -> bool:
        """Whether the job may run on fewer nodes than it started with (``--nnodes=MIN:MAX``, MIN < MAX)."""
        return self.node_range is not None and self.node_range[0] < self.node_range[1]

    @property
    def ranks_per_node(self) -> int:
        """The ranks on this node: :attr:`local_world_size`, or 1 (this process alone) when it is unset."""
        return 1 if self.local_world_size is None else self.local_world_size

    def store_port(self) -> int:
        """``MASTER_PORT``, the port of the launcher's rendezvous store (stores of ours listen next to it).

        Raises:
            ValueError: it is unset.
        """
        if self.master_port is None:
            raise ValueError(
                f"MASTER_PORT is not set: the launcher's rendezvous port is needed here. Launch with {LAUNCHERS} "
                "(they set it), or export MASTER_PORT"
            )
        return self.master_port

    def master_endpoint(self) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)``, the launcher's rendezvous store.

        Raises:
            ValueError: either variable is unset.
        """
        unset = [n for n, v in (("MASTER_ADDR", self.master_addr), ("MASTER_PORT", self.master_port)) if v is None]
        if unset:
            raise ValueError(
                f"{' and '.join(unset)} {'is' if len(unset) == 1 else 'are'} not set: the launcher's rendezvous store "
                f"is needed here. Launch with {LAUNCHERS} (they set both), or export MASTER_ADDR and MASTER_PORT"
            )
        assert self.master_addr is not None and self.master_port is not None
        return self.master_addr, self.master_port


VARIABLES: dict[str, tuple[str, ...]] = {
    "rank": ("RANK",),
    "local_rank": ("LOCAL_RANK",),
    "world_size": ("WORLD_SIZE",),
    "local_world_size": ("LOCAL_WORLD_SIZE",),
    "ranks_per_node": ("LOCAL_WORLD_SIZE",),
    "restart_count": ("TORCHELASTIC_RESTART_COUNT",),
    "requeue_count": ("SLURM_RESTART_COUNT",),
    "job_id": ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"),
    "master_addr": ("MASTER_ADDR",),
    "master_port": ("MASTER_PORT",),
    "master_endpoint": ("MASTER_ADDR", "MASTER_PORT"),
    "store_port": ("MASTER_PORT",),
    "slurm_procid": ("SLURM_PROCID",),
    "slurm_localid": ("SLURM_LOCALID",),
    "node_range": ("MBRIDGE_NNODES",),
    "elastic": ("MBRIDGE_NNODES",),
}
"""The variables behind each attribute of :class:`LaunchEnv` (how a check that lists its inputs follows a read)."""


def current(environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """The launch identity in ``environ`` (default ``os.environ``) now; read again at every call, never cached.

    Raises:
        ValueError: a variable that must be a whole number is not one, or is out of range (the message names the
            variable and the fix).
    """
    env = os.environ if environ is None else environ
    return LaunchEnv(
        rank=_integer(env, "RANK", 0, minimum=0),
        local_rank=_integer(env, "LOCAL_RANK", 0, minimum=0),
        world_size=_integer(env, "WORLD_SIZE", 1, minimum=1),
        local_world_size=_integer(env, "LOCAL_WORLD_SIZE", None, minimum=1),
        restart_count=_integer(env, "TORCHELASTIC_RESTART_COUNT", 0, minimum=0),
        requeue_count=_integer(env, "SLURM_RESTART_COUNT", 0, minimum=0),
        job_id=env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or "local",
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=_integer(env, "MASTER_PORT", None, minimum=0, maximum=MAX_PORT),
        slurm_procid=_integer(env, "SLURM_PROCID", None, minimum=0),
        slurm_localid=_integer(env, "SLURM_LOCALID", None, minimum=0),
        node_range=_node_range(env),
    )


def _node_range(env: Mapping[str, str]) -> Optional[tuple[int, int]]:
    """``MBRIDGE_NNODES`` as ``(MIN, MAX)``; ``None`` when unset or empty."""
    raw = env.get(NNODES_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        return node_range(raw)
    except ValueError:
        raise ValueError(
            f"{NNODES_ENV}={raw!r} is not N or MIN:MAX with 1 <= MIN <= MAX; fix: unset it (python -m "
            "megatron.bridge.launch and megatron.bridge.ft_launch set it from --nnodes themselves)"
        ) from None


def _integer(
    env: Mapping[str, str], name: str, default: Optional[int], minimum: int, maximum: Optional[int] = None
) -> Optional[int]:
    """Variable ``name`` of ``env`` as a whole number in ``[minimum, maximum]``; ``default`` when unset or empty."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
    fix = (
        f"unset it, or set it to a whole number {bounds} ({LAUNCHERS} set the launcher's variables themselves, "
        "srun its SLURM_ ones: look for a job script that overrides it)"
    )
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a whole number; fix: {fix}") from None
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name}={raw!r} is out of range ({bounds}); fix: {fix}")
    return value
