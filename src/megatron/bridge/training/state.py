"""What a run carries: ``TrainState`` (progress, saved in every checkpoint) and ``GlobalState`` (the run's handles).

``GlobalState`` is what Megatron-Bridge passes to a forward step that takes ``state`` and to every callback: the
config, the training progress, the tokenizer, timers, the TensorBoard writer, the signal handler and the resiliency
features' handles. Handles are built on first use, so a state made before ``torch.distributed`` starts costs
nothing; the one exception is the preemption signal handler, installed as soon as the config is set (when
``train.exit_signal_handler`` is on) so that a signal arriving during set-up is not lost. An in-process restart
calls :meth:`GlobalState.reset_for_restart` so that the next iteration builds fresh ones.
"""

import time
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch
from megatron.core.energy_monitor import EnergyMonitor
from megatron.core.timers import Timers
from megatron.core.utils import StragglerDetector
from torch.distributed.checkpoint.stateful import Stateful

from megatron.bridge.training.nvrx_straggler import NVRxStragglerDetectionManager
from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer
from megatron.bridge.training.utils.sig_utils import DistributedSignalHandler
from megatron.bridge.utils.common_utils import get_rank_safe, get_world_size_safe

_TENSOR_DTYPES = {
    "floating_point_operations_so_far": torch.float64,
    "do_train": torch.bool,
    "do_valid": torch.bool,
    "do_test": torch.bool,
}
"""``TrainState.state_dict``'s dtype per field; the counters not named here are ``torch.int64``."""

_MODEL_CONFIG_CALLBACKS = (
    "finalize_model_grads_func",
    "grad_scale_func",
    "no_sync_func",
    "grad_sync_func",
    "param_sync_func",
)
"""What the loop binds on the model config to one iteration's model and optimizer."""


