"""Tokenizers built offline from a ``TokenizerConfig``: NullTokenizer, byte-level, a local ``tokenizer.json``.

Megatron-Bridge's public ``build_tokenizer`` (``megatron.bridge.training.tokenizers.tokenizer``) is this module's
:func:`build_tokenizer`. It lives under ``data/`` because preprocessing and the data checks need it too, and
``data/`` imports nothing from ``training/`` but its config (``tests/unit_tests/utils/test_import_graph.py``).

Three tokenizers, selected as in Megatron-Bridge (megatron-core's ``build_tokenizer`` reads the same fields):

- ``tokenizer_type="NullTokenizer"`` with ``vocab_size=N``: megatron-core's null tokenizer ("ids as text"); ids
  ``0 .. N-1``, the last one its end-of-document id. (megatron-core's own adds one id past ``N`` for it; here the
  vocabulary is exactly ``N``, so ``model.vocab_size = tokenizer.vocab_size`` never leaves an id past the
  embedding, and the mock stream, which draws ids below ``N``, is unchanged.)
- ``metadata_path={"library": "byte-level"}`` (or a local JSON file holding it) with ``tokenizer_type`` left
  ``None``: megatron-core's ``ByteLevelTokenizer``, UTF-8 bytes as ids, 512 ids (``vocab_size`` may raise it),
  end-of-document 0, pad 1. Its ``detokenize`` strips trailing whitespace (megatron-core's behaviour).
- ``tokenizer_type="HuggingFaceTokenizer"`` with ``tokenizer_model`` a local ``tokenizer.json`` or a directory
  holding one, loaded with the ``tokenizers`` package (``pip install 'mbridge-resiliency[data]'``); megatron-core's
  own wrapper needs ``transformers``. Text is encoded without the tokenizer's post-processor tokens (BOS etc.):
  documents are separated by the end-of-document token preprocessing appends.

Guards against: a tokenizer fetched from the network, or silently different from the one asked for. Nothing is
ever downloaded: a path that does not exist is a ``ValueError`` naming ``tokenizer.tokenizer_model``, the path and
the fix, not a hub lookup. Every other tokenizer type, and fields a selected tokenizer would not honour, are
refused by name.
"""

import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Literal, Optional

from megatron.bridge.utils.cpu_shims import before_megatron_core_import
from megatron.bridge.utils.fields import fail
from megatron.bridge.utils.optional_imports import require

before_megatron_core_import()  # noqa: E402 - on CPU, before megatron-core's fused ops are imported

from megatron.core.tokenizers import MegatronTokenizer, MegatronTokenizerBase  # noqa: E402

TokenizerConfig = Any
"""A ``training.config.TokenizerConfig`` (data/ imports nothing from training/ for annotations either)."""

TokenizerKind = Literal["null", "byte-level", "huggingface"]

BYTE_LEVEL = "byte-level"
"""megatron-core's library name for its byte-level tokenizer, the ``metadata_path`` spelling that selects it."""
BYTE_LEVEL_MIN_VOCAB = 256
"""A byte-level vocabulary holds at least every byte value."""
EOD_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
"""End-of-document tokens looked for in a ``tokenizer.json`` that names none (``hf_tokenizer_kwargs``,
``tokenizer_config.json``)."""
PAD_TOKENS = ("<pad>", "<|pad|>", "[PAD]")
"""Padding tokens looked for likewise (optional: without one, megatron-core pads with an id no token has)."""
HF_KWARGS = ("eos_token", "pad_token", "revision", "use_fast")
"""The ``hf_tokenizer_kwargs`` honoured for a ``tokenizer.json``: which of its tokens end a document and pad, the
hub revision ``training.tokenizers.build_tokenizer`` resolved to the local path, and ``use_fast`` (true only: a
``tokenizer.json`` is a fast tokenizer)."""
NULL_LIBRARY = "null-text"
"""megatron-core's library name of its NullTokenizer from 0.17 on (0.16 calls it ``"null"``): the name reported on
every release."""
_EXAMPLES = (
    'tokenizer_type="NullTokenizer" with vocab_size, metadata_path={"library": "byte-level"}, or '
    'tokenizer_type="HuggingFaceTokenizer" with tokenizer_model=<local tokenizer.json or its directory>'
)


