"""The launch environment: each variable's default, its value, a bad value's message, and no caching between calls."""

import dataclasses

import pytest

from megatron.bridge.utils import common_utils, launch_env
from megatron.bridge.utils.common_utils import get_rank_safe, get_world_size_safe
from megatron.bridge.utils.launch_env import LaunchEnv

ALL = sorted({name for names in launch_env.VARIABLES.values() for name in names})
"""Every variable the module reads."""


@pytest.fixture
def bare(monkeypatch):
    """A process started without a launcher or scheduler."""
    for name in ALL:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_without_a_launcher(bare):
    env = launch_env.current()
    assert env == LaunchEnv()
    assert (env.rank, env.local_rank, env.world_size, env.restart_count, env.job_id) == (0, 0, 1, 0, "local")
    assert env.local_world_size is None and env.ranks_per_node == 1
    assert (env.master_addr, env.master_port, env.slurm_procid, env.slurm_localid) == (None, None, None, None)


def test_values_of_a_torchrun_launch(bare):
    launcher = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_RUN_ID": "run-7",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29500",
    }
    for name, value in launcher.items():
        bare.setenv(name, value)
    env = launch_env.current()
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert env.ranks_per_node == 4 and env.restart_count == 2 and env.job_id == "run-7"
    assert env.master_endpoint() == ("node0", 29500)


def test_the_slurm_job_id_comes_first(bare):
    bare.setenv("TORCHELASTIC_RUN_ID", "run-7")
    bare.setenv("SLURM_JOB_ID", "1234")
    bare.setenv("SLURM_PROCID", "3")
    bare.setenv("SLURM_LOCALID", "1")
    env = launch_env.current()
    assert (env.job_id, env.slurm_procid, env.slurm_localid) == ("1234", 3, 1)
    bare.setenv("SLURM_JOB_ID", "")  # empty counts as unset
    assert launch_env.current().job_id == "run-7"


def test_an_explicit_mapping_is_read_instead_of_the_process_environment(bare):
    bare.setenv("RANK", "3")
    assert launch_env.current({"WORLD_SIZE": "2"}) == LaunchEnv(world_size=2)


def test_each_call_reads_the_variables_again(bare):
    # In-process restart renumbers the ranks of the same process between iterations.
    bare.setattr(common_utils.dist, "is_initialized", lambda: False)  # the fallbacks, even in a shared test world
    bare.setenv("RANK", "3")
    bare.setenv("WORLD_SIZE", "4")
    assert (launch_env.current().rank, launch_env.current().world_size) == (3, 4)
    assert (get_rank_safe(), get_world_size_safe()) == (3, 4)
    bare.setenv("RANK", "1")
    bare.setenv("WORLD_SIZE", "3")
    assert (launch_env.current().rank, launch_env.current().world_size) == (1, 3)
    assert (get_rank_safe(), get_world_size_safe()) == (1, 3)


@pytest.mark.parametrize(
    "name,value,problem",
    [
        ("RANK", "abc", "is not a whole number"),
        ("LOCAL_WORLD_SIZE", "2.5", "is not a whole number"),
        ("TORCHELASTIC_RESTART_COUNT", "x", "is not a whole number"),
        ("WORLD_SIZE", "0", r"is out of range \(>= 1\)"),
        ("LOCAL_RANK", "-1", r"is out of range \(>= 0\)"),
        ("MASTER_PORT", "70000", r"is out of range \(from 0 to 65535\)"),
    ],
)
def test_a_bad_value_names_the_variable_and_the_fix(bare, name, value, problem):
    bare.setenv(name, value)
    with pytest.raises(ValueError, match=f"^{name}='{value}' {problem}; fix: unset it, or set it to a whole number"):
        launch_env.current()


def test_an_unset_rendezvous_store_is_named(bare):
    with pytest.raises(ValueError, match="^MASTER_ADDR and MASTER_PORT are not set: .* export MASTER_ADDR"):
        launch_env.current().master_endpoint()
    bare.setenv("MASTER_ADDR", "node0")
    with pytest.raises(ValueError, match="^MASTER_PORT is not set"):
        launch_env.current().master_endpoint()


def test_the_identity_is_frozen_and_every_attribute_names_its_variables(bare):
    env = launch_env.current()
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.rank = 1  # type: ignore[misc]
    fields = {f.name for f in dataclasses.fields(LaunchEnv)}
    assert fields <= set(launch_env.VARIABLES)
    assert set(launch_env.VARIABLES) - fields == {"ranks_per_node", "master_endpoint", "store_port", "elastic"}


def test_the_store_port_alone_needs_only_master_port():
    assert launch_env.current({"MASTER_PORT": "29500"}).store_port() == 29500
    with pytest.raises(ValueError, match="MASTER_PORT is not set"):
        launch_env.current({"MASTER_ADDR": "node1"}).store_port()
