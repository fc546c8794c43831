"""Non-tensor training state (loops, schedulers, callbacks, RNG, data position) as JSON, never pickle.

[Note: state codec] Lightning's checkpoint dict, minus the model and optimizer tensors, is small
but full of Python types JSON lacks: tuples, dicts with int keys, small tensors (RNG states, a
callback's best score), numpy arrays (numpy's RNG state). :func:`encode` writes them as tagged
JSON objects (``{"__tuple__": [...]}``, ``{"__tensor__": {dtype, shape, base64 bytes}}``, ...) and
:func:`decode` turns them back. Anything else fails at *save* time with the key path that holds
it, so a checkpoint never needs an unpickler to load. Hyperparameters (``hyper_parameters`` and
friends) are informative only: values JSON cannot hold are kept as their ``repr`` with a warning.
"""

from __future__ import annotations

import base64
import random
import warnings
from typing import Any

import numpy as np
import torch

_MAX_INLINE_BYTES = 64 * 2**20
_TAGS = ("__tuple__", "__dict__", "__tensor__", "__ndarray__", "__repr__")
_LENIENT_KEYS = ("hyper_parameters", "hparams")


def _lenient(path: str) -> bool:
    return any(key in path for key in _LENIENT_KEYS)


def _array_record(array: np.ndarray) -> dict[str, Any]:
    array = np.ascontiguousarray(array)
    return {"dtype": array.dtype.str, "shape": list(array.shape), "data": base64.b64encode(array.tobytes()).decode()}


def encode(value: Any, path: str = "checkpoint") -> Any:
    """``value`` as JSON-ready data (see [Note: state codec]); ``TypeError`` names the key path."""
    if value is None or isinstance(value, (bool, int, float, str)):
        if type(value) in (bool, int, float, str) or value is None:
            return value
        # int/str subclasses (enums): keep their plain value
        return encode(value.value if hasattr(value, "value") else type(value).__mro__[1](value), path)
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        if tensor.numel() * tensor.element_size() > _MAX_INLINE_BYTES:
            raise TypeError(f"{path}: a {tuple(tensor.shape)} tensor is too large for the checkpoint's JSON state")
        dtype = str(tensor.dtype).removeprefix("torch.")
        raw = tensor.view(torch.uint8) if tensor.dtype == torch.bfloat16 else tensor
        record = _array_record(raw.numpy() if tensor.dtype != torch.bfloat16 else raw.numpy())
        record["torch_dtype"] = dtype
        record["shape"] = list(tensor.shape)
        return {"__tensor__": record}
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError(f"{path}: numpy object arrays cannot be stored")
        return {"__ndarray__": _array_record(value)}
    if isinstance(value, np.generic):
        return encode(value.item(), path)
    if isinstance(value, tuple):
        return {"__tuple__": [encode(item, f"{path}[{i}]") for i, item in enumerate(value)]}
    if isinstance(value, list):
        return [encode(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        plain = all(isinstance(key, str) and key not in _TAGS for key in value)
        if plain:
            return {key: encode(item, f"{path}.{key}") for key, item in value.items()}
        return {
            "__dict__": [[encode(key, f"{path}<key>"), encode(item, f"{path}.{key}")] for key, item in value.items()]
        }
    if _lenient(path):
        warnings.warn(f"lightning_zero checkpoint: {path} ({type(value).__name__}) is stored as its repr", stacklevel=2)
        return {"__repr__": repr(value)}
    raise TypeError(
        f"{path}: cannot store a {type(value).__module__}.{type(value).__qualname__} in a lightning_zero"
        " checkpoint (its non-tensor state is JSON so that loading never unpickles). Return plain"
        " types (dict, list, tuple, str, numbers, tensors) from the state_dict() that produced it."
    )


def _array_from(record: dict[str, Any]) -> np.ndarray:
    data = base64.b64decode(record["data"])
    return np.frombuffer(data, dtype=np.dtype(record["dtype"])).reshape(record["shape"]).copy()


def decode(value: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(value, list):
        return [decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, payload),) = value.items()
        if tag == "__tuple__":
            return tuple(decode(item) for item in payload)
        if tag == "__dict__":
            return {decode(key): decode(item) for key, item in payload}
        if tag == "__ndarray__":
            return _array_from(payload)
        if tag == "__repr__":
            return payload
        if tag == "__tensor__":
            dtype = getattr(torch, payload["torch_dtype"])
            array = _array_from({**payload, "shape": [-1]})
            tensor = torch.from_numpy(array)
            if dtype == torch.bfloat16:
                tensor = tensor.view(torch.bfloat16)
            return tensor.reshape(payload["shape"])
    return {key: decode(item) for key, item in value.items()}


# --------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's random states: torch (CPU and each CUDA device), numpy, Python."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(tuple(state["numpy"]))
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
