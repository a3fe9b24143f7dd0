"""Dotted command-line overrides (``train.train_iters=100 ft.enable_ft_package=true``) applied to a config.

The syntax is OmegaConf's dotlist, as Megatron-Bridge users know it. Unknown keys and values of the wrong type
are rejected with a ``ValueError`` that names the override.
"""

from typing import TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")


def apply_overrides(cfg: T, overrides: list[str]) -> T:
    """Return a copy of the dataclass config ``cfg`` with dotted ``key=value`` overrides applied.

    Args:
        cfg: a dataclass config such as ``ConfigContainer``.
        overrides: items like ``"checkpoint.save=/ckpt"``; ``null`` sets ``None``.

    Raises:
        ValueError: an item is not ``key=value``, names an unknown field, or has a value of the wrong type.
    """
    merged = OmegaConf.structured(cfg)
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r}: expected key=value, e.g. train.train_iters=100")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as err:
            reason = str(err).splitlines()[0]
            raise ValueError(f"override {item!r}: {reason}") from None
    return OmegaConf.to_object(merged)
