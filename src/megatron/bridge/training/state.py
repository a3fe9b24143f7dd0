"""What a run carries: ``TrainState`` (progress, saved in every checkpoint) and ``GlobalState`` (the run's handles).

``GlobalState`` is what Megatron-Bridge passes to a forward step that takes ``state`` and to every callback: the
config, the training progress, the signal handler and the resiliency features' handles. Handles are built on first
use, so a state made before ``torch.distributed`` starts costs nothing. An in-process restart calls
:meth:`GlobalState.reset_for_restart` so that the next iteration builds fresh ones.
"""

import time
from dataclasses import dataclass, fields
from typing import Any, Optional


@dataclass
class TrainState:
    """Progress of training; saved in every checkpoint."""

    step: int = 0
    """Optimizer steps completed (the iteration number of the newest finished step)."""
    consumed_train_samples: int = 0
    """Global samples consumed; also the data position (a resumed run continues at this sample)."""
    skipped_train_samples: int = 0
    """Samples of steps whose update was skipped (e.g. a NaN loss with ``max_consecutive_nan_skips``)."""
    consumed_valid_samples: int = 0
    """Validation samples consumed."""
    floating_point_operations_so_far: int = 0
    """Model floating-point operations of the applied steps so far."""
    do_train: bool = False
    """Training iterations remain to be run."""
    do_valid: bool = False
    """Validation data exists and evaluation is configured."""
    do_test: bool = False
    """Test data exists and a test evaluation is configured."""

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values, one per field, for checkpoints."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (fields a checkpoint does not have keep their defaults)."""
        if "iteration" in state and "step" not in state:  # written before the field took Megatron-Bridge's name
            state = {**state, "step": state["iteration"]}
        for f in fields(self):
            if f.name in state:
                setattr(self, f.name, type(f.default)(_item(state[f.name])))


def _item(value: Any) -> Any:
    """A tensor's Python value (checkpoints written by Megatron-Bridge hold 0-d tensors), else the value."""
    return value.item() if hasattr(value, "item") else value


@dataclass
class FaultToleranceState:
    """What fault tolerance tracks over a run (see ``fault_tolerance.py``)."""

    ft_state_path: Optional[str] = None
    """``<checkpoint.save>/ft_state.json``: the section timeouts learned so far."""
    is_persistent_chkpt_loaded: bool = False
    """This run resumed from a global (persistent) checkpoint, so its ``setup`` time includes a real load."""
    is_async_chkpt_enabled: bool = False
    """Saves are asynchronous (their blocking part is all the ``checkpointing`` section measures)."""
    is_calculating_timeouts: bool = False
    """``ft.calc_ft_timeouts``: learn the section timeouts from this run."""
    is_setup_section_open: bool = False
    """The ``setup`` section is open (closed by the first training or evaluation step)."""
    seen_checkpoints_cnt: int = 0
    """Checkpoint saves seen in this run."""
    seen_tr_iters_cnt: int = 0
    """Training steps seen in this run."""
    curr_eval_iter_idx: int = 0
    """Evaluation steps seen in the current evaluation (its first is a warm-up, outside the ``step`` section)."""


class GlobalState:
    """The run's config, progress and resiliency handles, shared by the loop, the features and user code."""

    def __init__(self) -> None:
        self._cfg: Any = None
        self._train_state: Optional[TrainState] = None
        self._ft_state: Optional[FaultToleranceState] = None
        self._signal_handler: Any = None
        self._nvrx_straggler_manager: Any = None
        self._nvrx_straggler_created = False
        self._async_calls_queue: Any = None
        self.rank_monitor_client: Any = None
        """nvidia-resiliency-ext's ``RankMonitorClient`` while fault tolerance is connected (``fault_tolerance.setup``
        sets it, ``shutdown``/``abort`` clear it); the module functions report through it."""
        self.start_time = time.monotonic()
        """``time.monotonic()`` when this state was made: a start to measure durations from, not a timestamp."""
        self.stop_request: Optional[tuple[Any, str]] = None
        """A feature's request that training stop after the current step: ``(exit code, reason)``."""

    def request_stop(self, exit_code: Any, reason: str) -> None:
        """Ask the loop to stop after the current step (call it alike on every rank: the stop is collective)."""
        if self.stop_request is None:
            self.stop_request = (exit_code, reason)

    @property
    def cfg(self) -> Any:
        """The run's ``ConfigContainer``."""
        return self._cfg

    @cfg.setter
    def cfg(self, value: Any) -> None:
        self._cfg = value

    @property
    def train_state(self) -> TrainState:
        """Training progress (``step``, ``consumed_train_samples``, ...)."""
        if self._train_state is None:
            self._train_state = TrainState()
        return self._train_state

    @train_state.setter
    def train_state(self, value: TrainState) -> None:
        self._train_state = value

    @property
    def fault_tolerance_state(self) -> FaultToleranceState:
        """What fault tolerance tracks over the run."""
        if self._ft_state is None:
            self._ft_state = FaultToleranceState()
        return self._ft_state

    @fault_tolerance_state.setter
    def fault_tolerance_state(self, value: FaultToleranceState) -> None:
        self._ft_state = value

    @property
    def signal_handler(self) -> Any:
        """The ``DistributedSignalHandler`` of ``train.exit_signal`` (it traps the signal only once entered)."""
        if self._signal_handler is None:
            from megatron.bridge.training.utils.sig_utils import DistributedSignalHandler

            self._signal_handler = DistributedSignalHandler(self._cfg.train.exit_signal)
        return self._signal_handler

    @property
    def nvrx_straggler_manager(self) -> Any:
        """The straggler detection manager when ``cfg.nvrx_straggler`` is set, else ``None``; built once."""
        if not self._nvrx_straggler_created and self._cfg is not None and self._cfg.nvrx_straggler is not None:
            from megatron.bridge.training.nvrx_straggler import NVRxStragglerDetectionManager

            self._nvrx_straggler_manager = NVRxStragglerDetectionManager(self._cfg.nvrx_straggler)
            self._nvrx_straggler_created = True
        return self._nvrx_straggler_manager

    @nvrx_straggler_manager.setter
    def nvrx_straggler_manager(self, value: Any) -> None:
        self._nvrx_straggler_manager = value
        self._nvrx_straggler_created = True

    @property
    def async_calls_queue(self) -> Any:
        """The queue of asynchronous checkpoint writes while async saves are on.

        Set when the run's checkpoint manager starts; ``checkpointing.schedule_async_save`` schedules on it.
        """
        return self._async_calls_queue

    @async_calls_queue.setter
    def async_calls_queue(self, value: Any) -> None:
        self._async_calls_queue = value

    def reset_for_restart(self) -> None:
        """Forget every per-run handle so that an in-process restart builds new ones; config and ft state stay."""
        self._train_state = None
        self._signal_handler = None
        if self._nvrx_straggler_manager is not None:  # its detector is process-global: free it for the next manager
            from megatron.bridge.training.nvrx_straggler import safe_shutdown_nvrx_straggler_manager

            safe_shutdown_nvrx_straggler_manager(self._nvrx_straggler_manager)
        self._nvrx_straggler_manager = None
        self._nvrx_straggler_created = False
        self._async_calls_queue = None
        self.stop_request = None
        self.start_time = time.monotonic()
