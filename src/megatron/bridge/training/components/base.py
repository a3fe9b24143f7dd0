"""Components: each feature of a run is one object, declared in one ordered list, set up and torn down from it.

The failure this prevents is a feature wired by hand in several places (a callback list, a chain of forward-step
wrappers, teardown steps, fields of the loop's context), where forgetting one place leaves a rank monitor connected
after a fault, a thread running into the next in-process restart, or a fault drill's injection unwired. A
:class:`Component` says everything about its feature in one class:

- :meth:`Component.build` (a class method): make it from the config and what the run knows before the process group
  exists (:class:`Run`), or return ``None`` when the feature is off;
- :meth:`~Component.setup`: once the process group exists, before the checkpoint manager and the model are built;
- the loop's events, as any :class:`~megatron.bridge.training.callbacks.Callback` (a component is one): the loop's
  features run at each event in the list's order, before the user's callbacks;
- :meth:`~Component.ready`: the checkpoint is loaded and the data is ready, training is about to start;
- :meth:`~Component.wrap_forward_step` and :meth:`~Component.wrap_train_step`: what it wraps (the first component
  of the list wraps innermost);
- :meth:`~Component.finish` (training ended with an exit code), :meth:`~Component.fail` (the attempt is unwinding
  with an exception) and :meth:`~Component.close` (teardown, on every path, in reverse order).

:class:`Components` runs one list; ``training/pretrain.py`` holds the list. Components talk to each other only
through :class:`Run` (typed slots such as :attr:`Run.section_timeout`), never by importing each other.
"""

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron.bridge.training.callbacks import Callback

logger = logging.getLogger(__name__)


def _no_timeout(section: str) -> Optional[float]:
    return None


@dataclass(eq=False)
class Run:
    """What one training attempt knows and has built so far: what components read, and the slots they fill.

    Filled by ``pretrain.py`` in the order of set-up; a component reads a field only in a phase where it is set
    (``device``, ``checkpoints``, ``metrics``: from :meth:`Component.setup` on; ``model`` and the rest: at
    :meth:`Component.ready`).
    """

    cfg: Any
    """The run's ``ConfigContainer`` (validated)."""
    global_state: Any
    """The run's ``GlobalState``: what callbacks and forward steps see."""
    rank: int
    """This process's global rank (the launcher's before the process group exists, the group's after)."""
    attempt: str
    """This attempt's name (``hang_attribution.attempt_name``): restarts in and out of the process differ."""
    inprocess_iteration: int
    """In-process restart's iteration (0 without it, and in its first iteration)."""
    job_id: str
    """The scheduler's job (``utils.launch_env``)."""
    start_time: float
    """``time.monotonic()`` at the attempt's start (deadlines count from it)."""
    process_start: float
    """When the process started (a timestamp)."""
    attempt_start: float
    """When this attempt started (a timestamp): the process start, or an in-process restart iteration's start."""
    restart: Any = None
    """In-process restart's ``RestartIteration`` when the run is wrapped, else ``None``."""
    device: Any = None
    """The device this rank trains on (from :meth:`Component.setup` on)."""
    checkpoints: Any = None
    """The run's ``CheckpointManager`` (after set-up; ``resumed`` says what was loaded, at :meth:`Component.ready`)."""
    metrics: Any = None
    """The run's ``MetricsWriter`` (log line and TensorBoard scalars)."""
    checkpoint_extras: dict[str, Callable[[], Any]] = field(default_factory=dict)
    """Entries every checkpoint carries in its common state, each made by its function at save time (filled at
    :meth:`Component.build`: the checkpoint manager is made after set-up)."""
    section_timeout: Callable[[str], Optional[float]] = _no_timeout
    """Seconds a section (``setup``, ``step``, ``checkpointing``) may stay open before the hang detector acts
    (fault tolerance's, when on)."""
    where_is: Optional[Callable[[int], Optional[str]]] = None
    """Where a rank's main thread was at its latest stack dump, for a hang report (hang attribution's, when it
    writes stacks)."""
    goodput: Any = None
    """The goodput ledger the loop writes its re-run and commit time to (the goodput component's tracker)."""
    load_started: Optional[float] = None
    """``time.perf_counter()`` when the checkpoint load began."""
    phases: Any = None
    """The attempt's set-up clock (``events/phases.py``): its ``seconds`` of each set-up phase ended so far (the
    goodput ledger reads them at :meth:`Component.ready`)."""


