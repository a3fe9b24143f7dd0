"""Hang attribution's stack files and summaries, the liveness ping's diagnosis, and device health on CPU."""

import logging
import time
import types

import pytest
import torch
import torch.distributed as dist
from tests.unit_tests.configs import base_config

from megatron.bridge.training.config import HealthConfig
from megatron.bridge.training.exit_codes import ExitCode, TrainingExit
from megatron.bridge.training.health import device as device_health
from megatron.bridge.training.health import hang_attribution
from megatron.bridge.training.health.liveness import LivenessPing
from megatron.bridge.utils import upstream


def _stuck_in_a_known_place(watch):
    watch.open("step")
    time.sleep(0.8)
    watch.close()


def test_watch_dumps_an_open_section_once_and_names_the_function(tmp_path, caplog):
    watch = hang_attribution.HangWatch(str(tmp_path), "attempt_0_0_0", 3, lambda section: 0.3)
    with caplog.at_level(logging.WARNING, logger="megatron.bridge"):
        _stuck_in_a_known_place(watch)
        time.sleep(0.4)  # closed now: no second dump
    watch.shutdown()
    text = (tmp_path / "attempt_0_0_0" / "rank3.stacks").read_text()
    assert text.count("--- step open for") == 1
    where = hang_attribution.summarize_stack_file(watch.path)
    assert where.startswith("rank 3 in _stuck_in_a_known_place (test_health.py:"), where
    assert "[attribution] rank 3 in _stuck_in_a_known_place" in caplog.text


def test_sections_closed_in_time_leave_no_files(tmp_path):
    watch = hang_attribution.HangWatch(str(tmp_path / "attribution"), "attempt_0_0_0", 0, lambda section: 5.0)
    for _ in range(1000):
        watch.open("step")
        watch.close()
    watch.shutdown()
    assert not (tmp_path / "attribution").exists()


def test_no_delay_means_no_dump(tmp_path):
    watch = hang_attribution.HangWatch(str(tmp_path), "a", 0, lambda section: None)
    watch.open("setup")
    time.sleep(0.6)
    watch.shutdown()
    assert not (tmp_path / "a").exists()


def test_disabled_watch_is_a_no_op():
    watch = hang_attribution.HangWatch(None, "a", 0, lambda section: 0.1)
    watch.open("step")
    watch.close()
    watch.shutdown()
    assert watch.where_is(1) is None


def test_summary_of_earlier_attempts_is_written_once(tmp_path, caplog):
    folder = tmp_path / "attempt_0_0_0"
    folder.mkdir()
    main = "0x00007f0000000001"
    (folder / "rank1.stacks").write_text(
        f"rank 1 pid 9 main thread {main}\n--- step open for 3.0 s\n"
        'Current thread 0x00007f0000000002 (most recent call first):\n  File "/x/hang.py", line 5 in _watch\n\n'
        f'Thread {main} (most recent call first):\n  File "/x/injection.py", line 130 in stall_forever\n'
        '  File "/x/train.py", line 200 in train\n'
    )
    (folder / "rank0.stacks").write_text(
        f"rank 0 pid 8 main thread {main}\n--- step open for 3.1 s\nThread {main} (most recent call first):\n"
        '  File "/v/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
        '  File "/x/train.py", line 90 in train_step\n'
    )
    (folder / "rank2.stacks").write_text(f"rank 2 pid 7 main thread {main}\n")  # stopped: header only
    with caplog.at_level(logging.WARNING, logger="megatron.bridge"):
        lines = hang_attribution.summarize_earlier_attempts(str(tmp_path), "attempt_0_1_0")
    assert len(lines) == 1
    line = lines[0]
    assert "rank 0 in all_reduce (distributed_c10d.py:3252) [step open for 3.1 s], waiting in a collective" in line
    assert "rank 1 in stall_forever (injection.py:130) [step open for 3.0 s]" in line
    assert "no stack from rank2" in line
    assert (folder / "summary.txt").exists()
    assert hang_attribution.summarize_earlier_attempts(str(tmp_path), "attempt_0_1_0") == []  # once
    assert hang_attribution.summarize_earlier_attempts(str(tmp_path / "missing"), "x") == []


