"""tests/capabilities.py: a drill that cannot set up its fault skips outside CI and fails in CI, with the reason."""

import pytest
from tests.capabilities import in_ci, unavailable


@pytest.mark.parametrize(
    ("environ", "ci"),
    [
        ({}, False),
        ({"CI": ""}, False),
        ({"CI": "false"}, False),
        ({"CI": "0"}, False),
        ({"CI": " No "}, False),
        ({"CI": "true"}, True),
        ({"CI": "TRUE"}, True),
        ({"CI": "1"}, True),
        ({"CI": "yes"}, True),
        ({"GITHUB_ACTIONS": "true"}, False),  # only CI decides
    ],
)
def test_ci_is_decided_by_the_ci_variable_alone(environ, ci):
    assert in_ci(environ) is ci


def test_outside_ci_a_missing_capability_skips_with_the_reason():
    with pytest.raises(pytest.skip.Exception, match="needs root and the cgroup v1 memory controller"):
        unavailable("needs root and the cgroup v1 memory controller", {"CI": "false"})


def test_in_ci_a_missing_capability_fails_with_the_reason():
    with pytest.raises(pytest.fail.Exception) as failed:
        unavailable("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): permission denied", {"CI": "true"})
    assert "CI must run this drill" in str(failed.value)
    assert "cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): permission denied" in str(failed.value)


def test_the_default_is_this_process_environment(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception):
        unavailable("no setpriv")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        unavailable("no setpriv")
