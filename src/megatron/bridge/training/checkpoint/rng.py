"""Capture and restore every random generator a run uses, in a form that loads with ``weights_only=True``."""

import io
import random

import numpy as np
import torch

from megatron.bridge.utils.cpu_shims import training_on_cpu


def get_rng_state() -> dict:
    """Return python, numpy, torch (CPU and CUDA) and megatron-core tracker states as tensors and plain types."""
    from megatron.core import tensor_parallel

    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": py_gauss},
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
        "tracker": dict(tensor_parallel.get_cuda_rng_tracker().get_states()),
    }
    if not training_on_cpu():  # on a GPU node with dist.device=cpu, CUDA stays untouched
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore generators from :func:`get_rng_state`."""
    from megatron.core import tensor_parallel

    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and not training_on_cpu():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["tracker"]))


def snapshot_rng_state() -> tuple:
    """A cheap in-memory copy of every generator (no conversion; for :func:`restore_rng_state` in this process)."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    cuda = None if training_on_cpu() else torch.cuda.get_rng_state()
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda, dict(tracker)


def restore_rng_state(snapshot: tuple) -> None:
    """Restore generators from :func:`snapshot_rng_state`."""
    from megatron.core import tensor_parallel

    py, npy, cpu, cuda, tracker = snapshot
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(tracker))  # it keeps, and later writes into, the dict


_HEADER = 8  # bytes of little-endian payload length in front of a serialized state


def serialize_rng_state(state: dict) -> bytes:
    """Serialize :func:`get_rng_state` output (tensors and plain values only)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def rng_blob_length(payload: bytes) -> int:
    """Bytes :func:`rng_blob_to_tensor` needs for ``payload``."""
    return len(payload) + _HEADER


def rng_blob_to_tensor(payload: bytes, length: int) -> torch.Tensor:
    """A uint8 tensor of exactly ``length`` bytes: a length header, ``payload``, zero padding."""
    if rng_blob_length(payload) > length:
        raise ValueError(f"RNG state needs {rng_blob_length(payload)} bytes, only {length} reserved")
    out = torch.zeros(length, dtype=torch.uint8)
    out[:_HEADER] = torch.tensor(list(len(payload).to_bytes(_HEADER, "little")), dtype=torch.uint8)
    out[_HEADER : _HEADER + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return out


def rng_state_from_tensor(blob: torch.Tensor) -> dict:
    """Inverse of :func:`rng_blob_to_tensor`; loads with ``weights_only=True`` (no arbitrary unpickling)."""
    raw = blob.cpu().numpy().tobytes()
    size = int.from_bytes(raw[:_HEADER], "little")
    return torch.load(io.BytesIO(raw[_HEADER : _HEADER + size]), weights_only=True)
