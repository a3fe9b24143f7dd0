"""A recipe's environment defaults (``ConfigContainer.env_vars``), set before a run starts.

Some settings are environment variables read by libraries at import or first use (Transformer Engine, NCCL, the
PyTorch allocator). A recipe names them in ``env_vars``; :func:`apply_env_defaults` sets each one this process does
not already have, so a value the launcher or the job script exported wins over the recipe's. A name or value that
cannot be an environment variable stops the run before anything starts.
"""

import os
from collections.abc import Mapping
from typing import Any


def apply_env_defaults(env_vars: Mapping[Any, Any]) -> None:
    """Set each of ``env_vars`` (stringified) that the process environment lacks.

    Raises:
        ValueError: a name that is not a non-empty string.
        TypeError: a value that is not a string, number or bool.
    """
    for name, value in env_vars.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"env_vars: {name!r} is not a variable name. Fix: use non-empty string names.")
        if not isinstance(value, (str, int, float, bool)):
            raise TypeError(
                f"env_vars.{name}: expects a string, number or bool, got {type(value).__name__}. Fix: give a scalar."
            )
    for name, value in env_vars.items():  # all checked first: a bad entry sets none
        os.environ.setdefault(name, str(value))