def test_a_rank_waiting_in_a_pipeline_receive_is_waiting_in_a_collective(tmp_path):
    # The innermost Python frame of a blocked pipeline receive is megatron's own p2p code: ``req.wait()`` is C++.
    main = "0x00007f0000000001"
    stacks = tmp_path / "rank0.stacks"
    stacks.write_text(
        f"rank 0 pid 8 main thread {main}\n--- step open for 1.5 s\nThread {main} (most recent call first):\n"
        '  File "/v/megatron/core/pipeline_parallel/p2p_communication.py", line 392 in _communicate\n'
        '  File "/v/megatron/core/pipeline_parallel/p2p_communication.py", line 470 in recv_forward\n'
        '  File "/v/megatron/core/pipeline_parallel/schedules.py", line 1900 in forward_backward_pipelining\n'
    )
    where = hang_attribution.summarize_stack_file(str(stacks))
    assert where == "rank 0 in _communicate (p2p_communication.py:392) [step open for 1.5 s], waiting in a collective"
    stacks.write_text(stacks.read_text().replace("pipeline_parallel/p2p_communication", "models/gpt/gpt_model"))
    assert not hang_attribution.summarize_stack_file(str(stacks)).endswith("waiting in a collective")


def test_attempt_name_counts_every_kind_of_restart():
    env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert hang_attribution.attempt_name(env, inprocess_iteration=3) == "attempt_77_2_1_3"
    assert hang_attribution.attempt_name({"TORCHELASTIC_RUN_ID": "a/b"}) == "attempt_a_b_0_0_0"
    assert hang_attribution.attempt_name({}) == "attempt_local_0_0_0"


def test_the_latest_dump_is_the_one_named(tmp_path):
    delays = {"checkpointing": 0.3, "step": 0.3}
    watch = hang_attribution.HangWatch(str(tmp_path), "a", 0, delays.get)
    watch.open("checkpointing")
    time.sleep(0.8)  # a slow but healthy save dumps first
    watch.close()
    _stuck_in_a_known_place(watch)
    watch.shutdown()
    assert hang_attribution.summarize_stack_file(watch.path).startswith("rank 0 in _stuck_in_a_known_place (")
    assert "[step open for" in hang_attribution.summarize_stack_file(watch.path)


def test_a_reused_attempt_name_keeps_the_earlier_evidence(tmp_path):
    first = hang_attribution.HangWatch(str(tmp_path), "a", 1, lambda section: 0.3)
    _stuck_in_a_known_place(first)
    first.shutdown()
    assert hang_attribution.summarize_earlier_attempts(str(tmp_path), "b")  # summarized once: summary.txt written
    second = hang_attribution.HangWatch(str(tmp_path), "a", 1, lambda section: 5.0)  # same name, no hang
    second.shutdown()
    assert "in _stuck_in_a_known_place" in hang_attribution.summarize_stack_file(second.path)
    assert not (tmp_path / "a" / hang_attribution.SUMMARY).exists(), "to be summarized again with the new start"


def test_a_long_healthy_step_does_not_dump_when_only_the_ping_is_on():
    from megatron.bridge.training.health.hang_attribution import stack_dump_delay

    cfg = base_config()
    cfg.health.liveness_ping_interval, cfg.health.liveness_ping_timeout = 10, 60.0
    ft = lambda section: None  # noqa: E731 - fault tolerance's section timeouts: none
    watch = types.SimpleNamespace(last_duration=lambda section: 45.0)
    assert stack_dump_delay(cfg, ft, watch, "step") == 75.0  # past a 45 s step by half the ping timeout
    assert stack_dump_delay(cfg, ft, watch, "checkpointing") is None
    ft = {"step": 100.0, "checkpointing": 20.0}.get
    assert stack_dump_delay(cfg, ft, watch, "step") == 50.0  # half the ft timeout comes first
    assert stack_dump_delay(cfg, ft, watch, "checkpointing") == 10.0
    cfg.health.stack_dump_after = 0
    assert stack_dump_delay(cfg, ft, watch, "step") is None


class _OneRank:
    """The liveness ping's view of a world of ``size`` ranks, with a real in-memory store."""

    def __init__(self, monkeypatch, size):
        monkeypatch.setattr(dist, "get_world_size", lambda: size)
        self.store = dist.HashStore()


