"""Suite-wide rules: two tiers, a time limit on every test, and no process outliving its test.

- Tiers: everything under ``tests/functional_tests/`` carries the ``functional`` marker (real multi-process runs),
  as does a test elsewhere that is marked so; the rest is the unit tier (``pytest -m "not functional"``, our own
  logic, mocks allowed).
- Parallel workers (pytest-xdist, ``--dist loadscope``): a module's tests run on one worker, so a module-scoped
  fixture (a drill's run, the Slurm cluster of the Slurm drills) is made once; the session-wide shared runs are made
  once per run across workers (``tests/resources.once_per_run``). Modules are handed out longest first
  (:data:`LONGEST_FIRST`, run with ``--no-loadscope-reorder``): a long module started last would leave the tier
  waiting on one worker while the others sit idle.
- Time limits (pytest-timeout): ``UNIT_TIMEOUT`` seconds for a unit test, ``FUNCTIONAL_TIMEOUT`` for a functional
  one, unless the test sets its own ``@pytest.mark.timeout``. The limit covers set-up, so a shared fixture that
  trains a reference run counts against the first test that asks for it.
- Processes: each test runs with ``MBRIDGE_TEST_ID`` set, so every process it starts carries it. When the test
  fails (a time limit included), the report gets a section with the Python stacks of those still alive; after the
  test, any left are killed.
"""

import os
import uuid

import pytest
from tests import processes

UNIT_TIMEOUT = 60
FUNCTIONAL_TIMEOUT = 600
_FUNCTIONAL_DIR = os.path.join(os.path.dirname(os.path.realpath(__file__)), "functional_tests")


LONGEST_FIRST = (
    "test_main_job.py", "training/test_parallel_resume.py", "recipes/test_preemption_slurm.py",
    "training/test_local_checkpointing.py", "training/test_rerun_state_machine.py", "test_drill_mutations.py",
    "training/test_fault_tolerance.py", "test_gpu_check.py", "training/test_shrink.py",
    "training/test_straggler_example.py", "training/test_preemption.py", "training/test_resume.py",
    "training/test_checkpoint_faults.py", "training/test_storage_faults.py", "training/test_health.py",
    "training/test_inprocess_restart.py",
    "training/test_fault_tolerance_example.py", "training/test_launchers.py", "test_wheel.py",
    "recipes/test_fault_tolerance_plugin.py",
)  # fmt: skip
"""Functional modules by the time their tests took in full runs (a module's wall time on a loaded 2-core machine),
longest first; the others follow in collection order."""


def _scheduling_rank(item: pytest.Item) -> int:
    path = os.path.realpath(item.path)
    for rank, module in enumerate(LONGEST_FIRST):
        if path == os.path.join(_FUNCTIONAL_DIR, module):
            return rank
    return len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_scheduling_rank)  # stable: a module's tests keep their order
    for item in items:
        functional = item.get_closest_marker("functional") is not None
        if not functional and os.path.realpath(item.path).startswith(_FUNCTIONAL_DIR + os.sep):
            item.add_marker(pytest.mark.functional)
            functional = True
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(FUNCTIONAL_TIMEOUT if functional else UNIT_TIMEOUT))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    test_id = uuid.uuid4().hex[:16]
    previous = os.environ.get(processes.TEST_ID)
    os.environ[processes.TEST_ID] = test_id
    item.stash[_TEST_ID] = test_id
    try:
        yield
    finally:
        processes.kill_tagged(processes.TEST_ID, test_id)  # a backstop: the teardown report normally did it
        if previous is None:
            os.environ.pop(processes.TEST_ID, None)
        else:
            os.environ[processes.TEST_ID] = previous


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if _TEST_ID not in item.stash:
        return
    test_id = item.stash[_TEST_ID]
    if report.failed:
        alive = processes.tagged(processes.TEST_ID, test_id)
        if alive:
            report.sections.append((f"stacks of the {len(alive)} processes still alive", processes.stacks(alive)))
    if call.when == "teardown":  # the test and its fixtures are done: nothing of it may live on
        leftovers = processes.kill_tagged(processes.TEST_ID, test_id)
        if leftovers:
            report.sections.append((_LEFTOVERS, f"killed {len(leftovers)}: {leftovers}"))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Name the tests that left processes behind (reports carry it, so it works from pytest-xdist workers too)."""
    for reports in terminalreporter.stats.values():
        for report in reports:
            for title, text in getattr(report, "sections", []):
                if title == _LEFTOVERS:
                    terminalreporter.write_line(f"[processes] {report.nodeid} left processes behind: {text}")


_TEST_ID = pytest.StashKey[str]()
_LEFTOVERS = "processes left behind"
