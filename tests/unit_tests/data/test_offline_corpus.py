"""The offline corpus: the standard library's sources as JSONL, bounded, deterministic, no network."""

import json

from megatron.bridge.data import offline_corpus


def _records(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_max_files_bounds_the_corpus_and_two_runs_are_byte_identical(tmp_path, capsys):
    assert offline_corpus.main(["--output", str(tmp_path / "a.jsonl"), "--max-files", "5"]) == 0
    assert "wrote 5 files" in capsys.readouterr().out
    offline_corpus.main(["--output", str(tmp_path / "b.jsonl"), "--max-files", "5"])
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    records = _records(tmp_path / "a.jsonl")
    paths = [r["path"] for r in records]
    assert len(records) == 5 and paths == sorted(paths) == offline_corpus.source_files()[:5]
    assert all(p.endswith(".py") and r["text"] for p, r in zip(paths, records))
    assert sorted(tmp_path.iterdir()) == [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]  # no temporary left


def test_max_bytes_bounds_the_text_without_cutting_a_file(tmp_path):
    files, total = offline_corpus.write_corpus(str(tmp_path / "c.jsonl"), max_bytes=200_000)
    texts = [r["text"] for r in _records(tmp_path / "c.jsonl")]
    assert files == len(texts) > 1 and total == sum(len(t.encode()) for t in texts) <= 200_000


def test_non_utf8_files_and_installed_packages_are_skipped(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_bytes(b"s = '\xff\xfe'\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "c.py").write_text("installed = True\n")
    (tmp_path / "d.txt").write_text("not source\n")
    assert [r["path"] for r in offline_corpus.documents(str(tmp_path))] == ["a.py"]
