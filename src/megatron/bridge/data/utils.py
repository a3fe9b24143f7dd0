"""Which function builds a dataset config's splits (Megatron-Bridge's ``data.utils``).

:func:`get_dataset_provider` maps a dataset config to a provider function ``(train_val_test_num_samples,
dataset_config, tokenizer=None, pg_collection=None) -> (train, valid, test)`` that
:func:`megatron.bridge.data.loaders.build_train_valid_test_datasets` calls: this package's GPT configs (real files or
the mock stream) get :func:`pretrain_train_valid_test_datasets_provider`, a :class:`~megatron.bridge.data.base.
DatasetProvider` its own ``build_datasets``. Training set-up binds the run's tokenizer and process groups with
:func:`bind_provider_context`.
"""

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Optional

from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider
from megatron.bridge.data.builders import Samples, build_gpt_datasets
from megatron.bridge.data.checks import is_mock
from megatron.bridge.data.config import GPTDatasetConfig
from megatron.bridge.data.mock import MockGPTDataset

Splits = tuple[Optional[Any], Optional[Any], Optional[Any]]


def pretrain_train_valid_test_datasets_provider(
    train_val_test_num_samples: Sequence[int], dataset_config: GPTDatasetConfig, tokenizer: Any = None
) -> Splits:
    """The train, validation and test datasets of a GPT dataset config; ``None`` for a split needing no samples.

    Without data files (``MockGPTDatasetConfig``) each split is the endless mock stream of
    :mod:`megatron.bridge.data.mock` (vocabulary from the tokenizer; validation seeded ``random_seed + 1``, test
    ``+ 2``); with them, megatron-core's ``GPTDataset`` splits (:func:`~megatron.bridge.data.builders.
    build_gpt_datasets`, which every rank must call). ``tokenizer``: the built tokenizer; ``None`` reads
    ``dataset_config.tokenizer``.
    """
    tokenizer = tokenizer if tokenizer is not None else getattr(dataset_config, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            "building the GPT datasets needs the tokenizer (its vocabulary and end-of-document id): pass tokenizer= "
            "or set dataset_config.tokenizer"
        )
    counts = [int(n) for n in train_val_test_num_samples]
    if is_mock(dataset_config):
        seed, length = dataset_config.random_seed, dataset_config.sequence_length
        return tuple(  # type: ignore[return-value]
            MockGPTDataset(tokenizer.vocab_size, length, seed + i) if n > 0 else None for i, n in enumerate(counts)
        )
    built = build_gpt_datasets(dataset_config, tokenizer, *counts)
    return tuple(  # type: ignore[return-value]
        Samples(dataset) if dataset is not None and n > 0 else None for dataset, n in zip(built, counts)
    )


def _from_build_datasets(
    train_val_test_num_samples: Sequence[int],
    config: DatasetProvider,
    tokenizer: Any = None,
    pg_collection: Any = None,
) -> Splits:
    """A :class:`DatasetProvider`'s splits: its ``build_datasets`` with the counts, tokenizer and process groups."""
    train, valid, test = (int(n) for n in train_val_test_num_samples)
    context = DatasetBuildContext(train, valid, test, tokenizer=tokenizer, pg_collection=pg_collection)
    return config.build_datasets(context)


_REGISTRY: dict[type, Callable[..., Splits]] = {GPTDatasetConfig: pretrain_train_valid_test_datasets_provider}
"""Provider function per dataset config class (``MockGPTDatasetConfig`` is a ``GPTDatasetConfig``)."""


def get_dataset_provider(dataset_config: Any) -> Callable[..., Splits]:
    """The function that builds ``dataset_config``'s splits.

    Raises:
        KeyError: no provider for the config's class (it is neither a ``GPTDatasetConfig`` nor a ``DatasetProvider``).
    """
    for config_type, provider in _REGISTRY.items():
        if isinstance(dataset_config, config_type):
            return provider
    if isinstance(dataset_config, DatasetProvider):
        return _from_build_datasets
    raise KeyError(
        f"no dataset provider for a {type(dataset_config).__name__}: use GPTDatasetConfig, MockGPTDatasetConfig or a "
        "DatasetProvider subclass"
    )


def bind_provider_context(provider: Callable[..., Splits], *, tokenizer: Any, pg_collection: Any) -> Callable:
    """``provider`` with the run's tokenizer and process groups bound, where its signature takes them."""
    parameters = inspect.signature(provider).parameters
    bound = {"tokenizer": tokenizer, "pg_collection": pg_collection}
    return functools.partial(provider, **{name: value for name, value in bound.items() if name in parameters})


__all__ = ["bind_provider_context", "get_dataset_provider", "pretrain_train_valid_test_datasets_provider"]
