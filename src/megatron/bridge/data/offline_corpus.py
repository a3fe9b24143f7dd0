"""A JSONL text corpus that every machine can make without a network: the Python standard library's sources.

    python -m megatron.bridge.data.offline_corpus --output corpus.jsonl [--max-files N] [--max-bytes B]

Real text for tests, examples and smoke runs on machines that cannot download a data set: every ``.py`` file under
``sysconfig.get_paths()["stdlib"]`` (about 1,800 files, 31 MB for Python 3.11), in sorted order of their relative
paths, skipping ``site-packages``/``dist-packages`` (what is installed there differs between machines),
``__pycache__`` and files that are not UTF-8. One line per file: ``{"text": <source>, "path": <relative path>}``.
The same Python version gives byte-identical output on every machine.

Guards against: a corpus that differs between machines or runs (installed packages, directory listing order), and
a truncated corpus after a crash (the file is written with ``atomic_write``). Imports no megatron-core.
"""

import argparse
import json
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from typing import Optional

from megatron.bridge.utils.fs import atomic_write

SKIPPED_DIRECTORIES = frozenset({"site-packages", "dist-packages", "__pycache__"})
"""Directories whose content differs between machines (installed packages) or is not source."""


def stdlib_root() -> str:
    """The standard library's directory."""
    return sysconfig.get_paths()["stdlib"]


def source_files(root: Optional[str] = None) -> list[str]:
    """The ``.py`` files under ``root`` (default: the standard library), as sorted relative paths."""
    root = root or stdlib_root()
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRECTORIES]
        for name in files:
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(directory, name), root))
    return sorted(found)


def documents(
    root: Optional[str] = None, max_files: Optional[int] = None, max_bytes: Optional[int] = None
) -> Iterator[dict[str, str]]:
    """The corpus's records in order: at most ``max_files`` files, at most ``max_bytes`` bytes of UTF-8 text.

    A file that would take the text past ``max_bytes`` ends the corpus (files are never cut).
    """
    root = root or stdlib_root()
    files = total = 0
    for relative in source_files(root):
        if max_files is not None and files >= max_files:
            return
        try:
            with open(os.path.join(root, relative), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        size = len(text.encode("utf-8"))
        if max_bytes is not None and total + size > max_bytes:
            return
        files += 1
        total += size
        yield {"text": text, "path": relative}


def write_corpus(
    output: str, root: Optional[str] = None, max_files: Optional[int] = None, max_bytes: Optional[int] = None
) -> tuple[int, int]:
    """Write the corpus to ``output`` (atomically); return ``(files, bytes of text)``."""
    lines, total = [], 0
    for record in documents(root, max_files, max_bytes):
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
        total += len(record["text"].encode("utf-8"))
    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    atomic_write(output, "".join(lines))
    return len(lines), total


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command (see the module doc)."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron.bridge.data.offline_corpus",
        description="Write the Python standard library's sources as a JSONL corpus (no network needed).",
    )
    parser.add_argument("--output", required=True, help="the JSONL file to write")
    parser.add_argument("--max-files", type=int, help="at most this many source files")
    parser.add_argument("--max-bytes", type=int, help="at most this many bytes of text")
    args = parser.parse_args(argv)
    for name in ("max_files", "max_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    files, total = write_corpus(args.output, max_files=args.max_files, max_bytes=args.max_bytes)
    print(f"offline_corpus: wrote {files} files, {total / 1e6:.1f} MB of text from {stdlib_root()} to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
