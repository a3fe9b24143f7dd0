r"""Run any recipe by name with dotted overrides, under any launcher.

::

    torchrun --nproc-per-node=2 -m megatron.bridge.recipes.run llama3_tiny_pretrain_config \\
        "dataset.blend=[['/data/corpus_text_document'],None]" checkpoint.save=/ckpt
    ft_launcher ... -m megatron.bridge.recipes.run llama3_8b_pretrain_config train.train_iters=100

The recipe is a function returning a ``ConfigContainer``: a bare name is looked up in this package's recipe
modules (:data:`RECIPE_MODULES`), ``module:function`` or ``module.function`` anywhere importable. The rest of the
command line is dotted ``key=value`` overrides (``training/utils/overrides.py``). The forward step is the GPT one
(``training/gpt_step.py``). Exit codes are ``pretrain.main``'s; an unknown recipe exits 2 naming the close matches.
"""

import difflib
import importlib
import logging
import sys
from collections.abc import Callable
from typing import Optional

RECIPE_MODULES = (
    "megatron.bridge.recipes.llama",
    "megatron.bridge.recipes.llama.h100",
    "megatron.bridge.recipes.tiny_gpt",
)
"""Where a bare recipe name is looked up, in order."""

logger = logging.getLogger(__name__)


def _recipes() -> dict[str, Callable]:
    found: dict[str, Callable] = {}
    for module_name in RECIPE_MODULES:
        module = importlib.import_module(module_name)
        for name in dir(module):
            if name.endswith("_config") and callable(getattr(module, name)) and not name.startswith("_"):
                found.setdefault(name, getattr(module, name))
    return found


def find_recipe(name: str) -> Callable:
    """The recipe function ``name`` names (see the module doc).

    Raises:
        ValueError: no such recipe; the message lists the close matches and the known names.
    """
    if ":" in name or "." in name:
        module_name, _, function = name.replace(":", ".").rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), function)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"recipe {name!r}: {err}") from None
    recipes = _recipes()
    if name in recipes:
        return recipes[name]
    close = difflib.get_close_matches(name, recipes, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown recipe {name!r}{hint} Known: {', '.join(sorted(recipes))}")


def main(argv: Optional[list[str]] = None) -> None:
    """Pretrain ``argv[0]``'s recipe with the overrides that follow; exits with the run's exit code."""
    argv = sys.argv[1:] if argv is None else argv
    from megatron.bridge.training.exit_codes import ExitCode

    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        logging.basicConfig()
        logger.error("usage: python -m megatron.bridge.recipes.run <recipe> [key=value ...]")
        sys.exit(int(ExitCode.CONFIG_ERROR))
    try:
        recipe = find_recipe(argv[0])
    except ValueError as err:
        logging.basicConfig()
        logger.error("%s", err)
        sys.exit(int(ExitCode.CONFIG_ERROR))
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import main as pretrain_main

    pretrain_main(recipe, forward_step, argv[1:])


if __name__ == "__main__":  # the guard matters: checkpoint writers and data loaders spawn helper processes
    main()
