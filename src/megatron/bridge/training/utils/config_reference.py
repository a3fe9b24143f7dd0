"""The field reference: every field of every ``ConfigContainer`` section, its type, default and status, as markdown.

``python -m megatron.bridge.training.utils.config_reference [PATH]`` rewrites the generated part of
``docs/training/config-reference.md`` (between the two markers); a unit test checks that the committed page is what
this renders, so the page cannot drift from the code. A field's status comes from ``config_checks/field_support.py``:
honoured,
refused unless left at its default, or accepted without effect (it configures only a refused feature).
"""

import ast
import dataclasses
import inspect
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, Optional

from megatron.bridge.training.config_checks import field_support
from megatron.bridge.utils.fields import describe, hints, union_args

BEGIN = "<!-- BEGIN GENERATED: python -m megatron.bridge.training.utils.config_reference -->"
END = "<!-- END GENERATED -->"

MEGATRON_CORE_SECTIONS = {
    "model": (
        "megatron-core's `TransformerConfig` (as `GPTModelProvider`)",
        "megatron-core's own checks run at `validate()`, and layouts that cannot work: `num_layers` not divisible by "
        "the pipeline (and virtual pipeline) stages, heads or `num_query_groups` not divisible by "
        "`tensor_model_parallel_size`. Refused: `fp16`, and bfloat16 (`bf16`, `params_dtype`) on CPU "
        "(`dist.device=cpu` at `validate()`; `auto` on a node without a GPU, at start: exit 2).",
    ),
    "optimizer": (
        "megatron-core's `OptimizerConfig`",
        "megatron-core's own checks run at `validate()`. `use_distributed_optimizer` and `overlap_param_gather` "
        "set here or in `ddp` are turned on in both, with a warning (as in Megatron-Bridge). Refused: `optimizer` "
        "other than adam/sgd, and a precision that differs from the model's.",
    ),
    "ddp": (
        "megatron-core's `DistributedDataParallelConfig`",
        "Passed to megatron-core's DDP as it is (`use_distributed_optimizer` and `overlap_param_gather` are turned on "
        "in both this and the optimizer when either asks for them).",
    ),
}
"""Sections that are megatron-core classes: every field goes to megatron-core; only the listed values are refused."""


