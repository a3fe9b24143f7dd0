"""``dist.device`` on real 2-rank runs on this machine without a GPU: ``cuda`` stops before training, ``cpu`` trains."""

import pytest
import torch
from tests.functional_tests.env_report import record
from tests.functional_tests.harness import tail, torchrun

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="drills for a node without a GPU")


@pytest.mark.timeout(150)
def test_cuda_on_a_node_without_a_gpu_exits_25_and_trains_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = torchrun(ckpt, "dist.device=cuda", timeout=120)
    assert run.exit_code == 25, tail(run)
    stops = [line for line in run.output.splitlines() if "training stopped: DEVICE_UNHEALTHY (exit code 25)" in line]
    # Each rank checks on its own; torchrun stops the other rank at the first exit, which may come before the slower
    # rank reaches its check.
    assert stops and {line.split("]")[0].split("[")[-1] for line in stops} <= {"rank0", "rank1"}, tail(run)
    assert "dist.device=cuda but this node has no GPU" in stops[0], stops[0]
    assert "Fix: run this job on GPU nodes" in stops[0] and "set dist.device=cpu" in stops[0], stops[0]
    assert not run.losses(), "nothing may train"
    assert "initialized gloo" not in run.output, "no process group is created"
    assert not list(ckpt.glob("iter_*")) and not (ckpt / "job_info.jsonl").exists()
    record("dist.device=cuda on a node without a GPU", run, lost="nothing (nothing started)")


@pytest.mark.timeout(150)
def test_cpu_trains_and_says_so(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = torchrun(ckpt, "dist.device=cpu", "train.train_iters=2", "scheduler.lr_warmup_iters=1", timeout=120)
    assert run.exit_code == 0, tail(run)
    assert sorted(run.losses()) == [1, 2], tail(run)
    for rank in (0, 1):
        assert (
            run.output.count(f"[rank{rank}] INFO megatron.bridge.training.initialize: device: cpu (dist.device=cpu)")
            == 1
        )
    assert "using gloo (training on CPU)" in run.output, "the default nccl backend runs on gloo"
    block = run.output[run.output.index("job info:") :].splitlines()[1:3]
    assert block[1].strip().endswith("device cpu"), block


@pytest.mark.timeout(150)
def test_bf16_with_auto_stops_with_the_config_error_once_the_device_is_known(tmp_path):
    bf16 = ["model.params_dtype=bfloat16", "model.bf16=true", "optimizer.bf16=true", "optimizer.params_dtype=bfloat16"]
    run = torchrun(tmp_path / "ckpt", *bf16, timeout=120)  # dist.device=auto: validate() cannot refuse it
    assert run.exit_code == 2, tail(run)
    assert "training stopped: CONFIG_ERROR (exit code 2): model.params_dtype: bfloat16 needs CUDA" in run.output
    assert "but dist.device=auto resolved to cpu (no GPU on this node)" in run.output, tail(run)
    assert not run.losses()
    record("bf16 with dist.device=auto on a node without a GPU", run, lost="nothing (nothing trained)")
