"""Content hashes of a local checkpoint shard: computed by its owner before it leaves, checked by every reader.

The failure: a shard of the local tier travels (to the node's disk, to replicas on other nodes, back over the network
after a restart) and a bit can change on the way, or a file can hold another rank's or another iteration's state. A
shard loaded that way trains on silently from a wrong state. So its owner hashes every tensor, every object and its
common part (:func:`content_hashes`) and stamps whose state it is (:func:`owner_tag`: rank, iteration, parallel
layout) into the shard itself (:data:`HASHES_ATTR`); whoever reads it checks it (:func:`verify_content`) before
keeping or forwarding it. ``local_tier.py`` does both.
"""

import hashlib
import io
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

HASHES_ATTR = "mbridge_content_hashes"
"""Attribute of a saved ``MCoreTensorAwareStateDict`` holding its owner's content hashes (pickled with it)."""

COMMON = "<common>"
"""The hash table's key for the shard's common (not sharded) state."""
OWNER = "<owner>"
"""The hash table's key for :func:`owner_tag`."""


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (copied to the CPU first when it is elsewhere)."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    digest = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
    flat = data.contiguous().reshape(-1)
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy())  # hashlib releases the GIL: threads hash in parallel
    return digest.hexdigest()


def sharded_items(tasd: Any) -> list[tuple[str, Any]]:
    """``(name, ShardedTensor or ShardedObject)`` of every item of ``tasd`` that carries data."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    items = []
    for sh in nested_values(tasd.sharded_state_dict):
        if isinstance(sh, ShardedTensor) and sh.data is not None:
            offsets = ",".join(map(str, sh.global_offset))
            items.append((f"tensor {sh.key}[{offsets}]{'' if sh.flattened_range is None else sh.flattened_range}", sh))
        elif isinstance(sh, ShardedObject) and sh.data is not None:
            items.append((f"object {sh.unique_key}", sh))
    return items


def value_digest(value: Any) -> str:
    """A digest of plain state (dicts, lists, numbers, strings, tensors) that survives a pickle round trip.

    Pickling the whole structure is not stable: equal values shared by reference before saving are separate objects
    after loading, and pickle encodes the two cases differently.
    """
    digest = hashlib.sha256()

    def feed(obj: Any) -> None:
        if isinstance(obj, dict):
            digest.update(b"{")
            for key, item in obj.items():
                feed(key)
                feed(item)
            digest.update(b"}")
        elif isinstance(obj, (list, tuple)):
            digest.update(f"{type(obj).__name__}[".encode())
            for item in obj:
                feed(item)
            digest.update(b"]")
        elif isinstance(obj, torch.Tensor):
            digest.update(tensor_digest(obj).encode())
        elif isinstance(obj, io.BytesIO):
            digest.update(obj.getvalue())
        elif obj is None or isinstance(obj, (str, int, float, bool, bytes)):
            digest.update(repr(obj).encode())
        else:
            digest.update(pickle.dumps(obj, protocol=4))
        digest.update(b",")

    feed(value)
    return digest.hexdigest()


def content_hashes(tasd: Any) -> dict[str, str]:
    """SHA-256 of every tensor and object of ``tasd`` and of its common part, by name."""
    items = sharded_items(tasd)
    tensors = [(name, sh.data) for name, sh in items if isinstance(sh.data, torch.Tensor)]
    hashes = {name: value_digest(sh.data) for name, sh in items if not isinstance(sh.data, torch.Tensor)}
    hashes[COMMON] = value_digest(tasd.common)
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        hashes.update(zip([n for n, _ in tensors], pool.map(tensor_digest, [t for _, t in tensors])))
    return hashes


def owner_tag(rank: int, iteration: int, layout: str = "") -> str:
    """What the hash table records about a shard: whose state, of which iteration, under which parallel layout."""
    return f"rank {rank}, iteration {iteration}" + (f", {layout}" if layout else "")


def saved_layout(tasd: Any) -> Optional[str]:
    """The parallel layout a shard was saved under, from its owner's tag (``None``: no tag; ``""``: none recorded)."""
    hashes = getattr(tasd, HASHES_ATTR, None)
    tag = hashes.get(OWNER) if isinstance(hashes, dict) else None
    if not isinstance(tag, str):
        return None
    parts = tag.split(", ", 2)  # "rank R", "iteration I", the layout
    return parts[2] if len(parts) == 3 else ""


def verify_content(tasd: Any, owner: Optional[str] = None) -> list[str]:
    """Problems of ``tasd`` against the hashes its owner stored in it (empty when it is intact).

    Args:
        tasd: a loaded or received shard.
        owner: :func:`owner_tag` of the shard that was asked for; a shard of another rank or iteration is a problem.
    """
    expected = getattr(tasd, HASHES_ATTR, None)
    if not isinstance(expected, dict):
        return ["carries no content hashes (not written by this version)"]
    problems = []
    if owner is not None and expected.get(OWNER) != owner:
        problems.append(f"holds the state of {expected.get(OWNER)}, not of {owner}")
    expected = {name: digest for name, digest in expected.items() if name != OWNER}
    actual = content_hashes(tasd)
    problems += [
        f"{name}: content differs from what its owner saved"
        for name in actual
        if name in expected and actual[name] != expected[name]
    ]
    problems += [f"{name}: missing" for name in expected if name not in actual]
    problems += [f"{name}: not in the owner's hash table" for name in actual if name not in expected]
    return problems
