"""Where a training attempt's set-up time goes: one ``phase`` event per phase, from process start to data build.

The failure it handles: a restart was timed as one span (the launcher's restart, then the first step), so a slow
rendezvous, a slow health check or a slow model build looked the same, and the projection to a large job could not
scale the part that grows with it. :class:`PhaseClock` is what ``pretrain`` calls at the end of each set-up phase:
the phase ran from the end of the one before (the attempt's start for the first), so the phases of one attempt
leave no gap between them. Each end writes a ``phase`` event (``events/stream.py``: ``cycle_phase``, ``start``,
``end``, wall-clock unix times that compare across processes) and keeps the seconds for the goodput ledger; under
in-process restart it also reports progress to the wrapper's watchdog, which bounds each set-up phase.
"""

import time
from collections.abc import Callable
from typing import Optional

from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import CyclePhase, EventKind


class PhaseClock:
    """The set-up phases of one attempt, timed back to back from ``origin``.

    Args:
        origin: unix time the attempt started (``time.time()``): the first phase's start.
        ping: called at the end of every phase (in-process restart's progress report), if given.
        clock: unix time (default ``time.time``, the event stream's clock; tests pass a fake one).
    """

    def __init__(
        self, origin: float, ping: Optional[Callable[[], None]] = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.last = origin
        """When the latest phase ended (the next one starts there)."""
        self.seconds: dict[str, float] = {}
        """Seconds of each phase that ended so far, by :class:`CyclePhase` value, in their order."""
        self._ping = ping
        self._clock = clock

    def record(self, phase: CyclePhase, start: float, end: float) -> None:
        """Write that ``phase`` ran from ``start`` to ``end`` and keep its seconds (the clock's position stays)."""
        self.seconds[phase.value] = self.seconds.get(phase.value, 0.0) + max(0.0, end - start)
        event_stream.emit(EventKind.PHASE, cycle_phase=phase, start=start, end=end)

    def lap(self, phase: CyclePhase) -> None:
        """``phase`` ended now: it ran from the end of the phase before."""
        now = self._clock()
        self.record(phase, self.last, now)
        self.last = now
        if self._ping is not None:
            self._ping()
