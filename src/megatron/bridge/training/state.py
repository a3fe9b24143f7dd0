"""What a run carries from step to step and across restarts: iteration and data position."""

from dataclasses import asdict, dataclass


@dataclass
class TrainState:
    """Progress of training; saved in every checkpoint."""

    iteration: int = 0
    """Optimizer steps completed."""
    consumed_train_samples: int = 0
    """Global samples consumed; also the data position (mock data is addressed by sample index)."""

    def state_dict(self) -> dict[str, int]:
        """Plain-int representation for checkpoints."""
        return asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore from :meth:`state_dict`."""
        self.iteration = int(state["iteration"])
        self.consumed_train_samples = int(state["consumed_train_samples"])
