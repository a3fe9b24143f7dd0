"""Verify checkpoints by hand: ``mbridge-verify-checkpoint DIR [--all]``.

``DIR`` is either one checkpoint (``.../iter_0000100``) or a save directory, in which case the checkpoint named by
the tracker is checked (every committed one with ``--all``). Exit status 0 means every checked checkpoint matches
its manifest; 1 means at least one does not (a checkpoint of this package without its manifest is damaged); 2 means
nothing to check; 3 means some were written elsewhere (Megatron-Bridge, a conversion tool) without a manifest, so
they could not be verified, and every other one matched.
"""

import argparse
import logging
import os
import sys

from megatron.bridge.training.checkpoint import contents, layout, manifest
from megatron.bridge.training.checkpoint.names import is_checkpoint_iteration_directory

UNVERIFIED = 3
"""Exit status when some checkpoints could not be verified (written elsewhere, no manifest) and none failed."""


def _targets(path: str, check_all: bool) -> list[str]:
    if os.path.exists(os.path.join(path, manifest.MANIFEST_NAME)) or is_checkpoint_iteration_directory(path):
        return [path]
    iterations = layout.committed_iterations(path)
    if not check_all:
        tracked = layout.read_tracker(path)
        iterations = [tracked] if tracked is not None else iterations[:1]
    return [layout.iter_dir(path, it) for it in iterations]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mbridge-verify-checkpoint``; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a checkpoint directory (iter_NNNNNNN) or a save directory")
    parser.add_argument("--all", action="store_true", help="check every committed checkpoint of a save directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")

    targets = _targets(args.path, args.all)
    if not targets:
        print(f"no checkpoint found in {args.path}", file=sys.stderr)
        return 2
    failed = unverified = 0
    for target in targets:
        if contents.foreign_without_manifest(target) is not None:
            unverified += 1
            print(
                f"UNVERIFIED {target}: written elsewhere, without a {manifest.MANIFEST_NAME}: nothing to check against"
            )
            continue
        problems = manifest.verify_dir(target)
        if problems:
            failed += 1
            print(f"FAILED {target}")
            for problem in problems:
                print(f"  {problem}")
        else:
            print(f"OK     {target} ({len(manifest.read_manifest(target))} files)")
    return 1 if failed else UNVERIFIED if unverified else 0


if __name__ == "__main__":
    sys.exit(main())
