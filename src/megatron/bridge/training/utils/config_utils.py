"""A config as plain YAML values and back: ``ConfigContainer.to_yaml``/``from_yaml`` and the checkpoint's run config.

:func:`to_plain` writes each dataclass as a mapping whose ``_target_`` names its class (Megatron-Bridge's layout);
functions, classes and dtypes become ``{_target_: <dotted name>, _call_: false}``; a value YAML cannot hold (a live
object) its ``repr`` string. :func:`from_plain` builds the objects again: each ``_target_`` class from its init
fields (a value equal to the field's default is left out, so a class that refuses a field it has a default for
still builds), then the fields it computes (``validate()``'s results) set as they were; dotted names imported, lists
made tuples or sets and numbers made enums where the field's type says so.

Guards against: a config read back wrong without a word. A field that held a live object (a ``functools.partial``,
a module) comes back as its ``repr`` string; where the field's type does not take a string, reading it fails naming
the field, instead of handing a string to code expecting a function.
"""

import dataclasses
import enum
import importlib
import typing
from pathlib import PurePath
from typing import Any, Optional, Union

import torch
import yaml

from megatron.bridge.utils import fs

_SCALARS = (bool, int, float, str, type(None))


_PUBLIC_HOME = {"megatron.bridge.training.config_sections": "megatron.bridge.training.config"}
"""Packages whose classes are imported from elsewhere: ``config_sections`` holds sections of ``training.config``,
where Megatron-Bridge has them, so a run config names them there (Megatron-Bridge reads it back)."""


def _dotted_name(obj: Any) -> str:
    module = getattr(obj, "__module__", "") or ""
    package = module.rpartition(".")[0]
    module = _PUBLIC_HOME.get(package, module)
    return f"{module}.{getattr(obj, '__qualname__', getattr(obj, '__name__', repr(obj)))}"


