"""Dataclass field introspection shared by the config checks and the dotted-override parser.

- :func:`hints`, :func:`union_args`, :func:`describe`: a field's type, read once, described for an error message.
- :func:`nearest`: the valid name a typo was probably meant to be.
- :func:`named_fields`: a class decorator whose ``__init__`` names the nearest field for an unknown keyword.
- :func:`field_problems`: values of the wrong type, and attributes set on a config that are not fields of it.
- :func:`fail`: the one error every config and data check raises, naming the field (or file) and the fix.
- :func:`is_enabled`: whether an optional config section is on (present, and its own switch field true).
"""

import dataclasses
import difflib
import enum
import functools
import types
import typing
from collections.abc import Iterator
from typing import Any, Final, Literal, Optional, TypeVar, Union

C = TypeVar("C", bound=type)


def hints(cls: type) -> dict[str, Any]:
    """The field types of ``cls``; a field whose annotation cannot be resolved counts as ``Any``."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - annotations naming names only a type checker imports
        return {f.name: (f.type if not isinstance(f.type, str) else Any) for f in dataclasses.fields(cls)}


def union_args(hint: Any) -> tuple:
    """The members of a ``Union``/``Optional``/``X | Y`` hint, else ``(hint,)``."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def describe(hint: Any) -> str:
    """A short human name of a type hint: ``int or None``, ``one of 'a', 'b'``, ``list``."""
    if hint is type(None):
        return "None"
    options = union_args(hint)
    if len(options) > 1:
        return " or ".join(describe(o) for o in options)
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(hint))
    origin = typing.get_origin(hint)
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def nearest(name: str, names: list[str]) -> Optional[str]:
    """The name in ``names`` that ``name`` most likely misspells, if any is close."""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return close[0] if close else None


def init_field_names(cls_or_obj: Any) -> list[str]:
    """Public fields that a constructor takes (``_private`` and ``init=False`` ones left out)."""
    return [f.name for f in dataclasses.fields(cls_or_obj) if f.init and not f.name.startswith("_")]


def named_fields(cls: C) -> C:
    """Make ``cls(**kwargs)`` name the nearest valid field when a keyword is not one (``TypeError``, as before)."""
    init = cls.__init__

    @functools.wraps(init)
    def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        names = init_field_names(cls)
        for key in kwargs:
            if key not in names:
                guess = nearest(key, names)
                hint = f"; did you mean {guess!r}?" if guess else f"; its fields: {', '.join(names)}"
                raise TypeError(f"{cls.__name__} has no field {key!r}{hint}")
        init(self, *args, **kwargs)

    cls.__init__ = checked_init  # type: ignore[method-assign]
    return cls


def matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits the type ``hint`` (containers by their outer type; unknown hints accept anything)."""
    if hint is Any or isinstance(hint, (str, TypeVar)):
        return True
    options = union_args(hint)
    if len(options) > 1:
        return any(matches(value, option) for option in options)
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (list, tuple):  # a blend written as a list where the hint says tuple is fine
        return isinstance(value, (list, tuple))
    if origin is not None:
        return not isinstance(origin, type) or isinstance(value, origin)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def field_problems(section: Any, prefix: str) -> Iterator[str]:
    """Problems of one dataclass config, each naming the dotted field.

    A value of the wrong type, or an attribute set on it that is not a field (a misspelt assignment such as
    ``cfg.train.trian_iters = 5``).
    """
    names = [f.name for f in dataclasses.fields(section)]
    for attr in vars(section):
        if attr not in names and not attr.startswith("_"):
            guess = nearest(attr, init_field_names(section))
            hint = f"did you mean {prefix}.{guess}?" if guess else "remove it"
            yield f"{prefix}.{attr}: is not a field of {type(section).__name__}. Fix: {hint}"
    field_types = hints(type(section))
    for f in dataclasses.fields(section):
        if f.name.startswith("_") or not f.init:
            continue
        value = getattr(section, f.name)
        hint = field_types.get(f.name, Any)
        if not matches(value, hint):
            yield (
                f"{prefix}.{f.name}: expects {describe(hint)}, got {value!r} ({type(value).__name__}). "
                f"Fix: give a value of that type"
            )


class ConfigError(ValueError, AssertionError):
    """A config or data check failed.

    A ``ValueError``; also an ``AssertionError`` because Megatron-Bridge's own checks of the same conditions are
    assertions, so callers written for either catch it.
    """


def fail(subject: str, problem: str, fix: str) -> typing.NoReturn:
    """Raise ``ConfigError("<subject>: <problem>. Fix: <fix>.")``; ``subject`` is a dotted field or a file."""
    raise ConfigError(f"{subject}: {problem}. Fix: {fix}.")


SWITCH: Final = "SWITCH"
"""The class attribute (a ``ClassVar[str]``) by which a section names its own on/off field, e.g.
``FaultToleranceConfig.SWITCH == "enable_ft_package"``; a section without one has no switch."""


def is_enabled(section: Any) -> bool:
    """Whether an optional config section is on: the one way to ask it (``is_enabled(cfg.ft)``).

    As in Megatron-Bridge, a section is off when it is ``None`` and, for a section with its own switch field
    (``ft.enable_ft_package``, ``nvrx_straggler.enabled``, ``inprocess_restart.enabled``, ``straggler.log_straggler``:
    the field its class names in :data:`SWITCH`), when that field is false. A present section without a switch
    (``profiling``) is on.
    """
    if section is None:
        return False
    switch = getattr(section.__class__, SWITCH, None)  # ``__class__``: a mock made with ``spec=`` answers its spec
    return switch is None or bool(getattr(section, switch))
