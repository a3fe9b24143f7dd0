"""Fault tolerance's module functions: sections in loop order, learned timeouts saved, counters, shutdown.

The rank monitor is a fake here (it lives in ft_launcher); the real one is exercised by the functional drills.
"""

import json
from types import SimpleNamespace

import pytest
from tests.unit_tests.configs import base_config

from megatron.bridge.training import fault_tolerance
from megatron.bridge.training.exit_codes import ExitCode
from megatron.bridge.training.health.rank_monitor_client import LayeredClient
from megatron.bridge.training.state import GlobalState
from megatron.bridge.training.utils.overrides import apply_overrides


class FakeRankMonitorClient:
    """Records the calls the way ft_launcher's rank monitor would receive them; timeouts are upstream's types."""

    sections = {"setup": 600.0, "step": 180.0, "checkpointing": 420.0}
    learned_step = 5.0

    def __init__(self):
        from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts, SectionTimeouts

        self.calls = []
        self.loaded = None
        self.is_initialized = False
        self.cfg = SimpleNamespace(rank_section_timeouts=dict(self.sections))
        self.section_timeouts = SectionTimeouts(section=dict(self.sections), out_of_section=300.0)
        self.hb_timeouts = HeartbeatTimeouts(initial=600.0, subsequent=20.0)

    def init_workload_monitoring(self):
        self.calls.append("init")
        self.is_initialized = True

    def load_state_dict(self, state):
        self.loaded = state

    def start_section(self, name):
        self.calls.append(f"start {name}")

    def end_section(self, name):
        self.calls.append(f"end {name}")

    def send_heartbeat(self):
        self.calls.append("heartbeat")

    def calculate_and_set_section_timeouts(self, selected_sections, calc_out_of_section, skip_if_not_ready=False):
        self.calls.append(f"calculate {','.join(selected_sections)}{' +oos' if calc_out_of_section else ''}")
        self.section_timeouts.section["step"] = self.learned_step
        return True

    def calculate_and_set_hb_timeouts(self, skip_if_not_ready=False):
        self.calls.append("calculate heartbeat")
        self.hb_timeouts.subsequent = 2.0
        return True

    def _set_calculated_timeouts(self, new_hb_timeouts, new_section_timeouts):
        if new_section_timeouts is not None:
            self.calls.append(f"set step={new_section_timeouts.section['step']:g}")
            self.section_timeouts = new_section_timeouts
        if new_hb_timeouts is not None:
            self.calls.append(f"set heartbeat={new_hb_timeouts.subsequent:g}")
            self.hb_timeouts = new_hb_timeouts

    def state_dict(self):
        return {"section_timeouts": dict(self.section_timeouts.section)}

    def end_all_sections(self):
        self.calls.append("end all")

    def shutdown_workload_monitoring(self):
        self.calls.append("shutdown")
        self.is_initialized = False

    def send_workload_control_request(self, request):
        self.calls.append(f"request {request.action.name}: {request.description}")


@pytest.fixture
def fake_client(monkeypatch):
    import nvidia_resiliency_ext.fault_tolerance as ft_package

    made = []
    monkeypatch.setattr(ft_package, "RankMonitorClient", lambda: made.append(FakeRankMonitorClient()) or made[-1])
    monkeypatch.setenv("RANK", "0")
    return made


def _state(tmp_path, *overrides):
    cfg = apply_overrides(base_config(), [f"checkpoint.save={tmp_path}", f"checkpoint.load={tmp_path}", *overrides])
    state = GlobalState()
    state.cfg = cfg
    return cfg, state


def _steps(state, n, evaluate=0):
    for _ in range(n):
        fault_tolerance.on_training_step_start(state)
        fault_tolerance.on_training_step_end(state)
    for _ in range(evaluate):
        fault_tolerance.on_eval_step_start(state)
        fault_tolerance.on_eval_step_end(state)


