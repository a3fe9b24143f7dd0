"""What a drill does when this machine cannot set up its fault: skip here, fail in CI.

A drill that needs root, a mount, a cgroup controller, a tool or a cluster calls :func:`unavailable` with the reason
when it cannot have it. Outside CI the test skips with that reason (a developer's machine may lack the capability).
In CI (``CI`` set to anything but ``""``, ``0``, ``false`` or ``no``, as CI services set ``CI=true``) it fails with
the reason instead: a suite that CI runs must not pass with a fault it never tried.
"""

import os
from collections.abc import Mapping
from typing import NoReturn, Optional

import pytest

CI_ENV = "CI"
_NOT_CI = ("", "0", "false", "no")


def in_ci(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the suite runs in CI: ``CI`` is set to a value other than ``""``, ``0``, ``false`` or ``no``."""
    value = (os.environ if environ is None else environ).get(CI_ENV, "")
    return value.strip().lower() not in _NOT_CI


def unavailable(reason: str, environ: Optional[Mapping[str, str]] = None) -> NoReturn:
    """This machine cannot set up the drill's fault, for ``reason``: fail in CI, skip elsewhere.

    Args:
        reason: what is missing and, where known, how to get it (shown as the skip reason or the failure).
        environ: the environment to decide from (default: this process's).

    Raises:
        pytest.fail.Exception: in CI.
        pytest.skip.Exception: elsewhere.
    """
    if in_ci(environ):
        pytest.fail(f"CI must run this drill, but it cannot set up its fault here: {reason}", pytrace=False)
    pytest.skip(reason)
