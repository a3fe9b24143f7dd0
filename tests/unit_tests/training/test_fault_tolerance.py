"""Fault tolerance's module functions: sections in loop order, learned timeouts saved, counters, shutdown.

The rank monitor is a fake here (it lives in ft_launcher); the real one is exercised by the functional drills.
"""

import json
from types import SimpleNamespace

import pytest
from tests.unit_tests.configs import base_config

from megatron.bridge.training import fault_tolerance
from megatron.bridge.training.exit_codes import ExitCode
from megatron.bridge.training.state import GlobalState
from megatron.bridge.training.utils.overrides import apply_overrides


class FakeRankMonitorClient:
    """Records the calls the way ft_launcher's rank monitor would receive them."""

    sections = {"setup": 600.0, "step": 180.0, "checkpointing": 420.0}

    def __init__(self):
        self.calls = []
        self.loaded = None
        self.section_timeouts = SimpleNamespace(section=dict(self.sections), out_of_section=300.0)

    def init_workload_monitoring(self):
        self.calls.append("init")

    def load_state_dict(self, state):
        self.loaded = state

    def start_section(self, name):
        self.calls.append(f"start {name}")

    def end_section(self, name):
        self.calls.append(f"end {name}")

    def calculate_and_set_section_timeouts(self, selected_sections, calc_out_of_section, skip_if_not_ready):
        self.calls.append(f"calculate {','.join(selected_sections)}")
        self.section_timeouts.section["step"] = 5.0
        return True

    def state_dict(self):
        return {"section_timeouts": self.section_timeouts.section}

    def end_all_sections(self):
        self.calls.append("end all")

    def shutdown_workload_monitoring(self):
        self.calls.append("shutdown")

    def send_workload_control_request(self, request):
        self.calls.append(f"request {request.action.name}: {request.description}")


@pytest.fixture
def fake_client(monkeypatch):
    import nvidia_resiliency_ext.fault_tolerance as ft_package

    made = []
    monkeypatch.setattr(ft_package, "RankMonitorClient", lambda: made.append(FakeRankMonitorClient()) or made[-1])
    return made


def _state(tmp_path, *overrides):
    cfg = apply_overrides(
        base_config(),
        [f"checkpoint.save={tmp_path}", f"checkpoint.load={tmp_path}", *overrides],
    )
    state = GlobalState()
    state.cfg = cfg
    return cfg, state


