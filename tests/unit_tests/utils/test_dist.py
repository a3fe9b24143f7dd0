"""Rank-0 work shared with every rank, barriers and the signal agreement, in one process and between two gloo ranks."""

import json
import os
import subprocess
import sys

import pytest

from megatron.bridge.training.utils.sig_utils import DistributedSignalHandler
from megatron.bridge.utils import dist as dist_utils


def test_without_a_process_group_every_helper_works_locally():
    calls = []
    assert dist_utils.on_rank0(lambda: calls.append(1) or "done", "the work") == "done"
    assert calls == [1]
    with pytest.raises(dist_utils.RankZeroError, match="the work failed on rank 0: ValueError: boom"):
        dist_utils.on_rank0(lambda: (_ for _ in ()).throw(ValueError("boom")), "the work")
    assert dist_utils.broadcast_from_rank0({"a": 1}) == {"a": 1}
    assert dist_utils.all_gather_object(3) == [3]
    dist_utils.barrier()
    dist_utils.barrier(timeout=0.1)
    assert (dist_utils.rank(), dist_utils.world_size()) == (0, 1)


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    result: dict = {}
    calls = []
    result["value"] = dist_utils.on_rank0(lambda: calls.append(1) or f"from rank {dist.get_rank()}", "the read")
    result["calls"] = len(calls)

    def boom() -> None:
        raise ValueError("boom")

    try:
        dist_utils.on_rank0(boom, "the commit")
    except dist_utils.RankZeroError as err:
        result["error"] = str(err)
    result["gathered"] = dist_utils.all_gather_object(rank * 10)
    handler = DistributedSignalHandler()
    if rank == 1:
        handler.received_at = 1.0  # as the handler records a signal that reached rank 1 only
    result["signals"] = handler.signals_received()  # a collective, as the sig_utils API promises
    for _ in range(3):  # a barrier of one name passed several times
        dist_utils.barrier(timeout=30, name="again")
    if rank == 0:  # rank 1 never comes to this one
        try:
            dist_utils.barrier(timeout=1, name="late")
        except dist_utils.BarrierTimeout as err:
            result["timeout"] = [str(err), err.missing]
    dist_utils.barrier()  # and both meet here
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_gloo_ranks_share_rank0_results_and_errors_and_a_timed_barrier_names_the_absent(tmp_path):
    code = f"from {__name__} import _worker; import sys; _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(r), str(tmp_path / "store"), str(tmp_path)], env=env)
        for r in range(2)
    ]
    for p in procs:
        assert p.wait(100) == 0, f"a rank exited with {p.returncode}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["value"] for r in results] == ["from rank 0", "from rank 0"]
    assert [r["calls"] for r in results] == [1, 0]  # the work ran on rank 0 only
    for r in results:
        assert r["error"] == "the commit failed on rank 0: ValueError: boom"
        assert r["gathered"] == [0, 10]
        assert r["signals"] == [False, True]  # every rank learns that rank 1 was signalled
    message, missing = results[0]["timeout"]
    assert missing == [1]
    assert "late: rank(s) [1] did not arrive within 1 s" in message
    assert "timeout" not in results[1]
