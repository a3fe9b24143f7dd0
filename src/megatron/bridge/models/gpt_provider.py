"""``GPTModelProvider``: a megatron-core ``TransformerConfig`` that also builds the GPT model it describes.

As in Megatron-Bridge, the provider *is* the model's config: every ``TransformerConfig`` field (``num_layers``,
``hidden_size``, ``tensor_model_parallel_size``, ``bf16``, ...) is a field of it, plus the GPT ones below.
megatron-core's own checks and derived fields (``ffn_hidden_size`` of ``None`` becomes ``4 * hidden_size``, ...)
run in :meth:`finalize`, not at construction, so that a recipe's provider can still be changed by dotted
overrides; ``ConfigContainer.validate()`` finalizes it. :meth:`provide` builds megatron-core's ``GPTModel``
(``MCoreGPTModel`` here, as in Megatron-Bridge) with the layer spec ``transformer_layer_spec`` gives: by default
(:func:`default_layer_spec`) :func:`transformer_engine_layer_spec`, megatron-core's Transformer Engine spec, which
falls back to its local, plain-PyTorch spec where Transformer Engine is not installed or has no GPU to run on.
The distributed build (``provide_distributed_model``) comes from ``ModelProviderMixin``.

Fusions whose kernels the device lacks are turned off when the model is built for it (:meth:`for_device`): the fused
cross entropy (on by default, as in Megatron-Bridge) on CPU, and its Transformer Engine variant without a usable
Transformer Engine.
"""

import copy
import functools
import importlib.util
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch

from megatron.bridge.utils.cpu_shims import before_megatron_core_import, training_on_cpu

before_megatron_core_import()  # noqa: E402 - on CPU, before megatron-core's fused ops are imported

from megatron.core.models.gpt import GPTModel as MCoreGPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402

from megatron.bridge.models.model_provider import ModelProviderMixin  # noqa: E402

logger = logging.getLogger(__name__)


def local_layer_spec(config: "GPTModelProvider") -> ModuleSpec:
    """megatron-core's local GPT layer spec (plain PyTorch modules; runs on CPU and GPU)."""
    return get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)


def transformer_engine_layer_spec(config: "GPTModelProvider") -> ModuleSpec:
    """megatron-core's Transformer Engine GPT layer spec; its local spec where Transformer Engine is not usable.

    Transformer Engine needs its package and a GPU; without them the same layers are built from plain PyTorch
    modules (:func:`local_layer_spec`), logged once. The TE spec's norms read ``normalization`` from the config
    itself: the spec function takes no such argument.
    """
    if not transformer_engine_usable():
        _log_local_fallback()
        return local_layer_spec(config)
    return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)


def transformer_engine_full_layer_spec(config: "GPTModelProvider") -> ModuleSpec:
    """Megatron-Bridge's whole-layer Transformer Engine spec (``use_transformer_engine_full_layer_spec``): not here.

    Raises:
        ValueError: always; the layer is Megatron-Bridge's own Transformer Engine module, not megatron-core's.
    """
    raise ValueError(
        "model.use_transformer_engine_full_layer_spec: the full Transformer Engine layer spec is not available in "
        "this package. Fix: leave it False (the default spec uses Transformer Engine's modules where usable)."
    )


@functools.cache
def _log_local_fallback() -> None:
    logger.info("Transformer Engine is not usable here (not installed, or no GPU): using the local layer spec")


@functools.cache
def transformer_engine_usable() -> bool:
    """Whether Transformer Engine is installed, imports with megatron-core's wrappers of it, and has a GPU to run on.

    Without an installed ``transformer_engine`` nothing is imported (the answer is known from the import system).
    """
    if importlib.util.find_spec("transformer_engine") is None or training_on_cpu():
        return False
    try:
        import megatron.core.extensions.transformer_engine  # noqa: F401 - imports transformer_engine itself
    except Exception as err:  # a broken install raises more than ImportError (OSError for a missing CUDA library)
        logger.warning("transformer_engine is installed but does not import (%s); using the local layer spec", err)
        return False
    return True