def test_sections_follow_the_loop_and_learned_timeouts_are_saved_and_restored(tmp_path, fake_client, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    cfg, state = _state(tmp_path, "ft.enable_ft_package=true", "ft.calc_ft_timeouts=true", "checkpoint.async_save=true")
    fault_tolerance.setup(cfg, state)
    client = fake_client[0]
    assert state.rank_monitor_client is client
    ft_state = state.fault_tolerance_state
    assert ft_state.is_setup_section_open and ft_state.is_calculating_timeouts and ft_state.is_async_chkpt_enabled
    assert ft_state.ft_state_path == str(tmp_path / "ft_state.json")
    fault_tolerance.on_checkpoint_loaded(is_local_chkpt=True, global_state=state)
    assert not ft_state.is_persistent_chkpt_loaded

    for _ in range(2):
        fault_tolerance.on_training_step_start(state)
        fault_tolerance.on_training_step_end(state)
    fault_tolerance.on_checkpointing_start(state)
    fault_tolerance.on_checkpointing_end(is_async_finalization=False, global_state=state)
    fault_tolerance.on_checkpointing_start(state)
    fault_tolerance.on_checkpointing_end(is_async_finalization=True, global_state=state)  # no second update
    fault_tolerance.shutdown(state)
    assert client.calls == [
        "init", "start setup",
        "end setup", "start step", "end step", "start step", "end step",
        "start checkpointing", "end checkpointing", "calculate step,checkpointing",
        "start checkpointing", "end checkpointing",
        "end all", "shutdown",
    ]  # fmt: skip
    assert (ft_state.seen_tr_iters_cnt, ft_state.seen_checkpoints_cnt) == (2, 1)
    assert state.rank_monitor_client is None
    saved = json.loads((tmp_path / "ft_state.json").read_text())
    assert saved["section_timeouts"]["step"] == 5.0

    again = GlobalState()
    again.cfg = cfg
    fault_tolerance.setup(cfg, again)  # the next run loads what this one learned
    assert fake_client[1].loaded == saved


def test_every_function_is_a_no_op_when_fault_tolerance_is_off(tmp_path, fake_client):
    cfg, state = _state(tmp_path)
    fault_tolerance.setup(cfg, state)
    fault_tolerance.on_training_step_start(state)
    fault_tolerance.on_training_step_end(state)
    fault_tolerance.on_checkpointing_start(state)
    fault_tolerance.on_checkpointing_end(False, state)
    fault_tolerance.shutdown(state)
    assert fake_client == [] and state.rank_monitor_client is None
    untouched = GlobalState()  # setup never ran: nothing to do either
    fault_tolerance.on_training_step_start(untouched)
    fault_tolerance.shutdown(untouched)


class LayeredClient(FakeRankMonitorClient):
    """A fake whose timeouts are upstream's own type, and which records timeouts set on the rank monitor."""

    sections = {"setup": 600.0, "step": 30.0, "checkpointing": 420.0}

    def __init__(self):
        from nvidia_resiliency_ext.fault_tolerance.data import SectionTimeouts

        super().__init__()
        self.section_timeouts = SectionTimeouts(section=dict(self.sections), out_of_section=300.0)

    def calculate_and_set_section_timeouts(self, selected_sections, calc_out_of_section, skip_if_not_ready):
        self.calls.append("calculate")
        self.section_timeouts.section["step"] = 5.0
        return True

    def _set_calculated_timeouts(self, new_hb_timeouts, new_section_timeouts):
        self.calls.append(f"set step={new_section_timeouts.section['step']:g}")
        self.section_timeouts = new_section_timeouts


def test_under_inprocess_restart_hang_timeouts_stay_above_its_hard_timeout(tmp_path, monkeypatch, caplog):
    import nvidia_resiliency_ext.fault_tolerance as ft_package

    monkeypatch.setattr(ft_package, "RankMonitorClient", LayeredClient)
    monkeypatch.setenv("RANK", "0")
    caplog.set_level("INFO", logger=fault_tolerance.__name__)
    layered = ("ft.enable_ft_package=true", "ft.calc_ft_timeouts=true", "inprocess_restart.enabled=true")
    cfg, state = _state(tmp_path, *layered, "inprocess_restart.hard_timeout=45")
    fault_tolerance.setup(cfg, state)  # the launcher's step timeout (30 s) is below the hard timeout: raised
    client = state.rank_monitor_client
    assert client.section_timeouts.section == {"setup": 600.0, "step": 45.0, "checkpointing": 420.0}
    assert "step timeout 30.0s raised to inprocess_restart.hard_timeout=45.0s" in caplog.text
    fault_tolerance.on_checkpointing_start(state)
    fault_tolerance.on_checkpointing_end(is_async_finalization=False, global_state=state)  # learns 5 s: raised again
    assert client.calls[-2:] == ["calculate", "set step=45"]
    assert json.loads((tmp_path / "ft_state.json").read_text())["section_timeouts"]["step"] == 45.0

    (tmp_path / "alone").mkdir()
    cfg, state = _state(tmp_path / "alone", *layered[:2])  # without in-process restart, learned values stand
    fault_tolerance.setup(cfg, state)
    fault_tolerance.on_checkpointing_end(is_async_finalization=False, global_state=state)
    assert state.rank_monitor_client.section_timeouts.section["step"] == 5.0


class HeartbeatClient(FakeRankMonitorClient):
    """A launcher without section timeouts: heartbeats, whose subsequent timeout is the hang timeout."""

    sections = {}

    def __init__(self):
        from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts

        super().__init__()
        self.hb_timeouts = HeartbeatTimeouts(initial=600.0, subsequent=20.0)

    def send_heartbeat(self):
        self.calls.append("heartbeat")

    def _set_calculated_timeouts(self, new_hb_timeouts, new_section_timeouts):
        assert new_section_timeouts is None
        self.hb_timeouts = new_hb_timeouts


def test_under_inprocess_restart_the_heartbeat_timeout_stays_above_its_hard_timeout(tmp_path, monkeypatch):
    import nvidia_resiliency_ext.fault_tolerance as ft_package

    monkeypatch.setattr(ft_package, "RankMonitorClient", HeartbeatClient)
    monkeypatch.setenv("RANK", "0")
    cfg, state = _state(tmp_path, "ft.enable_ft_package=true", "inprocess_restart.enabled=true")
    fault_tolerance.setup(cfg, state)
    hb = state.rank_monitor_client.hb_timeouts
    assert (hb.initial, hb.subsequent) == (600.0, cfg.inprocess_restart.hard_timeout)


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
    state.fault_tolerance.on_train_end(code)
    assert flag.exists() == flagged
    if flagged:
        assert flag.read_text() == f"training ended with exit code {int(code)} ({code.name})\n"
    requests = [c for c in fake_client[0].calls if c.startswith("request")]
    assert requests == ([f"request ShutdownWorkload: exit code {int(code)} ({code.name})"] if asked else [])


def test_a_stop_on_broken_storage_still_asks_the_launcher_and_does_not_raise(tmp_path, fake_client, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv("FAULT_TOL_FINISHED_FLAG_FILE", str(blocker / "finished.flag"))  # the write fails (ENOTDIR)
    monkeypatch.setenv("RANK", "0")
    cfg, state = _state(tmp_path, "ft.enable_ft_package=true")
    fault_tolerance.setup(cfg, state)
    state.fault_tolerance.on_train_end(ExitCode.STORAGE_FULL)
    assert [c for c in fake_client[0].calls if c.startswith("request")] == [
        "request ShutdownWorkload: exit code 26 (STORAGE_FULL)"
    ]
