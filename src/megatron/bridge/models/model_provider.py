"""``ModelProviderMixin``: what every model provider adds to its config, building the model a rank trains.

A provider is a config that can build its model. Subclasses implement :meth:`ModelProviderMixin.provide` (one
model chunk) and :meth:`ModelProviderMixin.finalize` (checks and derived fields after overrides); the mixin adds
:meth:`~ModelProviderMixin.provide_distributed_model`, the training loop's way to get this rank's chunks: one per
virtual pipeline stage, built by :func:`get_model`, optionally changed by pre-wrap hooks (before the wrappers: e.g.
freezing layers), wrapped in mixed precision and megatron-core DDP, then handed to post-wrap hooks. Names and
signatures are Megatron-Bridge's.

Differences from Megatron-Bridge, each refused by name rather than ignored: torch.distributed and megatron-core model
parallelism must already be started (the training loop's ``initialize`` does it, with the backend the device calls
for; nothing here picks NCCL); FSDP, meta-device initialization and per-rank random initialization are not
available. ``device`` (ours) says where the parameters end up.
"""

import abc
from collections.abc import Callable, Mapping
from typing import Any, Generic, Optional, TypeVar, Union

import torch

from megatron.bridge.utils.cpu_shims import before_megatron_core_import

before_megatron_core_import()  # noqa: E402 - on CPU, before megatron-core's fused ops are imported

