"""The ``checkpoint`` section of ``ConfigContainer``: where and how checkpoints are saved and loaded.

Megatron-Bridge's ``CheckpointConfig`` with its fields; import it from ``megatron.bridge.training.config``, as in
Megatron-Bridge (it lives here to keep that module short). Its ``finalize()`` runs the section's own checks
(``config_checks/sections.py``); ``ConfigContainer.validate()`` then checks it against the world size
(``config_checks/checkpoint.py``).
"""

from dataclasses import dataclass
from typing import Literal, Optional

from megatron.bridge.training.config_checks import sections as section_checks
from megatron.bridge.utils.fields import named_fields


@named_fields
@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoint save and load (global ``torch_dist`` tier; ``non_persistent_*`` is the local tier)."""

    save: Optional[str] = None
    """Directory to save checkpoints into; ``None`` disables saving."""
    save_interval: Optional[int] = None
    """Save every this many iterations (and at the end of training)."""
    most_recent_k: int = -1
    """Keep only the newest k committed checkpoints; -1 keeps all."""
    save_retain_interval: Optional[int] = None
    """Keep only the checkpoints whose iteration is a multiple of this, and the newest: with ``save_interval=100,
    save_retain_interval=1000`` every thousandth stays and each other one is deleted once a newer one is committed.
    A positive multiple of ``save_interval``; not with ``most_recent_k``. ``None``: ``most_recent_k`` decides."""
    save_optim: bool = True
    """Save the optimizer state."""
    save_rng: bool = True
    """Save every random generator's state."""
    load: Optional[str] = None
    """Directory to resume from (usually the same as ``save``); ``None`` starts from scratch."""
    load_optim: bool = True
    """Load the optimizer state."""
    load_rng: bool = True
    """Load the random generators' state."""
    load_main_params_from_ckpt: bool = False
    """Load fp32 main parameters from the checkpoint (needs ``load_optim=False``)."""
    non_persistent_save_interval: Optional[int] = None
    """Local-tier save interval in iterations."""
    non_persistent_ckpt_type: Optional[Literal["global", "local", "in_memory", "None"]] = None
    """Kind of non-persistent checkpoint: ``"local"`` (node-local storage through nvidia-resiliency-ext)."""
    non_persistent_global_ckpt_dir: Optional[str] = None
    """Directory of ``"global"`` non-persistent checkpoints."""
    non_persistent_local_ckpt_dir: Optional[str] = None
    """Node-local directory for the local tier."""
    non_persistent_local_ckpt_algo: Literal["fully_parallel", "atomic"] = "fully_parallel"
    """Local-tier save algorithm."""
    finetune: bool = False
    """Load only the weights and start at iteration 0."""
    pretrained_checkpoint: Optional[str] = None
    """Weights to start a finetuning run from."""
    ckpt_step: Optional[int] = None
    """Resume from exactly this iteration of ``load`` (it must exist and verify; no fallback to an older one)."""
    use_checkpoint_args: bool = False
    """Take model arguments from the checkpoint."""
    exit_on_missing_checkpoint: bool = False
    """Fail (exit code 3) when ``load`` holds no checkpoint at all, instead of starting from iteration 0."""
    global_save_failure_policy: Literal["stop", "continue_local"] = "stop"
    """What a global save does when its storage fails (too little free space before it, ``ENOSPC``/``EDQUOT`` or a
    read-only, unwritable or failing file system during it): ``"stop"`` ends the run with exit code 26 (full) or 27
    (unavailable); ``"continue_local"`` logs a warning each time, saves that state to the local tier instead and
    trains on (needs ``non_persistent_ckpt_type="local"``). Local-tier failures always stop."""
    save_retries: int = 3
    """How many times a global save whose storage failed with a transient error (``EIO``, ``ESTALE``, a lost network
    mount, ...: ``STORAGE_UNAVAILABLE``) is tried again before the run stops with exit code 27. Before each retry the
    failed attempt's files are removed (a loader never sees them) and it waits ``save_retry_backoff`` seconds,
    doubled at each retry (at most 60 s); the loop's lost time is goodput's ``save_retry``. A synchronous save is
    retried by every rank together; an asynchronous one by each rank's background writer, while training goes on.
    A full file system (``ENOSPC``/``EDQUOT``, exit code 26) is not retried: space does not come back by waiting.
    0: no retry."""
    save_retry_backoff: float = 1.0
    """Seconds to wait before the first retry of a failed global save (``save_retries``); each further retry waits
    twice as long as the one before, at most 60 s. 0: retry at once."""
    ckpt_format: Literal["torch_dist", "zarr", "fsdp_dtensor"] = "torch_dist"
    """On-disk format: megatron-core distributed checkpointing (``torch_dist``)."""
    fully_parallel_save: bool = True
    """Spread the writing of replicated tensors over data-parallel ranks."""
    async_save: bool = False
    """Write checkpoint files in a background process while training continues (needs ``torch_dist``)."""
    async_strategy: Literal["nvrx", "mcore"] = "nvrx"
    """Who runs asynchronous saves: nvidia-resiliency-ext's ``AsyncCallsQueue``."""
    use_persistent_ckpt_worker: bool = True
    """Keep one long-lived background writer process for asynchronous saves: megatron-core's on GPU; on CPU this
    package's, forked before the model exists and fed through shared memory (``checkpoint/snapshot_writer.py``)."""
    fully_parallel_load: bool = False
    """Spread checkpoint reading over data-parallel ranks and exchange the parts."""
    ckpt_assume_constant_structure: bool = False
    """Assume every save has the same structure: megatron-core checks it on the second save and from then on reuses
    the save plan instead of building and exchanging it (``torch_dist``; less blocking time per save)."""
    dist_ckpt_strictness: Literal[
        "assume_ok_unexpected",
        "log_unexpected",
        "log_all",
        "raise_unexpected",
        "raise_all",
        "return_unexpected",
        "return_all",
        "ignore_all",
    ] = "assume_ok_unexpected"
    """What loading does about keys the checkpoint and the model do not share (megatron-core ``StrictHandling``)."""
    replication: bool = False
    """Replicate local-tier shards to other nodes."""
    replication_jump: Optional[int] = None
    """Rank distance between replicas; ``None`` means ranks per node."""
    replication_factor: int = 2
    """Number of copies of each local-tier shard."""

    def finalize(self) -> None:
        """Check the section's own combinations (``ckpt_step`` needs ``load``, retention interval, ...)."""
        section_checks.finalize_checkpoint(self)
