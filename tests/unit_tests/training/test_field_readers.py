"""A field the reference page calls honoured is read by some code.

``docs/training/config-reference.md`` marks a field "honoured" unless ``field_support`` lists it as refused or inert.
A field nothing reads would be honoured only on paper (``nvrx_straggler.logger_name`` was, until its reports went to
the logger it names), so this looks for a reader of each one:

- a field our own dataclasses declare must be read somewhere in ``src/megatron/bridge``: an attribute load
  ``x.<name>`` or the string ``"<name>"`` (``getattr``); validation counts, since it derives values from fields;
- a field a megatron-core class declares (the dataset configs) goes to megatron-core as it is, so megatron-core's
  package that declares it (``megatron.core.datasets``) must read it, or our code must (validation refusing values).

Names are matched, not types: the check cannot prove a field is used well, only catch one whose name nothing reads
(a name shared with another object's attribute, such as ``context_parallel_size``, hides a missing reader).
"""

import ast
import dataclasses
import functools
import importlib
import re
from pathlib import Path

import pytest

from megatron.bridge.training.utils import config_reference

SRC = Path(__file__).resolve().parents[3] / "src" / "megatron" / "bridge"
REFERENCE = Path(__file__).resolve().parents[3] / "docs" / "training" / "config-reference.md"
_ROW = re.compile(r"^\| `(\w+)` \|.*\| honoured \|")
_SECTION = re.compile(r"^## `(\w+)`")


def _documented_honoured() -> list[tuple[str, str]]:
    """``(section, field)`` for every row of the reference page whose status is "honoured"."""
    rows, section = [], None
    for line in REFERENCE.read_text().splitlines():
        if m := _SECTION.match(line):
            section = m.group(1)
        elif (m := _ROW.match(line)) and section is not None:
            rows.append((section, m.group(1)))
    return rows


@functools.cache
def _names_read(package_dir: Path) -> frozenset[str]:
    """Attribute names loaded, and string constants, anywhere in the Python files under ``package_dir``."""
    found: set[str] = set()
    for path in package_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                found.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return frozenset(found)


def _declared_by(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO whose own annotations declare field ``name``."""
    return next(k for k in cls.__mro__ if name in vars(k).get("__annotations__", {}))


def _package_dir(module: str) -> Path:
    """The directory of the package that holds ``module`` (``megatron.core.datasets.gpt_dataset`` -> datasets/)."""
    return Path(importlib.import_module(module.rpartition(".")[0]).__file__).parent


HONOURED = _documented_honoured()


def test_the_page_lists_honoured_fields_of_every_own_section():
    sections = {section for section, _ in HONOURED}
    assert len(HONOURED) > 100 and {"checkpoint", "ft", "nvrx_straggler", "inprocess_restart", "dataset"} <= sections


@pytest.mark.parametrize("section, name", HONOURED, ids=[f"{s}.{n}" for s, n in HONOURED])
def test_a_field_documented_as_honoured_is_read_by_some_code(section, name):
    cls = config_reference.section_class(section)
    assert name in {f.name for f in dataclasses.fields(cls)}, f"{section}.{name} is not a field of {cls.__name__}"
    owner = _declared_by(cls, name)
    readers = [SRC] if owner.__module__.startswith("megatron.bridge") else [_package_dir(owner.__module__), SRC]
    assert any(name in _names_read(where) for where in readers), (
        f"{section}.{name} is documented as honoured, but no code reads it (searched {owner.__module__}'s package "
        "and ours): honour it, or list it in field_support.REFUSED or INERT with the reason, then regenerate the page "
        "(python -m megatron.bridge.training.utils.config_reference)"
    )


def test_the_reader_search_finds_a_missing_reader(tmp_path):
    """The search itself can fail: a package that only declares a field does not read it."""
    (tmp_path / "decl.py").write_text("class C:\n    logger_name: str = 'x'\n    '''Doc.'''\n")
    (tmp_path / "use.py").write_text("def f(c):\n    c.other = 1\n    return c.enabled\n")
    names = _names_read(tmp_path)
    assert "logger_name" not in names and "other" not in names and "enabled" in names