def test_sections_follow_the_loop_after_warm_up_and_learned_timeouts_are_saved_and_restored(tmp_path, fake_client):
    cfg, state = _state(tmp_path, "ft.enable_ft_package=true", "ft.calc_ft_timeouts=true")
    fault_tolerance.setup(cfg, state)
    client = fake_client[0]
    assert state.rank_monitor_client is client
    ft_state = state.fault_tolerance_state
    assert ft_state.is_setup_section_open and ft_state.is_calculating_timeouts and not ft_state.is_async_chkpt_enabled
    assert ft_state.ft_state_path == str(tmp_path / "ft_state.json")
    fault_tolerance.on_checkpoint_loaded(is_local_chkpt=True, global_state=state)  # too fast to learn setup from

    _steps(state, 2, evaluate=2)  # the first of each is a warm-up, out of section
    assert client.calls == [
        "init", "start setup",
        "end setup",  # step 1: warm-up
        "start step", "end step",  # step 2
        "start step", "end step",  # evaluation step 2
    ]  # fmt: skip
    fault_tolerance.on_checkpointing_start(state)
    fault_tolerance.on_checkpointing_end(is_async_finalization=False, global_state=state)
    assert client.calls[-3:] == ["start checkpointing", "end checkpointing", "calculate checkpointing"]
    assert json.loads((tmp_path / "ft_state.json").read_text())["section_timeouts"]["step"] == 5.0

    _steps(state, 14)  # 16 training steps seen: the step timeout can be learned
    fault_tolerance.on_checkpointing_start(state)
    fault_tolerance.on_checkpointing_end(is_async_finalization=True, global_state=state)  # a finalization: no update
    assert client.calls[-1] == "end checkpointing"
    fault_tolerance.shutdown(state)  # no global checkpoint loaded: neither setup nor out-of-section learned
    assert client.calls[-3:] == ["calculate step,checkpointing", "end all", "shutdown"]
    assert (ft_state.seen_tr_iters_cnt, ft_state.seen_checkpoints_cnt) == (16, 1)
    assert state.rank_monitor_client is None
    saved = json.loads((tmp_path / "ft_state.json").read_text())

    again = GlobalState()
    again.cfg = cfg
    fault_tolerance.setup(cfg, again)  # the next run loads what this one learned, and counts from zero
    assert fake_client[1].loaded == saved and again.fault_tolerance_state.seen_tr_iters_cnt == 0


def test_a_run_that_loaded_a_global_checkpoint_learns_setup_and_at_the_end_out_of_section(tmp_path, fake_client):
    cfg, state = _state(tmp_path, "ft.enable_ft_package=true", "ft.calc_ft_timeouts=true", "checkpoint.async_save=true")
    fault_tolerance.setup(cfg, state)
    fault_tolerance.on_checkpoint_loaded(is_local_chkpt=False, global_state=state)
    _steps(state, 16)
    fault_tolerance.on_checkpointing_start(state)
    fault_tolerance.on_checkpointing_end(is_async_finalization=False, global_state=state)
    fault_tolerance.shutdown(state)
    learned = [c for c in fake_client[0].calls if c.startswith("calculate")]
    assert learned == ["calculate setup,step", "calculate setup,step +oos"]  # async saves: checkpointing never


def test_every_function_is_a_no_op_while_no_client_is_connected(tmp_path, fake_client):
    cfg, state = _state(tmp_path, "ft.calc_ft_timeouts=true")  # fault tolerance off: the loop never calls setup
    _steps(state, 2, evaluate=2)
    fault_tolerance.on_checkpointing_start(state)
    fault_tolerance.on_checkpointing_end(False, state)
    fault_tolerance.keep_timeouts_at_least(state, 90)
    assert fault_tolerance.section_timeout(state, "step") is None
    fault_tolerance.shutdown(state)
    fault_tolerance.abort(state)
    assert fake_client == [] and state.rank_monitor_client is None


