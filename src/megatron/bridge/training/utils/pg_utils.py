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
