"""Silent data corruption of the weights: a data-parallel replica whose weights no longer equal its peers'.

The failure: a bit flipped in one rank's copy of the weights (a bad memory cell, a faulty core, a DMA gone wrong)
shows in the loss only when it happens to make it NaN or a spike (about 1 % of such corruptions do); otherwise that
replica trains on from other weights, its gradients enter every replica's update, and the run is silently wrong from
then on. Every rank of a data-parallel group must hold bit-identical weights after the optimizer step (with the
distributed optimizer, after its parameter all-gather), so comparing them finds it.

How (``train.check_weight_hash_across_dp_replicas_interval``, upstream's field): every N steps, at the end of the
step, and right before every checkpoint save (either tier), each rank hashes each of its parameters (SHA-1 of the
raw bytes, as megatron-core's ``check_param_hashes_across_dp_replicas`` does), its data-parallel group all-gathers
the digests (expert parameters: the expert data-parallel group, as upstream) and every rank of the world agrees, in
one all-reduce, on the ranks whose weights differ from their group's majority (with two replicas there is none:
both are named). A checkpoint is therefore only ever written from weights that agreed at its iteration.

On a mismatch: a ``fault_detected`` event per named rank (mechanism ``weight_hash``) and an error line naming the
ranks, their hosts and the parameters that differ; then every rank stops the attempt together, before anything of
the corrupt state is saved:

- first time on those ranks: exit code 31 (``WEIGHT_HASH_ROLLBACK``, action *restart*): the in-job restart loads the
  newest checkpoint, whose weights agreed when it was saved, and training goes on from there;
- a named rank, on the same host, was named before in this job (``<checkpoint.save>/weight_hash_mismatches.json``
  remembers every mismatch across attempts): that rank's hardware is suspect, a restart on it would only corrupt
  again: exit code 30 (``WEIGHTS_DIVERGED``, action *stop*; requeue excluding its node). Also 30 without
  ``checkpoint.save``: there is nothing to roll back to and nowhere to remember.

megatron-core's function is not called: it moves the digests to CUDA (so it fails on CPU), logs only on the rank
that differs from data-parallel rank 0, and returns one boolean, which neither names the ranks nor agrees the
verdict across groups. What it cannot see, here as upstream: a corruption of the distributed optimizer's own shard of
the master weights, which its all-gather copies to every replica alike.
"""

import contextlib
import hashlib
import json
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.bridge.training.components import Component, Run
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind, Mechanism
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.utils.dist import BarrierTimeout, barrier
from megatron.bridge.utils.fs import atomic_write_json

logger = logging.getLogger(__name__)

RECORD_FILE = "weight_hash_mismatches.json"
"""The mismatches of the job, in ``checkpoint.save``: what makes a second one on the same rank recognizable."""
DIGEST_BYTES = 20
"""A SHA-1 digest's length."""
_RECORD_BARRIER_S = 60.0
"""How long the ranks wait for rank 0 to write the record before they stop (a peer gone does not hold them)."""


def parameter_digests(model: Sequence[torch.nn.Module]) -> dict[bool, tuple[list[str], torch.Tensor]]:
    """Each parameter's SHA-1 over its raw bytes, split by ``expert`` (``param.allreduce`` false, as upstream).

    Returns:
        ``{False: (names, digests), True: (names, digests)}``: names ``<chunk>.<parameter>``, digests a CPU
        ``uint8`` tensor of shape ``[parameters, 20]`` in the model's parameter order.
    """
    found: dict[bool, tuple[list[str], list[bytes]]] = {False: ([], []), True: ([], [])}
    for index, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            data = param.detach()
            raw = data.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
            names, digests = found[not getattr(param, "allreduce", True)]
            names.append(f"{index}.{name}")
            digests.append(hashlib.sha1(raw).digest())
    return {expert: (names, _stacked(digests)) for expert, (names, digests) in found.items()}


def _stacked(digests: list[bytes]) -> torch.Tensor:
    """``digests`` as one ``uint8`` tensor ``[len(digests), 20]``."""
    if not digests:
        return torch.zeros((0, DIGEST_BYTES), dtype=torch.uint8)
    return torch.frombuffer(bytearray(b"".join(digests)), dtype=torch.uint8).view(-1, DIGEST_BYTES)


@dataclass(frozen=True)
class GroupMismatch:
    """Replicas of one group whose weights differ."""

    ranks: list[int]
    """The global ranks named: those off their group's majority, or every rank of the group when there is none."""
    parameters: list[str]
    """The parameters whose digests differ within the group."""
    group: list[int]
    """The group's global ranks."""


