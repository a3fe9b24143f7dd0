"""Dotted command-line overrides (``train.train_iters=100 ft.enable_ft_package=True``) applied to a config.

The form Megatron-Bridge users type: ``section.field=value`` (``+section.field=value`` is the same here, every field
exists), ``~section`` sets an optional section or field to ``None``. A value is a Python literal (``True``, ``3e-4``,
``None``, ``[1, 2]``), a YAML-style word (``true``, ``null``) or else text. Every value is checked against the type
of its field; an optional section that is ``None`` (``ft``, ``nvrx_straggler``, ...) is created with its defaults
when one of its fields is set.

Nothing is applied when an item is wrong: the ``ValueError`` names the item, the field, and the fix (the nearest
valid name for a typo, the expected type for a bad value).
"""

import ast
import copy
import dataclasses
import enum
import typing
from typing import Any, Literal, TypeVar

from megatron.bridge.utils.fields import describe, hints, init_field_names, nearest, union_args

T = TypeVar("T")

_TRUE, _FALSE, _NONE = {"true", "yes", "on"}, {"false", "no", "off"}, {"null", "none", "~"}
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
_DTYPES.update({"float16": "float16", "fp16": "float16", "half": "float16", "float": "float32"})


class _Refused(ValueError):
    """A value that does not fit its field; the message says what was expected."""


def apply_overrides(cfg: T, overrides: list[str]) -> T:
    """Return a copy of the dataclass config ``cfg`` with dotted ``key=value`` overrides applied.

    Args:
        cfg: a dataclass config such as ``ConfigContainer``.
        overrides: items like ``"checkpoint.save=/ckpt"``; ``null``/``None`` sets ``None``.

    Raises:
        ValueError: an item is not ``key=value``, names an unknown field, or has a value of the wrong type.
    """
    result = copy.deepcopy(cfg)
    for item in overrides:
        _apply(result, item)
    return result


def _apply(root: Any, item: str) -> None:
    text = item.strip()
    if text.startswith("~"):
        key, raw, reset = text[1:], None, True
    else:
        key, sep, raw = text.lstrip("+").partition("=")
        reset = False
        if not sep:
            raise ValueError(f"override {item!r}: expected key=value, e.g. train.train_iters=100")
    names = key.strip().split(".")
    if not all(names):
        raise ValueError(f"override {item!r}: expected key=value, e.g. train.train_iters=100")
    obj = root
    for depth, name in enumerate(names):
        hint = _field_hint(obj, name, names[:depth], item)
        dotted = ".".join(names[: depth + 1])
        if depth == len(names) - 1:
            value = _reset(hint, dotted, item) if reset else _value(raw, hint, dotted, item)
            setattr(obj, name, value)
            return
        child = getattr(obj, name)
        if child is None:
            child = _new_section(hint, dotted, item)
            setattr(obj, name, child)
        if not dataclasses.is_dataclass(child):
            raise ValueError(f"override {item!r}: {dotted} is a value, not a section; set it as {dotted}=<value>")
        obj = child


def _field_hint(obj: Any, name: str, prefix: list[str], item: str) -> Any:
    names = init_field_names(obj)
    if name not in names:
        where = ".".join(prefix) or type(obj).__name__
        close = nearest(name, names)
        hint = f"; did you mean {'.'.join([*prefix, close])}?" if close else f"; its fields: {', '.join(names)}"
        raise ValueError(f"override {item!r}: {where} has no field {name!r}{hint}")
    return hints(type(obj)).get(name, Any)


def _new_section(hint: Any, dotted: str, item: str) -> Any:
    """A section with its defaults, for an optional section that was ``None``."""
    section = next((t for t in union_args(hint) if dataclasses.is_dataclass(t)), None)
    if section is None:
        raise ValueError(f"override {item!r}: {dotted} is a value, not a section; set it as {dotted}=<value>")
    try:
        return section()
    except TypeError as err:
        raise ValueError(f"override {item!r}: {dotted} is None and has no defaults to start from ({err})") from None


def _reset(hint: Any, dotted: str, item: str) -> None:
    if type(None) not in union_args(hint) and hint is not Any:
        raise ValueError(f"override {item!r}: {dotted} cannot be None (it is {describe(hint)})")
    return None


def _parse(raw: str) -> Any:
    """A Python literal, a YAML-style word, or the text itself."""
    text = raw.strip()
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pass
    lowered = text.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    if lowered in _NONE:
        return None
    return text


def _value(raw: str, hint: Any, dotted: str, item: str) -> Any:
    try:
        return _convert(raw, _parse(raw), hint)
    except _Refused as err:
        raise ValueError(f"override {item!r}: {dotted} expects {err}, got {raw.strip()!r}") from None


def _convert(raw: str, parsed: Any, hint: Any) -> Any:
    """``parsed`` as a value of ``hint``; raises :class:`_Refused` with what was expected."""
    if hint is Any or isinstance(hint, (str, typing.TypeVar)):
        return parsed
    options = union_args(hint)
    if len(options) > 1:
        if parsed is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(raw, parsed, option)
            except _Refused:
                continue
        raise _Refused(describe(hint))
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        for candidate in (parsed, raw.strip()):
            if candidate in choices:
                return candidate
        raise _Refused(f"one of {', '.join(repr(c) for c in choices)}")
    if origin in (list, tuple, set, dict) or hint in (list, tuple, set, dict):
        kind = origin or hint
        if isinstance(parsed, (list, tuple, set)) and kind is not dict:
            return kind(parsed)
        if isinstance(parsed, dict) and kind is dict:
            return parsed
        raise _Refused(f"a {kind.__name__} literal, e.g. {'[1, 2]' if kind is not dict else '{a: 1}'}")
    if hint is type(None):
        if parsed is None:
            return None
        raise _Refused("None")
    if hint is bool:
        if isinstance(parsed, bool):
            return parsed
        raise _Refused("True or False")
    if hint is int:
        if isinstance(parsed, int) and not isinstance(parsed, bool):
            return parsed
        raise _Refused("an integer")
    if hint is float:
        if isinstance(parsed, (int, float)) and not isinstance(parsed, bool):
            return float(parsed)
        raise _Refused("a number")
    if hint is str:
        return raw.strip() if not isinstance(parsed, str) else parsed
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum(hint, raw.strip(), parsed)
    if _is_dtype(hint):
        return _dtype(raw.strip())
    if dataclasses.is_dataclass(hint):
        raise _Refused(f"its fields to be set one by one (e.g. <section>.{dataclasses.fields(hint)[0].name}=...)")
    raise _Refused(f"{describe(hint)}, which cannot be given on the command line: set it in Python")


def _enum(cls: type, text: str, parsed: Any) -> Any:
    names = {member.name.lower(): member for member in cls}
    if text.lower() in names:
        return names[text.lower()]
    try:
        return cls(parsed)
    except (ValueError, TypeError):
        raise _Refused(f"one of {', '.join(m.name for m in cls)}") from None


def _is_dtype(hint: Any) -> bool:
    return getattr(hint, "__module__", "") == "torch" and getattr(hint, "__name__", "") == "dtype"


def _dtype(text: str) -> Any:
    import torch

    name = _DTYPES.get(text.lower().removeprefix("torch."))
    if name is None:
        raise _Refused(f"a dtype ({', '.join(sorted(set(_DTYPES)))})")
    return getattr(torch, name)
