"""The compatibility module: every private upstream name we use resolves, and is reached only through it."""

import ast
import logging
import re
from pathlib import Path

import pytest

from megatron.bridge.utils import upstream

SRC = Path(upstream.__file__).resolve().parents[1]  # src/megatron/bridge

# Private-looking names that are not upstream internals: namedtuple API, os, and our own marker attributes.
NOT_UPSTREAM = {
    "_replace",
    "_asdict",
    "_exit",
    "_run_exitfuncs",
    "_cpu_shim",
    "_cpu_shimmed",
    "_format_gpu_scores",  # our straggler manager's (Megatron-Bridge's name for it)
    "_train_iters_from_num_epochs",  # our TrainingConfig's (Megatron-Bridge's name for it)
    # Megatron-Bridge's private checkpoint functions, ours at its paths (``training/checkpointing.py`` and the
    # state-dict builders it re-exports); the checkpoint manager is given that module and calls them through it:
    "_load_base_checkpoint",
    "_load_model_state_dict",
    "_build_sharded_state_dict_metadata",
    "_get_train_state_from_state_dict",
}
"""The standard library's (stable across Python 3 releases, documented or used as such) and our own."""


def test_every_listed_symbol_resolves_in_the_installed_releases():
    problems = upstream.problems()
    assert not problems, "private upstream names missing after an upgrade:\n" + "\n".join(problems)


def test_a_removed_symbol_is_reported_with_its_name_use_and_both_releases(monkeypatch):
    from megatron.core import rerun_state_machine

    monkeypatch.delattr(rerun_state_machine, "_set_rerun_state_machine")
    problems = upstream.problems()
    assert len(problems) == 1, problems
    assert problems[0].startswith("megatron.core.rerun_state_machine:_set_rerun_state_machine (call; ")
    checked = ", ".join(upstream.CHECKED_AGAINST["megatron-core"])
    installed = upstream.installed_version("megatron-core")
    assert f"Checked against megatron-core {checked}, installed {installed}" in problems[0]
    with pytest.raises(upstream.UpstreamChanged, match="_set_rerun_state_machine"):
        upstream.set_rerun_state_machine(None)


def test_a_state_attribute_upstream_stops_setting_is_reported(monkeypatch):
    from megatron.core.rerun_state_machine import RerunStateMachine

    real = upstream._sets_on_instances
    monkeypatch.setattr(upstream, "_sets_on_instances", lambda cls, name: name != "suspicious_node" and real(cls, name))
    problems = upstream.problems()
    assert [p.split(" ")[0] for p in problems] == [f"{RerunStateMachine.__module__}:RerunStateMachine.suspicious_node"]


def test_a_moved_module_is_found_in_its_newer_layout(monkeypatch):
    symbol = next(s for s in upstream.SYMBOLS if s.key.endswith(":CuptiManager"))
    assert symbol.newer_modules == ("nvidia_resiliency_ext.attribution.straggler.straggler",)
    import importlib

    real_import = importlib.import_module
    seen = []

    def recording_import(name, *args):
        seen.append(name)
        return real_import(name, *args)

    monkeypatch.setattr(upstream.importlib, "import_module", recording_import)
    assert upstream.get(symbol.key) is not None
    assert seen[0] == "nvidia_resiliency_ext.attribution.straggler.straggler"  # newest layout first


def test_unlisted_names_are_refused_and_only_patch_symbols_are_patched():
    with pytest.raises(KeyError, match="not listed"):
        upstream.get("megatron.core.parallel_state:_GLOBAL_MEMORY_BUFFER")
    with pytest.raises(AssertionError, match="not patched"):
        upstream.patch("torch.distributed.distributed_c10d:_abort_process_group", None)


def test_a_subclass_base_missing_an_override_target_warns_naming_it(monkeypatch, caplog):
    from megatron.core.rerun_state_machine import RerunStateMachine

    monkeypatch.setattr(upstream, "_warned", set())
    monkeypatch.delattr(RerunStateMachine, "_maybe_report_stats")
    with caplog.at_level(logging.WARNING, logger=upstream.__name__):
        assert upstream.base_class("megatron.core.rerun_state_machine:RerunStateMachine") is RerunStateMachine
    assert "RerunStateMachine._maybe_report_stats (override;" in caplog.text


def _private_uses(path: Path) -> list[str]:
    """``file:line expression`` of every private name of another object or module used in ``path``."""
    overrides = {s.attr.rsplit(".", 1)[-1] for s in upstream.SYMBOLS if s.use == "override"}
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("megatron.bridge"):
            found += [f"{path}:{node.lineno} import {a.name}" for a in node.names if a.name.startswith("_")]
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in NOT_UPSTREAM:
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            continue  # our own attributes (and, in a subclass of an upstream class, listed overrides)
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super" and name in overrides:
            continue
        found.append(f"{path.relative_to(SRC)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_private_upstream_names_are_reached_only_through_the_compat_module():
    found = [use for path in sorted(SRC.rglob("*.py")) if path.name != "upstream.py" for use in _private_uses(path)]
    assert not found, (
        "private names of another module used outside utils/upstream.py (list them in upstream.SYMBOLS and reach "
        "them through upstream.get/patch/bound):\n" + "\n".join(found)
    )


def test_tests_and_benchmarks_reach_the_listed_private_names_only_through_the_compat_module():
    # Private names of upstream's that we read, call or patch (an "override" is our own method: tests may call it).
    listed = {
        name
        for symbol in upstream.SYMBOLS
        if symbol.use != "override" and (name := symbol.attr.split(".")[-1]).startswith("_")
    }
    pattern = re.compile(r"\.(" + "|".join(sorted(map(re.escape, listed))) + r")\b")
    repo = SRC.parents[2]
    found = [
        f"{path.relative_to(repo)}:{number} {line.strip()}"
        for root in (repo / "tests", repo / "benchmarks")
        for path in sorted(root.rglob("*.py"))
        if path.name != "test_upstream.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith("#")
    ]
    assert not found, "use upstream.get/patch/bound (or its public helpers) for:\n" + "\n".join(found)


def test_a_symbol_of_some_releases_only_is_checked_and_picked_only_there(monkeypatch):
    old, new = upstream._BY_KEY[upstream.PICK_PORT_SOCKET], upstream._BY_KEY[upstream.PICK_PORT_NUMBER]
    assert old.checked == ("0.4.1",) and new.checked == upstream.CHECKED_AGAINST["torch"]
    versions = {"nvidia-resiliency-ext": "0.4.1"}
    monkeypatch.setattr(upstream, "installed_version", lambda package: versions.get(package))
    assert old.applies() and not new.applies()
    assert upstream.applicable((old.key, new.key)) == old.key
    versions["nvidia-resiliency-ext"] = "0.7.0"
    assert upstream.applicable((old.key, new.key)) == new.key
    assert upstream.applicable(upstream.STANDBY_PATCHES["ft_launcher"]) == upstream.STANDBY_PATCHES["torch"][0]
    versions.clear()  # not installed: neither holds
    assert upstream.applicable((old.key, new.key)) is None


def test_every_conditional_symbol_holds_in_some_checked_release():
    for symbol in upstream.SYMBOLS:
        assert symbol.checked, f"{symbol.key}: its condition {symbol.when!r} admits no checked release"
