"""The rendezvous heartbeat settings of ``--rdzv-conf``: read with torch's names, used by the installed rendezvous."""

import importlib
from datetime import timedelta

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from megatron.bridge.utils import rendezvous_keep_alive as keep_alive
from megatron.bridge.utils import upstream

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "conf, expected",
    [
        (None, None),
        ("join_timeout=60,last_call_timeout=5", None),
        ("keep_alive_interval=1", keep_alive.KeepAlive(1.0, 3)),
        ("join_timeout=60,keep_alive_interval=0.5,keep_alive_max_attempt=4", keep_alive.KeepAlive(0.5, 4)),
        ("keep_alive_max_attempt=2", keep_alive.KeepAlive(5.0, 2)),
    ],
)
def test_settings_are_read_with_torchs_names_and_defaults(conf, expected):
    assert keep_alive.from_rdzv_conf(conf) == expected


@pytest.mark.parametrize("conf", ["keep_alive_interval=0", "keep_alive_max_attempt=-1", "keep_alive_interval=soon"])
def test_a_value_that_is_not_positive_is_refused_naming_the_key_and_the_fix(conf):
    with pytest.raises(ValueError, match=r"--rdzv-conf: keep_alive_interval=.*e\.g\. keep_alive_interval=1"):
        keep_alive.from_rdzv_conf(conf)


def test_a_lost_node_is_dropped_after_interval_times_attempts():
    assert keep_alive.KeepAlive(1.5, 2).dropped_after_s == 3.0
    assert keep_alive.KeepAlive().dropped_after_s == 15.0  # torch's and nvidia-resiliency-ext's 5 s x 3


@pytest.mark.parametrize("conf", ["keep_alive_interval=nan", "keep_alive_interval=inf"])
def test_a_value_that_is_not_finite_is_refused(conf):
    with pytest.raises(ValueError, match="--rdzv-conf: keep_alive_interval="):
        keep_alive.from_rdzv_conf(conf)


@pytest.fixture
def restored():
    """Put back the rendezvous settings class the test patched."""
    key = upstream.RENDEZVOUS_SETTINGS
    original = upstream.find(key) if upstream.applicable((key,)) else None
    yield
    if original is not None:
        upstream.patch(key, original)


def test_the_legacy_rendezvous_builds_its_handler_with_the_settings(restored):
    legacy = upstream.applicable((upstream.RENDEZVOUS_SETTINGS,)) is not None
    assert keep_alive.install(keep_alive.KeepAlive(1.0, 2)) == legacy
    if not legacy:  # nvidia-resiliency-ext 0.7: only the barrier rendezvous, which does not drop nodes by heartbeats
        pytest.skip("no legacy rendezvous in this nvidia-resiliency-ext")
    # The handler ft_launcher's c10d backend builds, from the legacy module's own factory (its dead-node sweep reads
    # these two settings).
    module = importlib.import_module(upstream.RENDEZVOUS_SETTINGS.split(":", 1)[0])
    params = RendezvousParameters(backend="c10d", endpoint="localhost:0", run_id="r", min_nodes=1, max_nodes=2)
    handler = module.create_handler(HashStore(), C10dRendezvousBackend(HashStore(), "r"), params)
    settings = handler.settings
    assert (settings.keep_alive_interval, settings.keep_alive_max_attempt) == (timedelta(seconds=1), 2)