def build_tokenizer(config: "TokenizerConfig") -> MegatronTokenizerBase:
    """The tokenizer ``config`` describes, built from local files only.

    Returns a megatron-core ``MegatronTokenizerBase`` (what megatron-core's datasets take) with at least
    ``vocab_size``, ``eod``, ``tokenize(text) -> list[int]``, ``detokenize(ids) -> str`` and
    ``unique_identifiers``.

    Raises:
        ValueError: ``"tokenizer.<field>: <problem>. Fix: <fix>."`` for an unsupported type, a missing path, a
            field the selected tokenizer would not honour.
        ImportError: a HuggingFace tokenizer without the ``tokenizers`` package (names the pip extra).
    """
    kind = tokenizer_kind(config)
    if kind == "null":
        return _null_tokenizer(config.vocab_size)
    if kind == BYTE_LEVEL:
        kwargs = {} if config.vocab_size is None else {"vocab_size": config.vocab_size}
        return MegatronTokenizer.from_pretrained(metadata_path={"library": BYTE_LEVEL}, **kwargs)
    return _huggingface_tokenizer(config)


def tokenizer_kind(config: "TokenizerConfig") -> TokenizerKind:
    """Which tokenizer ``config`` selects; raise the config error when it selects none this framework builds."""
    metadata = _metadata(config.metadata_path)
    library = None if metadata is None else metadata.get("library")
    kind = config.tokenizer_type
    if kind == "NullTokenizer":
        if metadata is not None:
            fail("tokenizer.metadata_path", "NullTokenizer reads no metadata", "leave it None")
        if not isinstance(config.vocab_size, int) or config.vocab_size < 1:
            fail("tokenizer.vocab_size", f"NullTokenizer needs a vocabulary size, got {config.vocab_size}", "set it")
        return "null"
    if kind == "HuggingFaceTokenizer":
        if library not in (None, "huggingface"):
            fail(
                "tokenizer.metadata_path",
                f"library {library!r} contradicts tokenizer_type='HuggingFaceTokenizer'",
                "leave metadata_path None",
            )
        return "huggingface"
    if kind is None and library == BYTE_LEVEL:
        if config.vocab_size is not None and config.vocab_size < BYTE_LEVEL_MIN_VOCAB:
            fail(
                "tokenizer.vocab_size",
                f"a byte-level vocabulary holds every byte value, {config.vocab_size} < {BYTE_LEVEL_MIN_VOCAB}",
                "leave it None (512) or raise it",
            )
        _refuse_set(config, ("special_tokens",), "the byte-level tokenizer")
        return BYTE_LEVEL
    if kind is None and library is not None:
        fail(
            "tokenizer.metadata_path",
            f"library {library!r} is not available here (only {BYTE_LEVEL!r} is selected by metadata)",
            f"use {_EXAMPLES}",
        )
    if kind is None:
        fail("tokenizer.tokenizer_type", "is not set", f"use {_EXAMPLES}")
    if library == BYTE_LEVEL:
        fail(
            "tokenizer.tokenizer_type",
            f"{kind!r} with metadata_path library 'byte-level' is ambiguous",
            "leave tokenizer_type None to select the byte-level tokenizer",
        )
    fail("tokenizer.tokenizer_type", f"{kind!r} is not available here", f"use {_EXAMPLES}")


def _metadata(metadata_path: Any) -> Optional[dict]:
    """``metadata_path`` as a dict: the dict itself, or the JSON object of a local file."""
    if metadata_path is None or isinstance(metadata_path, dict):
        return metadata_path
    path = os.path.expanduser(str(metadata_path))
    if not os.path.isfile(path):
        fail(
            "tokenizer.metadata_path",
            f"{path} is not a file",
            'give the metadata itself, e.g. {"library": "byte-level"}, or the path of a local JSON file holding it',
        )
    try:
        with open(path, encoding="utf-8") as f:
            metadata = json.load(f)
    except (OSError, ValueError) as err:
        fail("tokenizer.metadata_path", f"{path} is not readable JSON ({err})", "fix or replace the file")
    if not isinstance(metadata, dict):
        fail("tokenizer.metadata_path", f"{path} holds a {type(metadata).__name__}, not an object", "fix the file")
    return metadata


def _refuse_set(config: "TokenizerConfig", names: Sequence[str], what: str) -> None:
    for name in names:
        if getattr(config, name):
            fail(f"tokenizer.{name}", f"is not read by {what}", "leave it unset")


