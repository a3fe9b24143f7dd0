"""The process groups a model runs on (Megatron-Bridge's ``training.utils.pg_utils``)."""

from typing import Any, Union

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_attr_wrapped_model


def get_pg_collection(model: Union[Any, list[Any]]) -> ProcessGroupCollection:
    """The ``ProcessGroupCollection`` of ``model`` (a model chunk, possibly wrapped, or a list of chunks).

    megatron-core models carry the collection they were built with (``pg_collection``); a model without one runs on
    the global groups of ``megatron.core.parallel_state``.
    """
    chunk = model[0] if isinstance(model, list) else model
    try:
        return get_attr_wrapped_model(chunk, "pg_collection", allow_none=False)
    except RuntimeError as err:
        if "couldn't find attribute pg_collection" not in str(err):
            raise
        return ProcessGroupCollection.use_mpu_process_groups()


def checkpoint_process_groups() -> ProcessGroupCollection:
    """The groups a checkpoint is saved and read over (pp, tp, dp_cp, ep) from ``megatron.core.parallel_state``."""
    from megatron.core import parallel_state

    return ProcessGroupCollection(
        tp=parallel_state.get_tensor_model_parallel_group(),
        pp=parallel_state.get_pipeline_model_parallel_group(),
        dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True),
        ep=parallel_state.get_expert_model_parallel_group(check_initialized=False),
    )
