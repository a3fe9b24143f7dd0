"""``build_tokenizer``: Megatron-Bridge's public name for building the tokenizer a ``TokenizerConfig`` describes.

Supported, all offline: ``NullTokenizer`` (``vocab_size`` ids), megatron-core's byte-level tokenizer
(``metadata_path={"library": "byte-level"}``) and a local HuggingFace ``tokenizer.json`` (``HuggingFaceTokenizer``).
The implementation is :mod:`megatron.bridge.data.tokenization`: preprocessing and the data checks need it, and
``data/`` may not import ``training/``. It guards against a tokenizer fetched from the network or silently different
from the one configured: nothing is downloaded, and what cannot be honoured is refused by field name.
"""

from megatron.bridge.data.tokenization import LocalHuggingFaceTokenizer, build_tokenizer

__all__ = ["LocalHuggingFaceTokenizer", "build_tokenizer"]