def _null_tokenizer(vocab_size: int) -> MegatronTokenizerBase:
    """megatron-core's null tokenizer with ids ``0 .. vocab_size - 1`` (the last the end-of-document id)."""
    for library in ("null", "null-text"):  # megatron-core renamed the library after 0.16
        # Up to 0.16 it adds the end-of-document id to the size asked for; 0.19 counts it in.
        for asked in (vocab_size - 1, vocab_size):
            try:
                tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": library}, vocab_size=asked)
            except (KeyError, AttributeError, ValueError, AssertionError):  # 0.19 asserts a path for a name it lacks
                break
            if tokenizer.vocab_size == vocab_size and tokenizer.eod == vocab_size - 1:
                tokenizer.library = NULL_LIBRARY  # read only at construction: the same tokenizer under one name
                return tokenizer
    raise RuntimeError(
        "megatron-core's NullTokenizer gives no vocabulary of exactly vocab_size ids with its end-of-document id last; "
        "update megatron.bridge.data.tokenization._null_tokenizer"
    )


def _huggingface_tokenizer(config: "TokenizerConfig") -> "LocalHuggingFaceTokenizer":
    if config.tokenizer_model is None:
        fail(
            "tokenizer.tokenizer_model",
            "HuggingFaceTokenizer needs a tokenizer and none is given",
            "set it to a local tokenizer.json or a directory holding one",
        )
    _refuse_set(config, ("vocab_file", "merge_file"), "a tokenizer.json tokenizer (its vocabulary is in the file)")
    _refuse_set(config, ("trust_remote_code",), "a tokenizer.json tokenizer (it runs no code)")
    kwargs = dict(config.hf_tokenizer_kwargs or {})
    unknown = sorted(set(kwargs) - set(HF_KWARGS))
    if unknown:
        fail(
            "tokenizer.hf_tokenizer_kwargs",
            f"{unknown[0]!r} is not honoured for a tokenizer.json (only {', '.join(HF_KWARGS)})",
            "remove it",
        )
    if config.tokenizer_hf_no_use_fast:
        fail(
            "tokenizer.hf_tokenizer_kwargs['use_fast']",
            "is false, but a tokenizer.json is a fast tokenizer and no slow one is built here",
            "remove it, or set it to True",
        )
    tokenizer = LocalHuggingFaceTokenizer(
        str(config.tokenizer_model),
        special_tokens=config.special_tokens,
        eos_token=kwargs.get("eos_token"),
        pad_token=kwargs.get("pad_token"),
    )
    if config.vocab_size is not None and config.vocab_size != tokenizer.vocab_size:
        fail(
            "tokenizer.vocab_size",
            f"{config.vocab_size} differs from the {tokenizer.vocab_size} ids of {tokenizer.path}",
            "leave it None (the tokenizer's vocabulary sizes the model)",
        )
    return tokenizer


def tokenizer_json_path(tokenizer_model: str) -> str:
    """The ``tokenizer.json`` that ``tokenizer_model`` names (the file, or the one in the directory); never a hub name.

    Raises:
        ValueError: the path does not exist, or is a directory without a ``tokenizer.json``.
    """
    path = os.path.abspath(os.path.expanduser(tokenizer_model))
    local = "give the local path of a tokenizer.json, or of a directory holding one (e.g. from save_pretrained)"
    if not os.path.exists(path):
        shown = path if path == str(tokenizer_model) else f"{tokenizer_model} ({path})"
        fail(
            "tokenizer.tokenizer_model",
            f"{shown} does not exist (nothing is downloaded here: a HuggingFace hub name is not a path)",
            local,
        )
    if os.path.isdir(path):
        candidate = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(candidate):
            fail("tokenizer.tokenizer_model", f"the directory {path} holds no tokenizer.json", local)
        return candidate
    return path


