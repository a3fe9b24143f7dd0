"""A config written the Megatron-Bridge way, a user callback, local and global checkpoints, evaluation, stop and
resume.

The user's callback (``examples/training_features/callbacks/``) sees the checkpoint the run resumed from, where
training starts, every step and every committed checkpoint of both tiers; the
resumed run ends bit-identical to the uninterrupted tiny-GPT reference (same model, optimizer, data and seed).
"""

import json

from tests.functional_tests.harness import REPO, assert_same_state, checkpoint_state, tail, torchrun

EXAMPLE = REPO / "examples" / "training_features" / "callbacks" / "pretrain_with_callbacks.py"


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_user_callback_sees_the_resume_and_the_run_matches_the_reference(reference_tp1, tmp_path):
    reference, reference_ckpt = reference_tp1
    ckpt, local = tmp_path / "ckpt", tmp_path / "local"
    both_tiers = (
        "checkpoint.non_persistent_ckpt_type=local", f"checkpoint.non_persistent_local_ckpt_dir={local}",
        "checkpoint.non_persistent_save_interval=2", "validation.eval_interval=4", "validation.eval_iters=2",
    )  # fmt: skip
    first_log, second_log = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first = torchrun(ckpt, *both_tiers, "train.exit_interval=7", entry=[str(EXAMPLE), "--record", str(first_log)])
    assert first.exit_code == 20, tail(first)
    second = torchrun(ckpt, *both_tiers, entry=[str(EXAMPLE), "--record", str(second_log)])
    assert second.exit_code == 0, tail(second)
    assert "saved local checkpoint at iteration 4" in first.output, tail(first)  # both tiers were written

    first_events, second_events = _records(first_log), _records(second_log)
    assert first_events[0] == {"event": "start", "step": 0, "consumed": 0}  # from scratch: nothing was loaded
    assert not [e for e in first_events if e["event"] == "loaded"]
    assert [e["step"] for e in first_events if e["event"] == "step"] == list(range(1, 8))
    assert not [e for e in first_events if e["event"] == "end"]  # an early exit is not the end of training
    saved = [(e["step"], e["tier"]) for e in first_events if e["event"] == "saved"]
    assert saved == [(2, "local"), (3, "global"), (4, "local"), (6, "global"), (7, "global")], saved
    assert all(e["checkpoint"].endswith(f"iter_{e['step']:07d}") for e in first_events if e.get("tier") == "global")

    loaded, start = second_events[:2]
    assert loaded["event"] == "loaded" and loaded["tier"] == "global", loaded
    assert loaded["checkpoint"].endswith("iter_0000007"), loaded
    assert start == {"event": "start", "step": 7, "consumed": 56}, start
    saved = [(e["step"], e["tier"]) for e in second_events if e["event"] == "saved"]
    assert saved == [(8, "local"), (9, "global"), (10, "local"), (12, "global")], saved
    steps = [e for e in second_events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(8, 13)) and not any(e["skipped"] for e in steps)
    assert second_events[-1] == {"event": "end", "step": 12, "consumed": 96}
    evals = [(e["step"], e["consumed_valid"]) for e in [*first_events, *second_events] if e["event"] == "eval"]
    assert evals == [(4, 16), (8, 32), (12, 48)]  # 2 steps of 8 samples each; the count survives the resume
    assert all(0 < e["loss"] < 10 for e in [*first_events, *second_events] if e["event"] == "eval")

    # The callback's losses are the ones the loop logs, and the same as the uninterrupted run's (which never
    # evaluated: evaluation changes nothing of training).
    logged = {**first.losses(), **second.losses()}
    assert {e["step"]: e["loss"] for e in [*first_events, *second_events] if e["event"] == "step"} == logged
    assert logged == reference.losses()
    state, reference_state = checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012")
    evaluation_progress = ("common.train_state.consumed_valid_samples", "common.train_state.do_valid")
    assert [state.pop(k) for k in evaluation_progress] == [48, True]
    assert [reference_state.pop(k) for k in evaluation_progress] == [0, False]
    assert_same_state(state, reference_state)  # everything else, bit for bit
