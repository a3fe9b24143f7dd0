"""What every dataset config shares, and the contract of a config that builds its own datasets.

Megatron-Bridge's ``data.base``: :class:`DataloaderConfig` (the loader fields every dataset config carries),
:class:`DatasetProvider` (a config whose :meth:`~DatasetProvider.build_datasets` returns the splits) and
:class:`DatasetBuildContext` (what training set-up tells it). Kept free of megatron-core imports: configs import it.
"""

import abc
from dataclasses import dataclass
from typing import Any, Literal, Optional


@dataclass(kw_only=True)
class DataloaderConfig:
    """How batches are loaded (``torch.utils.data.DataLoader`` settings)."""

    dataloader_type: Optional[Literal["single", "cyclic", "batch", "external"]] = None
    """Which sampler reads the datasets. ``"single"`` (``None`` means it): consecutive micro-batches from the
    consumed sample count on, so a resumed run reads what an uninterrupted one would. ``"batch"``: each data-parallel
    rank loads its share of a whole global batch at once (cut into micro-batches for the loop), the dataset shuffled
    per epoch. ``"external"``: a ``DatasetProvider``'s datasets are ready-made loaders, read as they are.
    ``"cyclic"`` (shuffled epochs) serves Megatron-Bridge's fine-tuning datasets, which this package does not
    provide, and is refused."""
    num_workers: int = 2
    """Data-loader worker processes per rank (0 loads in the training process)."""
    data_sharding: bool = True
    """Each data-parallel rank reads its own share of every global batch (read by the ``"cyclic"`` sampler)."""
    pin_memory: bool = True
    """Copy batches into pinned memory (only where a GPU is present)."""
    drop_last: bool = True
    """Drop a last incomplete batch. ``False`` with ``"batch"`` needs a dataset that reads index ``-1`` as a
    loss-masked padding sample, which none of this package's datasets is: such a config is refused unless the
    dataset is a whole number of global batches."""
    persistent_workers: bool = True
    """Keep workers alive between epochs (off when ``num_workers`` is 0)."""
    trust_remote_code: Optional[bool] = None
    """Run code shipped with a Hugging Face dataset."""
    dataloader_save: Optional[str] = None
    """Where a loader that can save its stream position (Megatron-Bridge's Energon loader) saves it. No loader of
    this package needs it: the data position is the consumed sample count, saved in every checkpoint."""
    dataloader_load: Optional[str] = None
    """Where such a loader's saved position is read from (see ``dataloader_save``)."""

    def finalize(self) -> None:
        """Settle dependent fields: workers cannot persist without workers."""
        if self.num_workers == 0:
            self.persistent_workers = False


@dataclass(frozen=True)
class DatasetBuildContext:
    """What training set-up tells a :class:`DatasetProvider` when it asks for the datasets."""

    train_samples: int
    """Global training samples the run reads in total."""
    valid_samples: int
    """Global validation samples the run reads in total (0: no validation split is needed)."""
    test_samples: int
    """Global test samples (0: no test split is needed)."""
    tokenizer: Any = None
    """The built tokenizer."""
    pg_collection: Any = None
    """megatron-core's ``ProcessGroupCollection`` of the run (``None`` outside a run)."""


@dataclass
class DatasetProvider(DataloaderConfig, abc.ABC):
    """A dataset config that builds its own datasets (Megatron-Bridge's custom-provider contract).

    Subclass it and implement :meth:`build_datasets`; training set-up calls it once with the sample counts the run
    needs and reads each returned map-style dataset with the sampler ``dataloader_type`` names, like the built-in
    datasets (a resumed run sees the same batches). A sample is a dict; the built-in forward step reads
    ``tokens``, ``labels``, ``loss_mask`` and ``position_ids``.
    """

    @abc.abstractmethod
    def build_datasets(self, context: DatasetBuildContext) -> tuple[Any, Any, Any]:
        """The train, validation and test datasets (``None`` for a split not provided)."""


__all__ = ["DataloaderConfig", "DatasetBuildContext", "DatasetProvider"]
