"""Per-step metrics: rank 0's log line and TensorBoard scalars.

The log line comes every ``logger.log_interval`` steps; with ``logger.tensorboard_dir`` set, the scalars every
``logger.tensorboard_log_interval`` steps.
"""

import logging
from typing import Optional

from megatron.bridge.training.config import LoggerConfig
from megatron.bridge.utils.optional_imports import require

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Writes training metrics; only rank 0 writes anything."""

    def __init__(self, cfg: LoggerConfig, rank: int) -> None:
        self.enabled = rank == 0
        self._cfg = cfg
        self._tb: Optional[object] = None
        if self.enabled and cfg.tensorboard_dir:
            tensorboard = require("torch.utils.tensorboard")
            self._tb = tensorboard.SummaryWriter(log_dir=cfg.tensorboard_dir, max_queue=cfg.tensorboard_queue_size)

    def due(self, iteration: int) -> bool:
        """Whether ``iteration`` is logged, to the console or to TensorBoard (when it is on).

        The answer is the same on every rank: the step's losses are then reduced across ranks.
        """
        return self.console_due(iteration) or self._tb_due(iteration)

    def console_due(self, iteration: int) -> bool:
        """Whether ``iteration`` gets the log line (every ``logger.log_interval`` steps)."""
        return iteration % self._cfg.log_interval == 0

    def _tb_due(self, iteration: int) -> bool:
        return self._cfg.tensorboard_dir is not None and iteration % self._cfg.tensorboard_log_interval == 0

    def log_step(self, iteration: int, train_iters: int, consumed: int, metrics: dict[str, float]) -> None:
        """Log one training step (call it when :meth:`due`).

        The loss is printed with full precision so runs can be compared exactly.
        """
        if not self.enabled:
            return
        if self._tb is not None and self._tb_due(iteration):
            for name, value in metrics.items():
                self._tb.add_scalar(f"train/{name.replace(' ', '_')}", value, iteration)
        if not self.console_due(iteration):
            return
        logger.info(
            "iteration %d/%d | consumed samples %d | lm loss %r | grad norm %.6f | lr %.6e | step time %.4f s",
            iteration,
            train_iters,
            consumed,
            metrics.get("lm loss", float("nan")),  # a forward step may report its loss under another name
            metrics["grad norm"],
            metrics["lr"],
            metrics["step time"],
        )

    def log_scalars(self, scalars: dict[str, float], iteration: int) -> None:
        """Write named scalars (e.g. ``straggler/relative_perf_score_min``) to TensorBoard at ``iteration``."""
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, iteration)

    def close(self) -> None:
        """Flush and close TensorBoard files."""
        if self._tb is not None:
            self._tb.close()
