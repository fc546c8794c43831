"""``lightning-zero export CKPT OUT``: one consolidated state dict in the plain ``Llama`` layout.

Streaming: the output header (names, dtypes, dense shapes) is known from the checkpoint's
metadata before any tensor is read, so the safetensors file is written header first, then one
parameter at a time: each parameter is assembled from its saved rectangles (each read alone from
its ``.distcp`` file with ``torch.load(weights_only=True)``) and appended. Peak memory is one
parameter plus one saved rectangle. Runs without a process group.

``OUT`` ending in ``.safetensors`` gets safetensors; any other name (``.pt``, ``.bin``) gets a
``torch.save`` file of the same dict, written from a memory-mapped temporary safetensors file so
the tensors are paged from disk rather than held in memory. Either loads into
``Llama(config)`` with ``load_state_dict`` and no lightning_zero import::

    from safetensors.torch import load_file
    model.load_state_dict(load_file("llama.safetensors"))
    model.load_state_dict(torch.load("llama.pt", weights_only=True))
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

import lightning_zero.checkpoint.objstore as objstore
from lightning_zero.checkpoint.dcp import CheckpointError, read_dcp_metadata, storage_shape, unpickle_dcp_metadata

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class _FileWindow(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a seekable file of their own, so
    ``torch.load`` reads a saved rectangle straight into its tensor (no copy of the payload)."""

    def __init__(self, handle: Any, offset: int, length: int) -> None:
        super().__init__()
        self._handle, self._offset, self._length, self._position = handle, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = min(max(0, base + position), self._length)
        return self._position

    def readinto(self, buffer: Any) -> int:
        wanted = min(len(buffer), self._length - self._position)
        if wanted <= 0:
            return 0
        self._handle.seek(self._offset + self._position)
        got = self._handle.readinto(memoryview(buffer)[:wanted])
        self._position += got
        return got


def _read_rectangle(root: Any, storage: Any) -> torch.Tensor:
    if isinstance(root, str):  # a URL checkpoint's data prefix: one ranged read
        url = objstore.join(root, storage.relative_path)
        fs, inner = objstore.filesystem(url)
        data = fs.cat_file(inner, start=storage.offset, end=storage.offset + storage.length)
        if len(data) != storage.length:
            raise CheckpointError(f"{url}: truncated (wanted {storage.length} bytes at offset {storage.offset})")
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    path = root / storage.relative_path
    with open(path, "rb") as handle:
        if path.stat().st_size < storage.offset + storage.length:
            raise CheckpointError(f"{path}: truncated (wanted {storage.length} bytes at offset {storage.offset})")
        try:
            return torch.load(io.BufferedReader(_FileWindow(handle, storage.offset, storage.length)),
                              map_location="cpu", weights_only=True)  # fmt: skip
        except Exception as exc:
            raise CheckpointError(f"{path}: unreadable tensor at offset {storage.offset} ({exc})") from exc


def assemble(root: Path, metadata: Any, key: str) -> torch.Tensor:
    """The full dense (storage-shaped) tensor ``key`` from every saved rectangle."""
    entry = metadata.state_dict_metadata[key]
    full = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    covered = 0
    for chunk in entry.chunks:
        rectangle = _read_rectangle(root, metadata.storage_data[_index(key, chunk.offsets)])
        region = full
        for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
            region = region.narrow(dim, offset, size)
        region.copy_(rectangle.view(region.shape))
        covered += math.prod(chunk.sizes)
    if covered != full.numel():
        raise CheckpointError(f"{root}: {key} covers {covered} of {full.numel()} elements")
    return full


def _index(key: str, offsets: Any) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(key, torch.Size(offsets))


def dcp_metadata(root: Any) -> Any:
    """The DCP metadata of a checkpoint directory, or of a URL checkpoint's data prefix."""
    if isinstance(root, str):
        url = objstore.join(root, ".metadata")
        return unpickle_dcp_metadata(io.BytesIO(objstore.read_bytes(url, objstore.DEFAULT_POLICY)), url)
    return read_dcp_metadata(str(root / ".metadata"))