from megatron.core import parallel_state  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.pipeline_parallel.utils import (  # noqa: E402
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.module import Float16Module, MegatronModule  # noqa: E402

ModelT = TypeVar("ModelT", bound=MegatronModule)
WrapHook = Callable[[list[MegatronModule]], Optional[list[MegatronModule]]]
"""A hook on the model chunks; it may change them in place (returning ``None``) or return replacements."""


class ModelProviderMixin(abc.ABC, Generic[ModelT]):
    """Adds the distributed model build, overrides and wrap hooks to a provider that implements ``provide``."""

    @abc.abstractmethod
    def provide(
        self, pre_process: Optional[bool] = None, post_process: Optional[bool] = None, vp_stage: Optional[int] = None
    ) -> ModelT:
        """One chunk of stage ``vp_stage``; with the embedding if ``pre_process``, the output if ``post_process``."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Checks and derived fields, once every override is applied."""

    def apply_overrides_and_finalize(
        self, dtype: Optional[torch.dtype] = None, overrides: Optional[Mapping[str, object]] = None
    ) -> "ModelProviderMixin[ModelT]":
        """Set the parameter dtype (and ``fp16``/``bf16`` with it) and attributes, then :meth:`finalize`.

        Raises:
            AttributeError: an override names no attribute of this provider (nothing is set, nothing finalized).
        """
        for name in overrides or {}:
            if not hasattr(self, name):
                raise AttributeError(f"{type(self).__name__} has no attribute {name!r}.")
        if dtype is not None:
            self.params_dtype = dtype
            self.fp16 = dtype == torch.float16
            self.bf16 = dtype == torch.bfloat16
        for name, value in (overrides or {}).items():
            setattr(self, name, value)
        self.finalize()
        return self

    def provide_distributed_model(
        self,
        ddp_config: Optional[Any] = None,
        model_type: ModelType = ModelType.encoder_or_decoder,
        overlap_param_gather_with_optimizer_step: bool = False,
        fp16: Optional[bool] = None,
        bf16: Optional[bool] = None,
        use_megatron_fsdp: bool = False,
        use_torch_fsdp2: bool = False,
        wrap_with_ddp: bool = True,
        data_parallel_random_init: bool = False,
        use_cpu_initialization: Optional[bool] = False,
        init_model_with_meta_device: Optional[bool] = None,
        pre_wrap_hook: Union[WrapHook, list[WrapHook], None] = None,
        post_wrap_hook: Optional[WrapHook] = None,
        mixed_precision_wrapper: Optional[Callable[[Any, MegatronModule], MegatronModule]] = Float16Module,
        pg_collection: Optional[ProcessGroupCollection] = None,
        device: Optional[torch.device] = None,
    ) -> list[ModelT]:
        """The model chunks of this rank, wrapped for training (see :func:`get_model` for the arguments).

        ``pre_wrap_hook``/``post_wrap_hook`` given here replace the registered ones. The process groups
        (``pg_collection``, default megatron-core's global ones) are kept on the provider as ``_pg_collection``.

        Raises:
            ValueError: ``wrap_with_ddp`` without a ``ddp_config``.
            RuntimeError: torch.distributed or megatron-core model parallelism is not started.
        """
        if wrap_with_ddp and ddp_config is None:
            raise ValueError("ddp_config is required when wrap_with_ddp is True")
        if not torch.distributed.is_initialized() or not parallel_state.is_initialized():
            raise RuntimeError(
                "provide_distributed_model needs torch.distributed and megatron-core model parallelism started "
                "first. Fix: run it inside the training loop, or call megatron.bridge.training.initialize first."
            )
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self._pg_collection = pg_collection
        if isinstance(pre_wrap_hook, list):
            pre_hook: Optional[WrapHook] = _compose(list(pre_wrap_hook))
        else:
            pre_hook = pre_wrap_hook or self.pre_wrap_hook
        post_hook = post_wrap_hook or self.post_wrap_hook
        model = get_model(
            self,
            ddp_config=ddp_config,
            model_type=model_type,
            overlap_param_gather_with_optimizer_step=overlap_param_gather_with_optimizer_step,
            fp16=fp16,
            bf16=bf16,
            use_megatron_fsdp=use_megatron_fsdp,
            use_torch_fsdp2=use_torch_fsdp2,
            wrap_with_ddp=wrap_with_ddp,
            data_parallel_random_init=data_parallel_random_init,
            use_cpu_initialization=use_cpu_initialization,
            init_model_with_meta_device=init_model_with_meta_device,
            pre_wrap_hook=pre_hook,
            mixed_precision_wrapper=mixed_precision_wrapper,
            pg_collection=pg_collection,
            device=device,
        )
        if post_hook is not None:
            changed = post_hook(model)
            if changed is not None:
                model = changed
        return model

    @property
    def pre_wrap_hook(self) -> Optional[WrapHook]:
        """The registered pre-wrap hooks run in order as one hook; ``None`` when none is registered."""
        hooks = getattr(self, "_pre_wrap_hooks", None)
        return _compose(hooks) if hooks else None

    @property
    def post_wrap_hook(self) -> Optional[WrapHook]:
        """The registered post-wrap hooks run in order as one hook; ``None`` when none is registered."""
        hooks = getattr(self, "_post_wrap_hooks", None)
        return _compose(hooks) if hooks else None

    def register_pre_wrap_hook(self, hook: WrapHook, prepend: bool = False) -> None:
        """Run ``hook`` on the bare chunks before they are wrapped; first of all with ``prepend``."""
        _register(self, "_pre_wrap_hooks", hook, prepend)

    def register_post_wrap_hook(self, hook: WrapHook, prepend: bool = False) -> None:
        """Run ``hook`` on the wrapped chunks; first of all with ``prepend``."""
        _register(self, "_post_wrap_hooks", hook, prepend)


def _register(provider: Any, attribute: str, hook: WrapHook, prepend: bool) -> None:
    hooks = getattr(provider, attribute, None)
    if hooks is None:
        hooks = []
        setattr(provider, attribute, hooks)
    hooks.insert(0, hook) if prepend else hooks.append(hook)


def _compose(hooks: list[WrapHook]) -> WrapHook:
    """One hook running ``hooks`` in order, each on what the one before returned (or kept, when it returned None)."""

    def composed(model: list[MegatronModule]) -> list[MegatronModule]:
        for hook in hooks:
            changed = hook(model)
            if changed is not None:
                model = changed
        return model

    return composed


def get_model(
    model_provider: ModelProviderMixin,
    ddp_config: Optional[Any],
    model_type: ModelType = ModelType.encoder_or_decoder,
    overlap_param_gather_with_optimizer_step: bool = False,
    fp16: Optional[bool] = None,
    bf16: Optional[bool] = None,
    use_megatron_fsdp: bool = False,
    use_torch_fsdp2: bool = False,
    wrap_with_ddp: bool = True,
    data_parallel_random_init: bool = False,
    use_cpu_initialization: Optional[bool] = False,
    init_model_with_meta_device: Optional[bool] = None,
    pre_wrap_hook: Union[WrapHook, list[WrapHook], None] = None,
    mixed_precision_wrapper: Optional[Callable[[Any, MegatronModule], MegatronModule]] = Float16Module,
    *,
    pg_collection: ProcessGroupCollection,
    device: Optional[torch.device] = None,
) -> list[MegatronModule]:
    """Build this rank's chunks with ``model_provider.provide``, then hook, place, cast and wrap them.

    Args:
        model_provider: the provider (changed in place: ``fp16``/``bf16`` overrides, ``use_cpu_initialization``).
        ddp_config: megatron-core's ``DistributedDataParallelConfig``; needed with ``wrap_with_ddp``.
        model_type: megatron-core's model type, set on every chunk.
        overlap_param_gather_with_optimizer_step: megatron-core DDP's option of that name (needs the
            distributed optimizer).
        fp16: override the provider's fp16 (enabling it disables bf16).
        bf16: override the provider's bf16 (enabling it disables fp16).
        use_megatron_fsdp: not available here (refused).
        use_torch_fsdp2: not available here (refused).
        wrap_with_ddp: wrap each chunk in megatron-core DDP (the training loop needs it; inspection does not).
        data_parallel_random_init: not available here (refused); data-parallel replicas start equal because
            every rank seeds its generators alike.
        use_cpu_initialization: create the parameters on CPU (megatron-core's option).
        init_model_with_meta_device: not available here (refused).
        pre_wrap_hook: a hook, or hooks run in order, on the bare chunks.
        mixed_precision_wrapper: wraps each chunk when ``fp16`` or ``bf16`` is on; ``None``: no wrapper.
        pg_collection: the process groups (the pipeline group decides which chunks hold embedding and output).
        device: where the parameters end up; default: the current CUDA device, or the CPU with
            ``use_cpu_initialization`` or without CUDA.

    Returns:
        One module per virtual pipeline stage of this rank, in stage order.
    """
    for name, value in (
        ("use_megatron_fsdp", use_megatron_fsdp),
        ("use_torch_fsdp2", use_torch_fsdp2),
        ("init_model_with_meta_device", init_model_with_meta_device),
        ("data_parallel_random_init", data_parallel_random_init),
    ):
        if value:
            raise ValueError(f"get_model: {name}=True is not available in this package. Fix: leave it False.")
    if fp16 and bf16:
        raise ValueError("Only one of fp16 and bf16 can be enabled.")
    _apply_precision(model_provider, fp16, bf16)
    model_provider.use_cpu_initialization = bool(use_cpu_initialization)
    if device is None:
        on_gpu = torch.cuda.is_available() and not use_cpu_initialization
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if not torch.distributed.is_initialized() or torch.distributed.get_backend() == "gloo":
        from megatron.bridge.utils.cpu_shims import gloo_pipeline_settings

        gloo_pipeline_settings(model_provider)
    model = _create_model(model_provider, model_type, pg_collection)
    if pre_wrap_hook is not None:
        hook = _compose(pre_wrap_hook) if isinstance(pre_wrap_hook, list) else pre_wrap_hook
        changed = hook(model)
        if changed is not None:
            model = changed
    from megatron.core import tensor_parallel

    for chunk in model:
        for param in chunk.parameters():  # a hook may have added parameters (adapters)
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    model = [chunk.to(device) for chunk in model]
    if (model_provider.fp16 or model_provider.bf16) and mixed_precision_wrapper is not None:
        model = [mixed_precision_wrapper(model_provider, chunk) for chunk in model]
    if not wrap_with_ddp:
        return model
    from megatron.bridge.models.distributed import wrap_data_parallel

    return wrap_data_parallel(model, ddp_config, overlap_param_gather_with_optimizer_step)


def _apply_precision(provider: Any, fp16: Optional[bool], bf16: Optional[bool]) -> None:
    """Set ``fp16``/``bf16`` as asked (one on turns the other off) and the dtypes that follow from them."""
    if fp16 is None and bf16 is None:
        return
    if fp16 is not None:
        provider.fp16 = fp16
    if bf16 is not None:
        provider.bf16 = bf16
    if fp16 and bf16 is None:
        provider.bf16 = False
    if bf16 and fp16 is None:
        provider.fp16 = False
    dtype = torch.float16 if provider.fp16 else torch.bfloat16 if provider.bf16 else torch.float32
    for name in ("params_dtype", "pipeline_dtype", "autocast_dtype"):
        if hasattr(provider, name):
            setattr(provider, name, dtype)


def _create_model(
    provider: ModelProviderMixin, model_type: ModelType, pg_collection: ProcessGroupCollection
) -> list[MegatronModule]:
    """One chunk per virtual pipeline stage (one without interleaving); first/last stage from the pipeline group."""
    vp_size = getattr(provider, "virtual_pipeline_model_parallel_size", None)
    pp_group = pg_collection.pp
    stages: list[Optional[int]] = list(range(vp_size)) if vp_size is not None and pp_group.size() > 1 else [None]
    model = []
    for vp_stage in stages:
        if vp_stage is None:
            first, last = is_pp_first_stage(pp_group), is_pp_last_stage(pp_group)
            chunk = provider.provide(pre_process=first, post_process=last)
        else:
            first = is_vp_first_stage(vp_stage=vp_stage, vp_size=vp_size) and is_pp_first_stage(pp_group)
            last = is_vp_last_stage(vp_stage=vp_stage, vp_size=vp_size) and is_pp_last_stage(pp_group)
            chunk = provider.provide(pre_process=first, post_process=last, vp_stage=vp_stage)
            chunk.vp_stage = vp_stage
        chunk.model_type = model_type
        model.append(chunk)
    return model


__all__ = ["ModelProviderMixin", "get_model"]
