"""Python's garbage collector stalling a step: set-up's objects frozen, and Megatron-Bridge's manual collection.

Failure handled: a full (generation-2) collection walks every object the interpreter tracks. In a training process
those are mostly what set-up built and what lives as long as the run: torch, megatron-core and their modules, the
model, the optimizer, the data pipeline (about 340 000 objects for the CPU Llama recipe). A save allocates enough
long-lived objects to set one off: a rank then stops for about 0.25 s on a 2-core machine, at a step of its own
choosing, its peers wait for it in the step's next collective, and the step looks like a straggler's. A forked async
checkpoint writer that collects touches every one of those objects and copies their memory pages.

How: when training starts, ``gc.freeze()``: everything that exists then is moved out of the collector's sight, so a
later full collection walks only what training allocated since. The frozen objects are still freed by reference
counting; reference cycles among them wait until training ends (set-up's leftover garbage, and what lives as long as
the run anyway). No collection first: it would walk all of them once, 0.2 s at the first step. Nothing is frozen
under in-process restart: an aborted iteration's model must stay collectable (the wrapper freezes what exists when it
starts). When training ends, the objects go back to the collector.

With ``train.manual_gc`` (Megatron-Bridge's fields), automatic collection is turned off and every rank collects at
the same steps: every ``train.manual_gc_interval`` steps (0: never) and, with ``train.manual_gc_eval``, a full
collection before each evaluation and a young-generation one after it. Automatic collection is turned back on when
training ends.
"""

import gc
import logging
from typing import Any

from megatron.bridge.training.components import Component, Run
from megatron.bridge.training.config import TrainingConfig, is_enabled

logger = logging.getLogger(__name__)


def maybe_run_manual_gc(manual_gc_enabled: bool, manual_gc_interval: int, iteration: int) -> None:
    """Collect garbage at ``iteration`` when manual collection is on and the interval (non-zero) divides it."""
    if manual_gc_enabled and manual_gc_interval != 0 and iteration % manual_gc_interval == 0:
        gc.collect()


class GarbageCollectionCallback(Component):
    """Freezes what set-up built when training starts; runs ``train.manual_gc``'s collections (a run's component).

    Args:
        cfg: the run's ``train`` section.
        freeze: whether to freeze set-up's objects (``False`` under in-process restart).
    """

    def __init__(self, cfg: TrainingConfig, freeze: bool) -> None:
        self.cfg = cfg
        self.freeze = freeze
        self._froze = False
        self._disabled = False

    @classmethod
    def build(cls, run: Run) -> "GarbageCollectionCallback":
        """Freezing is off under in-process restart: the next iteration's set-up must be able to free the last one's."""
        return cls(run.cfg.train, freeze=not is_enabled(run.cfg.inprocess_restart))

    def on_train_start(self, context: Any) -> None:
        """Freeze what exists; with ``manual_gc``, turn automatic collection off and collect once first."""
        if self.cfg.manual_gc:
            if gc.isenabled():
                gc.disable()
                self._disabled = True
            gc.collect()  # as Megatron-Bridge does; otherwise set-up's garbage is frozen with the rest (0.2 s saved)
        if self.freeze:
            gc.freeze()
            self._froze = True
            logger.debug("garbage collection: %d objects frozen", gc.get_freeze_count())

    def on_train_step_end(self, context: Any) -> None:
        """``manual_gc``: collect at every ``manual_gc_interval``-th step (the iteration this step completes)."""
        maybe_run_manual_gc(self.cfg.manual_gc, self.cfg.manual_gc_interval, context.state.train_state.step + 1)

    def on_eval_start(self, context: Any) -> None:
        """``manual_gc_eval``: a full collection before evaluating."""
        if self.cfg.manual_gc and self.cfg.manual_gc_eval:
            gc.collect()

    def on_eval_end(self, context: Any) -> None:
        """``manual_gc_eval``: collect what evaluation left in the young generation."""
        if self.cfg.manual_gc and self.cfg.manual_gc_eval:
            gc.collect(generation=0)

    def close(self) -> None:
        """Give the frozen objects back to the collector and turn automatic collection on again (idempotent)."""
        if self._froze:
            gc.unfreeze()
            self._froze = False
        if self._disabled:
            gc.enable()
            self._disabled = False
