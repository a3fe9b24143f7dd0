"""The one place optional dependencies are imported, each failing with the extra to install."""

from typing import Any

_EXTRAS = {
    "torch.utils.tensorboard": "logging",
    "matplotlib": "logging",
    "nemo_run": "recipes",
}


def require(module: str) -> Any:
    """Import ``module`` or raise ``ImportError`` naming the pip extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        extra = _EXTRAS.get(module, "")
        hint = f"pip install 'mbridge-resiliency[{extra}]'" if extra else f"pip install {module.split('.')[0]}"
        raise ImportError(f"{module} is needed for this feature but is not importable ({err}); {hint}") from err


# nvidia-resiliency-ext moved the straggler package in 0.6; newest layout first.
STRAGGLER_PACKAGES = ("nvidia_resiliency_ext.attribution.straggler", "nvidia_resiliency_ext.straggler")