def compare_group(gathered: torch.Tensor, group: Sequence[int], names: Sequence[str]) -> Optional[GroupMismatch]:
    """The ranks of ``group`` whose digests differ from the group's majority, or ``None`` when all agree.

    Args:
        gathered: ``[len(group), parameters, 20]``: every rank's digests, in ``group``'s order.
        group: the group's global ranks.
        names: the parameters' names.
    """
    rows = gathered.numpy()
    if (rows == rows[0]).all():
        return None
    named: set[int] = set()
    parameters = []
    for p, name in enumerate(names):
        column = [rows[g, p].tobytes() for g in range(len(group))]
        counts = Counter(column)
        if len(counts) == 1:
            continue
        parameters.append(name)
        top, votes = counts.most_common(1)[0]
        majority = top if 2 * votes > len(group) else None
        named.update(rank for rank, digest in zip(group, column) if digest != majority)
    return GroupMismatch(sorted(named), parameters, list(group))


def _gather(local: torch.Tensor, group: Any, device: torch.device) -> torch.Tensor:
    """Every rank of ``group``'s ``local``, stacked in the group's rank order (on the CPU)."""
    tensor = local.to(device)
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return torch.stack([t.cpu() for t in out])


@contextlib.contextmanager
def params_synced(model: Sequence[Any]) -> Iterator[None]:
    """Within: every chunk's parameters are all-gathered (distributed optimizer with ``overlap_param_gather``).

    Such a chunk gathers its updated parameters in the next forward's pre-hooks; as upstream's training loop does
    around its hash check, the hooks are removed with a synchronous gather, and put back after.
    """
    hooked = [chunk for chunk in model if getattr(chunk, "use_forward_hook", False)]
    for chunk in hooked:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in hooked:
            chunk.enable_forward_pre_hook()


def check_replicas(model: Sequence[Any], groups: dict[bool, Any]) -> tuple[list[int], list[GroupMismatch]]:
    """Compare this rank's parameters with its replicas'; every rank of the world calls it at the same point.

    Args:
        model: this rank's model chunks.
        groups: the group each kind of parameter is compared in: ``False`` (dense) and ``True`` (expert), each a
            process group or a function returning one (called only when this rank has such parameters).

    Returns:
        The ranks named anywhere in the world (the same list on every rank), and the mismatches of this rank's own
        groups (with the parameters that differ).
    """
    device = next(iter(model[0].parameters())).device
    mine = []
    with params_synced(model):
        digests = parameter_digests(model)
    for expert, (names, local) in digests.items():
        if not names:
            continue
        group = groups[expert]() if callable(groups[expert]) else groups[expert]
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        found = compare_group(_gather(local, group, device), ranks, names)
        if found is not None:
            mine.append(found)
    marks = torch.zeros(dist.get_world_size(), dtype=torch.int32)
    for found in mine:
        marks[found.ranks] = 1
    marks = marks.to(device)
    dist.all_reduce(marks, op=dist.ReduceOp.MAX)  # every group's verdict, to every rank
    return [int(r) for r in torch.nonzero(marks.cpu()).flatten().tolist()], mine


def read_record(save_dir: Optional[str]) -> list[dict]:
    """The mismatches recorded in ``save_dir`` by earlier attempts of the job (none when there is no record)."""
    if save_dir is None:
        return []
    try:
        with open(os.path.join(save_dir, RECORD_FILE)) as f:
            return list(json.load(f).get("mismatches", []))
    except FileNotFoundError:
        return []
    except (OSError, ValueError, AttributeError) as err:  # unreadable: every rank reads the same, so they agree
        logger.warning("weight hash check: cannot read %s (%s): no earlier mismatch known", RECORD_FILE, err)
        return []


def seen_before(record: Sequence[dict], named: dict[int, str]) -> list[int]:
    """The ranks of ``named`` (rank -> host) that an earlier mismatch of ``record`` named on the same host."""
    earlier = {(int(rank), host) for entry in record for rank, host in entry.get("ranks", {}).items()}
    return sorted(rank for rank, host in named.items() if (rank, host) in earlier)


