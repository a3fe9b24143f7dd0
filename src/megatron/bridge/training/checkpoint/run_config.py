"""The run's configuration as plain YAML (``run_config.yaml``), saved into every global checkpoint.

Megatron-Bridge's tools and loaders read a checkpoint's settings from ``iter_*/run_config.yaml`` (``read_run_config``
in ``training/utils/checkpoint_utils.py``): e.g. whether the optimizer state was saved, the parallel layout, the model
shape. The file holds each section of the ``ConfigContainer`` as a mapping with a ``_target_`` naming its class, as
Megatron-Bridge writes it; functions, classes and dtypes become ``{_target_: <dotted name>, _call_: false}``, and a
value YAML cannot hold (a live object) its ``repr`` string. It is read, never executed: loading a checkpoint here never
instantiates anything from it.
"""

import dataclasses
import enum
from pathlib import PurePath
from typing import Any

import torch
import yaml

from megatron.bridge.utils import fs

_SCALARS = (bool, int, float, str, type(None))


def _dotted_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '') or ''}.{getattr(obj, '__qualname__', getattr(obj, '__name__', repr(obj)))}"


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
    if isinstance(obj, type) or callable(obj):
        return {"_target_": _dotted_name(obj), "_call_": False}
    return repr(obj)


def write_run_config(path: str, plain: dict[str, Any]) -> None:
    """Write ``plain`` (a :func:`to_plain` result) to ``path`` as YAML, atomically (flushed by the commit)."""
    text = yaml.safe_dump(plain, sort_keys=False, default_flow_style=False)
    fs.atomic_write(path, text, durable=False)
