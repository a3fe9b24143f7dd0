"""Bad data input is refused before training, naming the field or file and the fix; the checks write nothing."""

import os
import shutil

import pytest
from tests.unit_tests.data.helpers import texts, write_jsonl

from megatron.bridge.data.checks import check_dataset_files, default_path_to_cache
from megatron.bridge.data.config import GPTDatasetConfig
from megatron.bridge.data.preprocess import preprocess
from megatron.bridge.data.tokenization import build_tokenizer
from megatron.bridge.training.config import TokenizerConfig

BYTE_LEVEL = TokenizerConfig(metadata_path={"library": "byte-level"})
FLAGS = {"reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A 40-document byte-level dataset (~12k tokens); tests copy it before damaging it."""
    root = tmp_path_factory.mktemp("good")
    source = write_jsonl(root / "in.jsonl", [{"text": t} for t in texts(40)])
    preprocess(source, str(root / "docs"), build_tokenizer(BYTE_LEVEL), append_eod=True, log=lambda _line: None)
    return str(root / "docs")


def _copy(prefix: str, directory, name: str = "docs") -> str:
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, os.path.join(directory, name + ext))
    return os.path.join(str(directory), name)


def _cfg(blend=None, **fields) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        **{"seq_length": 64, "random_seed": 1, "blend": blend, "split": "90,10,0", **FLAGS, **fields}
    )


def _refused(cfg, fragment: str) -> str:
    with pytest.raises(ValueError) as err:
        check_dataset_files(cfg)
    message = str(err.value)
    assert fragment in message and ". Fix: " in message, message
    return message


def test_good_data_passes_returns_the_vocabulary_and_writes_nothing(good, tmp_path):
    prefix = _copy(good, tmp_path)
    before = sorted(os.listdir(tmp_path))
    assert [part.prefix for part in check_dataset_files(_cfg(([prefix], None)))] == [prefix]
    assert len(check_dataset_files(_cfg(([prefix, prefix], [1, 3])))) == 2
    assert sorted(os.listdir(tmp_path)) == before  # not even the index cache directory
    assert default_path_to_cache(_cfg(([prefix], None))) == str(tmp_path / "index-cache")


def test_a_missing_prefix_names_the_missing_file(good, tmp_path):
    prefix = _copy(good, tmp_path)
    message = _refused(_cfg(([str(tmp_path / "nothere")], None)), "dataset.blend: ")
    assert "nothere.bin and" in message and "nothere.idx do not exist" in message
    assert "python -m megatron.bridge.data.preprocess" in message
    os.remove(prefix + ".idx")
    _refused(_cfg(([prefix], None)), f"dataset.blend: {prefix}.idx does not exist")
    _refused(_cfg(([prefix + ".bin"], None)), "drop the extension from the prefix")
    per_split = _cfg(None, split=None, blend_per_split=[([good], None), ([prefix], None), None])
    _refused(per_split, f"dataset.blend_per_split[1]: {prefix}.idx does not exist")


def test_a_bin_that_does_not_match_its_idx_is_refused(good, tmp_path):
    prefix = _copy(good, tmp_path)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") - 10)
    message = _refused(_cfg(([prefix], None)), f"{prefix}.bin: is ")
    assert "uint16" in message and "truncated, or the two files are from different runs" in message
    shutil.copy(good + ".bin", prefix + ".bin")
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"garbage!!")
    _refused(_cfg(([prefix], None)), f"{prefix}.idx: is not a readable megatron-core index")


@pytest.mark.parametrize(
    "blend, fragment",
    [
        ([["a", "b"], [0.5]], "dataset.blend: 2 prefixes but 1 weights"),
        ([["a", "b"], [0.5, -1]], "dataset.blend: weight -1 is not a finite number >= 0"),
        ([["a", "b"], [0.5, "x"]], "dataset.blend: weight 'x' is not a finite number >= 0"),
        ([["a"], [float("nan")]], "dataset.blend: weight nan is not"),
        ([["a", "b"], [0, 0]], "dataset.blend: the weights [0, 0] are all zero"),
        (["30", "a", "70", "b"], "get_blend_from_list"),
        ([[], None], "dataset.blend: the prefixes [] are not a non-empty list of paths"),
    ],
)
def test_blend_weights_that_do_not_parse_are_refused(blend, fragment):
    _refused(_cfg(blend), fragment)


def test_blend_and_split_combinations_are_refused(good):
    _refused(_cfg(([good], None), split=None), "dataset.split: is not set, and a blend needs it")
    _refused(_cfg(([good], None), split="1,2,3,4"), "dataset.split: '1,2,3,4' is not a train,validation,test")
    _refused(_cfg(([good], None), split="0,0,0"), "dataset.split: '0,0,0' is not a train,validation,test")
    _refused(_cfg(None, split=None, blend_per_split=[([good], None), None]), "dataset.blend_per_split: needs 3")
    both = _cfg(([good], None), blend_per_split=[([good], None), None, None])
    _refused(both, "dataset.blend_per_split: and dataset.blend are both set")


def test_a_sequence_length_the_data_cannot_serve_is_refused(good, tmp_path):
    total = sum(len(t.encode()) + 1 for t in texts(40))
    _refused(_cfg(([good], None), seq_length=total), f"dataset.sequence_length: {good} (dataset.blend) holds {total}")
    small = tmp_path / "small"
    source = write_jsonl(tmp_path / "s.jsonl", [{"text": t} for t in texts(10)])
    preprocess(source, str(small), build_tokenizer(BYTE_LEVEL), log=lambda _line: None)
    message = _refused(_cfg(([str(small)], None), split="99,1,0"), "dataset.split: gives the validation split")
    assert "sequences 10..10 of the 10" in message and "0 tokens" in message
    assert check_dataset_files(_cfg(([str(small)], None), split="100,0,0"))


# The tokenizer against the model's vocabulary: validation's check (training/test_config_fields.py).


def test_an_index_cache_that_cannot_be_a_directory_is_refused(good, tmp_path):
    (tmp_path / "a-file").write_text("")
    cfg = _cfg(([good], None), path_to_cache=str(tmp_path / "a-file" / "cache"))
    _refused(cfg, "dataset.path_to_cache: ")
    assert check_dataset_files(_cfg(([good], None), path_to_cache=str(tmp_path / "new" / "cache")))
    assert not (tmp_path / "new").exists()
