"""Weight-hash drills: one bit of one rank's weights flipped after an optimizer step, in a 2-rank run (DP=2).

``bitflip@5:1`` flips a mantissa bit of rank 1's largest parameter right after the update of iteration 5: the loss
stays finite, no loss check sees it. With ``train.check_weight_hash_across_dp_replicas_interval=2`` the replicas are
compared after iteration 6 (and before every save), the mismatch names both ranks (two replicas: no majority), the
attempt stops with 31 before saving 6, ft_launcher's in-job restart loads 3 (checked when it was saved) and the run
ends bit for bit as the fault-free one. With ``:always`` the flip recurs on the same rank in the restarted attempt:
it stops with 30. The re-run state machine's transient-fault drill (``validate_results``, a NaN computed once, re-run,
found not reproducible and counted as transient) is ``test_rerun_state_machine.py -k transient``.
"""

import json

import pytest
from tests.doc_log_lines import assert_doc_log_lines
from tests.functional_tests.harness import assert_same_state, checkpoint_state, ft_launcher, tail

from megatron.bridge.training.events.stream import Mechanism
from megatron.bridge.training.health.weight_hash import RECORD_FILE

CHECK = "train.check_weight_hash_across_dp_replicas_interval=2"


@pytest.mark.timeout(240)
def test_weight_hash_bitflip_found_rolled_back_ends_as_fault_free(reference_tp1, tmp_path):
    _, reference_ckpt = reference_tp1
    ckpt = tmp_path / "ckpt"
    run = ft_launcher(ckpt, CHECK, "ft.enable_ft_package=true", max_restarts=2, env={"MBRIDGE_FAULTS": "bitflip@5:1"})
    assert run.exit_code == 0, tail(run, 120)
    assert "fault injection: bitflip after the optimizer step of iteration 5" in run.output
    detected = sorted((e.rank, e.iteration, e.exit_code) for e in run.detected(Mechanism.WEIGHT_HASH))
    assert detected == [(0, 6, 31), (1, 6, 31)], tail(run, 120)  # within the interval: the first check after 5
    assert "weight hash check after iteration 6: data-parallel replicas hold different weights" in run.output
    assert_doc_log_lines(run.output)
    assert run.loaded() == [3], tail(run, 120)  # the restart rolled back to the newest checkpoint
    record = json.loads((ckpt / RECORD_FILE).read_text())["mismatches"]
    assert [(m["iteration"], sorted(m["ranks"]), m["exit_code"]) for m in record] == [(6, ["0", "1"], 31)]
    assert_same_state(checkpoint_state(ckpt / "iter_0000012"), checkpoint_state(reference_ckpt / "iter_0000012"))


@pytest.mark.timeout(240)
def test_weight_hash_mismatch_recurring_on_the_same_rank_stops_with_30(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {"MBRIDGE_FAULTS": "bitflip@5:1:always"}
    run = ft_launcher(ckpt, CHECK, "ft.enable_ft_package=true", max_restarts=3, env=env)
    assert run.exit_code == 30, tail(run, 120)
    codes = [e.exit_code for e in run.detected(Mechanism.WEIGHT_HASH) if e.rank == 1]
    assert codes == [31, 30], tail(run, 120)  # rolled back once, then the same rank again: suspect, stop
    assert "were named before on the same host: suspect hardware, stopping" in run.output
    assert "asked ft_launcher not to restart the workers" in run.output
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"  # nothing diverged was saved
