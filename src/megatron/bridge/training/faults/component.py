"""Fault injection as a run's component: the drills' faults strike at the moments the registry names.

The failure simulated is whichever the config or ``MBRIDGE_FAULTS`` asks for (``faults/spec.py`` lists the
kinds). This component makes the registry of this attempt before the checkpoint manager exists (a fault may strike
during the load), and once the run is ready gives this rank's step faults the loop's events and forward step:
after fault tolerance's ``ft.simulate_fault`` joined the registry (fault tolerance is declared before it).
"""

from collections.abc import Callable
from typing import Any, Optional

import torch.distributed as dist

from megatron.bridge.training.components import Component, Run
from megatron.bridge.training.faults import injection


class FaultInjection(Component):
    """The fault registry of this attempt, and this rank's faults in the training loop."""

    def __init__(self) -> None:
        self.registry: Optional[injection.FaultRegistry] = None
        self.step_faults: Optional[injection.StepFaults] = None

    def setup(self, run: Run) -> None:
        """Make the faults of ``fault_injection`` and the environment this process's (again at each restart)."""
        self.registry = injection.install(run.cfg.fault_injection, run.inprocess_iteration)

    def ready(self, run: Run) -> None:
        """Take this rank's step, forward and timed faults from the registry."""
        self.step_faults = injection.StepFaults(dist.get_rank(), self.registry)

    def on_train_step_start(self, context: Any) -> None:
        """Strike what is scheduled for the step about to run."""
        self.step_faults.on_train_step_start(context)

    def on_train_step_end(self, context: Any) -> None:
        """Strike what is scheduled right after the optimizer step (``bitflip``)."""
        self.step_faults.on_train_step_end(context)

    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        """The forward step with this rank's ``slow``, ``nan`` and ``spike`` faults (unchanged without any)."""
        return self.step_faults.wrap_forward_step(forward_step)
