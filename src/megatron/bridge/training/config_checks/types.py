"""The objects the config checks are given, named for readers; each is ``Any`` to the type checker.

``config.py`` and ``config_sections/`` import the checks (``ConfigContainer.validate()`` and each section's
``finalize()`` call them), so the checks import nothing from either, not even under ``TYPE_CHECKING``: the layers
are ``utils.fields`` < ``config_checks`` < ``config_sections`` < ``config``, and a check reads the fields of what it
is given by name. These aliases say which object a parameter is.
"""

from typing import Any, TypeAlias

Container: TypeAlias = Any
"""A ``megatron.bridge.training.config.ConfigContainer``."""

ModelConfig: TypeAlias = Any
"""A ``megatron.bridge.models.gpt_provider.GPTModelProvider`` (megatron-core's ``TransformerConfig``)."""

Section: TypeAlias = Any
"""One section of a ``ConfigContainer`` (``CheckpointConfig``, ``FaultToleranceConfig``, ...), named where used."""
