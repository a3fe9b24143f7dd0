"""Callbacks: code that runs at named moments of training, user code and this package's own features alike.

The event names are Megatron-Bridge's, so a callback written for it runs here unchanged. A callback is either a
:class:`Callback` subclass that overrides the events it cares about, or a plain function registered for one event
with :meth:`CallbackManager.register`. Functions of one event run in the order they were added; an exception in a
callback propagates and stops training like any other error in the loop.

The two checkpoint events get a :class:`CheckpointCallbackContext` (the checkpoint's path and tier) instead of a
:class:`CallbackContext`: ``on_checkpoint_save`` once a checkpoint is committed (for an asynchronous save, when its
background write has been committed, a few steps later), ``on_checkpoint_load`` after the run resumed from one.
``on_checkpoint_save_start``/``_end`` (this package's, with a :class:`CallbackContext`) bracket the time the loop is
blocked on a save.

This package's own features (goodput, the event stream, fault tolerance, hang attribution, fault injection, liveness
ping, straggler detection) are callbacks too: :meth:`CallbackManager.chain` puts them, in their documented order,
before the user's.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

TRAIN_EVENTS = ("on_train_start", "on_train_step_start", "on_train_step_end", "on_train_end")
EVAL_EVENTS = ("on_eval_start", "on_eval_step_start", "on_eval_step_end", "on_eval_end")
TEST_EVENTS = ("on_test_start", "on_test_step_start", "on_test_step_end", "on_test_end")
CHECKPOINT_EVENTS = ("on_checkpoint_save_start", "on_checkpoint_save_end", "on_checkpoint_save", "on_checkpoint_load")

VALID_EVENTS: frozenset[str] = frozenset(
    ("on_data_init_start", *TRAIN_EVENTS, *EVAL_EVENTS, *TEST_EVENTS, "on_checkpoint_save")
)
"""Megatron-Bridge's events, exactly its set (code written against it may enumerate it)."""
PACKAGE_EVENTS: frozenset[str] = frozenset(CHECKPOINT_EVENTS) - VALID_EVENTS
"""This package's own events (the save bracket and the load); a manager accepts them beside :data:`VALID_EVENTS`."""
ALL_EVENTS: frozenset[str] = VALID_EVENTS | PACKAGE_EVENTS
"""Every event a callback may handle."""


@dataclass
class CallbackContext:
    """What a callback sees. Fields that do not apply to an event are ``None``."""

    state: Any
    """The run's ``GlobalState`` (config, ``train_state`` with ``step`` and ``consumed_train_samples``, ...)."""
    model: list
    """The model chunks being trained (one per virtual pipeline stage)."""
    user_state: dict = field(default_factory=dict)
    """One dict shared by every event of the run: a callback keeps its own data here between events."""
    optimizer: Any = None
    """The optimizer (training events and ``on_data_init_start``)."""
    scheduler: Any = None
    """The learning-rate scheduler (training events and ``on_data_init_start``)."""
    loss_dict: Optional[dict[str, Any]] = None
    """``on_train_step_end``: the step's reduced losses, e.g. ``{"lm loss": tensor}``; empty for a step that was
    not applied."""
    grad_norm: Optional[float] = None
    """``on_train_step_end``: the gradient norm before clipping (``None`` when the step was not applied)."""
    skipped_iter: Optional[bool] = None
    """``on_train_step_end``: ``True`` when the optimizer step was skipped (e.g. a NaN loss was skipped)."""
    step_time: Optional[float] = None
    """``on_train_step_end``: seconds the step's forward, backward and update took (this package's addition)."""
    total_loss_dict: Optional[dict[str, Any]] = None
    """``on_eval_end``/``on_test_end``: the losses averaged over the evaluation."""