def _ping(store, where=None, timeout=0.6):
    ping = LivenessPing(HealthConfig(liveness_ping_interval=2, liveness_ping_timeout=timeout), "0.0", where or {}.get)
    ping._store = store
    return ping


def test_ping_names_ranks_whose_record_is_old_or_missing(monkeypatch):
    world = _OneRank(monkeypatch, 4)
    for rank, last in [(0, 6), (1, 4), (3, 6)]:
        world.store.set(f"mbridge_liveness/0.0/rank{rank}", str(last))
    ping = _ping(world.store, {1: "rank 1 in stall_forever (f.py:1)"}.get)
    start = time.monotonic()
    message = ping._diagnose(6, start, 0.6, RuntimeError("[gloo/pair.cc:553] Connection closed by peer"))
    assert time.monotonic() - start >= 0.5, "late ranks get until the deadline to arrive"
    assert message.startswith("liveness ping at iteration 6: rank 1 (last ping at iteration 4; stack: rank 1 in ")
    assert "rank 2 (no ping recorded)" in message
    assert "rank 0" not in message and "rank 3" not in message
    assert message.endswith("(dead or stuck; noticed after 0.6 s: Connection closed by peer)")


def test_other_survivors_report_the_searching_rank_verdict(monkeypatch):
    world = _OneRank(monkeypatch, 2)
    world.store.add("mbridge_liveness/0.0/failed6", 1)  # another rank noticed first and searches
    world.store.set("mbridge_liveness/0.0/verdict6", "liveness ping at iteration 6: rank 3 (...) did not answer")
    message = _ping(world.store)._diagnose(6, time.monotonic(), 0.1, RuntimeError("timeout"))
    assert message == "liveness ping at iteration 6: rank 3 (...) did not answer"


def test_without_a_verdict_the_survivor_says_so(monkeypatch):
    import megatron.bridge.training.health.liveness as liveness

    monkeypatch.setattr(liveness, "VERDICT_GRACE_S", 0.3)
    world = _OneRank(monkeypatch, 2)
    world.store.add("mbridge_liveness/0.0/failed6", 1)  # the searching rank died before its verdict
    start = time.monotonic()
    message = _ping(world.store, timeout=0.1)._diagnose(6, start, 0.1, RuntimeError("timeout"))
    assert "no rank could name the lost ranks" in message and time.monotonic() - start < 5


def test_the_searching_rank_publishes_its_verdict(monkeypatch):
    world = _OneRank(monkeypatch, 2)
    world.store.set("mbridge_liveness/0.0/rank0", "6")
    message = _ping(world.store, timeout=0.2)._diagnose(6, time.monotonic(), 0.2, RuntimeError("x"))
    assert world.store.get("mbridge_liveness/0.0/verdict6").decode() == message
    assert "rank 1 (no ping recorded)" in message


def test_ping_says_when_the_store_is_gone():
    class Gone:
        def add(self, *args):
            raise RuntimeError("Broken pipe")

    message = _ping(Gone())._diagnose(6, time.monotonic(), 0.1, RuntimeError("Connection closed by peer"))
    assert "no rank could name the lost ranks (RuntimeError: Broken pipe)" in message


def test_ping_off_joins_no_collective_and_records_nothing(monkeypatch, caplog):
    """Off (``health.liveness_ping_interval=0``, the default): nothing the ping does when on happens, at any step: no
    side group, no record in the store, no all-reduce, no log line. The same probes see all of it with the ping on."""
    calls = []
    monkeypatch.setattr(dist, "new_group", lambda **kwargs: calls.append("new_group") or "side group")
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None: calls.append(f"all_reduce on {group}"))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)

    def run(cfg):
        store = dist.HashStore()
        monkeypatch.setattr(upstream, "default_store", lambda: store)
        calls.clear()
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="megatron.bridge.training.health.liveness"):
            ping = LivenessPing(cfg, "0.0", {}.get)
            ping.setup()
            for iteration in range(1, 13):
                ping.maybe_ping(iteration)
            ping.shutdown()
        return list(calls), store.num_keys(), caplog.text

    calls_on, records_on, log_on = run(HealthConfig(liveness_ping_interval=3))
    assert calls_on == ["new_group"] + ["all_reduce on side group"] * 4 and records_on == 1, (calls_on, records_on)
    assert "liveness ping every 3 steps" in log_on
    assert run(HealthConfig()) == ([], 0, "")
    assert run(HealthConfig(liveness_ping_interval=0, liveness_ping_timeout=5.0)) == ([], 0, "")


