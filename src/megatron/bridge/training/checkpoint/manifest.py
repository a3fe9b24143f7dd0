"""Checkpoint integrity: a manifest of every file's size and SHA-256, written at save and checked at load.

Hashing is split over ranks: rank ``r`` of ``n`` hashes every ``n``-th file (``files[r::n]``), so a large
checkpoint on a shared file system is read in parallel. These functions do no communication; the caller gathers
the partial results (see ``checkpoint/saving.py`` and ``checkpoint/loading.py``).
"""

import hashlib
import json
import logging
import os
from dataclasses import dataclass

from megatron.bridge.utils.fs import atomic_write_json

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
PARTIAL_PREFIX = ".partial_manifest_rank"
MANIFEST_VERSION = 1
_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class FileEntry:
    """Size and content hash of one checkpoint file."""

    size: int
    sha256: str


def hash_file(path: str) -> FileEntry:
    """Return the size and SHA-256 of the file at ``path``."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileEntry(size=size, sha256=digest.hexdigest())


def list_files(ckpt_dir: str) -> list[str]:
    """Sorted paths, relative to ``ckpt_dir``, of every regular file in it except the manifest."""
    found = []
    for root, _, files in os.walk(ckpt_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), ckpt_dir)
            if rel != MANIFEST_NAME and not name.startswith(PARTIAL_PREFIX):
                found.append(rel)
    return sorted(found)


def hash_share(ckpt_dir: str, files: list[str], rank: int, world_size: int) -> dict[str, FileEntry]:
    """Hash this rank's share ``files[rank::world_size]`` of the checkpoint's files."""
    return {rel: hash_file(os.path.join(ckpt_dir, rel)) for rel in files[rank::world_size]}


def hash_rank_shards(ckpt_dir: str, rank: int) -> None:
    """Hash the shard files ``rank`` wrote (``__<rank>_*.distcp``) into a partial manifest next to them.

    Runs in the background checkpoint writer right after it wrote them, so the commit does not re-read them.
    """
    prefix = f"__{rank}_"
    entries = {
        name: hash_file(os.path.join(ckpt_dir, name))
        for name in sorted(os.listdir(ckpt_dir))
        if name.startswith(prefix) and name.endswith(".distcp")
    }
    path = os.path.join(ckpt_dir, f"{PARTIAL_PREFIX}{rank}.json")
    # Not durable: the commit reads and deletes it; the files it describes are flushed by the commit.
    atomic_write_json(path, {rel: [e.size, e.sha256] for rel, e in entries.items()}, durable=False)


def take_partial_manifests(ckpt_dir: str) -> dict[str, FileEntry]:
    """Read and delete the partial manifests in ``ckpt_dir``; entries whose file changed size are dropped."""
    entries: dict[str, FileEntry] = {}
    for name in sorted(os.listdir(ckpt_dir)):
        if not name.startswith(PARTIAL_PREFIX):
            continue
        path = os.path.join(ckpt_dir, name)
        if name.endswith(".json"):
            with open(path) as f:
                for rel, (size, sha) in json.load(f).items():
                    if os.path.getsize(os.path.join(ckpt_dir, rel)) == size:
                        entries[rel] = FileEntry(size=size, sha256=sha)
        os.remove(path)
    return entries


def write_manifest(ckpt_dir: str, iteration: int, entries: dict[str, FileEntry]) -> str:
    """Write the manifest for ``entries`` into ``ckpt_dir`` (flushed to disk) and return its path."""
    doc = {
        "version": MANIFEST_VERSION,
        "iteration": iteration,
        "files": {rel: {"size": e.size, "sha256": e.sha256} for rel, e in sorted(entries.items())},
    }
    path = os.path.join(ckpt_dir, MANIFEST_NAME)
    atomic_write_json(path, doc, indent=1)
    return path


def read_manifest(ckpt_dir: str) -> dict[str, FileEntry]:
    """Read the manifest of ``ckpt_dir``.

    Raises:
        ValueError: the manifest is missing or unreadable (the checkpoint was never committed by us).
    """
    path = os.path.join(ckpt_dir, MANIFEST_NAME)
    try:
        with open(path) as f:
            doc = json.load(f)
        return {rel: FileEntry(size=int(v["size"]), sha256=str(v["sha256"])) for rel, v in doc["files"].items()}
    except FileNotFoundError:
        raise ValueError(f"{path} is missing") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is unreadable: {err}") from None


def verify_share(ckpt_dir: str, manifest: dict[str, FileEntry], rank: int, world_size: int) -> list[str]:
    """Check this rank's share of the files named in ``manifest``; return one message per problem.

    Sizes are compared before hashing, so a truncated file is reported without reading it.
    """
    problems = []
    for rel in sorted(manifest)[rank::world_size]:
        expected = manifest[rel]
        path = os.path.join(ckpt_dir, rel)
        try:
            size = os.path.getsize(path)
        except OSError:
            problems.append(f"{rel}: missing")
            continue
        if size != expected.size:
            problems.append(f"{rel}: size {size} bytes, manifest says {expected.size}")
            continue
        try:
            actual = hash_file(path).sha256
        except OSError as err:
            problems.append(f"{rel}: unreadable ({err})")
            continue
        if actual != expected.sha256:
            problems.append(f"{rel}: sha256 {actual[:12]}…, manifest says {expected.sha256[:12]}…")
    return problems


def verify_dir(ckpt_dir: str) -> list[str]:
    """Check a whole checkpoint directory on one process; return one message per problem (empty: valid)."""
    try:
        manifest = read_manifest(ckpt_dir)
    except ValueError as err:
        return [str(err)]
    problems = verify_share(ckpt_dir, manifest, 0, 1)
    extra = sorted(set(list_files(ckpt_dir)) - set(manifest))
    if extra:
        logger.warning("%s: files not in the manifest (ignored): %s", ckpt_dir, ", ".join(extra))
    return problems