@dataclass
class CheckpointCallbackContext:
    """What a checkpoint event's callback sees."""

    state: Any
    """The run's ``GlobalState``."""
    checkpoint_name: str
    """The checkpoint's directory (``<checkpoint.save>/iter_NNNNNNN``; the node-local directory for the local tier)."""
    checkpoint_type: Any
    """Its tier: ``checkpointing.CheckpointType.GLOBAL`` or ``.LOCAL``."""
    user_state: dict = field(default_factory=dict)
    """The dict every context of this run carries (see :attr:`CallbackContext.user_state`)."""
    iteration: Optional[int] = None
    """The checkpoint's iteration (this package's addition; ``None`` when the caller did not say)."""
    finalize_seconds: Optional[float] = None
    """``on_checkpoint_save`` of an async save: the loop's time so far in the finalize committing it (this package's
    addition; ``None`` for a synchronous save, committed inside the save call)."""


CallbackEventContext = Union[CallbackContext, CheckpointCallbackContext]
"""What any callback receives."""


class Callback:
    """Base class: override the events to handle; each receives a :class:`CallbackContext` and returns nothing."""

    def on_data_init_start(self, context: CallbackContext) -> None:
        """Model, optimizer and checkpoint are ready; the data iterators are about to be built."""

    def on_train_start(self, context: CallbackContext) -> None:
        """Right before the first training step of this run (after a resume, the first step after it)."""

    def on_train_step_start(self, context: CallbackContext) -> None:
        """Before each training step; ``state.train_state.step`` is the number of steps done so far."""

    def on_train_step_end(self, context: CallbackContext) -> None:
        """After each training step that ran, before ``state.train_state.step`` counts it."""

    def on_train_end(self, context: CallbackContext) -> None:
        """Training reached ``train.train_iters``, or stopped early on purpose (signal, exit interval, straggler)."""

    def on_eval_start(self, context: CallbackContext) -> None:
        """Before an evaluation on the validation data."""

    def on_eval_step_start(self, context: CallbackContext) -> None:
        """Before each evaluation step."""

    def on_eval_step_end(self, context: CallbackContext) -> None:
        """After each evaluation step."""

    def on_eval_end(self, context: CallbackContext) -> None:
        """After an evaluation; ``total_loss_dict`` holds its averaged losses."""

    def on_test_start(self, context: CallbackContext) -> None:
        """Before the evaluation on the test data."""

    def on_test_step_start(self, context: CallbackContext) -> None:
        """Before each test step."""

    def on_test_step_end(self, context: CallbackContext) -> None:
        """After each test step."""

    def on_test_end(self, context: CallbackContext) -> None:
        """After the test evaluation; ``total_loss_dict`` holds its averaged losses."""

    def on_checkpoint_save_start(self, context: CallbackContext) -> None:
        """The loop is about to save a checkpoint (``state.train_state.step`` is its iteration)."""

    def on_checkpoint_save_end(self, context: CallbackContext) -> None:
        """The save returned (an asynchronous one may still be writing; ``on_checkpoint_save`` follows its commit)."""

    def on_checkpoint_save(self, context: CheckpointCallbackContext) -> None:
        """A checkpoint was committed (global or local tier)."""

    def on_checkpoint_load(self, context: CheckpointCallbackContext) -> None:
        """The run resumed from this checkpoint (not called when it started from scratch)."""


