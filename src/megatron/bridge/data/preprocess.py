r"""JSONL text to megatron-core's indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``), written so a crash leaves none.

    python -m megatron.bridge.data.preprocess --input corpus.jsonl --output-prefix out/corpus \
        --tokenizer-metadata '{"library": "byte-level"}' --append-eod

Each line of the input is a JSON object; the text under each ``--json-keys`` key (default ``text``) is one
document, tokenized and appended with megatron-core's ``IndexedDatasetBuilder`` (token dtype: megatron-core's
``DType.optimal_dtype`` for the vocabulary). ``--append-eod`` ends every document with the tokenizer's
end-of-document id (so ``reset_position_ids``/``eod_mask_loss`` can see document boundaries). With one key the
output is ``<prefix>.bin/.idx``; with several, one dataset per key, ``<prefix>_<key>.bin/.idx``. Blank lines and
documents that tokenize to nothing are skipped. A progress line (documents, tokens, MB/s) is printed every few
seconds.

Guards against a half-written dataset that a loader would take for a whole one. Both files are written under
temporary names (``.<name>.<pid>-<id>.tmp``, the convention of :mod:`megatron.bridge.utils.fs`, whose
``remove_temporaries`` clears what a killed run left) and put in place only when complete: an existing ``.idx`` is
removed first, then the ``.bin`` is renamed, then the ``.idx`` is written with ``atomic_write``. A loader needs
both files, so at every instant there is either no pair or a complete, matching one. A bad line fails the run
with ``<file>:<line>`` and the fix, before anything is put in place.
"""

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron.bridge.data.tokenization import build_tokenizer
from megatron.bridge.utils.cpu_shims import before_megatron_core_import
from megatron.bridge.utils.fields import fail
from megatron.bridge.utils.fs import TMP_SUFFIX, atomic_write, fsync_path, remove_temporaries

before_megatron_core_import()  # noqa: E402 - on CPU, before megatron-core's fused ops are imported

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402

CHUNK_DOCUMENTS = 256
"""Documents tokenized together (a HuggingFace tokenizer encodes a chunk on its threads)."""


@dataclass
class PreprocessStats:
    """What a preprocessing run read and wrote."""

    documents: int = 0
    """Documents written (over all keys)."""
    tokens: int = 0
    """Tokens written (over all keys), end-of-document ids included."""
    skipped: int = 0
    """Blank lines and documents that tokenized to nothing."""
    input_bytes: int = 0
    """Bytes of input read."""
    seconds: float = 0.0
    """Wall time of the run."""
    prefixes: list[str] = field(default_factory=list)
    """The dataset prefixes written (for ``dataset.blend``)."""


def output_prefixes(output_prefix: str, json_keys: Sequence[str]) -> dict[str, str]:
    """Key -> dataset prefix: ``output_prefix`` itself for one key, ``<output_prefix>_<key>`` for several."""
    if len(json_keys) == 1:
        return {json_keys[0]: output_prefix}
    return {key: f"{output_prefix}_{key}" for key in json_keys}


def _temporary(path: str) -> str:
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def preprocess(
    input_path: str,
    output_prefix: str,
    tokenizer: Any,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    log_interval: float = 5.0,
    log: Callable[[str], None] = _stderr,
) -> PreprocessStats:
    """Tokenize the JSONL file ``input_path`` into indexed datasets under ``output_prefix`` (see the module doc).

    Args:
        input_path: one JSON object per line.
        output_prefix: where to write (``<prefix>.bin/.idx``); its directory is created.
        tokenizer: from :func:`megatron.bridge.data.tokenization.build_tokenizer` (``tokenize``, ``eod``,
            ``vocab_size``; ``tokenize_batch`` is used when present).
        json_keys: the keys whose text is tokenized, one dataset each.
        append_eod: end every document with ``tokenizer.eod``.
        log_interval: seconds between progress lines.
        log: where progress lines go.

    Raises:
        ValueError: a missing input, a line that is not a JSON object or lacks a key (``<file>:<line>``), an input
            without documents. Nothing is put in place then.
    """
    start = time.monotonic()
    keys = list(json_keys)
    if not keys or len(set(keys)) != len(keys):
        fail("--json-keys", f"needs distinct keys, got {keys}", "name each key once, e.g. --json-keys text")
    if not os.path.isfile(input_path):
        fail("--input", f"{input_path} does not exist or is not a file", "give the path of a JSONL file")
    prefixes = output_prefixes(output_prefix, keys)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    for prefix in prefixes.values():  # what a killed earlier run left
        remove_temporaries(prefix + ".bin")
        remove_temporaries(prefix + ".idx")
    temporaries = {key: (_temporary(p + ".bin"), _temporary(p + ".idx")) for key, p in prefixes.items()}
    stats = PreprocessStats(prefixes=list(prefixes.values()))
    builders: dict[str, IndexedDatasetBuilder] = {}
    try:
        dtype = DType.optimal_dtype(tokenizer.vocab_size)
        for key, (tmp_bin, _tmp_idx) in temporaries.items():
            builders[key] = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
        _tokenize_file(input_path, keys, tokenizer, append_eod, builders, stats, start, log_interval, log)
        if stats.documents == 0:
            fail("--input", f"{input_path} holds no non-empty document under {keys}", "give a file with text")
        for key, (_tmp_bin, tmp_idx) in temporaries.items():
            builders[key].finalize(tmp_idx)
        for key, prefix in prefixes.items():
            _put_in_place(prefix, *temporaries[key])
    except BaseException:
        for builder in builders.values():
            builder.data_file.close()
        for paths in temporaries.values():
            for path in paths:
                if os.path.exists(path):
                    os.remove(path)
        raise
    stats.seconds = time.monotonic() - start
    log(
        f"preprocess: done: {_progress(stats, stats.seconds)}; wrote "
        + ", ".join(f"{p}.bin/.idx" for p in prefixes.values())
    )
    return stats