def to_plain(obj: Any) -> Any:
    """``obj`` as YAML-safe values: dataclasses and mappings as dicts, sequences as lists, names for code and dtypes."""
    if isinstance(obj, enum.Enum):  # before the scalars: an IntEnum (a signal) is an int YAML cannot name
        return obj.name if isinstance(obj.value, enum.Enum) else to_plain(obj.value)
    if obj is None or type(obj) in _SCALARS:
        return obj
    if isinstance(obj, _SCALARS):  # a subclass of a scalar type: its plain value
        return next(kind(obj) for kind in _SCALARS if isinstance(obj, kind))
    if isinstance(obj, torch.dtype):
        return {"_target_": str(obj), "_call_": False}
    if isinstance(obj, PurePath):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        plain = {"_target_": _dotted_name(type(obj))}
        for f in dataclasses.fields(obj):
            plain[f.name] = to_plain(getattr(obj, f.name, None))
        return plain
    if isinstance(obj, dict):
        return {str(key): to_plain(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_plain(item) for item in obj]
    if isinstance(obj, type) or (callable(obj) and hasattr(obj, "__qualname__")):  # a named function or class
        return {"_target_": _dotted_name(obj), "_call_": False}
    return repr(obj)


def resolve(dotted: str) -> Any:
    """The object a dotted name names: the longest importable module prefix, then attributes (``torch.float32``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            break
        return obj
    raise ImportError(f"cannot import {dotted!r}: no module or attribute of that name is installed")


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation naming what is not importable here: no hints, values as read
        return {}


def _accepts(hint: Any, kind: type) -> bool:
    """Whether a field typed ``hint`` may hold a ``kind`` (``Any`` and unparseable hints may hold anything)."""
    if hint is Any or hint is None:
        return True
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        return any(_accepts(arg, kind) for arg in typing.get_args(hint))
    if origin is typing.Literal:
        return any(isinstance(arg, kind) for arg in typing.get_args(hint))
    target = origin or hint
    return not isinstance(target, type) or issubclass(kind, target) or issubclass(target, kind)


def _as_field(value: Any, hint: Any, where: str) -> Any:
    """A read value in the form the field's type asks for: a tuple, an enum; a ``repr`` string is an error."""
    if hint is None:
        return value
    options = (
        [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is typing.Union else [hint]
    )
    for option in options:
        if isinstance(option, type) and issubclass(option, enum.Enum) and not isinstance(value, option):
            try:
                return option[value] if isinstance(value, str) else option(value)
            except (KeyError, ValueError):
                continue
        if isinstance(value, list) and typing.get_origin(option) in (tuple, set, frozenset):
            return typing.get_origin(option)(value)
    if isinstance(value, str) and not _accepts(hint, str):
        raise ValueError(
            f"{where} holds {value!r}, the text of an object YAML cannot hold; set {where} in Python after loading"
        )
    return value


def from_plain(plain: Any, where: str = "config") -> Any:
    """The objects :func:`to_plain` wrote: ``_target_`` mappings built, dotted names imported (see the module doc).

    Raises:
        ImportError: a ``_target_`` that is not installed here.
        ValueError: a field whose value cannot be restored (named by its dotted path from ``where``).
    """
    if isinstance(plain, list):
        return [from_plain(item, f"{where}[{i}]") for i, item in enumerate(plain)]
    if not isinstance(plain, dict):
        return plain
    if "_target_" not in plain:
        return {key: from_plain(value, f"{where}.{key}") for key, value in plain.items()}
    try:
        target = resolve(plain["_target_"])
    except ImportError as err:
        raise ImportError(f"{where}: {err}") from err
    if plain.get("_call_", True) is False:
        return target
    if not (isinstance(target, type) and dataclasses.is_dataclass(target)):
        raise ValueError(f"{where}: _target_ {plain['_target_']!r} is not a dataclass; only config classes are built")
    hints = _hints(target)
    kwargs, computed = {}, {}
    for f in dataclasses.fields(target):
        if f.name not in plain:
            continue
        if not f.init:
            computed[f.name] = plain[f.name]
            continue
        value = _as_field(from_plain(plain[f.name], f"{where}.{f.name}"), hints.get(f.name), f"{where}.{f.name}")
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        if default is not dataclasses.MISSING and _same(value, default):
            continue
        kwargs[f.name] = value
    obj = target(**kwargs)
    for name, value in computed.items():  # what validate() or the class computed: as it was, where it can be read
        try:
            setattr(obj, name, _as_field(from_plain(value, f"{where}.{name}"), hints.get(name), f"{where}.{name}"))
        except (ValueError, ImportError, AttributeError):
            pass  # a live object's text, or a read-only attribute: the class computes it again
    return obj


def yaml_text(plain: dict[str, Any]) -> str:
    """``plain`` as YAML text (keys in their order, block style): what :func:`write_yaml` writes."""
    return yaml.safe_dump(plain, sort_keys=False, default_flow_style=False)


def write_yaml(plain: Union[dict[str, Any], str], path: Optional[str] = None) -> None:
    """Write ``plain`` as YAML to ``path`` atomically (a reader never sees half a file), or print it when ``None``.

    ``plain`` may also be its :func:`yaml_text`, rendered before.
    """
    text = plain if isinstance(plain, str) else yaml_text(plain)
    if path is None:
        print(text, end="")
    else:
        fs.atomic_write(path, text, durable=False)


def read_yaml(path: str) -> dict[str, Any]:
    """The mapping a YAML file holds.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file does not hold a mapping.
    """
    with open(path) as f:
        plain = yaml.safe_load(f)
    if not isinstance(plain, dict):
        raise ValueError(f"{path} holds a {type(plain).__name__}, not a config mapping")
    return plain


def _same(value: Any, default: Any) -> bool:
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # a comparison that is not a bool (tensors): treat as different
        return False


__all__ = ["from_plain", "read_yaml", "resolve", "to_plain", "write_yaml"]