class LocalHuggingFaceTokenizer(MegatronTokenizerBase):
    """A ``tokenizer.json`` read with the ``tokenizers`` package, behind megatron-core's tokenizer interface.

    Args:
        tokenizer_model: a ``tokenizer.json`` or a directory holding one (and maybe ``tokenizer_config.json``).
        special_tokens: tokens to add as special tokens when missing (Megatron-Bridge's ``special_tokens``).
        eos_token: the token ending a document; default: ``tokenizer_config.json``'s ``eos_token``, else the
            first of :data:`EOD_TOKENS` in the vocabulary.
        pad_token: the padding token; found likewise (:data:`PAD_TOKENS`); none is fine.
    """

    def __init__(
        self,
        tokenizer_model: str,
        special_tokens: Optional[Sequence[str]] = None,
        eos_token: Optional[str] = None,
        pad_token: Optional[str] = None,
    ) -> None:
        json_path = tokenizer_json_path(tokenizer_model)
        super().__init__(json_path, {"library": "huggingface", "model_type": "gpt"})
        try:
            tokenizers = require("tokenizers")
        except ImportError as err:
            raise ImportError(
                f"tokenizer.tokenizer_type='HuggingFaceTokenizer' needs the tokenizers package: "
                f"pip install 'mbridge-resiliency[data]' ({err})"
            ) from err
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(json_path)
        except Exception as err:  # the package raises its own exception type for a malformed file
            fail("tokenizer.tokenizer_model", f"{json_path} is not a readable tokenizer.json ({err})", "fix the file")
        if special_tokens:
            self._tokenizer.add_special_tokens(list(special_tokens))
        self._vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        declared = _declared_tokens(os.path.dirname(json_path))
        self._eod = self._token_id("eos_token", eos_token or declared.get("eos_token"), EOD_TOKENS, required=True)
        self._pad = self._token_id("pad_token", pad_token or declared.get("pad_token"), PAD_TOKENS, required=False)

    def _token_id(self, role: str, named: Optional[str], candidates: Sequence[str], required: bool) -> Optional[int]:
        if named is not None:
            if named not in self._vocab:
                fail(
                    f"tokenizer.hf_tokenizer_kwargs[{role!r}]",
                    f"{named!r} is not a token of {self.path}",
                    "name a token the tokenizer has",
                )
            return self._vocab[named]
        for token in candidates:
            if token in self._vocab:
                return self._vocab[token]
        if required:
            fail(
                "tokenizer.tokenizer_model",
                f"{self.path} has no end-of-document token (none of {', '.join(candidates)})",
                "name one with tokenizer.hf_tokenizer_kwargs={'eos_token': ...}, or add one with "
                "tokenizer.special_tokens",
            )
        return None

    def tokenize(self, text: str) -> list[int]:
        """The ids of ``text`` (no special tokens added)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each of ``texts``, encoded on the package's threads."""
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; special tokens are kept."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        """Chat templates are not supported for a bare ``tokenizer.json``."""
        raise NotImplementedError("chat templates are not supported for a tokenizer.json tokenizer")

    @property
    def vocab(self) -> dict[str, int]:
        """Token -> id, added tokens included."""
        return dict(self._vocab)

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id -> token."""
        return {i: t for t, i in self._vocab.items()}

    @property
    def vocab_size(self) -> int:
        """One past the largest id (ids need not be contiguous)."""
        return max(self._vocab.values()) + 1

    @property
    def eod(self) -> int:
        """The end-of-document id."""
        return self._eod

    @property
    def eos(self) -> int:
        """The end-of-sequence id (the end-of-document id)."""
        return self._eod

    @property
    def eos_id(self) -> int:
        """The end-of-sequence id (the end-of-document id)."""
        return self._eod

    @property
    def pad(self) -> int:
        """The padding id; ``AttributeError`` without one (megatron-core's datasets then pick their own)."""
        if self._pad is None:
            raise AttributeError(f"{self.path} has no padding token")
        return self._pad

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What identifies this tokenizer in megatron-core's dataset cache descriptions."""
        return OrderedDict(
            [("class", f"{type(self).__module__}.{type(self).__qualname__}"), ("tokenizer_path", self.path)]
            + [("vocab_size", str(self.vocab_size)), ("eod", str(self._eod))]
        )


def _declared_tokens(directory: str) -> dict[str, str]:
    """``eos_token`` and ``pad_token`` as ``tokenizer_config.json`` next to the ``tokenizer.json`` names them."""
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        fail("tokenizer.tokenizer_model", f"{path} is not readable JSON ({err})", "fix or remove it")
    found = {}
    for role in HF_KWARGS:
        value = data.get(role) if isinstance(data, dict) else None
        if isinstance(value, dict):  # transformers writes AddedToken objects as {"content": ...}
            value = value.get("content")
        if isinstance(value, str):
            found[role] = value
    return found


__all__ = ["LocalHuggingFaceTokenizer", "build_tokenizer", "tokenizer_json_path", "tokenizer_kind"]
