"""The environment variables that config validation reads: the one list of them, each with why.

``ConfigContainer.validate()`` depends on the config and on these variables only (never on what CUDA reports: the
device is ``dist.device``). Launchers (torchrun, ``python -m megatron.bridge.launch``, ft_launcher, srun through
them) set most of them, and validation reads theirs through :func:`megatron.bridge.utils.launch_env.current`; the
rest are set by the job script. The table in ``docs/training/config-reference.md`` lists the same names, and a unit
test fails on a validation module that reads a variable missing here (directly or through ``launch_env``). A launch
variable that validation does not use but that is malformed (``RANK=abc``) still fails it: ``current()`` checks them
all.
"""

ENV_INPUTS: tuple[tuple[str, str], ...] = (
    ("WORLD_SIZE", "number of ranks (launcher), when validate() is not given world_size; 1 when unset"),
    ("LOCAL_RANK", "this rank's index on its node (launcher): the default of dist.local_rank"),
    ("LOCAL_WORLD_SIZE", "ranks per node (launcher): checkpoint replication and in-process restart's node groups"),
    ("MASTER_ADDR", "rendezvous host (launcher): in-process restart's store runs next to it"),
    ("MASTER_PORT", "rendezvous port (launcher): in-process restart's store listens on it plus an offset"),
    ("FT_RANK_MONITOR_IPC_SOCKET", "ft_launcher's rank monitor: ft.enable_ft_package needs one to report to"),
    ("TORCH_CPP_LOG_LEVEL", "in-process restart needs 'error' (job script): quiet c10d logs on abort"),
    ("TORCH_NCCL_RETHROW_CUDA_ERRORS", "in-process restart needs '0' (job script): NCCL errors do not kill ranks"),
    ("NCCL_NVLS_ENABLE", "in-process restart needs '0' (job script): NVLink SHARP off"),
    ("NCCL_ALGO", "model.deterministic_mode needs one of Tree, Ring, CollnetDirect, CollnetChain, ^NVLS (job script)"),
    ("MBRIDGE_FAULTS", "fault injection of launcher-driven runs (job script): checked like fault_injection.faults"),
    ("MBRIDGE_NNODES", "elastic range MIN:MAX (our launchers): every node count of it is checked at start"),
)
"""``(name, why validation reads it)`` for every environment variable the validation modules read."""

NAMES = frozenset(name for name, _ in ENV_INPUTS)
"""The names of :data:`ENV_INPUTS`."""
