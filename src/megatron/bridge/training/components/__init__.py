"""A feature of a run as one object: built from the config, on the loop's events, wrapping, torn down.

See :mod:`.base`; ``training/pretrain.py`` declares the run's components in one ordered list.
"""

from megatron.bridge.training.components.base import Component, Components, Run

__all__ = ["Component", "Components", "Run"]