def _write_safetensors(root: Any, meta: dict[str, Any], out: Path, prefix: str, extra: dict[str, str]) -> None:
    metadata = dcp_metadata(root)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **extra}}
    order = []
    offset = 0
    for name, info in meta["params"].items():
        key = f"model.{name}"
        if key not in metadata.state_dict_metadata:
            raise CheckpointError(f"{root}: meta.json lists {name!r} but no tensor {key!r} was saved")
        entry = metadata.state_dict_metadata[key]
        if tuple(entry.size) != storage_shape(info["shape"]):
            raise CheckpointError(f"{root}: {key} has size {tuple(entry.size)}, meta.json says {info['shape']}")
        dtype = entry.properties.dtype
        nbytes = math.prod(info["shape"]) * torch.empty((), dtype=dtype).element_size()
        out_name = name[len(prefix) :] if prefix and name.startswith(prefix) else name
        header[out_name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": info["shape"],
            "data_offsets": [offset, offset + nbytes],
        }
        order.append((key, nbytes))
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(out, "wb") as handle:
        handle.write(struct.pack("<Q", len(blob)))
        handle.write(blob)
        for key, nbytes in order:
            tensor = assemble(root, metadata, key).contiguous()
            data = tensor.view(torch.uint8) if tensor.dtype == torch.bfloat16 else tensor
            raw = data.numpy().tobytes()
            if len(raw) != nbytes:
                raise CheckpointError(f"{root}: {key} assembled to {len(raw)} bytes, expected {nbytes}")
            handle.write(raw)
            del tensor, data, raw
        handle.flush()
        os.fsync(handle.fileno())


def _safetensors_to_torch(src: Path, out: Path) -> None:
    """``torch.save`` the tensors of ``src`` as memory-mapped views (paged, not held)."""
    with open(src, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    start = 8 + length
    mapped = np.memmap(src, dtype=np.uint8, mode="r")
    numpy_dtypes = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
                    "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}  # fmt: skip
    state = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        raw = torch.from_numpy(np.asarray(mapped[start + lo : start + hi]))
        if info["dtype"] == "BF16":
            tensor = raw.view(torch.bfloat16)
        else:
            tensor = raw.view(torch.from_numpy(np.empty(0, dtype=numpy_dtypes[info["dtype"]])).dtype)
        state[name] = tensor.reshape(info["shape"])
    torch.save(state, out)


def export(ckpt: Union[str, os.PathLike], out: Union[str, os.PathLike], *, prefix: Optional[str] = None) -> Path:
    """Consolidate the sharded checkpoint ``ckpt`` into one plain state dict at ``out``.

    Keys are the module's parameter names without ``prefix`` (default: the prefix recorded at
    save time, ``"model."`` for ``LlamaLM``, so keys match ``Llama.state_dict()``). Values are the
    fp32 master weights (buffers and frozen parameters in their own dtype), in dense shapes
    whatever dp/tp layout wrote them. Every file is verified (size, sha256) first. ``ckpt`` and
    ``out`` may be fsspec URLs (credentials from the environment; [Note: commit objects] in
    ``objstore.py``).
    """
    from lightning_zero.checkpoint.load import open_checkpoint

    if objstore.is_url(out):  # written here, then uploaded in one piece
        with tempfile.TemporaryDirectory() as local:
            written = export(ckpt, Path(local, objstore.basename(str(out))), prefix=prefix)
            fs, inner = objstore.filesystem(str(out))
            fs.put_file(str(written), inner)
        return out  # type: ignore[return-value]
    opened = open_checkpoint(ckpt)
    meta = opened.meta
    prefix = meta.get("export_prefix", "") if prefix is None else prefix
    extra = {"lightning_zero_format": meta["format"]}
    config = (
        opened.state.get("hyper_parameters", {}).get("config")
        if isinstance(opened.state.get("hyper_parameters"), dict)
        else None
    )
    if isinstance(config, dict):
        extra["config"] = json.dumps(config)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial.safetensors")
    try:
        _write_safetensors(opened.path, meta, partial, prefix, extra)
        if out.suffix == ".safetensors":
            os.replace(partial, out)
        else:
            _safetensors_to_torch(partial, out)
    finally:
        if partial.exists():
            partial.unlink()
    return out
