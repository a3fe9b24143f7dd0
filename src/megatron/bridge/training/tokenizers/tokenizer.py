"""``build_tokenizer``: Megatron-Bridge's public name for building the tokenizer a ``TokenizerConfig`` describes.

As in Megatron-Bridge, it resolves what the config only points at, then hands the config to
``build_mcore_tokenizer``:

- ``chat_template_path`` (a local file, or an ``msc://`` URL where megatron-core's multi-storage client is enabled)
  becomes ``chat_template`` (:func:`_resolve_chat_template`);
- a HuggingFace hub name with a pinned ``hf_tokenizer_kwargs["revision"]`` becomes the local snapshot of that
  revision, taken from the HuggingFace cache only (:func:`_resolve_hf_tokenizer_revision`); the config itself is
  left as written (a copy is resolved).

``build_mcore_tokenizer`` is :func:`megatron.bridge.data.tokenization.build_tokenizer` (in Megatron-Bridge the name is
megatron-core's own builder): it builds megatron-core tokenizers from local files only, namely ``NullTokenizer``,
the byte-level tokenizer (``metadata_path={"library": "byte-level"}``) and a local ``tokenizer.json``
(``HuggingFaceTokenizer``), and refuses what it cannot honour by field name. It lives under ``data/`` because
preprocessing needs it and ``data/`` may not import ``training/``. Guards against a tokenizer fetched from the
network: nothing is downloaded, a revision missing from the cache is a ``ValueError`` saying how to fetch it.
"""

import copy
import dataclasses
from pathlib import Path
from typing import Optional

from megatron.bridge.utils.cpu_shims import before_megatron_core_import

before_megatron_core_import()  # noqa: E402 - on CPU, before megatron-core's fused ops are imported

from megatron.core.msc_utils import MultiStorageClientFeature  # noqa: E402
from megatron.core.tokenizers import MegatronTokenizerBase  # noqa: E402

from megatron.bridge.data.tokenization import LocalHuggingFaceTokenizer  # noqa: E402
from megatron.bridge.data.tokenization import build_tokenizer as build_mcore_tokenizer  # noqa: E402
from megatron.bridge.training.tokenizers.config import TokenizerConfig  # noqa: E402
from megatron.bridge.utils.fields import fail  # noqa: E402

HF_SNAPSHOT_FILES = (
    "config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges*",
    "*.model",
    "*.tiktoken",
    "*.py",
    "*.jinja",
    "chat_template*",
)
"""What of a hub snapshot a tokenizer needs (``snapshot_download``'s ``allow_patterns``)."""
HF_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.gguf", "*.onnx")
"""Model weights, never part of a tokenizer (``snapshot_download``'s ``ignore_patterns``)."""


def _resolve_chat_template(config: TokenizerConfig) -> Optional[str]:
    """The chat template ``config`` gives: ``chat_template`` itself, or the text of ``chat_template_path``.

    Raises:
        ValueError: both are set.
    """
    if config.chat_template_path is None:
        return config.chat_template
    if config.chat_template is not None:
        raise ValueError(
            "tokenizer.chat_template_path: set only one of chat_template and chat_template_path, not both. "
            "Fix: remove one."
        )
    path = str(config.chat_template_path)
    if MultiStorageClientFeature.is_enabled():
        msc = MultiStorageClientFeature.import_package()
        with msc.open(path, "r") as f:
            return f.read()
    with open(path, encoding="utf-8") as f:
        return f.read()


def _is_local_tokenizer_path(tokenizer_model: object) -> bool:
    """Whether ``tokenizer_model`` is meant as a local path rather than a hub name."""
    if isinstance(tokenizer_model, Path):
        return True
    if not isinstance(tokenizer_model, str):
        return False
    expanded = Path(tokenizer_model).expanduser()
    return expanded.is_absolute() or expanded.exists() or tokenizer_model.startswith(("./", "../", "~"))


def _resolve_hf_tokenizer_revision(config: TokenizerConfig) -> TokenizerConfig:
    """``config`` with a hub name and pinned revision replaced by that revision's local snapshot (a copy).

    Anything else (another tokenizer type, no revision, a local path) is returned as is.

    Raises:
        ValueError: the revision is not a non-empty string, or that snapshot is not in the HuggingFace cache.
    """
    kwargs = config.hf_tokenizer_kwargs or {}
    revision = kwargs.get("revision")
    if config.tokenizer_type != "HuggingFaceTokenizer" or revision is None:
        return config
    if not isinstance(revision, str) or not revision.strip():
        fail("tokenizer.hf_tokenizer_kwargs['revision']", f"must be a non-empty string, got {revision!r}", "fix it")
    if not isinstance(config.tokenizer_model, str) or _is_local_tokenizer_path(config.tokenizer_model):
        return config
    import huggingface_hub

    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id=config.tokenizer_model,
            revision=revision,
            allow_patterns=list(HF_SNAPSHOT_FILES),
            ignore_patterns=list(HF_WEIGHT_FILES),
            local_files_only=True,  # never downloaded here
        )
    except (huggingface_hub.errors.LocalEntryNotFoundError, FileNotFoundError) as err:
        fail(
            "tokenizer.tokenizer_model",
            f"revision {revision} of {config.tokenizer_model} is not in the HuggingFace cache ({err}); "
            "nothing is downloaded here",
            f"fetch it once where the hub is reachable (hf download {config.tokenizer_model} --revision {revision}), "
            "or give the local directory",
        )
    resolved = copy.copy(config)
    resolved.tokenizer_model = snapshot
    resolved.trust_remote_code = bool(kwargs.get("trust_remote_code", False))
    return resolved


def build_tokenizer(config: TokenizerConfig) -> MegatronTokenizerBase:
    """The tokenizer ``config`` describes, from local files only (see the module doc).

    Raises:
        ValueError: ``"tokenizer.<field>: <problem>. Fix: <fix>."`` for what cannot be built here.
    """
    if config.chat_template_path is not None:
        config = dataclasses.replace(config, chat_template=_resolve_chat_template(config), chat_template_path=None)
    return build_mcore_tokenizer(_resolve_hf_tokenizer_revision(config))


__all__ = ["LocalHuggingFaceTokenizer", "build_mcore_tokenizer", "build_tokenizer"]