def _put_in_place(prefix: str, tmp_bin: str, tmp_idx: str) -> None:
    """Replace ``<prefix>.bin/.idx`` by the complete temporaries, never exposing a mismatched pair."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    fsync_path(tmp_bin)
    if os.path.exists(idx_path):
        os.remove(idx_path)  # first break an old pair: old .idx + new .bin must never be seen together
    os.replace(tmp_bin, bin_path)
    with open(tmp_idx, "rb") as f:
        index = f.read()
    atomic_write(idx_path, index)  # the commit: the pair exists from here on (and the directory is fsynced)
    os.remove(tmp_idx)


def _progress(stats: PreprocessStats, elapsed: float) -> str:
    megabytes = stats.input_bytes / 1e6
    rate = megabytes / elapsed if elapsed > 0 else 0.0
    return (
        f"{stats.documents:,} documents, {stats.tokens:,} tokens, {megabytes:.1f} MB read in {elapsed:.1f} s "
        f"({rate:.2f} MB/s)"
    )


def _tokenize_file(
    input_path: str,
    keys: list[str],
    tokenizer: Any,
    append_eod: bool,
    builders: dict[str, IndexedDatasetBuilder],
    stats: PreprocessStats,
    start: float,
    log_interval: float,
    log: Callable[[str], None],
) -> None:
    batch = getattr(tokenizer, "tokenize_batch", None) or (lambda texts: [tokenizer.tokenize(t) for t in texts])
    eod = [tokenizer.eod] if append_eod else []
    pending: dict[str, list[str]] = {key: [] for key in keys}
    next_log = start + log_interval

    def flush() -> None:
        for key, texts in pending.items():
            for ids in batch(texts) if texts else []:
                ids = list(ids) + eod
                if not ids:
                    stats.skipped += 1
                    continue
                builders[key].add_document(ids, [len(ids)])
                stats.documents += 1
                stats.tokens += len(ids)
            texts.clear()

    with open(input_path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            stats.input_bytes += len(raw)
            if not raw.strip():
                stats.skipped += 1
                continue
            record = _parse_line(raw, f"{input_path}:{lineno}", keys)
            for key in keys:
                pending[key].append(record[key])
            if len(pending[keys[0]]) >= CHUNK_DOCUMENTS:
                flush()
                now = time.monotonic()
                if now >= next_log:
                    log(f"preprocess: {_progress(stats, now - start)}")
                    next_log = now + log_interval
    flush()


def _parse_line(raw: bytes, where: str, keys: list[str]) -> dict:
    try:
        record = json.loads(raw)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        fail(where, f"not valid JSON ({err})", "fix or remove the line (one JSON object per line)")
    if not isinstance(record, dict):
        fail(where, f"is a JSON {type(record).__name__}, not an object", "write one JSON object per line")
    for key in keys:
        if key not in record:
            present = ", ".join(sorted(map(repr, record))) or "none"
            fail(where, f"has no key {key!r} (its keys: {present})", "pass --json-keys with the key holding the text")
        if not isinstance(record[key], str):
            fail(where, f"{key!r} is a {type(record[key]).__name__}, not text", "store the document as a string")
    return record


def _metadata_argument(value: Optional[str]) -> Any:
    """``--tokenizer-metadata``: inline JSON (``{...}``) or the path of a JSON file."""
    if value is None or not value.lstrip().startswith("{"):
        return value
    try:
        return json.loads(value)
    except ValueError as err:
        fail("--tokenizer-metadata", f"{value!r} is not valid JSON ({err})", 'e.g. \'{"library": "byte-level"}\'')


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line (see the module doc)."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron.bridge.data.preprocess",
        description="Tokenize a JSONL file into megatron-core's indexed dataset (<prefix>.bin + <prefix>.idx).",
    )
    parser.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    parser.add_argument("--tokenizer-type", help="NullTokenizer or HuggingFaceTokenizer (TokenizerConfig)")
    parser.add_argument("--tokenizer-model", help="HuggingFaceTokenizer: a local tokenizer.json or its directory")
    parser.add_argument(
        "--tokenizer-metadata",
        help='tokenizer metadata, inline JSON or a file; \'{"library": "byte-level"}\' selects the byte-level one',
    )
    parser.add_argument("--vocab-size", type=int, help="NullTokenizer: its vocabulary size")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys holding the text (default: text)")
    parser.add_argument("--append-eod", action="store_true", help="end each document with the end-of-document id")
    parser.add_argument("--log-interval", type=float, default=5.0, help="seconds between progress lines")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command; 1 with the error on stderr when the input or the tokenizer is bad."""
    args = parse_args(argv)
    from megatron.bridge.training.config import TokenizerConfig

    try:
        tokenizer = build_tokenizer(
            TokenizerConfig(
                tokenizer_type=args.tokenizer_type,
                tokenizer_model=args.tokenizer_model,
                metadata_path=_metadata_argument(args.tokenizer_metadata),
                vocab_size=args.vocab_size,
            )
        )
        preprocess(args.input, args.output_prefix, tokenizer, args.json_keys, args.append_eod, args.log_interval)
    except (ValueError, ImportError) as err:
        print(f"preprocess: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
