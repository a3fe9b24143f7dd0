"""Loss validation with megatron-core's re-run state machine, and a bounded way out of re-run restart loops.

Every micro-batch loss is checked where it is computed for NaN/Inf and, optionally, for a spike: the train loop's
forward step is wrapped by :func:`check_losses`, whose loss function calls :func:`validate_loss` on each loss.
What happens next depends on ``rerun_state_machine.rerun_mode``:

* ``disabled``: after the forward-backward passes, one all-reduce tells every rank whether any rank saw a
  non-finite loss; then every rank skips the optimizer step (up to ``max_consecutive_nan_skips`` in a row) or
  stops with exit 17. A spike is logged.
* ``validate_results``: megatron-core re-runs the step in place. A result the re-run does not reproduce is a
  transient fault: training continues with the re-run's result (upstream would stop with 17; the re-run passed
  validation and is exactly what a fault-free step computes). A reproducible NaN makes every rank save a
  checkpoint at the step and exit 16, so that the step is re-run from it on other hardware. When the restart lands
  on the same device (in-job restart always does), upstream exits 16 again, forever; here the restarts for one
  step are counted in ``<checkpoint.save>/rerun_attempts.json`` and bounded by ``max_rerun_restarts``, after
  which ``on_rerun_limit`` stops the job with 17 or falls back once to an older checkpoint.
* ``report_determinism_stats``: every step runs twice and rank 0 logs how much the two results differ.

The train loop drives a :class:`RerunController` at three moments: :meth:`~RerunController.passes` around the
forward-backward passes, :meth:`~RerunController.end_step` before the optimizer step, and
:meth:`~RerunController.export_state` / :meth:`~RerunController.import_state` with checkpoints. A rank whose loss
fails a check writes a ``fault_detected`` event (``rerun_nan``, ``rerun_spike``, or ``nan_guard``:
``events/stream.py``).
"""

import functools
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.bridge.training import losses
from megatron.bridge.training.checkpoint import layout
from megatron.bridge.training.checkpoint.rng import restore_rng_state, snapshot_rng_state
from megatron.bridge.training.config import RerunStateMachineConfig
from megatron.bridge.training.events import stream as event_stream
from megatron.bridge.training.events.stream import EventKind, Mechanism
from megatron.bridge.training.exit_codes import ExitCode
from megatron.bridge.utils import upstream
from megatron.bridge.utils.dist import on_rank0
from megatron.bridge.utils.fs import atomic_write_json

logger = logging.getLogger(__name__)

ATTEMPTS_FILE = "rerun_attempts.json"
"""Per-job record of the exit-16 restarts for one step, next to the checkpoints."""

_checks: Optional[RerunStateMachineConfig] = None
"""The loss checks of the running job (the loss function has no other way to see the config)."""


def build_rerun_state_machine(cfg: RerunStateMachineConfig) -> Any:
    """A megatron-core ``RerunStateMachine`` for ``cfg`` that also reports determinism stats correctly."""
    from megatron.core import rerun_state_machine as rsm
    from megatron.core import tensor_parallel

    class BridgeRerunStateMachine(upstream.base_class(f"{rsm.__name__}:RerunStateMachine")):
        """Upstream's machine; its stats report reads caller fields that do not exist, so report them here.

        Its per-step all-reduce (whether a rank asks for a re-run) also carries the training loop's own per-step
        flags when the loop hands them over (:meth:`RerunController.carry`): one collective per step, not two.
        """

        step_flags: Optional[Callable[[], Optional[list[int]]]] = None
        """The loop's flags of this rank for this step (``None``: none to agree), read at the all-reduce."""
        agreed_flags: Optional[tuple[bool, ...]] = None
        """Those flags as every rank agreed them in this step's all-reduce; taken by the loop."""

        def _reduce_any(self, value: Any) -> Any:
            # Only the initial run's single question of each step; a re-run's pair of questions goes as upstream's.
            flags = None
            if self.step_flags is not None and not isinstance(value, list) and self.state == rsm.RerunState.INITIAL_RUN:
                flags = self.step_flags()
            if flags is None:
                return super()._reduce_any(value)
            agreed = super()._reduce_any([value, *flags])
            self.agreed_flags = tuple(agreed[1:])
            return agreed[0]

        def _maybe_report_stats(self) -> None:
            if self.current_iteration % self.REPORTING_INTERVAL_ITERATIONS == 0:
                _report_determinism_stats(self)

    global _checks
    _checks = cfg
    tracker = tensor_parallel.get_cuda_rng_tracker
    machine = BridgeRerunStateMachine(
        # The model-parallel RNG tracker (dropout) must replay too; python/numpy/torch states upstream saves itself.
        state_save_func=lambda: {"tracker": tracker().get_states()},
        # set_states keeps the dict it is given and later forks write into it: hand it a copy, or a second restore
        # of the same step would see the generators as the re-run left them.
        state_restore_func=lambda saved: tracker().set_states(dict(saved["tracker"])),
        mode=rsm.RerunMode(cfg.rerun_mode),
        error_injector=rsm.RerunErrorInjector(
            error_injection_rate=cfg.error_injection_rate,
            error_injection_type=rsm.RerunDiagnostic(cfg.error_injection_type),
        ),
        result_rejected_tracker_filename=cfg.result_rejected_tracker_filename,
    )
    machine.spiky_loss_factor = cfg.spiky_loss_factor  # what ``losses.masked_next_token_loss`` compares spikes with
    return machine


