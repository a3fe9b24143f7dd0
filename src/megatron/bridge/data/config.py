"""Dataset and data-loader configs in Megatron-Bridge's form: megatron-core's ``GPTDatasetConfig`` plus loader fields.

``GPTDatasetConfig`` *is* megatron-core's dataset config (``random_seed``, ``sequence_length``, ``blend``,
``split``, ``reset_position_ids``, ...) with the data-loader fields of :class:`DataloaderConfig` and the
``seq_length`` spelling recipes use. As in Megatron-Bridge, megatron-core's checks run in :meth:`finalize`
(``ConfigContainer.validate()`` calls it), not at construction, so dotted overrides can still change a recipe's
dataset. :class:`MockGPTDatasetConfig` is the same without data files: deterministic synthetic token sequences.
"""

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Optional

from megatron.bridge.data.base import DataloaderConfig
from megatron.bridge.utils.cpu_shims import before_megatron_core_import
from megatron.bridge.utils.fields import fail

before_megatron_core_import()  # noqa: E402 - on CPU, before megatron-core's fused ops are imported

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MCoreGPTDatasetConfig  # noqa: E402


@dataclass(init=False)
class GPTDatasetConfig(MCoreGPTDatasetConfig, DataloaderConfig):
    """megatron-core's GPT dataset config with data-loader fields; ``seq_length`` is ``sequence_length``."""

    def __init__(self, seq_length: Optional[int] = None, **kwargs: Any) -> None:
        if seq_length is not None:
            if kwargs.get("sequence_length", seq_length) != seq_length:
                raise TypeError(
                    f"{type(self).__name__}: seq_length={seq_length} and sequence_length="
                    f"{kwargs['sequence_length']} differ; give one of them"
                )
            kwargs["sequence_length"] = seq_length
        names = [f.name for f in dataclasses.fields(self) if f.init]
        unknown = [name for name in kwargs if name not in names]
        if unknown:
            close = difflib.get_close_matches(unknown[0], [*names, "seq_length"], n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{type(self).__name__} has no field {unknown[0]!r}{hint}")
        for f in dataclasses.fields(self):
            if f.name in kwargs:
                value = kwargs[f.name]
            elif f.default is not dataclasses.MISSING:
                value = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                raise TypeError(f"{type(self).__name__}: missing required field {f.name!r}")
            setattr(self, f.name, value)

    @property
    def seq_length(self) -> int:
        """The sequence length (``sequence_length``; the spelling Megatron-Bridge recipes use)."""
        return self.sequence_length

    @seq_length.setter
    def seq_length(self, value: int) -> None:
        self.sequence_length = value

    def finalize(self) -> None:
        """megatron-core's checks of the blend and split (and ``mock`` when there is no data); needs no tokenizer.

        megatron-core's GPT-specific post-init (which needs the built tokenizer) runs when the datasets are built.
        """
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(self, name) is None:
                fail(f"dataset.{name}", f"{name} is not set (megatron-core requires it)", "set it to False or True")
        BlendedMegatronDatasetConfig.__post_init__(self)
        DataloaderConfig.finalize(self)


@dataclass(init=False)
class MockGPTDatasetConfig(GPTDatasetConfig):
    """Synthetic data: no ``blend``; every sample is a deterministic function of ``random_seed`` and its index."""

    NO_FILES = ("blend", "blend_per_split")
    """megatron-core's data-file fields, which a mock config does not take (they stay ``None``)."""

    def __init__(self, seq_length: Optional[int] = None, **kwargs: Any) -> None:
        for name in self.NO_FILES:
            if name in kwargs:
                raise TypeError(
                    f"{type(self).__name__}.__init__() got an unexpected keyword argument {name!r} (mock data reads "
                    "no files: use GPTDatasetConfig)"
                )
        super().__init__(seq_length=seq_length, **kwargs)
        for name in self.NO_FILES:  # the class's None, as in Megatron-Bridge, where they are not init fields
            del self.__dict__[name]

    def finalize(self) -> None:
        """Refuse data files (a mock dataset reads none), then run :meth:`GPTDatasetConfig.finalize`."""
        for name in ("blend", "blend_per_split"):
            if getattr(self, name) is not None:
                raise TypeError(f"MockGPTDatasetConfig reads no data: {name} must be None (use GPTDatasetConfig)")
        super().finalize()


__all__ = ["GPTDatasetConfig", "MockGPTDatasetConfig"]