class Component(Callback):
    """One feature of a run. Override what applies; every hook's default does nothing."""

    @classmethod
    def build(cls, run: Run) -> Optional["Component"]:
        """The feature for this run, or ``None`` when the config turns it off (before the process group exists)."""
        return cls()

    def setup(self, run: Run) -> None:
        """The process group exists (``run.device``); the checkpoint manager and the model do not yet."""

    def ready(self, run: Run) -> None:
        """The checkpoint is loaded and the data is ready: training (or evaluation) starts next."""

    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        """The training forward step with this feature around it (unchanged by default)."""
        return forward_step

    def wrap_train_step(self, train_step: Callable) -> Callable:
        """The whole training step (forward, backward, update) with this feature around it (unchanged by default)."""
        return train_step

    def finish(self, run: Run, code: Any, reason: str) -> None:
        """Training ended with exit ``code`` (an ``ExitCode``) for ``reason``; every rank's saves are committed."""

    def fail(self, run: Run, err: BaseException) -> None:
        """The attempt is unwinding with ``err``; the process group is still up (it is aborted after this)."""

    def close(self) -> None:
        """Release what the feature holds (threads, connections, files); called once on every path."""


class Components:
    """A run's components, in their declared order: built one by one, then run phase by phase."""

    def __init__(self) -> None:
        self.items: list[Component] = []

    def build(self, features: Sequence[type[Component]], run: Run) -> None:
        """Build each feature's component (:meth:`Component.build`) in order; one that returns ``None`` is off.

        One at a time: when a build fails, the components built before it are still here to close.
        """
        for feature in features:
            component = feature.build(run)
            if component is not None:
                self.items.append(component)

    def setup(self, run: Run) -> None:
        """:meth:`Component.setup` of each, in order."""
        for component in self.items:
            component.setup(run)

    def ready(self, run: Run) -> None:
        """:meth:`Component.ready` of each, in order."""
        for component in self.items:
            component.ready(run)

    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        """``forward_step`` wrapped by each component, the first innermost."""
        for component in self.items:
            forward_step = component.wrap_forward_step(forward_step)
        return forward_step

    def wrap_train_step(self, train_step: Callable) -> Callable:
        """``train_step`` wrapped by each component, the first innermost."""
        for component in self.items:
            train_step = component.wrap_train_step(train_step)
        return train_step

    def finish(self, run: Run, code: Any, reason: str) -> None:
        """:meth:`Component.finish` of each, in order."""
        for component in self.items:
            component.finish(run, code, reason)

    def fail(self, run: Run, err: BaseException) -> None:
        """:meth:`Component.fail` of each, in order; one that fails is logged and the others still run."""
        for component in self.items:
            try:
                component.fail(run, err)
            except Exception:  # noqa: BLE001 - must not hide the error being raised
                logger.warning("%s: could not record the failure", type(component).__name__, exc_info=True)

    def close_steps(self) -> list[Callable[[], None]]:
        """Each component's :meth:`Component.close`, the last built first."""
        return [component.close for component in reversed(self.items)]


class Teardown:
    """The end of one run, in order; each step runs once, and a second call finishes what an interrupted one left.

    The steps are listed at the first call (from what the run had built by then). An in-process restart can
    interrupt the ``finally`` of an aborted iteration (its interruption is a ``BaseException``): the step it struck
    stays, and the wrapper's finalize step calls this again before the next iteration starts. A step that fails
    (an ``Exception``, such as a writer an interrupted close left half-closed) is logged and dropped, and the steps
    after it still run: otherwise one broken close would keep the rank monitor's connection open for good, and the
    next iteration would wait on it.
    """

    def __init__(self, list_steps: Callable[[], Iterable[Callable[[], None]]]) -> None:
        self._list_steps: Optional[Callable[[], Iterable[Callable[[], None]]]] = list_steps
        self._steps: list[Callable[[], None]] = []

    def __call__(self) -> None:
        """Run the steps left, in order."""
        if self._list_steps is not None:
            self._steps, self._list_steps = list(self._list_steps()), None  # the closure holds the model: let it go
        while self._steps:
            step = self._steps[0]
            try:
                step()  # removed once done: a step interrupted half-way runs again on the next call
            except Exception as err:  # noqa: BLE001 - a failed step must not hold back the ones after it
                logger.warning("teardown: %s failed (%s: %s); going on", _step_name(step), type(err).__name__, err)
            self._steps.pop(0)


def _step_name(step: Callable[[], None]) -> str:
    """A teardown step's name for the log (a partial's function, a bound method's qualified name)."""
    func = getattr(step, "func", step)
    return getattr(func, "__qualname__", None) or repr(func)
