"""Megatron-Bridge's pluggable checkpoint manager protocol, over the function API of ``checkpointing.py``.

Failure handled: code written against Megatron-Bridge's manager protocol (``save(ctx, callback_manager)``,
``load(ctx)``, ``finalize_async_saves``, ``checkpointing_context``) must reach the run's own
:class:`~megatron.bridge.training.checkpoint.manager.CheckpointManager` (atomic commit, verified load), not a second
save path beside it. :class:`FunctionCheckpointManager` calls ``save_checkpoint``, ``load_checkpoint`` and
``maybe_finalize_async_save`` of the function API it is given, over one checkpointing context, looking each name up
at the call (a patch of one reaches it). ``checkpointing.py`` defines Megatron-Bridge's ``DefaultCheckpointManager``
as this class given that module: passed in, never imported (that module imports this package).
"""

from typing import Any

from megatron.bridge.training.checkpoint.contexts import CheckpointLoadContext, CheckpointSaveContext
from megatron.bridge.training.config import CheckpointConfig


class FunctionCheckpointManager:
    """A pluggable checkpoint manager over a function API (``checkpointing.py``'s).

    ``save_checkpoint``, ``load_checkpoint`` and ``maybe_finalize_async_save`` over one checkpointing context, which
    holds the run's ``CheckpointManager`` once the first save or load ran.

    Args:
        checkpoint_config: the run's checkpoint section.
        api: the module (or object) whose ``init_checkpointing_context``, ``save_checkpoint``, ``load_checkpoint``
            and ``maybe_finalize_async_save`` it calls.
    """

    def __init__(self, checkpoint_config: CheckpointConfig, api: Any) -> None:
        self.checkpoint_config = checkpoint_config
        self.api = api
        self._context: dict[str, Any] = api.init_checkpointing_context(checkpoint_config)

    @property
    def checkpointing_context(self) -> dict[str, Any]:
        """The context passed to every save and load (see ``init_checkpointing_context``)."""
        return self._context

    def save(self, ctx: CheckpointSaveContext, callback_manager: Any) -> None:
        """Save with ``save_checkpoint``."""
        self.api.save_checkpoint(
            state=ctx.state,
            model=ctx.model,
            optimizer=ctx.optimizer,
            opt_param_scheduler=ctx.opt_param_scheduler,
            num_floating_point_operations_so_far=ctx.num_floating_point_operations_so_far,
            checkpointing_context=self._context,
            non_persistent_ckpt=ctx.non_persistent_ckpt,
            train_data_iterator=ctx.train_data_iterator,
            pg_collection=ctx.pg_collection,
            callback_manager=callback_manager,
            module_name=ctx.module_name,
        )

    def load(self, ctx: CheckpointLoadContext) -> tuple[int, int]:
        """Load with ``load_checkpoint``; ``(iteration, floating point operations so far)``."""
        return self.api.load_checkpoint(
            state=ctx.state,
            model=ctx.model,
            optimizer=ctx.optimizer,
            opt_param_scheduler=ctx.opt_param_scheduler,
            strict=ctx.strict,
            checkpointing_context=self._context,
            skip_load_to_model_and_opt=ctx.skip_load_to_model_and_opt,
            pg_collection=ctx.pg_collection,
            module_name=ctx.module_name,
        )

    def finalize_async_saves(self, state: Any, blocking: bool = False, terminate: bool = False) -> None:
        """Commit the finished asynchronous saves (all of them: ``blocking``) with ``maybe_finalize_async_save``."""
        self.api.maybe_finalize_async_save(
            global_state=state, ckpt_cfg=self.checkpoint_config, blocking=blocking, terminate=terminate
        )
