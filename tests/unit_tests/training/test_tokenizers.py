"""training.tokenizers.build_tokenizer: a chat template file and a pinned hub revision resolved, nothing downloaded."""

import pytest
from tests.unit_tests.data.helpers import texts, train_tokenizer_json

from megatron.bridge.training.tokenizers import tokenizer as tok_mod
from megatron.bridge.training.tokenizers.config import TokenizerConfig
from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_the_null_tokenizer_has_megatron_cores_current_library_name():
    assert build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=64)).library == "null-text"


def test_a_chat_template_file_is_read_into_the_built_config_and_the_given_one_is_unchanged(tmp_path, monkeypatch):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    seen = []
    monkeypatch.setattr(tok_mod, "build_mcore_tokenizer", seen.append)
    cfg = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=8, chat_template_path=str(tmp_path / "t.jinja"))
    build_tokenizer(cfg)
    assert (seen[0].chat_template, seen[0].chat_template_path) == (TEMPLATE, None)
    assert cfg.chat_template is None
    with pytest.raises(ValueError, match="set only one of chat_template and chat_template_path"):
        build_tokenizer(TokenizerConfig(chat_template=TEMPLATE, chat_template_path=str(tmp_path / "t.jinja")))


def test_a_pinned_hub_revision_is_taken_from_the_local_cache_only(tmp_path, monkeypatch):
    import huggingface_hub

    snapshot = tmp_path / "snapshot"
    train_tokenizer_json(snapshot, texts(), vocab_size=300)
    calls = []

    def cached_snapshot(**kwargs):
        calls.append(kwargs)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cached_snapshot)
    pin = {"revision": "0123abc"}
    cfg = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="org/model", hf_tokenizer_kwargs=pin)
    tok = build_tokenizer(cfg)
    assert tok.vocab_size == 300 and tok.tokenize("hello") != []
    assert calls[0]["local_files_only"] is True and calls[0]["revision"] == "0123abc"
    assert cfg.tokenizer_model == "org/model"  # the config is left as written


def test_a_revision_missing_from_the_cache_names_the_fix_and_trust_remote_code_is_refused(tmp_path, monkeypatch):
    import huggingface_hub

    def not_cached(**kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("not in cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_cached)
    cfg = TokenizerConfig(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model="org/model", hf_tokenizer_kwargs={"revision": "abc"}
    )
    with pytest.raises(ValueError, match=r"^tokenizer.tokenizer_model: revision abc of org/model is not in the Hugg"):
        build_tokenizer(cfg)
    snapshot = tmp_path / "snapshot"
    train_tokenizer_json(snapshot, texts(), vocab_size=300)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kwargs: str(snapshot))
    cfg.hf_tokenizer_kwargs = {"revision": "abc", "trust_remote_code": True}
    with pytest.raises(ValueError, match=r"^tokenizer.trust_remote_code: is not read by a tokenizer.json"):
        build_tokenizer(cfg)