def test_no_device_checks_on_cpu_said_once(monkeypatch, caplog):
    monkeypatch.setattr(device_health, "_said_no_devices", False)
    with caplog.at_level(logging.INFO, logger="megatron.bridge"):
        assert device_health.check_device_health(torch.device("cpu")) == []
        device_health.check_device_health(torch.device("cpu"))
    assert caplog.text.count("no device checks on this machine") == 1


@pytest.mark.parametrize("failing", ["cuda", "gpu", "nvlink"])
def test_failed_device_check_stops_with_25_naming_it(monkeypatch, failing):
    """Our mapping of nvidia-resiliency-ext's verdicts (stand-ins here: no GPU on this machine) to exit 25."""

    def cuda_check(timeout):
        def run(state):
            if failing == "cuda":
                raise TimeoutError
            return state

        return run

    modules = {
        "nvidia_resiliency_ext.inprocess.health_check": types.SimpleNamespace(CudaHealthCheck=cuda_check),
        "nvidia_resiliency_ext.shared_utils.health_check": types.SimpleNamespace(
            GPUHealthCheck=lambda: type("G", (), {"enabled": True, "__call__": lambda self: failing != "gpu"})(),
            NVLHealthCheck=lambda device_index: lambda: failing != "nvlink",
        ),
    }
    monkeypatch.setattr(device_health, "require", modules.__getitem__)
    with pytest.raises(TrainingExit) as err:
        device_health.check_device_health(torch.device("cuda", 0))
    assert err.value.exit_code == ExitCode.DEVICE_UNHEALTHY
    expected = {"cuda": "CUDA context", "gpu": "GPU (NVML recovery action)", "nvlink": "NVLink"}[failing]
    assert f"device health check '{expected}' failed on cuda:0" in err.value.reason


def test_a_timed_out_ping_waits_briefly_for_a_stuck_rank_stack(monkeypatch):
    # A stuck rank dumps half the ping timeout past its last step's length into its step: after a slow step, later
    # than the survivor's timeout. Its stack is named once it appears; a dead rank's (closed connection) is not awaited.
    world = _OneRank(monkeypatch, 2)
    world.store.set("mbridge_liveness/0.0/rank0", "6")
    world.store.set("mbridge_liveness/0.0/rank1", "4")
    dumped_at = time.monotonic() + 0.5
    where = {1: "rank 1 in stall_forever (f.py:1)"}
    late = lambda rank: where.get(rank) if time.monotonic() >= dumped_at else None  # noqa: E731
    start = time.monotonic()
    timed_out = _ping(world.store, late, timeout=0.1)._diagnose(6, start, 0.1, RuntimeError("Timed out"))
    assert "rank 1 (last ping at iteration 4; stack: rank 1 in stall_forever (f.py:1))" in timed_out, timed_out
    assert time.monotonic() - start < 0.5 + 1.0  # it stops waiting once the stack is there

    world.store.set("mbridge_liveness/0.0/rank0", "7")
    dumped_at = time.monotonic() + 0.5
    start = time.monotonic()
    # The next ping (a fresh search) fails on a closed connection after 0.01 s.
    closed = _ping(world.store, late, timeout=0.1)._diagnose(7, start, 0.01, RuntimeError("Connection closed by peer"))
    assert "rank 1 (last ping at iteration 4) did not answer" in closed, closed
    assert time.monotonic() - start < 0.5


def test_without_hang_attribution_no_stack_is_waited_for(monkeypatch):
    world = _OneRank(monkeypatch, 2)
    world.store.set("mbridge_liveness/0.0/rank0", "6")
    world.store.set("mbridge_liveness/0.0/rank1", "4")
    ping = LivenessPing(HealthConfig(liveness_ping_interval=2, liveness_ping_timeout=0.1), "0.0", None)
    ping._store = world.store
    start = time.monotonic()
    message = ping._diagnose(6, start, 0.1, RuntimeError("Timed out"))
    assert "rank 1 (last ping at iteration 4) did not answer" in message and time.monotonic() - start < 1.0
