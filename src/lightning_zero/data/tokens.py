"""Token files: raw little-endian ``uint16``/``uint32`` ids (``.bin``) or ``.npy``, memory-mapped,
with an optional ``.json`` record beside them (vocabulary size, dtype, tokenizer)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

TOKEN_DTYPES = ("uint16", "uint32")


BYTE_VOCAB = 256


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest token file dtype that holds ids below ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_tokens(path: Union[str, Path], tokens: np.ndarray, dtype: Optional[str] = None) -> Path:
    """Write 1-D token ids to ``path`` (``.npy``: numpy format, otherwise raw ``.bin``), atomically.

    ``dtype`` (``uint16``/``uint32``) defaults to the smallest that holds ``max(tokens)``.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0 or tokens.dtype.kind not in "iu":
        raise ValueError(
            f"write_tokens: tokens must be a non-empty 1-D integer array, got {tokens.dtype} {tokens.shape}"
        )
    low, high = int(tokens.min()), int(tokens.max())
    dtype = np.dtype(dtype) if dtype is not None else token_dtype(high + 1)
    if dtype.name not in TOKEN_DTYPES:
        raise ValueError(f"write_tokens: dtype must be one of {TOKEN_DTYPES}, got {dtype.name}")
    if low < 0 or high > np.iinfo(dtype).max:
        raise ValueError(f"write_tokens: ids span [{low}, {high}], which {dtype.name} cannot hold")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the target, then rename: concurrent writers (ranks) never expose a partial file.
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as handle:
        if path.suffix == ".npy":
            np.save(handle, tokens.astype(dtype))
        else:
            tokens.astype(dtype).tofile(handle)
    os.replace(handle.name, path)
    return path


def open_tokens(path: Union[str, Path], dtype: Union[str, np.dtype]) -> np.ndarray:
    """Memory-map a token file read-only: ``.npy`` keeps its own dtype, raw files use ``dtype``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"token file {str(path)!r} does not exist; write one with lightning_zero.data.write_tokens")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype.name not in TOKEN_DTYPES + ("int32", "int64"):
            raise ValueError(f"{str(path)!r}: expected a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        return tokens
    dtype = np.dtype(dtype)
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise ValueError(
            f"{str(path)!r} holds {size} bytes, not a whole number of {dtype.name} tokens "
            f"({dtype.itemsize} bytes each); pass the dtype it was written with"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def token_meta_path(path: Union[str, Path]) -> Path:
    """The JSON file next to a token file that records how it was made (``train.bin.json``)."""
    return Path(str(path) + ".json")


def read_token_meta(path: Union[str, Path]) -> Optional[dict[str, Any]]:
    """What :func:`prepare_tokens` recorded next to ``path`` (vocab size, dtype, ...), or ``None``."""
    meta_path = token_meta_path(path)
    if not meta_path.is_file():
        return None
    import json

    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as exc:
        raise ValueError(f"{meta_path}: unreadable token file metadata ({exc})") from exc
    if not isinstance(meta, dict) or "vocab_size" not in meta or "dtype" not in meta:
        raise ValueError(f"{meta_path}: token file metadata must record 'vocab_size' and 'dtype'")
    return meta
