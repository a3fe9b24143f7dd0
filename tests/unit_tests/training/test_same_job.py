"""The same-job check's logic: fingerprints, which group is the job's, and the report naming each difference."""

import dataclasses
import functools

import pytest

from megatron.bridge.recipes.tiny_gpt import tiny_gpt_config
from megatron.bridge.training.exit_codes import STOP_CODES, ExitCode
from megatron.bridge.training.health import same_job
from megatron.bridge.training.health.same_job import Fingerprint

pytestmark = pytest.mark.timeout(60)

RELEASES = {"torch": "2.13.0", "megatron-core": "0.16.1"}


def _print(rank: int, restarts: int = 0, host: str = "node-a", **config: str) -> Fingerprint:
    return Fingerprint(rank, host, restarts, dict(RELEASES), "a" * 64, {"optimizer.lr": "0.001", **config})


def test_flatten_names_every_leaf_by_its_dotted_path():
    assert same_job.flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": None}) == {"a.b": "1", "a.c.d": "'x'", "e": "None"}


def test_a_repr_with_an_address_is_compared_without_it():
    def f():
        return None

    flat = same_job.flatten({"model": {"init": f, "partial": functools.partial(f, 1)}})
    assert not any("0x" in value for value in flat.values()), flat
    assert "<function" in flat["model.init"]


def test_sections_that_may_differ_are_left_out():
    assert same_job.may_differ("fault_injection.faults") and same_job.may_differ("dist.local_rank")
    assert not same_job.may_differ("optimizer.lr") and not same_job.may_differ("model.activation_func._target_")


def test_a_config_fingerprint_is_stable_and_leaves_out_the_node_and_rank_fields(tmp_path):
    cfg = tiny_gpt_config()
    cfg.validate()  # as a run has it: megatron-core's post-init filled in its defaults (init methods...)
    first = same_job.fingerprint(cfg, 0)
    cfg.checkpoint.non_persistent_local_ckpt_dir = str(tmp_path / "this-node")
    cfg.dist.local_rank = 3  # set from the launcher, per rank
    assert same_job.fingerprint(cfg, 0).digest() == first.digest()
    assert not same_job.MAY_DIFFER & set(first.config)
    cfg.optimizer.lr = cfg.optimizer.lr * 2
    assert same_job.fingerprint(cfg, 0).digest() != first.digest()
    assert not any(" at 0x" in value for value in first.config.values())  # nothing that differs by process


def test_the_source_digest_changes_with_a_file(tmp_path):
    (tmp_path / "m.py").write_text("x = 1\n")
    before = same_job.source_digest.__wrapped__(str(tmp_path))
    (tmp_path / "m.py").write_text("x = 2\n")
    assert same_job.source_digest.__wrapped__(str(tmp_path)) != before


def test_every_rank_alike_is_no_report():
    assert same_job.report([_print(0), _print(1), _print(2)]) is None


def test_the_larger_group_is_the_job_and_the_odd_rank_is_named_with_its_difference():
    text = same_job.report([_print(0), _print(1, host="node-c", **{"optimizer.lr": "0.002"}), _print(2)])
    assert text is not None
    assert text.splitlines()[0].startswith("1 of 3 ranks run other code or another config than the job's")
    assert "  rank 1 on node-c: optimizer.lr=0.002 (the job: 0.001)" in text
    assert "Fix: start that node with the job's code and command line" in text


def test_on_a_tie_the_survivor_that_restarted_is_the_job_not_rank_0():
    spare = _print(0, restarts=0, host="spare", **{"optimizer.lr": "0.002"})  # the newcomer got rank 0
    survivor = _print(1, restarts=1, host="node-a")
    text = same_job.report([spare, survivor])
    assert "rank 0 on spare: optimizer.lr=0.002 (the job: 0.001)" in text, text


def test_on_a_full_tie_rank_0_is_the_job():
    text = same_job.report([_print(0), _print(1, **{"optimizer.lr": "0.002"})])
    assert "rank 1 on node-a" in text, text


def test_releases_and_source_are_named_too():
    other = dataclasses.replace(_print(1), releases={**RELEASES, "torch": "2.12.0"}, source="b" * 64)
    found = same_job.differences(_print(0), other)
    assert found[0] == "torch 2.12.0 (the job: 2.13.0)"
    assert found[1].startswith("the source of megatron.bridge differs (sha256 bbbbbbbbbbbb, the job: aaaaaaaaaaaa)")


def test_many_differences_are_cut_and_counted():
    config = {f"model.f{i}": str(i) for i in range(12)}
    text = same_job.report([_print(0), _print(1), _print(2, **config)])
    assert text.splitlines()[1].endswith("; and 4 more"), text


def test_the_refusal_stops_the_job():
    assert ExitCode.NODE_MISMATCH == 32 and ExitCode.NODE_MISMATCH in STOP_CODES