def _report_determinism_stats(machine: Any) -> None:
    """Rank 0 logs, per validated quantity, how much the re-run's results differed from the initial run's."""
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object({c.message: s for c, s in machine.stats.items()}, gathered, dst=0)
    if dist.get_rank() != 0:
        machine.stats.clear()
        return
    mine = {c.message: s for c, s in machine.stats.items()}
    for message in sorted({m for per_rank in gathered for m in per_rank}):
        others = [per_rank[message] for per_rank in gathered[1:] if message in per_rank]
        if message in mine:
            mine[message].combine(others)
            stats = mine[message]
        else:
            stats, rest = others[0], others[1:]
            stats.combine(rest)
        logger.info(
            "determinism stats at iteration %d, '%s' (all ranks, since start): %s",
            machine.current_iteration,
            message,
            stats.print_stats(),
        )


def check_losses(forward_step: Callable) -> Callable:
    """``forward_step`` whose loss function checks each loss it computes (:func:`validate_loss`), then returns it.

    The loss checked is the first value the loss function returns (the mean, or the sum when it also returns a
    token count), as megatron-core's schedule receives it; a call for non-loss data is not checked.
    """

    @functools.wraps(forward_step)
    def checked_forward_step(*args: Any, **kwargs: Any) -> tuple[Any, Callable]:
        output, loss_func = forward_step(*args, **kwargs)
        if isinstance(loss_func, functools.partial) and loss_func.func is losses.masked_next_token_loss:
            return output, loss_func  # it checks its own loss, as its check_for_* flags say

        def checked_loss_func(*loss_args: Any, **loss_kwargs: Any) -> Any:
            outputs = loss_func(*loss_args, **loss_kwargs)
            if not loss_kwargs.get("non_loss_data", False):
                # A copy: the schedule divides the returned loss in place by the number of micro-batches, and the
                # state machine keeps the tensor to compare with its re-run.
                validate_loss(outputs[0].detach().clone())
            return outputs

        return output, checked_loss_func

    return checked_forward_step


def validate_loss(loss: torch.Tensor) -> None:
    """Check one micro-batch's loss (called where the loss is computed, inside the forward-backward passes)."""
    if _checks is None:
        return
    losses.validate_loss_value(loss, _checks.check_for_nan_in_loss, _checks.check_for_spiky_loss)


@dataclass
class StepVerdict:
    """What the train loop does with the step whose forward-backward passes just ran."""

    apply: bool = True
    """Run the optimizer step (False: the step is skipped or the run stops before it)."""
    stop: Optional[tuple[ExitCode, str]] = None
    """Stop with this code and reason."""
    checkpoint: str = "if_due"
    """When stopping: ``"if_due"`` (the usual rule: save unless this iteration is saved), ``"force"`` (save the
    pre-step state with the machine's state, replacing a checkpoint of this iteration) or ``"none"``."""
    skipped: bool = False
    """The step's loss was NaN/Inf and its update was dropped; the iteration still counts (its data is used)."""


