"""``TokenizerConfig``: which tokenizer turns text into the token ids the model sees.

Megatron-Bridge's field names and defaults. ``build_tokenizer`` (``tokenizers/tokenizer.py``) builds three, all
from local files:

- ``tokenizer_type="NullTokenizer"`` with ``vocab_size``: ids ``0 .. vocab_size - 1`` (the last is its
  end-of-document id), no text; for the mock token stream.
- ``metadata_path={"library": "byte-level"}`` with ``tokenizer_type`` left ``None`` (Megatron-Bridge's spelling,
  read by megatron-core's ``build_tokenizer``): megatron-core's byte-level tokenizer, 512 ids.
- ``tokenizer_type="HuggingFaceTokenizer"`` with ``tokenizer_model`` a local ``tokenizer.json`` or a directory
  holding one (needs ``pip install 'mbridge-resiliency[data]'``), or a hub name with a pinned
  ``hf_tokenizer_kwargs["revision"]`` already in the local HuggingFace cache.

The other types are refused by name rather than ignored. Nothing is ever downloaded.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

TokenizerType = Literal[
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "MultimodalTokenizer",
    "NullMultimodalTokenizer",
    "NullTokenizer",
    "SFTTokenizer",
]


@dataclass
class TokenizerConfig:
    """The tokenizer and its vocabulary."""

    metadata_path: Optional[Union[str, dict]] = None
    """A tokenizer metadata file, or the metadata itself."""
    vocab_size: Optional[int] = None
    """Vocabulary size before padding; ``NullTokenizer`` needs it. The model's ``vocab_size`` defaults to it."""
    vocab_file: Optional[str] = None
    """Vocabulary file of a BPE or WordPiece tokenizer."""
    merge_file: Optional[str] = None
    """Merges file of a BPE tokenizer."""
    vocab_extra_ids: int = 0
    """Extra sentinel tokens (T5-style)."""
    tokenizer_type: Optional[TokenizerType] = None
    """The tokenizer: ``"NullTokenizer"`` or ``"HuggingFaceTokenizer"`` (a local ``tokenizer.json``); ``None`` with
    ``metadata_path={"library": "byte-level"}`` selects the byte-level tokenizer. The others are refused."""
    tokenizer_model: Optional[Union[str, Path]] = None
    """A SentencePiece model file, or a HuggingFace tokenizer's local path."""
    special_tokens: Optional[list[str]] = None
    """Special tokens to add."""
    chat_template: Optional[str] = None
    """A Jinja chat template."""
    chat_template_path: Optional[str] = None
    """A file holding the Jinja chat template (a local path, or an ``msc://`` URL with megatron-core's multi-storage
    client enabled), read into ``chat_template`` when the tokenizer is built; not with ``chat_template``."""
    trust_remote_code: bool = False
    """Run a hub tokenizer's own Python code; set from ``hf_tokenizer_kwargs`` when a pinned revision is resolved.
    Refused: a ``tokenizer.json`` needs no code."""
    tiktoken_pattern: Optional[str] = None
    """Tiktoken's split pattern (``"v1"`` or ``"v2"``)."""
    tiktoken_num_special_tokens: int = 1000
    """Number of tiktoken special tokens."""
    tiktoken_special_tokens: Optional[list[str]] = None
    """Tiktoken's special tokens."""
    tokenizer_prompt_format: Optional[str] = None
    """Prompt format of a multimodal or SFT tokenizer."""
    image_tag_type: Optional[str] = None
    """Image tag style of a multimodal tokenizer."""
    force_system_message: Optional[bool] = False
    """Always insert a system message (chat tokenizers)."""
    hf_tokenizer_kwargs: Optional[dict[str, Any]] = field(default_factory=dict)
    """More keyword arguments for a HuggingFace tokenizer: ``eos_token`` and ``pad_token`` (which of its tokens end a
    document and pad) and ``revision`` (with a hub name as ``tokenizer_model``: that revision's snapshot in the local
    HuggingFace cache)."""
    sp_tokenizer_kwargs: Optional[dict[str, Any]] = field(default_factory=dict)
    """More keyword arguments for a SentencePiece tokenizer."""

    @property
    def tokenizer_hf_no_use_fast(self) -> bool:
        """Whether ``hf_tokenizer_kwargs["use_fast"]`` is false (megatron-core's flat name; refused when built)."""
        return not (self.hf_tokenizer_kwargs or {}).get("use_fast", True)

    @property
    def tokenizer_hf_no_include_special_tokens(self) -> bool:
        """Whether ``hf_tokenizer_kwargs["include_special_tokens"]`` is false (megatron-core's flat name)."""
        return not (self.hf_tokenizer_kwargs or {}).get("include_special_tokens", True)

    @property
    def tokenizer_sentencepiece_legacy(self) -> bool:
        """``sp_tokenizer_kwargs["legacy"]`` (megatron-core's flat name)."""
        return bool((self.sp_tokenizer_kwargs or {}).get("legacy", False))