def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated field of ``cls`` and its bases (the nearest class wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, after in zip(body, body[1:]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    docs[stmt.target.id] = str(after.value.value)
    return docs


def _first_sentence(text: str) -> str:
    flat = " ".join(text.split())
    end = flat.find(". ")
    return flat if end < 0 else flat[: end + 1]


def _default(f: dataclasses.Field) -> str:
    """A field's default as the page shows it, read from the field alone (no field is special-cased).

    A default computed when the section is built by a named function (one read from the environment, say) is shown
    by that function's docstring, not by the value it gives on the machine that renders the page.
    """
    factory = f.default_factory
    if isinstance(factory, types.FunctionType) and factory.__name__ != "<lambda>" and factory.__doc__:
        return factory.__doc__.strip().splitlines()[0].rstrip(".").replace("``", "`")
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif factory is not dataclasses.MISSING:
        value = factory()
        if dataclasses.is_dataclass(value):
            return f"`{type(value).__name__}()`"
        if type(value).__module__.startswith("megatron.core"):
            return f"`{type(value).__name__}()`"
    else:
        return "required"
    text = value.name if hasattr(value, "name") and type(value).__module__ == "signal" else repr(value)
    return f"`{text}`"


def _status(dotted: str, f: dataclasses.Field) -> str:
    if dotted in field_support.REFUSED:
        return f"refused unless {_default(f)}: {field_support.REFUSED[dotted]}"
    if dotted in field_support.INERT:
        return f"accepted, no effect: {field_support.INERT[dotted]}"
    return "honoured"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table(name: str, cls: type, note: Optional[str] = None) -> list[str]:
    docs, types = _attribute_docs(cls), hints(cls)
    lines = [f"## `{name}`: `{cls.__name__}`", ""]
    if note:
        lines += [note, ""]
    lines += ["| field | type | default | status | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        dotted = f"{name}.{f.name}"
        lines.append(
            "| "
            + " | ".join(
                _cell(cell)
                for cell in (
                    f"`{f.name}`",
                    describe(types.get(f.name, Any)),
                    _default(f),
                    _status(dotted, f),
                    _first_sentence(docs.get(f.name, "")),
                )
            )
            + " |"
        )
    return [*lines, ""]


def render(container: Optional[type] = None) -> str:
    """The generated part of the reference page (without the markers).

    Everything in it comes from the classes: each section's fields, their types and defaults from the dataclass, the
    meaning from the docstring under each field, the status from ``field_support``; a field added to a section
    appears with no table to extend.

    Args:
        container: the container class whose sections are listed; ``None``: ``ConfigContainer``.
    """
    from megatron.bridge.data.config import MockGPTDatasetConfig

    container = container or _config_container()
    lines: list[str] = [f"{RELEASE_LINE}{megatron_core_release()}.", ""]
    top_docs = _attribute_docs(container)
    for f in dataclasses.fields(container):
        if not f.init:  # filled in by validate(), not a setting
            continue
        if f.name == "env_vars":  # a top-level setting, not a section
            lines += [f"## `{f.name}`", "", f"Default `{{}}`, honoured: {' '.join(top_docs[f.name].split())}", ""]
        elif f.name in MEGATRON_CORE_SECTIONS:
            what, note = MEGATRON_CORE_SECTIONS[f.name]
            lines += [f"## `{f.name}`: {what}", "", note, ""]
        elif f.name == "dataset":
            note = (
                "`MockGPTDatasetConfig` (shown) and `GPTDatasetConfig` are megatron-core's `GPTDatasetConfig` with "
                "the data-loader fields of `DataloaderConfig`; `seq_length` is accepted for `sequence_length`. "
                "With data files (`blend`, or `blend_per_split`), megatron-core's `GPTDataset` over indexed "
                "`.bin`/`.idx` files (checked at `validate()`); without, the mock token stream."
            )
            lines += _table(f.name, MockGPTDatasetConfig, note)
        elif f.name in field_support.REFUSED:
            lines += [f"## `{f.name}`", "", f"Refused unless `None`: {field_support.REFUSED[f.name]}.", ""]
        else:
            section = section_class(f.name, container)
            off = "`None` (the default) is off." if f.default is None else "`None` is off."
            lines += _table(f.name, section, off if section is not f.type else None)
    return "\n".join(lines).rstrip() + "\n"


def _config_container() -> type:
    from megatron.bridge.training.config import ConfigContainer

    return ConfigContainer


def section_class(name: str, container: Optional[type] = None) -> type:
    """The dataclass whose fields the page lists for section ``name`` (``dataset``: ``MockGPTDatasetConfig``)."""
    from megatron.bridge.data.config import MockGPTDatasetConfig

    if name == "dataset":
        return MockGPTDatasetConfig
    f = next(f for f in dataclasses.fields(container or _config_container()) if f.name == name)
    return f.type if isinstance(f.type, type) else _optional_section(f)


def _optional_section(f: dataclasses.Field) -> type:
    """The dataclass inside an ``Optional[...]`` section annotation."""
    return next(t for t in union_args(f.type) if dataclasses.is_dataclass(t))


def rewrite(path: Path) -> bool:
    """Replace the generated part of ``path``; return whether it changed."""
    text = path.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    new = f"{head}{BEGIN}\n\n{render()}\n{END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text


RELEASE_LINE = "Generated from the config classes of megatron-core "
"""How the generated part begins: the megatron-core release whose fields and docstrings it shows."""


def megatron_core_release() -> str:
    """The installed megatron-core release."""
    from importlib.metadata import version

    return version("megatron-core")


def documented_release(path: Path) -> str:
    """The megatron-core release the page at ``path`` was generated from (``"unknown"`` if it does not say)."""
    first = generated_part(path).lstrip("\n").splitlines()[0]
    return first[len(RELEASE_LINE) :].rstrip(".") if first.startswith(RELEASE_LINE) else "unknown"


def generated_part(path: Path) -> str:
    """What stands between the markers of ``path`` now."""
    _, _, rest = path.read_text().partition(BEGIN)
    return rest.partition(END)[0].strip("\n") + "\n"


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/training/config-reference.md")
    print(f"{target}: {'rewritten' if rewrite(target) else 'up to date'}")