class WeightHashCheck(Component):
    """Data-parallel replicas' weights compared every N steps and before every save; a mismatch stops the attempt."""

    def __init__(self, interval: int, save_dir: Optional[str]) -> None:
        self.interval = interval
        self.save_dir = save_dir
        self._verified: Optional[int] = None
        self._hosts: list[str] = []
        self._record: list[dict] = []

    @classmethod
    def build(cls, run: Run) -> Optional["WeightHashCheck"]:
        """On when ``train.check_weight_hash_across_dp_replicas_interval`` is set."""
        interval = run.cfg.train.check_weight_hash_across_dp_replicas_interval
        return cls(interval, run.cfg.checkpoint.save) if interval is not None else None

    def ready(self, run: Run) -> None:
        """Learn every rank's host and the job's earlier mismatches (every rank reads the same record)."""
        self._hosts = [""] * dist.get_world_size()
        dist.all_gather_object(self._hosts, socket.gethostname())
        self._record = read_record(self.save_dir)
        self._verified = None

    def on_train_step_end(self, context: Any) -> None:
        """Compare after the update of a step whose number is a multiple of the interval."""
        iteration = context.state.train_state.step + 1
        if iteration % self.interval == 0:
            self.check(context.model, iteration)

    def on_checkpoint_save_start(self, context: Any) -> None:
        """Compare before a save (unless this state was compared already): no checkpoint holds diverged weights."""
        self.check(context.model, context.state.train_state.step)

    def check(self, model: Sequence[Any], iteration: int) -> None:
        """Compare the weights after ``iteration`` across replicas; on a mismatch stop (:class:`TrainingExit`)."""
        if self._verified == iteration:
            return
        from megatron.core import parallel_state

        groups = {
            False: parallel_state.get_data_parallel_group(),
            True: parallel_state.get_expert_data_parallel_group,
        }
        named, mine = check_replicas(model, groups)
        if not named:
            self._verified = iteration
            return
        self._stop(iteration, named, mine)

    def _stop(self, iteration: int, named: list[int], mine: list[GroupMismatch]) -> None:
        me = dist.get_rank()
        hosts = {rank: self._hosts[rank] if rank < len(self._hosts) else "?" for rank in named}
        again = seen_before(self._record, hosts)
        if again:
            code = ExitCode.WEIGHTS_DIVERGED
            action = f"rank(s) {_ranks(again)} were named before on the same host: suspect hardware, stopping"
        elif self.save_dir is None:
            code = ExitCode.WEIGHTS_DIVERGED
            action = "no checkpoint.save to roll back to or to remember this in: stopping"
        else:
            code = ExitCode.WEIGHT_HASH_ROLLBACK
            action = "rolling back: the restart loads the newest checkpoint (its weights agreed when saved)"
        where = ", ".join(f"{rank} on {hosts[rank]}" for rank in named)
        parameters = sorted({p for found in mine for p in found.parameters})
        listed = ", ".join(parameters[:5]) + (", ..." if len(parameters) > 5 else "")
        which = f" in {len(parameters)} parameter(s) ({listed})" if parameters else ""
        pair = " (two replicas: either may be the wrong one)" if any(len(f.group) == 2 for f in mine) else ""
        reason = (
            f"weight hash check after iteration {iteration}: data-parallel replicas hold different weights: rank(s) "
            f"{where} differ{which}{pair}; {action}"
        )
        logger.error("%s (exit code %d)", reason, int(code))
        for found in mine:
            if me == found.group[0]:  # one writer per group: its first rank
                for rank in found.ranks:
                    event_stream.emit(
                        EventKind.FAULT_DETECTED,
                        mechanism=Mechanism.WEIGHT_HASH,
                        rank=rank,
                        iteration=iteration,
                        exit_code=int(code),
                        detail=f"differs from its replicas {found.group} in {', '.join(found.parameters)}",
                    )
        if me == 0 and self.save_dir is not None:
            entry = {"iteration": iteration, "ranks": {str(r): h for r, h in hosts.items()}, "exit_code": int(code)}
            entry["time"] = time.time()
            try:
                atomic_write_json(os.path.join(self.save_dir, RECORD_FILE), {"mismatches": [*self._record, entry]})
            except OSError as err:
                logger.error("weight hash check: could not record the mismatch in %s: %s", RECORD_FILE, err)
        try:  # no rank leaves before the record is written: the next attempt reads it
            barrier(timeout=_RECORD_BARRIER_S, name="weight hash mismatch recorded")
        except BarrierTimeout as err:
            logger.warning("weight hash check: stopping without every rank: %s", err)
        raise TrainingExit(code, reason)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
