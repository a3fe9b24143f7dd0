"""Preprocessing: JSONL to megatron-core's indexed dataset, put in place only when complete; bad lines by file:line."""

import os

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tests.unit_tests.data.helpers import texts, write_jsonl

from megatron.bridge.data import preprocess as pp
from megatron.bridge.data.tokenization import build_tokenizer
from megatron.bridge.training.config import TokenizerConfig

BYTE_LEVEL = TokenizerConfig(metadata_path={"library": "byte-level"})


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(BYTE_LEVEL)


def _quiet(_line: str) -> None:
    pass


def _document(prefix: str, index: int) -> list[int]:
    dataset = IndexedDataset(prefix)  # its arrays view a memory map it closes when collected: copy first
    return dataset[index].tolist()


def test_jsonl_becomes_an_indexed_dataset_megatron_core_reads(tmp_path, tokenizer):
    docs = texts(12)
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t, "id": i} for i, t in enumerate(docs)] + [""])
    lines = []
    stats = pp.preprocess(source, str(tmp_path / "out" / "c"), tokenizer, append_eod=True, log=lines.append)
    dataset = IndexedDataset(str(tmp_path / "out" / "c"))
    assert len(dataset) == stats.documents == 12 and stats.skipped == 1
    assert stats.tokens == sum(len(t.encode()) + 1 for t in docs) == int(dataset.sequence_lengths.sum())
    assert dataset.index.dtype == numpy.uint16  # megatron-core's choice for a 512-id vocabulary
    for i in (0, 11):
        assert dataset[i].tolist() == list(docs[i].encode()) + [tokenizer.eod]
    assert sorted(os.listdir(tmp_path / "out")) == ["c.bin", "c.idx"]
    assert "12 documents" in lines[-1] and "MB/s" in lines[-1]


def test_several_keys_make_one_dataset_each_and_progress_is_logged(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(pp, "CHUNK_DOCUMENTS", 2)
    source = write_jsonl(tmp_path / "in.jsonl", [{"q": f"question {i}", "a": f"answer {i}!"} for i in range(5)])
    lines = []
    stats = pp.preprocess(source, str(tmp_path / "qa"), tokenizer, ["q", "a"], log_interval=0, log=lines.append)
    assert stats.prefixes == [str(tmp_path / "qa_q"), str(tmp_path / "qa_a")]
    assert _document(str(tmp_path / "qa_a"), 4) == list(b"answer 4!")
    assert len(lines) >= 3 and all("documents" in line and "tokens" in line for line in lines)


@pytest.mark.parametrize(
    "line, fragment",
    [
        ('{"text": "ok"', "not valid JSON"),
        ('["text"]', "is a JSON list, not an object"),
        ('{"body": "x"}', "has no key 'text' (its keys: 'body'). Fix: pass --json-keys"),
        ('{"text": 3}', "'text' is a int, not text"),
    ],
)
def test_a_bad_line_names_file_and_line_and_leaves_no_files(tmp_path, tokenizer, line, fragment):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}, {"text": "also fine"}, line, {"text": "after"}])
    with pytest.raises(ValueError) as err:
        pp.preprocess(source, str(tmp_path / "c"), tokenizer, log=_quiet)
    assert str(err.value).startswith(f"{source}:3: {fragment}"), str(err.value)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # no .bin, no .idx, no temporary


def test_a_run_interrupted_mid_way_leaves_the_previous_pair_untouched_and_no_temporary(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts(20)])
    prefix = str(tmp_path / "c")
    pp.preprocess(source, prefix, tokenizer, log=_quiet)
    before = {name: (tmp_path / name).read_bytes() for name in ("c.bin", "c.idx")}

    class Interrupting:
        vocab_size, eod = tokenizer.vocab_size, tokenizer.eod

        def tokenize(self, text):
            if text.startswith("doc 15"):
                raise KeyboardInterrupt  # as a Ctrl-C or a preemption signal handler would
            return tokenizer.tokenize(text)

    with pytest.raises(KeyboardInterrupt):
        pp.preprocess(source, prefix, Interrupting(), append_eod=True, log=_quiet)
    assert {name: (tmp_path / name).read_bytes() for name in ("c.bin", "c.idx")} == before
    assert sorted(os.listdir(tmp_path)) == ["c.bin", "c.idx", "in.jsonl"]


def test_a_crash_while_putting_in_place_never_exposes_a_mismatched_pair(tmp_path, tokenizer, monkeypatch):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts(5)])
    prefix = str(tmp_path / "c")
    pp.preprocess(source, prefix, tokenizer, log=_quiet)

    def killed(path, data, **_kwargs):
        raise OSError("killed between the .bin rename and the .idx commit")

    monkeypatch.setattr(pp, "atomic_write", killed)
    with pytest.raises(OSError):
        pp.preprocess(source, prefix, tokenizer, append_eod=True, log=_quiet)
    assert not IndexedDataset.exists(prefix)  # the new .bin alone: no pair a loader could take
    monkeypatch.undo()
    pp.preprocess(source, prefix, tokenizer, append_eod=True, log=_quiet)  # a rerun cleans up and completes
    assert sorted(os.listdir(tmp_path)) == ["c.bin", "c.idx", "in.jsonl"]
    assert _document(prefix, 0)[-1] == tokenizer.eod


def test_leftovers_of_a_killed_run_are_removed_by_the_next(tmp_path, tokenizer):
    leftover = tmp_path / ".c.bin.12345-deadbeef.tmp"
    leftover.write_bytes(b"partial")
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "x y z"}])
    pp.preprocess(source, str(tmp_path / "c"), tokenizer, log=_quiet)
    assert sorted(os.listdir(tmp_path)) == ["c.bin", "c.idx", "in.jsonl"]


def test_missing_or_empty_input_is_an_error(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"--input: .*nope.jsonl does not exist or is not a file. Fix: "):
        pp.preprocess(str(tmp_path / "nope.jsonl"), str(tmp_path / "c"), tokenizer, log=_quiet)
    source = write_jsonl(tmp_path / "in.jsonl", ["", "  ", '{"text": ""}'])
    with pytest.raises(ValueError, match="holds no non-empty document"):
        pp.preprocess(source, str(tmp_path / "c"), tokenizer, log=_quiet)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_the_command_line(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}, {"text": "4 5"}])
    args = ["--input", source, "--output-prefix", str(tmp_path / "n"), "--tokenizer-type", "NullTokenizer"]
    assert pp.main([*args, "--vocab-size", "16", "--append-eod"]) == 0
    assert _document(str(tmp_path / "n"), 0) == [1, 2, 3, 15]
    assert pp.main([*args]) == 1
    assert "preprocess: error: tokenizer.vocab_size: NullTokenizer needs a vocabulary size" in capsys.readouterr().err
    meta = ["--tokenizer-metadata", '{"library": "byte-level"}']
    assert pp.main(["--input", source, "--output-prefix", str(tmp_path / "b"), *meta]) == 0
    assert _document(str(tmp_path / "b"), 1) == list(b"4 5")
