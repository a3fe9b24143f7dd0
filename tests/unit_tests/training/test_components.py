"""Components: one declared order for set-up, events, wrapping and finishing; teardown in reverse, on every path."""

import ast
import inspect
import logging
from pathlib import Path

import pytest

from megatron.bridge.training import pretrain
from megatron.bridge.training.callbacks import CallbackManager
from megatron.bridge.training.components import Component, Components, Run
from megatron.bridge.training.components.base import Teardown


def _run() -> Run:
    return Run(
        cfg=None,
        global_state=None,
        rank=0,
        attempt="attempt_local_0_0_0",
        inprocess_iteration=0,
        job_id="local",
        start_time=0.0,
        process_start=0.0,
        attempt_start=0.0,
    )


def _feature(name: str, calls: list, off: bool = False, fails_in: str = "") -> type[Component]:
    """A component class that records each hook it gets as ``"<name>.<hook>"``."""

    class Feature(Component):
        @classmethod
        def build(cls, run):
            calls.append(f"{name}.build")
            if fails_in == "build":
                raise RuntimeError(f"{name} cannot start")
            return None if off else cls()

        def setup(self, run):
            calls.append(f"{name}.setup")

        def ready(self, run):
            calls.append(f"{name}.ready")

        def on_train_step_start(self, context):
            calls.append(f"{name}.on_train_step_start")

        def wrap_forward_step(self, forward_step):
            return lambda *args: f"{name}({forward_step(*args)})"

        def wrap_train_step(self, train_step):
            return lambda *args: f"{name}[{train_step(*args)}]"

        def finish(self, run, code, reason):
            calls.append(f"{name}.finish:{code}")

        def fail(self, run, err):
            calls.append(f"{name}.fail")
            if fails_in == "fail":
                raise OSError("disk full")

        def close(self):
            calls.append(f"{name}.close")

    Feature.__name__ = Feature.__qualname__ = f"Feature_{name}"
    return Feature


def test_every_phase_runs_in_the_declared_order_and_teardown_in_reverse():
    calls: list[str] = []
    run = _run()
    features = Components()
    features.build([_feature("a", calls), _feature("off", calls, off=True), _feature("b", calls)], run)
    features.setup(run)
    features.ready(run)
    assert features.wrap_forward_step(lambda: "step")() == "b(a(step))"  # the first declared is innermost
    assert features.wrap_train_step(lambda: "train")() == "b[a[train]]"
    manager = CallbackManager.chain(features.items, None)
    manager.fire("on_train_step_start", None)
    features.finish(run, 0, "done")
    Teardown(features.close_steps)()
    assert calls == [
        "a.build",
        "off.build",  # off: built as nothing, never called again
        "b.build",
        "a.setup",
        "b.setup",
        "a.ready",
        "b.ready",
        "a.on_train_step_start",
        "b.on_train_step_start",
        "a.finish:0",
        "b.finish:0",
        "b.close",
        "a.close",
    ]


def test_a_failed_build_leaves_the_components_built_before_it_to_close():
    calls: list[str] = []
    features = Components()
    with pytest.raises(RuntimeError, match="b cannot start"):
        features.build([_feature("a", calls), _feature("b", calls, fails_in="build"), _feature("c", calls)], _run())
    Teardown(features.close_steps)()
    assert calls == ["a.build", "b.build", "a.close"]


def test_a_failing_fail_hook_is_logged_and_the_others_still_run(caplog):
    calls: list[str] = []
    features = Components()
    features.build([_feature("a", calls, fails_in="fail"), _feature("b", calls)], _run())
    with caplog.at_level(logging.WARNING):
        features.fail(_run(), ValueError("the error being raised"))
    assert calls[-2:] == ["a.fail", "b.fail"]
    assert "Feature_a: could not record the failure" in caplog.text


def test_pretrain_declares_each_feature_once_and_nothing_else_lists_them():
    assert len(set(pretrain.FEATURES)) == len(pretrain.FEATURES)
    assert all(issubclass(feature, Component) for feature in pretrain.FEATURES)
    # No feature class is named anywhere else in the package: the list is the one place that wires them.
    root = Path(inspect.getfile(pretrain)).parents[1]
    names = {feature.__name__ for feature in pretrain.FEATURES}
    elsewhere = []
    for path in root.rglob("*.py"):
        if path.name == "pretrain.py":
            continue
        tree = ast.parse(path.read_text())
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names
        }
        defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        elsewhere += [f"{path.relative_to(root)}: {name}" for name in sorted((used - defined) & names)]
    assert not elsewhere, "features wired outside pretrain.FEATURES:\n" + "\n".join(elsewhere)


def test_pretrain_reads_in_under_80_lines():
    source = inspect.getsource(pretrain._pretrain)
    assert len(source.splitlines()) < 80, len(source.splitlines())