@dataclass
class TrainState(Stateful):
    """Progress of training; saved in every checkpoint (``torch.distributed.checkpoint``'s ``Stateful``)."""

    step: int = 0
    """Optimizer steps completed (the iteration number of the newest finished step)."""
    consumed_train_samples: int = 0
    """Global samples consumed; also the data position (a resumed run continues at this sample)."""
    skipped_train_samples: int = 0
    """Samples of steps whose update was skipped (e.g. a NaN loss with ``max_consecutive_nan_skips``)."""
    consumed_valid_samples: int = 0
    """Validation samples consumed."""
    floating_point_operations_so_far: int = 0
    """Model floating-point operations of the applied steps so far (saved as ``float64``)."""
    do_train: bool = False
    """Training iterations remain to be run."""
    do_valid: bool = False
    """Validation data exists and evaluation is configured."""
    do_test: bool = False
    """Test data exists and a test evaluation is configured."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """One 0-d tensor per field, as Megatron-Bridge's checkpoints hold them (``int64``, ``float64``, ``bool``)."""
        return {
            f.name: torch.tensor(getattr(self, f.name), dtype=_TENSOR_DTYPES.get(f.name, torch.int64))
            for f in fields(self)
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`, from Megatron-Bridge's, or from an older one of this package.

        Values may be tensors or plain Python values; a field the checkpoint does not have keeps its default, and
        ``iteration`` (this package's name for ``step`` before it took Megatron-Bridge's) is read as ``step``.
        """
        if "iteration" in state_dict and "step" not in state_dict:
            state_dict = {**state_dict, "step": state_dict["iteration"]}
        for f in fields(self):
            if f.name not in state_dict:
                continue
            value = _item(state_dict[f.name])
            if isinstance(f.default, bool):
                value = bool(value)
            elif f.name != "floating_point_operations_so_far":  # may hold a fraction once summed as float64
                value = int(value)
            setattr(self, f.name, value)


def _item(value: Any) -> Any:
    """A tensor's Python value, else the value."""
    return value.item() if isinstance(value, torch.Tensor) else value


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
    """The run's config, progress and handles, shared by the loop, the features and user code."""

    def __init__(self) -> None:
        if getattr(self, "_initialized", False):  # a second __init__ keeps what the state holds
            return
        self._initialized = True
        self._cfg: Any = None
        self._tokenizer: Any = None
        self._tensorboard_logger: Any = None
        self._wandb_logger: Any = None
        self._mlflow_logger: Any = None
        self._comet_logger: Any = None
        self._timers: Optional[Timers] = None
        self._train_state: Optional[TrainState] = None
        self._ft_state: Optional[FaultToleranceState] = None
        self._signal_handler: Optional[DistributedSignalHandler] = None
        self._straggler_timer: Optional[StragglerDetector] = None
        self._async_calls_queue: Any = None
        self._nvrx_straggler_manager: Optional[NVRxStragglerDetectionManager] = None
        self._nvrx_straggler_created = False
        self._energy_monitor: Optional[EnergyMonitor] = None
        self._energy_monitor_created = False
        self.rank_monitor_client: Any = None
        """nvidia-resiliency-ext's ``RankMonitorClient`` while fault tolerance is connected (``fault_tolerance.setup``
        sets it, ``shutdown``/``abort`` clear it); the module functions report through it."""
        self.start_time: float = time.time()
        """``time.time()`` when this state was made."""
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
        """Set the config; with ``train.exit_signal_handler`` on, the signal handler is installed now."""
        self._cfg = value
        if value is not None:
            self._set_signal_handler()

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of ``cfg.tokenizer``, built on first use."""
        if self._tokenizer is None:
            self._tokenizer = build_tokenizer(self._cfg.tokenizer)
        return self._tokenizer

    @property
    def tensorboard_logger(self) -> Any:
        """A TensorBoard ``SummaryWriter`` on the last rank when ``logger.tensorboard_dir`` is set, else ``None``.

        The last rank holds the losses first (the last pipeline stage computes them).
        """
        if self._tensorboard_logger is None and self._cfg.logger.tensorboard_dir:
            if get_rank_safe() == get_world_size_safe() - 1:
                from torch.utils.tensorboard.writer import SummaryWriter

                print("> setting tensorboard ...")
                self._tensorboard_logger = SummaryWriter(
                    log_dir=self._cfg.logger.tensorboard_dir, max_queue=self._cfg.logger.tensorboard_queue_size
                )
        return self._tensorboard_logger

    @property
    def wandb_logger(self) -> Any:
        """A Weights & Biases run that user code attached (this package builds none; see the compatibility doc)."""
        return self._wandb_logger

    @wandb_logger.setter
    def wandb_logger(self, value: Any) -> None:
        self._wandb_logger = value

    @property
    def mlflow_logger(self) -> Any:
        """An MLflow client that user code attached (this package builds none)."""
        return self._mlflow_logger

    @mlflow_logger.setter
    def mlflow_logger(self, value: Any) -> None:
        self._mlflow_logger = value

    @property
    def comet_logger(self) -> Any:
        """A Comet ML experiment that user code attached (this package builds none)."""
        return self._comet_logger

    @comet_logger.setter
    def comet_logger(self, value: Any) -> None:
        self._comet_logger = value

    @property
    def timers(self) -> Timers:
        """megatron-core ``Timers`` at ``logger.timing_log_level`` / ``timing_log_option``; built on first use."""
        if self._timers is None:
            self._timers = Timers(self._cfg.logger.timing_log_level, self._cfg.logger.timing_log_option)
        return self._timers

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
    def signal_handler(self) -> Optional[DistributedSignalHandler]:
        """The entered ``DistributedSignalHandler`` of ``train.exit_signal``, or ``None``.

        ``None`` unless ``train.exit_signal_handler`` is on: the signal then keeps its default action.
        """
        if self._signal_handler is None:
            self._set_signal_handler()
        return self._signal_handler

    @property
    def straggler_timer(self) -> StragglerDetector:
        """megatron-core's ``StragglerDetector`` (the forward step times data loading and compute with it)."""
        if self._straggler_timer is None:
            self._straggler_timer = StragglerDetector()
        return self._straggler_timer

    @property
    def async_calls_queue(self) -> Any:
        """The queue of asynchronous checkpoint writes while async saves are on.

        Set when the run's checkpoint manager starts; ``checkpointing.schedule_async_save`` schedules on it. It
        outlives :meth:`reset_for_restart`: the aborted iteration's teardown closes it.
        """
        return self._async_calls_queue

    @async_calls_queue.setter
    def async_calls_queue(self, value: Any) -> None:
        self._async_calls_queue = value

    @property
    def nvrx_straggler_manager(self) -> Optional[NVRxStragglerDetectionManager]:
        """The straggler detection manager when ``cfg.nvrx_straggler`` is set, else ``None``; built once."""
        if (
            not self._nvrx_straggler_created
            and self._nvrx_straggler_manager is None
            and self._cfg is not None
            and self._cfg.nvrx_straggler is not None
        ):
            self._nvrx_straggler_manager = NVRxStragglerDetectionManager(self._cfg.nvrx_straggler)
            self._nvrx_straggler_created = True
        return self._nvrx_straggler_manager

    @nvrx_straggler_manager.setter
    def nvrx_straggler_manager(self, value: Any) -> None:
        self._nvrx_straggler_manager = value
        self._nvrx_straggler_created = True

    @property
    def energy_monitor(self) -> Optional[EnergyMonitor]:
        """megatron-core's ``EnergyMonitor`` when ``logger.log_energy`` is on (it reads GPU energy), else ``None``."""
        if (
            not self._energy_monitor_created
            and self._energy_monitor is None
            and self._cfg is not None
            and getattr(self._cfg.logger, "log_energy", False)
        ):
            self._energy_monitor = EnergyMonitor()
            self._energy_monitor_created = True
        return self._energy_monitor

    def _set_signal_handler(self) -> None:
        """Enter the handler of ``train.exit_signal`` when ``train.exit_signal_handler`` is on."""
        train = self._cfg.train
        if train is not None and train.exit_signal_handler:
            self._signal_handler = DistributedSignalHandler(train.exit_signal).__enter__()

    def reset_for_restart(self) -> None:
        """Forget every per-iteration handle so that an in-process restart builds new ones.

        The config, the fault tolerance state and client, and the async queue stay (the aborted iteration's
        teardown closes the queue). The signal handler is released, the TensorBoard writer closed, and the model
        config's callbacks bound to the aborted iteration's model and optimizer are cleared.
        """
        if self._cfg is not None and getattr(self._cfg, "model", None) is not None:
            model_config = getattr(self._cfg.model, "transformer", self._cfg.model)
            for name in _MODEL_CONFIG_CALLBACKS:
                if hasattr(model_config, name):
                    setattr(model_config, name, None)
        self._timers = None
        self._train_state = None
        if self._tensorboard_logger is not None:
            self._tensorboard_logger.close()
        self._tensorboard_logger = None
        self._wandb_logger = None
        self._mlflow_logger = None
        self._comet_logger = None
        self._energy_monitor = None
        self._energy_monitor_created = False
        if self._signal_handler is not None:
            self._signal_handler.release()
        self._signal_handler = None
        self._straggler_timer = None
        if self._nvrx_straggler_manager is not None:  # its detector is process-global: free it for the next manager
            from megatron.bridge.training.nvrx_straggler import safe_shutdown_nvrx_straggler_manager

            safe_shutdown_nvrx_straggler_manager(self._nvrx_straggler_manager)
        self._nvrx_straggler_manager = None
        self._nvrx_straggler_created = False
        self.stop_request = None
        self.start_time = time.time()
