"""Manifest hashing and verification: flipped bytes, truncation, missing files, missing manifest."""

import os

from megatron.bridge.training.checkpoint import manifest
from megatron.bridge.training.checkpoint.verify_cli import main as verify_main


def _make(tmp_path, n_files=5):
    d = tmp_path / "iter_0000003"
    (d / "sub").mkdir(parents=True)
    for i in range(n_files):
        (d / f"__{i}_0.distcp").write_bytes(bytes(range(256)) * (i + 1))
    (d / "sub" / "common.pt").write_bytes(b"abc")
    files = manifest.list_files(str(d))
    entries = {}
    for rank in range(3):  # hashing split over 3 "ranks" covers every file exactly once
        share = manifest.hash_share(str(d), files, rank, 3)
        assert not set(share) & set(entries)
        entries.update(share)
    assert sorted(entries) == files
    manifest.write_manifest(str(d), 3, entries)
    return d


def test_valid_checkpoint_verifies(tmp_path):
    d = _make(tmp_path)
    assert manifest.verify_dir(str(d)) == []
    assert verify_main([str(d)]) == 0


def test_flipped_byte_is_detected(tmp_path):
    d = _make(tmp_path)
    path = d / "__2_0.distcp"
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    problems = manifest.verify_dir(str(d))
    assert len(problems) == 1 and problems[0].startswith("__2_0.distcp: sha256")
    assert verify_main([str(d)]) == 1


def test_truncation_and_missing_file(tmp_path):
    d = _make(tmp_path)
    with open(d / "__1_0.distcp", "r+b") as f:
        f.truncate(10)
    os.remove(d / "sub" / "common.pt")
    problems = manifest.verify_dir(str(d))
    assert any(p.startswith("__1_0.distcp: size 10 bytes") for p in problems)
    assert any(p == "sub/common.pt: missing" for p in problems)


def test_missing_manifest(tmp_path):
    d = _make(tmp_path)
    os.remove(d / manifest.MANIFEST_NAME)
    problems = manifest.verify_dir(str(d))
    assert len(problems) == 1 and "missing" in problems[0]


def test_sharded_verification_covers_all_files(tmp_path):
    d = _make(tmp_path, n_files=7)
    (d / "__6_0.distcp").write_bytes(b"x")
    table = manifest.read_manifest(str(d))
    found = [p for r in range(4) for p in manifest.verify_share(str(d), table, r, 4)]
    assert len(found) == 1 and found[0].startswith("__6_0.distcp")
