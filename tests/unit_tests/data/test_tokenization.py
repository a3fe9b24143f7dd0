"""build_tokenizer: NullTokenizer, byte-level and a local tokenizer.json, offline; everything else refused by name."""

import json
import pickle

import pytest
from tests.unit_tests.data.helpers import texts, train_tokenizer_json

from megatron.bridge.data import tokenization
from megatron.bridge.training.config import TokenizerConfig
from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    return train_tokenizer_json(tmp_path_factory.mktemp("hf"), texts(), vocab_size=300)


def test_null_tokenizer_has_exactly_vocab_size_ids_with_eod_last():
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=128))
    assert tok.vocab_size == 128 and tok.eod == 127
    assert tok.tokenize("3 14 127") == [3, 14, 127]
    assert tok.detokenize([3, 14]) == "3 14"
    with pytest.raises(ValueError, match=r"tokenizer.vocab_size: NullTokenizer needs a vocabulary size, got None"):
        build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer"))


def test_byte_level_is_selected_by_metadata_and_round_trips_utf8():
    tok = build_tokenizer(TokenizerConfig(metadata_path={"library": "byte-level"}))
    text = "héllo wörld ✓ def f(x):\n\treturn x"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.detokenize(ids) == text
    assert (tok.vocab_size, tok.eod) == (512, 0)
    assert pickle.loads(pickle.dumps(tok)).tokenize("ab") == [97, 98]  # spawned loader workers get a copy


def test_byte_level_metadata_may_be_a_local_file_and_the_config_dict_is_not_changed(tmp_path):
    path = tmp_path / "tokenizer_metadata.json"
    path.write_text(json.dumps({"library": "byte-level"}))
    assert build_tokenizer(TokenizerConfig(metadata_path=str(path), vocab_size=1024)).vocab_size == 1024
    metadata = {"library": "byte-level"}
    build_tokenizer(TokenizerConfig(metadata_path=metadata))
    assert metadata == {"library": "byte-level"}


def test_hf_tokenizer_json_file_or_directory(tokenizer_json, tmp_path):
    import os

    for model in (tokenizer_json, os.path.dirname(tokenizer_json)):
        tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=model))
        assert tok.vocab_size == 300
        assert tok.eod == tok.vocab["<|endoftext|>"] and tok.pad == tok.vocab["<pad>"]
        text = "doc 7: alpha beta  gamma\nnew line ✓"
        ids = tok.tokenize(text)
        assert len(ids) < len(text.encode()) and max(ids) < tok.vocab_size
        assert tok.detokenize(ids) == text
        assert tok.tokenize_batch([text, "alpha"]) == [ids, tok.tokenize("alpha")]
    assert pickle.loads(pickle.dumps(tok)).tokenize(text) == ids


def test_hf_end_of_document_token_may_be_named(tokenizer_json):
    named = TokenizerConfig(
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=tokenizer_json,
        hf_tokenizer_kwargs={"eos_token": "<pad>"},
    )
    tok = build_tokenizer(named)
    assert tok.eod == tok.vocab["<pad>"]
    named.hf_tokenizer_kwargs = {"eos_token": "<nope>"}
    with pytest.raises(ValueError, match=r"hf_tokenizer_kwargs\['eos_token'\]: '<nope>' is not a token of"):
        build_tokenizer(named)
    named.hf_tokenizer_kwargs = {"trust_remote_code": True}
    with pytest.raises(ValueError, match="'trust_remote_code' is not honoured"):
        build_tokenizer(named)
    named.hf_tokenizer_kwargs = {"use_fast": True, "eos_token": "<pad>"}  # Megatron-Bridge's flag, as it reads it
    assert not named.tokenizer_hf_no_use_fast and build_tokenizer(named).eod == tok.eod
    named.hf_tokenizer_kwargs = {"use_fast": False}
    assert named.tokenizer_hf_no_use_fast
    with pytest.raises(
        ValueError, match=r"hf_tokenizer_kwargs\['use_fast'\]: is false, but a tokenizer.json is a fast"
    ):
        build_tokenizer(named)


def test_hf_tokenizer_config_json_names_the_eos_token(tmp_path):
    path = train_tokenizer_json(tmp_path / "m", texts(10), vocab_size=280)
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path))
    assert tok.eod == tok.vocab["<pad>"]


def test_a_missing_or_hub_like_path_is_an_error_naming_the_field_and_nothing_is_downloaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for model in ("meta-llama/Llama-3.2-1B", str(tmp_path / "nowhere" / "tokenizer.json")):
        cfg = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=model)
        with pytest.raises(ValueError) as err:
            build_tokenizer(cfg)
        message = str(err.value)
        assert message.startswith("tokenizer.tokenizer_model: ") and model in message
        assert "does not exist" in message and "Fix: give the local path of a tokenizer.json" in message
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="the directory .*empty holds no tokenizer.json"):
        build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="empty"))
    with pytest.raises(ValueError, match="tokenizer.tokenizer_model: HuggingFaceTokenizer needs a tokenizer"):
        build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer"))


def test_a_tokenizer_without_an_end_of_document_token_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(path))
    cfg = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(path))
    with pytest.raises(ValueError, match=r"has no end-of-document token .*Fix: name one with"):
        build_tokenizer(cfg)
    cfg.special_tokens = ["<|endoftext|>"]
    assert build_tokenizer(cfg).eod == 3


def test_without_the_tokenizers_package_the_error_names_the_extra(tokenizer_json, monkeypatch):
    def missing(module):
        raise ImportError(f"No module named {module!r}")

    monkeypatch.setattr(tokenization, "require", missing)
    with pytest.raises(ImportError, match=r"pip install 'mbridge-resiliency\[data\]'"):
        build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer_json))


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({}, "tokenizer.tokenizer_type: is not set"),
        ({"tokenizer_type": "GPT2BPETokenizer"}, "tokenizer.tokenizer_type: 'GPT2BPETokenizer' is not available here"),
        ({"metadata_path": {"library": "tiktoken"}}, "tokenizer.metadata_path: library 'tiktoken' is not available"),
        (
            {"tokenizer_type": "NullTokenizer", "vocab_size": 8, "metadata_path": {"library": "null"}},
            "tokenizer.metadata_path: NullTokenizer reads no metadata",
        ),
        ({"metadata_path": {"library": "byte-level"}, "vocab_size": 100}, "tokenizer.vocab_size: a byte-level"),
        ({"metadata_path": "/no/such/metadata.json"}, "tokenizer.metadata_path: /no/such/metadata.json is not a file"),
        (
            {"tokenizer_type": "SentencePieceTokenizer", "metadata_path": {"library": "byte-level"}},
            "tokenizer.tokenizer_type: 'SentencePieceTokenizer' with metadata_path library 'byte-level' is ambiguous",
        ),
    ],
)
def test_what_cannot_be_built_is_refused_by_field(fields, fragment):
    with pytest.raises(ValueError, match="Fix: ") as err:
        build_tokenizer(TokenizerConfig(**fields))
    assert str(err.value).startswith(fragment), str(err.value)


def test_hf_vocab_size_must_match_the_file(tokenizer_json):
    cfg = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer_json, vocab_size=512)
    with pytest.raises(ValueError, match="tokenizer.vocab_size: 512 differs from the 300 ids of"):
        build_tokenizer(cfg)