def test_setup_needs_a_save_directory_and_replaces_a_connected_client(tmp_path, fake_client):
    cfg = base_config()
    cfg.checkpoint.save = None
    with pytest.raises(ValueError, match="set checkpoint.save"):
        fault_tolerance.setup(cfg, GlobalState())
    cfg, state = _state(tmp_path / "new", "ft.enable_ft_package=true")
    fault_tolerance.setup(cfg, state)
    assert (tmp_path / "new").is_dir()
    fault_tolerance.setup(cfg, state)  # an in-process restart iteration: the last connection is closed first
    assert fake_client[0].calls[-1] == "shutdown" and state.rank_monitor_client is fake_client[1]


def test_a_lost_rank_monitor_is_survived(tmp_path, fake_client, caplog):
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_client import RankMonitorClientError

    cfg, state = _state(tmp_path, "ft.enable_ft_package=true")
    fault_tolerance.setup(cfg, state)

    def gone(name):
        raise RankMonitorClientError("connection reset")

    fake_client[0].end_section = gone
    fault_tolerance.on_training_step_start(state)  # closing setup fails: the rank goes on without the monitor
    assert state.rank_monitor_client is None and "the rank monitor is gone" in caplog.text
    _steps(state, 2)
    fault_tolerance.on_checkpointing_start(state)
    fault_tolerance.on_checkpointing_end(False, state)
    fault_tolerance.shutdown(state)


def test_an_unreadable_state_file_is_ignored(tmp_path, fake_client, caplog):
    (tmp_path / "ft_state.json").write_text("{")
    cfg, state = _state(tmp_path, "ft.enable_ft_package=true", "ft.calc_ft_timeouts=true")
    fault_tolerance.setup(cfg, state)
    assert fake_client[0].loaded is None and "ignoring unreadable" in caplog.text
    assert fake_client[0].calls == ["init", "start setup"]


def test_under_inprocess_restart_hang_timeouts_stay_above_its_hard_timeout(tmp_path, fake_client, caplog, monkeypatch):
    caplog.set_level("INFO", logger="megatron.bridge.training.health.rank_monitor_client")
    monkeypatch.setattr(FakeRankMonitorClient, "sections", {"setup": 600.0, "step": 30.0, "checkpointing": 420.0})
    layered = ("ft.enable_ft_package=true", "ft.calc_ft_timeouts=true", "inprocess_restart.enabled=true")
    cfg, state = _state(tmp_path, *layered, "inprocess_restart.hard_timeout=45")
    fault_tolerance.setup(cfg, state)
    fault_tolerance.keep_timeouts_at_least(state, cfg.inprocess_restart.hard_timeout)  # as pretrain does
    client = state.rank_monitor_client
    assert isinstance(client, LayeredClient) and client.client is fake_client[0]
    assert client.section_timeouts.section == {"setup": 600.0, "step": 45.0, "checkpointing": 420.0}
    assert fault_tolerance.section_timeout(state, "step") == 45.0
    assert "step timeout 30.0s raised to inprocess_restart.hard_timeout=45.0s" in caplog.text
    fault_tolerance.on_checkpointing_start(state)
    fault_tolerance.on_checkpointing_end(is_async_finalization=False, global_state=state)  # learns 5 s: raised
    assert fake_client[0].calls[-2:] == ["calculate checkpointing", "set step=45"]
    assert json.loads((tmp_path / "ft_state.json").read_text())["section_timeouts"]["step"] == 45.0

    (tmp_path / "alone").mkdir()
    cfg, state = _state(tmp_path / "alone", *layered[:2])  # without in-process restart, learned values stand
    fault_tolerance.setup(cfg, state)
    fault_tolerance.on_checkpointing_end(is_async_finalization=False, global_state=state)
    assert state.rank_monitor_client.section_timeouts.section["step"] == 5.0


