"""The atomic commit protocol, recovery after a crash at each of its steps, retention and the tracker."""

import os
import subprocess
import sys
import textwrap

import pytest

from megatron.bridge.training.checkpoint import layout, manifest
from megatron.bridge.training.faults import injection as fault_injection


def _fake_save(root: str, iteration: int, payload: bytes) -> None:
    """Write a small checkpoint into the temporary directory, with its manifest, as a save would."""
    tmp = layout.tmp_dir(root, iteration, "a1")
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "__0_0.distcp"), "wb") as f:
        f.write(payload)
    with open(os.path.join(tmp, "common.pt"), "wb") as f:
        f.write(b"common-" + payload[:4])
    files = manifest.list_files(tmp)
    manifest.write_manifest(tmp, iteration, manifest.hash_share(tmp, files, 0, 1))


def _visible(root: str) -> tuple:
    """What a loader sees after recovery: (tracker, committed iterations, payload of the tracked checkpoint)."""
    layout.recover(root)
    tracked = layout.read_tracker(root)
    payload = None
    if tracked is not None:
        ckpt = layout.iter_dir(root, tracked)
        assert manifest.verify_dir(ckpt) == [], "tracked checkpoint must verify"
        with open(os.path.join(ckpt, "__0_0.distcp"), "rb") as f:
            payload = f.read()
    leftovers = [n for n in os.listdir(root) if n.startswith(".") and n != ".latest_checkpointed_iteration.txt.tmp"]
    assert leftovers == [], leftovers
    return tracked, layout.committed_iterations(root), payload


def test_commit_publishes_and_tracks(tmp_path):
    root = str(tmp_path)
    _fake_save(root, 5, b"five")
    layout.commit(root, 5, "a1")
    assert layout.read_tracker(root) == 5
    assert layout.committed_iterations(root) == [5]
    assert not os.path.exists(layout.tmp_dir(root, 5, "a1"))
    assert manifest.verify_dir(layout.iter_dir(root, 5)) == []


_CHILD = textwrap.dedent(
    """
    import sys
    sys.path[:0] = {path!r}
    from tests.unit_tests.training.checkpoint.test_layout import _fake_save
    from megatron.bridge.training.checkpoint import layout
    root, iteration, payload = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
    _fake_save(root, iteration, payload)
    layout.commit(root, iteration, "a1")
    """
)


def _commit_in_child(root: str, iteration: int, payload: bytes, crash_at: str | None) -> int:
    """Save and commit ``iteration`` in a child process, with ``crash_at`` its fault spec (``$MBRIDGE_FAULTS``)."""
    env = dict(os.environ)
    env.pop(fault_injection.ENV, None)
    if crash_at:
        env[fault_injection.ENV] = crash_at
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    code = _CHILD.format(path=sys.path + [repo])
    proc = subprocess.run([sys.executable, "-c", code, root, str(iteration), payload.decode()], env=env)
    return proc.returncode


@pytest.mark.parametrize("point", [p for p in fault_injection.SAVE_POINTS if p != "during_write"])
@pytest.mark.parametrize("resave", [False, True], ids=["new-iteration", "resave-same-iteration"])
def test_crash_at_each_commit_step_never_tears(tmp_path, point, resave):
    root = str(tmp_path)
    assert _commit_in_child(root, 10, b"old-ten", None) == 0
    target = 10 if resave else 20
    rc = _commit_in_child(root, target, b"new-data", f"kill@{target}:0:save.{point}")
    if point == "after_replace_old" and not resave:
        assert rc == 0  # that step only exists when an older copy is replaced
    else:
        assert rc == -9, f"the fault point {point} must kill the process"
    tracked, committed, payload = _visible(root)
    crashed_before_tracker = point != "after_tracker" and rc == -9
    if crashed_before_tracker:
        assert tracked == 10
        # A re-save that crashed before the tracker moved may still have renamed its copy into place: either the
        # old or the new full copy is acceptable, never a torn one (verified in _visible).
        assert payload in (b"old-ten", b"new-data")
    else:
        assert tracked == target
        assert payload == b"new-data"
    assert 10 in committed


def test_a_save_fault_strikes_only_in_the_save_of_its_iteration(tmp_path):
    root = str(tmp_path)
    assert _commit_in_child(root, 10, b"old-ten", "kill@20:0:save.after_rename") == 0
    assert _commit_in_child(root, 20, b"new-data", "kill@20:0:save.after_rename") == -9
    assert _visible(root)[0] == 10


def test_crash_before_commit_leaves_previous(tmp_path):
    root = str(tmp_path)
    assert _commit_in_child(root, 10, b"old-ten", None) == 0
    # A save interrupted while writing: files without a manifest in the temporary directory.
    os.makedirs(layout.tmp_dir(root, 20, "b2"))
    with open(os.path.join(layout.tmp_dir(root, 20, "b2"), "__0_0.distcp"), "wb") as f:
        f.write(b"partial")
    assert _visible(root) == (10, [10], b"old-ten")


def test_retention_keeps_newest_and_protected(tmp_path):
    root = str(tmp_path)
    for it in (1, 2, 3, 4, 5):
        _fake_save(root, it, f"p{it}".encode())
        layout.commit(root, it, "a1")
    layout.write_tracker(root, 2)  # pretend the tracker lags: its checkpoint must survive
    deleted = layout.apply_retention(root, keep=2, protect={1})
    assert sorted(deleted) == [3]
    assert layout.committed_iterations(root) == [5, 4, 2, 1]
    assert layout.apply_retention(root, keep=-1, protect=set()) == []


def test_tracker_garbage_is_ignored(tmp_path):
    (tmp_path / layout.TRACKER_NAME).write_text("release\n")
    assert layout.read_tracker(str(tmp_path)) is None
    assert layout.read_tracker(str(tmp_path / "missing")) is None


def test_the_retain_interval_keeps_its_multiples_and_the_newest(tmp_path):
    root = str(tmp_path)
    for it in (10, 20, 30, 40, 50):
        _fake_save(root, it, f"p{it}".encode())
        layout.commit(root, it, "a1")
    layout.write_tracker(root, 50)
    deleted = layout.apply_retention(root, keep=-1, protect=set(), retain_interval=20)
    assert sorted(deleted) == [10, 30]  # 50 is not a multiple but the newest: it stays until a newer one commits
    assert layout.committed_iterations(root) == [50, 40, 20]
    _fake_save(root, 60, b"p60")
    layout.commit(root, 60, "a1")
    assert layout.apply_retention(root, keep=-1, protect={60}, retain_interval=20) == [50]
    assert layout.committed_iterations(root) == [60, 40, 20]
