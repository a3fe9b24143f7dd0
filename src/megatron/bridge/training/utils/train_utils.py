"""Forward steps in every form Megatron-Bridge accepts, made into what megatron-core's schedule calls.

The schedule calls ``forward_step_func(data_iterator, model)``. A forward step that wants the run's
``GlobalState`` says so by annotating a parameter with ``GlobalState`` or by naming its first parameter ``state``
(or ``global_state``); it then gets the state bound as its first argument. Counting parameters would not do:
``(data_iterator, model, return_schedule_plan=False)`` also has three.
"""

import functools
import inspect
from collections.abc import Callable
from typing import Any, Optional

_STATE_NAMES = ("state", "global_state")


def _signature(fn: Callable) -> Optional[inspect.Signature]:
    """The signature as a caller sees it (a functor's ``__call__`` without ``self``; a partial without its bound)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _is_global_state(annotation: Any) -> bool:
    if annotation is inspect.Parameter.empty:
        return False
    if isinstance(annotation, str):
        return "GlobalState" in annotation
    return getattr(annotation, "__name__", None) == "GlobalState"


def needs_global_state_injection(forward_step_func: Callable) -> bool:
    """Whether ``forward_step_func`` takes the ``GlobalState`` (by annotation, else by its first parameter's name)."""
    signature = _signature(forward_step_func)
    if signature is None:
        return False
    params = list(signature.parameters.values())
    if any(_is_global_state(p.annotation) for p in params):
        return True
    return bool(params) and params[0].name in _STATE_NAMES


def maybe_inject_state(forward_step_func: Callable, state: Any, needs_injection: Optional[bool] = None) -> Callable:
    """``forward_step_func`` with ``state`` bound first when it takes the state, else unchanged."""
    if needs_injection is None:
        needs_injection = needs_global_state_injection(forward_step_func)
    return functools.partial(forward_step_func, state) if needs_injection else forward_step_func


def prepare_forward_step_func(forward_step_func: Callable, state: Any) -> Callable:
    """What the schedule calls: ``forward_step_func`` with the state bound when it asks for it."""
    if not callable(forward_step_func):
        raise TypeError(
            f"forward_step_func: {forward_step_func!r} is not callable; pass a function such as "
            "megatron.bridge.training.gpt_step.forward_step"
        )
    return maybe_inject_state(forward_step_func, state)