def test_without_section_timeouts_heartbeats_are_sent_and_kept_above_the_hard_timeout(
    tmp_path, fake_client, caplog, monkeypatch
):
    monkeypatch.setattr(FakeRankMonitorClient, "sections", {})
    cfg, state = _state(tmp_path, "ft.enable_ft_package=true", "ft.calc_ft_timeouts=true")
    fault_tolerance.setup(cfg, state)
    assert "sending heartbeats instead" in caplog.text
    fault_tolerance.keep_timeouts_at_least(state, 60.0)
    client = fake_client[0]
    assert (client.hb_timeouts.initial, client.hb_timeouts.subsequent) == (600.0, 60.0)
    assert fault_tolerance.section_timeout(state, "setup") == 600.0
    _steps(state, 2)  # the end of setup is the first heartbeat, the end of each step after the warm-up the next
    fault_tolerance.on_checkpointing_start(state)
    fault_tolerance.on_checkpointing_end(False, state)
    fault_tolerance.shutdown(state)
    assert client.calls == [
        "init", "set heartbeat=60", "heartbeat", "heartbeat", "heartbeat",
        "calculate heartbeat", "set heartbeat=60",  # at the save
        "calculate heartbeat", "set heartbeat=60",  # at the end of the run
        "shutdown",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("code", "rank", "flagged", "asked"),
    [
        (ExitCode.FINISHED, 0, True, False),
        (ExitCode.FINISHED, 1, False, False),  # rank 0 says the job is done
        (ExitCode.STORAGE_FULL, 1, True, True),  # any rank that ends with a stop code: a restart meets the same disk
        (ExitCode.RERUN_FAILED_VALIDATION, 0, True, True),
        (ExitCode.CONFIG_ERROR, 1, True, True),
        (ExitCode.PREEMPTED, 0, False, False),  # requeue and resume
        (ExitCode.UNEXPECTED_ERROR, 0, False, False),  # restart
    ],
)
def test_a_finished_run_or_a_stop_code_is_not_restarted_or_requeued(
    tmp_path, fake_client, monkeypatch, code, rank, flagged, asked
):
    flag = tmp_path / "finished.flag"
    monkeypatch.setenv("FAULT_TOL_FINISHED_FLAG_FILE", str(flag))
    monkeypatch.setenv("RANK", str(rank))
    cfg, state = _state(tmp_path, "ft.enable_ft_package=true")
    fault_tolerance.setup(cfg, state)
    fault_tolerance.report_exit(state, code)
    assert flag.exists() == flagged
    if flagged:
        assert flag.read_text() == f"training ended with exit code {int(code)} ({code.name})\n"
    requests = [c for c in fake_client[0].calls if c.startswith("request")]
    assert requests == ([f"request ShutdownWorkload: exit code {int(code)} ({code.name})"] if asked else [])


def test_a_finished_run_is_not_requeued_with_fault_tolerance_off(tmp_path, monkeypatch):
    flag = tmp_path / "finished.flag"
    monkeypatch.setenv("FAULT_TOL_FINISHED_FLAG_FILE", str(flag))
    monkeypatch.setenv("RANK", "0")
    fault_tolerance.report_exit(GlobalState(), ExitCode.FINISHED)
    assert flag.exists()


def test_a_stop_on_broken_storage_still_asks_the_launcher_and_does_not_raise(tmp_path, fake_client, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv("FAULT_TOL_FINISHED_FLAG_FILE", str(blocker / "finished.flag"))  # the write fails (ENOTDIR)
    cfg, state = _state(tmp_path, "ft.enable_ft_package=true")
    fault_tolerance.setup(cfg, state)
    fault_tolerance.report_exit(state, ExitCode.STORAGE_FULL)
    assert [c for c in fake_client[0].calls if c.startswith("request")] == [
        "request ShutdownWorkload: exit code 26 (STORAGE_FULL)"
    ]


def test_an_unknown_simulated_fault_type_is_refused():
    config = SimpleNamespace(enable_ft_package=True, simulate_fault=True, simulated_fault_type="rank_sleepy")
    with pytest.raises(ValueError, match="Unknown fault type rank_sleepy"):
        fault_tolerance.maybe_setup_simulated_fault(config)