class CallbackManager:
    """The callbacks of one run, by event, in the order they run."""

    def __init__(self, user_state: Optional[dict] = None) -> None:
        """An empty manager; ``user_state``: the dict its contexts carry (a new one by default)."""
        self._callbacks: dict[str, list[Callable[[CallbackEventContext], None]]] = {e: [] for e in ALL_EVENTS}
        self._user_state: dict = user_state if user_state is not None else {}

    @property
    def user_state(self) -> dict:
        """The dict every :class:`CallbackContext` of this run carries as ``user_state``."""
        return self._user_state

    @property
    def events(self) -> frozenset[str]:
        """Megatron-Bridge's event names (this package's own are :data:`PACKAGE_EVENTS`)."""
        return VALID_EVENTS

    def add(self, callback: Union[Callback, Iterable[Callback]]) -> None:
        """Register the events each callback overrides (one callback or several)."""
        for cb in [callback] if isinstance(callback, Callback) else list(callback):
            if not isinstance(cb, Callback):
                raise TypeError(
                    f"callbacks: {cb!r} is not a Callback; subclass megatron.bridge.training.callbacks.Callback, "
                    "or register a function with CallbackManager.register(event_name, fn)"
                )
            for event in ALL_EVENTS:
                if getattr(type(cb), event) is not getattr(Callback, event):
                    self._callbacks[event].append(getattr(cb, event))

    @classmethod
    def chain(cls, first: Iterable[Callback], then: Optional["CallbackManager"]) -> "CallbackManager":
        """One manager running the callbacks ``first`` (in order), then every callback of ``then``.

        The loop's features go ``first``; ``then`` is the user's manager, whose ``user_state`` the result shares.
        """
        manager = cls(user_state=then.user_state if then is not None else None)
        manager.add(list(first))
        if then is not None:
            for event in sorted(ALL_EVENTS):
                for fn in then.list_callbacks(event):
                    manager.register(event, fn)
        return manager

    def register(self, event_name: str, fn: Callable[[CallbackEventContext], None]) -> None:
        """Run ``fn(context)`` at ``event_name``, after the functions already registered there."""
        self._check(event_name)
        self._callbacks[event_name].append(fn)

    def list_callbacks(self, event_name: str) -> list[Callable[[CallbackEventContext], None]]:
        """The functions of ``event_name`` in the order they run (a copy)."""
        self._check(event_name)
        return list(self._callbacks[event_name])

    def has_callbacks(self, event_name: str) -> bool:
        """Whether anything is registered for ``event_name``."""
        return bool(self._callbacks.get(event_name))

    def fire(self, event_name: str, context: CallbackEventContext) -> None:
        """Run every function of ``event_name`` with ``context``, in order."""
        self._check(event_name)
        for fn in self._callbacks[event_name]:
            fn(context)

    @staticmethod
    def _check(event_name: str) -> None:
        if event_name not in ALL_EVENTS:
            raise ValueError(f"Unknown event {event_name!r}. Valid events: {', '.join(sorted(ALL_EVENTS))}")


def normalize_callbacks(
    callbacks: Union[None, CallbackManager, Callback, Iterable[Callback]],
) -> Optional[CallbackManager]:
    """``pretrain``'s ``callbacks`` argument as a manager: ``None`` stays ``None``; a list gets a new manager."""
    if callbacks is None or isinstance(callbacks, CallbackManager):
        return callbacks
    manager = CallbackManager()
    manager.add(callbacks)
    return manager


def should_fire(callback_manager: Optional[CallbackManager], event_name: str) -> bool:
    """Whether ``event_name`` has anything to run (build the context only then)."""
    return callback_manager is not None and callback_manager.has_callbacks(event_name)


def fire_event(
    callback_manager: Optional[CallbackManager], event_name: str, state: Any, model: Any, **fields: Any
) -> None:
    """Run the callbacks of ``event_name`` with a context of ``state``, ``model`` and ``fields``.

    The context is built only when something is registered for the event.
    """
    if should_fire(callback_manager, event_name):
        chunks = model if isinstance(model, list) else [model]
        context = CallbackContext(state=state, model=chunks, user_state=callback_manager.user_state, **fields)
        callback_manager.fire(event_name, context)


def fire_checkpoint_event(
    callback_manager: Optional[CallbackManager],
    event_name: str,
    state: Any,
    checkpoint_name: str,
    checkpoint_type: Any,
    iteration: Optional[int] = None,
    finalize_seconds: Optional[float] = None,
) -> None:
    """Run the callbacks of a checkpoint event with a :class:`CheckpointCallbackContext` (built only when needed)."""
    if should_fire(callback_manager, event_name):
        context = CheckpointCallbackContext(
            state, checkpoint_name, checkpoint_type, callback_manager.user_state, iteration, finalize_seconds
        )
        callback_manager.fire(event_name, context)