def default_layer_spec(config: "GPTModelProvider") -> ModuleSpec:
    """The full-layer Transformer Engine spec when asked for, else :func:`transformer_engine_layer_spec`."""
    if config.use_transformer_engine_full_layer_spec:
        return transformer_engine_full_layer_spec(config)
    return transformer_engine_layer_spec(config)


def calculate_padded_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by * tensor_model_parallel_size``."""
    multiple = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


@dataclass
class GPTModelProvider(TransformerConfig, ModelProviderMixin[MCoreGPTModel]):
    """A GPT model: megatron-core's ``TransformerConfig`` plus what ``GPTModel`` takes; :meth:`provide` builds it."""

    fp16_lm_cross_entropy: bool = False
    """Compute the language-model cross entropy in fp16."""
    logit_dtype: Optional[torch.dtype] = None
    """dtype of the output logits; ``None``: megatron-core's choice. Needs a megatron-core whose ``GPTModel`` takes
    ``logit_dtype`` (Megatron-LM PR #6252); an older one refuses it when the model is built."""
    parallel_output: bool = True
    """Keep the logits split over tensor-parallel ranks (the loss is computed on the split logits)."""
    share_embeddings_and_output_weights: bool = True
    """Tie the input embedding and the output projection."""
    make_vocab_size_divisible_by: int = 128
    """With ``should_pad_vocab``: pad the vocabulary to a multiple of this times the tensor-parallel size."""
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    """Learned absolute position embeddings, or rotary ones."""
    rotary_base: int = 10000
    """Rotary embedding base (theta)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that is rotated."""
    seq_len_interpolation_factor: Optional[float] = None
    """Rotary position interpolation factor for longer sequences; ``None`` is none."""
    rope_scaling: bool = False
    """Scale the rotary frequencies for long contexts as Llama 3.1 does (megatron-core's ``rope_scaling``)."""
    rope_scaling_factor: float = 8.0
    """With ``rope_scaling``: what the lowest rotary frequencies are divided by (8 for Llama 3.1, 32 for Llama 3.2)."""
    seq_length: int = 1024
    """Sequence length of the training samples and the longest position embedded."""
    scatter_embedding_sequence_parallel: bool = True
    """With sequence parallelism: scatter the embedding output over the tensor-parallel ranks."""
    cross_entropy_loss_fusion: bool = True
    """Fused cross entropy (``cross_entropy_fusion_impl`` picks megatron-core's or Transformer Engine's kernel);
    turned off when the model is built on CPU, or for ``"te"`` where Transformer Engine is not usable."""
    mtp_enabled: bool = False
    """Multi-token prediction: not available here (``True`` is refused by :meth:`finalize`)."""
    restore_modelopt_state: bool = False
    """Restore a ModelOpt (quantization, sparsity) state: not available here (``True`` is refused)."""
    use_transformer_engine_full_layer_spec: bool = False
    """Megatron-Bridge's whole-layer Transformer Engine spec: not available here (``True`` is refused)."""
    vocab_size: Optional[int] = None
    """Vocabulary size (before padding); ``None`` takes the tokenizer's (``tokenizer.vocab_size``)."""
    should_pad_vocab: bool = False
    """Pad ``vocab_size`` to a multiple of ``make_vocab_size_divisible_by * tensor_model_parallel_size``."""
    transformer_layer_spec: Union[ModuleSpec, Callable[["GPTModelProvider"], ModuleSpec]] = default_layer_spec
    """The transformer layer's modules, or a function of this provider that returns them (``vp_stage`` too, if it
    takes it); by default Transformer Engine's where it is usable, else megatron-core's local ones."""

    def __post_init__(self) -> None:
        """Nothing yet: megatron-core's checks and derived fields wait for :meth:`finalize` (overrides come first)."""

    def finalize(self) -> None:
        """Run megatron-core's checks and fill its derived fields; safe to call again after a change.

        With pipeline parallelism, ``pipeline_dtype`` (the dtype of the activations stages exchange) of ``None``
        becomes the model's compute dtype.
        """
        for name in ("mtp_enabled", "restore_modelopt_state", "use_transformer_engine_full_layer_spec"):
            if getattr(self, name):
                raise ValueError(f"model.{name}: not available in this package. Fix: leave it False.")
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            self.pipeline_dtype = torch.bfloat16 if self.bf16 else self.params_dtype
        TransformerConfig.__post_init__(self)

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary size the embedding and output layers have."""
        if self.vocab_size is None:
            raise ValueError("model.vocab_size is not set: set it, or tokenizer.vocab_size with the NullTokenizer")
        if not self.should_pad_vocab:
            return self.vocab_size
        return calculate_padded_vocab_size(
            self.vocab_size, self.make_vocab_size_divisible_by, self.tensor_model_parallel_size
        )

    def provide(
        self, pre_process: Optional[bool] = None, post_process: Optional[bool] = None, vp_stage: Optional[int] = None
    ) -> MCoreGPTModel:
        """Build the ``GPTModel`` this provider describes (after ``torch.distributed`` and model parallelism start).

        Args:
            pre_process: build the embedding; ``None``: when this is the first pipeline stage.
            post_process: build the output layer; ``None``: when this is the last pipeline stage.
            vp_stage: the virtual pipeline stage of the chunk to build, if any.
        """
        from megatron.core import parallel_state

        if pre_process is None:
            pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
        if post_process is None:
            post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
        return MCoreGPTModel(
            config=self,
            transformer_layer_spec=self._layer_spec(vp_stage),
            vocab_size=self.padded_vocab_size,
            max_sequence_length=self.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            fp16_lm_cross_entropy=self.fp16_lm_cross_entropy,
            parallel_output=self.parallel_output,
            share_embeddings_and_output_weights=self.share_embeddings_and_output_weights,
            position_embedding_type=self.position_embedding_type,
            rotary_percent=self.rotary_percent,
            rotary_base=self.rotary_base,
            rope_scaling=self.rope_scaling,
            rope_scaling_factor=self.rope_scaling_factor,
            seq_len_interpolation_factor=self.seq_len_interpolation_factor,
            scatter_embedding_sequence_parallel=self.scatter_embedding_sequence_parallel,
            vp_stage=vp_stage,
            **self._logit_dtype_kwarg(),
        )

    def _logit_dtype_kwarg(self) -> dict:
        """``logit_dtype`` for ``MCoreGPTModel`` when one is asked for; a clear error where it is not taken."""
        if self.logit_dtype is None:
            return {}
        if "logit_dtype" not in inspect.signature(MCoreGPTModel).parameters:
            raise RuntimeError(
                f"model.logit_dtype={self.logit_dtype} needs a megatron-core whose GPTModel takes logit_dtype "
                "(Megatron-LM PR #6252); the installed one does not. Fix: leave logit_dtype None, or upgrade "
                "megatron-core."
            )
        return {"logit_dtype": self.logit_dtype}

    def _layer_spec(self, vp_stage: Optional[int]) -> ModuleSpec:
        spec = self.transformer_layer_spec
        if isinstance(spec, ModuleSpec):
            return spec
        if "vp_stage" in inspect.signature(spec).parameters:
            return spec(self, vp_stage=vp_stage)
        return spec(self)

    def for_device(self, device: torch.device) -> "GPTModelProvider":
        """A finalized copy whose parameters are created on ``device``'s side (on CPU without a GPU).

        The fused cross entropy is turned off where its kernel is missing: on CPU, and for Transformer Engine's
        (``cross_entropy_fusion_impl="te"``) where Transformer Engine is not usable.
        """
        provider = copy.copy(self)
        provider.use_cpu_initialization = self.use_cpu_initialization or device.type == "cpu"
        if provider.cross_entropy_loss_fusion and (
            device.type == "cpu" or (provider.cross_entropy_fusion_impl == "te" and not transformer_engine_usable())
        ):
            logger.info("fused cross entropy (%s) has no kernel here: unfused", provider.cross_entropy_fusion_impl)
            provider.cross_entropy_loss_fusion = False
        provider.finalize()
        return provider
