"""The Slurm cluster of the drills: one per test session (per pytest process), started when a drill first needs it."""

import pytest
from tests.capabilities import unavailable
from tests.functional_tests import slurm_cluster


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> dict[str, str]:
    """The environment for clients and jobs of a running one-node cluster (``SLURM_CONF``); stopped at the end."""
    reason = slurm_cluster.missing()
    if reason:
        unavailable(f"{reason} (scripts/setup_slurm.sh installs it)")
    with slurm_cluster.slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env