class RerunController:
    """Drives megatron-core's re-run state machine from the train loop (see the module docstring)."""

    def __init__(self, cfg: RerunStateMachineConfig, save_dir: Optional[str]) -> None:
        from megatron.core.rerun_state_machine import RerunMode

        self.cfg = cfg
        self.save_dir = save_dir
        self.mode = RerunMode(cfg.rerun_mode)
        self._validating = self.mode == RerunMode.VALIDATE_RESULTS
        self._rng_after_pass: Optional[tuple] = None
        self._rng_before_step: Optional[tuple] = None
        self._guard = False
        self._passes = 0
        self.consecutive_nan_steps = 0
        self.transient_errors = 0

    @property
    def machine(self) -> Any:
        """The process's megatron-core ``RerunStateMachine``."""
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        return get_rerun_state_machine()

    def carry(self, step_flags: Optional[Callable[[], Optional[list[int]]]]) -> None:
        """Have the machine's per-step all-reduce carry ``step_flags()`` too (``None``: stop); see :meth:`agreed`."""
        machine = self.machine
        if hasattr(machine, "step_flags"):  # this package's machine (a user's own has no such hook)
            machine.step_flags, machine.agreed_flags = step_flags, None

    def agreed(self) -> Optional[tuple[bool, ...]]:
        """The carried flags as every rank agreed them in this step (``None``: the machine made no all-reduce)."""
        machine = self.machine
        agreed = getattr(machine, "agreed_flags", None)
        if agreed is not None:
            machine.agreed_flags = None
        return agreed

    def wrap_data_iterator(self, data_iterator: Iterator) -> Iterator:
        """The iterator the state machine can rewind (needed whenever it re-runs steps)."""
        from megatron.core.rerun_state_machine import RerunDataIterator, RerunMode

        return data_iterator if self.mode == RerunMode.DISABLED else RerunDataIterator(data_iterator)

    def passes(self, data_iterator: Iterator, iteration: int) -> Iterator[int]:
        """Yield once per forward-backward pass of the step after ``iteration`` (more than once for a re-run)."""
        from megatron.core.rerun_state_machine import RerunState

        machine = self.machine
        if machine.state == RerunState.NOT_RUNNING_YET:
            machine.current_iteration = iteration  # upstream increments it: its logs then name our step number
        # With validate_results, megatron-core's own all-reduced checks cover NaN/Inf from the second step of a
        # process on; the guard (one more all-reduce) covers the rest: the other modes and that first step.
        # A re-run only compares the one check that failed, so after more than one pass the guard runs as well.
        self._guard = self.cfg.check_for_nan_in_loss and not (self._validating and machine.first_iteration_complete)
        if self.cfg.check_for_nan_in_loss:
            self._rng_before_step = snapshot_rng_state()  # a NaN stop saves the state before the step, generators too
        self._passes = 0
        if hasattr(machine, "agreed_flags"):
            machine.agreed_flags = None  # only this step's all-reduce counts
        while machine.should_run_forward_backward(data_iterator):
            yield self._passes
            self._passes += 1
            if self._validating:
                self._rng_after_pass = snapshot_rng_state()

    def end_step(self, iteration: int, losses: list[dict]) -> StepVerdict:
        """Decide, identically on every rank, what happens to the step after ``iteration`` (see StepVerdict)."""
        from megatron.core.rerun_state_machine import RerunState

        machine = self.machine
        step = iteration + 1
        if self._validating and machine.state == RerunState.RERUNNING_IN_PLACE:
            # Only a result the re-run did not reproduce ends the passes in this state (upstream: stop with 17).
            restore_rng_state(self._rng_after_pass)  # as after a fault-free step: upstream rewound it for a save
            machine.state = RerunState.NOT_RUNNING_YET
            self.transient_errors += 1
            logger.warning(
                "iteration %d: the failed check (%s) was not reproduced by a re-run on the same device: a transient "
                "fault; training continues with the re-run's result (%d transient fault(s) in this run)",
                step,
                machine.failed_validation_call.caller.message if machine.failed_validation_call else "?",
                self.transient_errors,
            )
        should_save, should_exit, code = machine.should_checkpoint_and_exit()
        if should_exit:
            return self._rerun_exit(step, should_save, ExitCode(code))
        if self.cfg.check_for_nan_in_loss and (self._guard or self._passes > 1):
            return self._nan_guard(step, losses)
        return StepVerdict()

    def _nan_guard(self, step: int, losses: list[dict]) -> StepVerdict:
        """Every rank learns whether any rank's loss was NaN/Inf (one all-reduce); skip the step or stop."""
        local = [value for x in losses for value in x.values()]  # every reported loss, whatever its name
        device = local[0].device if local else torch.device("cpu")
        bad = torch.tensor([0 if all(torch.isfinite(v).all() for v in local) else 1], dtype=torch.int32, device=device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if not bad.item():
            self.consecutive_nan_steps = 0
            return StepVerdict()
        self.consecutive_nan_steps += 1
        where = "this rank" if any(not torch.isfinite(v).all() for v in local) else "another rank"
        if where == "this rank":
            event_stream.emit(
                EventKind.FAULT_DETECTED, mechanism=Mechanism.NAN_GUARD, rank=dist.get_rank(), iteration=step
            )
        if self.consecutive_nan_steps <= self.cfg.max_consecutive_nan_skips:
            logger.warning(
                "iteration %d: NaN/Inf loss (seen on %s): optimizer step skipped, gradients dropped (%d of "
                "rerun_state_machine.max_consecutive_nan_skips=%d in a row)",
                step,
                where,
                self.consecutive_nan_steps,
                self.cfg.max_consecutive_nan_skips,
            )
            return StepVerdict(apply=False, skipped=True)
        in_a_row = f" for {self.consecutive_nan_steps} steps in a row" if self.consecutive_nan_steps > 1 else ""
        reason = (
            f"NaN/Inf loss at iteration {step}{in_a_row} (seen on {where}); the step was not applied and the "
            f"checkpoint holds the state before it. Lower the learning rate or inspect the data, set "
            f"rerun_state_machine.rerun_mode=validate_results to tell a hardware fault from a training problem"
        )
        restore_rng_state(self._rng_before_step)  # the checkpoint written on the way out resumes exactly this step
        return StepVerdict(apply=False, stop=(ExitCode.RERUN_FAILED_VALIDATION, reason))

    # --------------------------------------------------------------- bounded restarts

    def _rerun_exit(self, step: int, save: bool, code: ExitCode) -> StepVerdict:
        """Upstream asks to exit: with 17 as is; with 16 only while the restarts for this step stay in bounds."""
        if code != ExitCode.RERUN_RESUME:
            return StepVerdict(
                apply=False,
                checkpoint="force" if save else "none",
                stop=(code, f"the result at iteration {step} failed validation (megatron-core re-run state machine)"),
            )
        record = on_rank0(lambda: self._count_restart(step), "updating the re-run record")
        restarts, fallbacks = record["restarts"], record["fallbacks"]
        limit = self.cfg.max_rerun_restarts
        if restarts <= limit:
            why = "to re-run it on other hardware" if save else "again: the restart landed on the same device"
            return StepVerdict(
                apply=False,
                checkpoint="force" if save else "none",
                stop=(code, f"iteration {step} reproducibly failed validation; restart {restarts} of {limit} {why}"),
            )
        failing = step - 1
        if self.cfg.on_rerun_limit == "fallback" and fallbacks == 0:
            older = on_rank0(lambda: self._fall_back(step, failing), "the fallback to an older checkpoint")
            if older is not None:
                return StepVerdict(
                    apply=False,
                    checkpoint="none",
                    stop=(
                        ExitCode.RERUN_RESUME,
                        f"iteration {step} kept failing validation from the checkpoint at iteration {failing} after "
                        f"{limit} restarts (rerun_state_machine.max_rerun_restarts); that checkpoint was set aside "
                        f"and the next start resumes from iteration {older}",
                    ),
                )
        tried = " and one fallback to an older checkpoint" if fallbacks else ""
        return StepVerdict(
            apply=False,
            checkpoint="none",
            stop=(
                ExitCode.RERUN_FAILED_VALIDATION,
                f"iteration {step} reproducibly failed validation and {limit} restarts "
                f"(rerun_state_machine.max_rerun_restarts){tried} could not re-run it on other hardware: in-job "
                f"restarts land on the same device. Stopping instead of looping. Resume on other nodes (e.g. exclude "
                f"this one) to finish the diagnosis from the checkpoint at iteration {failing}, or inspect that "
                f"checkpoint and the data at step {step}; delete {ATTEMPTS_FILE} in checkpoint.save to allow "
                f"{limit} more restarts",
            ),
        )

    def _attempts_path(self) -> str:
        if self.save_dir is None:
            raise RuntimeError("rerun_state_machine needs checkpoint.save to count its restarts (validate() checks)")
        return os.path.join(self.save_dir, ATTEMPTS_FILE)

    def _count_restart(self, step: int) -> dict:
        """Rank 0: add one exit-16 restart for ``step`` to the record and return it."""
        path = self._attempts_path()
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            record = {}
        if record.get("step") != step:
            record = {"step": step, "restarts": 0, "fallbacks": 0}
        record["restarts"] += 1
        atomic_write_json(path, record)
        return record

    def _fall_back(self, step: int, failing: int) -> Optional[int]:
        """Rank 0: rename the checkpoint at ``failing`` aside, point the tracker at the newest older one."""
        root = self.save_dir
        older = [it for it in layout.committed_iterations(root) if it < failing]
        if not older:
            logger.error("no checkpoint older than iteration %d to fall back to", failing)
            return None
        aside = layout.iter_dir(root, failing) + ".rerun_failed"
        n = 1
        while os.path.exists(aside):
            n += 1
            aside = f"{layout.iter_dir(root, failing)}.rerun_failed{n}"
        layout.write_tracker(root, older[0])
        if os.path.isdir(layout.iter_dir(root, failing)):
            os.rename(layout.iter_dir(root, failing), aside)
        record = {"step": step, "restarts": 0, "fallbacks": 1}
        atomic_write_json(self._attempts_path(), record)
        logger.error("set the checkpoint at iteration %d aside as %s; next start loads %d", failing, aside, older[0])
        return older[0]

    # --------------------------------------------------------------- checkpoint state

    def export_state(self) -> Optional[dict]:
        """Return this rank's machine state as plain values for a checkpoint (None unless a step is re-run)."""
        from megatron.core.rerun_state_machine import RerunState

        m = self.machine
        if m.state == RerunState.NOT_RUNNING_YET:
            return None
        call = m.failed_validation_call
        injector = m.error_injector
        return {
            "mode": m.mode.value,
            "state": m.state.value,
            "current_iteration": m.current_iteration,
            "flags": [m.rerun_requested, m.checkpoint_requested, m.restart_again_requested, m.continue_requested],
            "failed_validation_call": None if call is None else [call.caller.message, call.caller.rank, call.sequence],
            "initial_result": None if m.initial_result is None else float(m.initial_result),
            "suspicious_node": m.suspicious_node,
            "suspicious_device": None if m.suspicious_device is None else str(m.suspicious_device),
            "large_value_counts": dict(m.large_value_counts),
            "max_values": dict(m.max_values),
            "injector": [
                injector.error_injection_rate,
                injector.error_injection_type.value,
                None if injector.injected_error_type is None else injector.injected_error_type.value,
            ],
        }

    def import_state(self, saved: Optional[dict]) -> None:
        """Restore :meth:`export_state` output from a checkpoint (megatron-core ignores it when disabled)."""
        if saved is None:
            return
        from megatron.core import rerun_state_machine as rsm

        call, device, result = saved["failed_validation_call"], saved["suspicious_device"], saved["initial_result"]
        rate, kind, injected = saved["injector"]
        flags = saved["flags"]
        if device is not None:
            device = int(device) if device.isdigit() else torch.device(device)
        sharded = {
            "rerun_requested": flags[0],
            "checkpoint_requested": flags[1],
            "restart_again_requested": flags[2],
            "continue_requested": flags[3],
            "error_injector_checkpoint": {
                "error_injection_rate": rate,
                "error_injection_type": rsm.RerunDiagnostic(kind),
                "injected_error_type": None if injected is None else rsm.RerunDiagnostic(injected),
            },
            "failed_validation_call": (
                None if call is None else rsm.Call(rsm.Caller(message=call[0], rank=call[1]), call[2])
            ),
            "initial_result": None if result is None else torch.tensor(result),
            "suspicious_node": saved["suspicious_node"],
            "suspicious_device": device,
            "data_iterator_checkpoints": None,  # data resumes from consumed samples
            "large_value_counts": saved["large_value_counts"],
            "max_values": saved["max_values"],
        }
        self.machine.load_state_dict(
            {
                "mode": rsm.RerunMode(saved["mode"]),
                "state": rsm.RerunState(saved["state"]),
                "current_iteration": saved["current_iteration"],
                "sharded": sharded,
            }
        )
