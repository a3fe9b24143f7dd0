"""The Slurm cluster of the drills: one per test session (per pytest process), started when a drill first needs it."""

import os

import pytest
from tests.functional_tests import slurm_cluster


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> dict[str, str]:
    """The environment for clients and jobs of a running one-node cluster (``SLURM_CONF``); stopped at the end."""
    reason = slurm_cluster.missing()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Slurm drill: {reason} (scripts/setup_slurm.sh installs it)")
        pytest.skip(reason)
    with slurm_cluster.slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env
