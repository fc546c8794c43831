"""Hugging Face weight files: read tensors (or one rank's slice of them) and write sharded safetensors.

Model-agnostic: which checkpoint key feeds which parameter, and any layout change on the way (the
Llama q/k rotary permutation), is a *plan* the model family supplies (``models/llama/hf.py``).

Reading. :func:`open_weight_files` finds the weights of a directory in the order Hugging Face
does (``model.safetensors.index.json``, ``model.safetensors``, ``pytorch_model.bin.index.json``,
``pytorch_model.bin``) and reads only the headers: every tensor's file, dtype and shape. A shard
the index names but that is missing, a file shorter than its header says (truncated), or a
tensor the index places in a file that lacks it fails here, naming the file and the tensor,
before a single weight is read. :meth:`WeightFiles.read_into` then reads one tensor, or this rank's
slice of it along one dimension (rows permuted on the way, as the q/k rotary permutation needs),
straight into the destination parameter with positioned reads of the file's bytes: one read per run
of rows that follow each other in the file, none mapped, no copy besides the parameter (another
dtype or a device parameter goes through a buffer of at most :data:`READ_CHUNK_BYTES`).
:meth:`WeightFiles.read` returns a tensor (safetensors' slice reads). ``.bin`` files are opened
with ``torch.load(weights_only=True, mmap=True)`` (paged, never unpickling code).

Loading into a module. :func:`check_plan` compares a plan (``{param name: Source}``) with the
files: missing keys, unexpected keys (beyond the family's ignorable ones) and shape mismatches
fail together in one message, shapes on both sides. :func:`load_module_params` fills the
parameters a module holds directly, each with the slice its rank keeps under tensor parallelism
(``_tp_shard_dim`` on the parameter, ``tp_rank``/``tp_size`` on its module, the marks of
``lightning_zero.tp``), so a rank reads only what it keeps, one module at a time; a plan's
``transform`` there must be a row permutation (it is applied to row indices, not to data).

Writing. :func:`plan_layout` plans the files from names, shapes and dtypes (no tensor needed) as
``save_pretrained`` would (:func:`plan_shards`, :func:`save_order_key`): ``model.safetensors``
(one shard) or ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.
:func:`write_safetensors_shards` writes that layout in one process, each shard's header first and
then the tensors one at a time, so peak memory is one tensor whatever the model's size;
``hf_write.py`` writes it from every rank at once (no gather).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_zero.checkpoint.dcp import CheckpointError

PathLike = Union[str, os.PathLike]
READ_CHUNK_BYTES = 16 * 2**20  # the buffer of a read_into whose destination is not the file's bytes

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where a checkpoint tensor lives and what it is (from the file header, nothing read)."""

    key: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: Optional[int] = None  # safetensors: byte offset of the data in the file (None: .bin)


@dataclass(frozen=True)
class Source:
    """Where one parameter comes from: checkpoint ``key``, its expected dense ``shape``, and an
    optional ``transform(tensor, dim)`` applied to what was read (the whole tensor, or this
    rank's slice along ``dim``) before it is copied into the parameter."""

    key: str
    shape: tuple[int, ...]
    transform: Optional[Callable[[torch.Tensor, Optional[int]], torch.Tensor]] = None


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header, data start) of a safetensors file; ``CheckpointError`` if it is cut short or not one."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors header (truncated?)")
            (length,) = struct.unpack("<Q", prefix)
            if length > size - 8:
                raise CheckpointError(f"{path}: header claims {length} bytes but the file has {size} (truncated?)")
            header = json.loads(handle.read(length))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a safetensors file (unreadable header: {exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not a mapping)")
    start = 8 + length
    end = max((int(info["data_offsets"][1]) for key, info in header.items() if key != "__metadata__"), default=0)
    if start + end > size:
        last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
        raise CheckpointError(
            f"{path}: truncated: its header places tensor {last!r} up to byte {start + end}, the file has {size} bytes"
        )
    return header, start


def _safetensors_infos(path: Path) -> dict[str, TensorInfo]:
    header, start = read_safetensors_header(path)
    infos = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(
                f"{path}: tensor {key!r} has dtype {info.get('dtype')!r}, not one of {sorted(SAFETENSORS_DTYPES)}"
            )
        shape = tuple(int(s) for s in info["shape"])
        infos[key] = TensorInfo(key, path, dtype, shape, start + int(info["data_offsets"][0]))
    return infos


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # truncated zip, pickle with code, old non-zip format
        raise CheckpointError(f"{path}: unreadable as a weights-only torch file ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a mapping of names to tensors")
    return dict(state)


class WeightFiles:
    """The tensors of a Hugging Face weights directory, by checkpoint key (headers only; see module doc)."""

    def __init__(self, directory: PathLike) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory (expected a Hugging Face model directory)")
        self.infos: dict[str, TensorInfo] = {}
        self._bin_cache: tuple[Optional[Path], dict[str, torch.Tensor]] = (None, {})
        index_name = next(
            (n for n in (SAFE_INDEX, SAFE_SINGLE, BIN_INDEX, BIN_SINGLE) if (self.directory / n).is_file()), None
        )
        if index_name is None:
            raise CheckpointError(
                f"{self.directory}: no weights found; expected {SAFE_INDEX}, {SAFE_SINGLE}, {BIN_INDEX} or {BIN_SINGLE}"
            )
        self.format = "safetensors" if index_name.startswith("model.safetensors") else "bin"
        if index_name.endswith(".index.json"):
            self._open_index(self.directory / index_name)
        else:
            self._open_file(self.directory / index_name, expected=None)

    def _open_index(self, index_path: Path) -> None:
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: not a weights index with a 'weight_map' ({exc})") from exc
        by_file: dict[str, list[str]] = {}
        for key, file_name in weight_map.items():
            by_file.setdefault(str(file_name), []).append(key)
        for file_name, keys in sorted(by_file.items()):
            path = self.directory / file_name
            if not path.is_file():
                raise CheckpointError(
                    f"{path}: missing; {index_path.name} places {len(keys)} tensor(s) there, e.g. {sorted(keys)[0]!r}"
                )
            self._open_file(path, expected=keys)

    def _open_file(self, path: Path, expected: Optional[list[str]]) -> None:
        if self.format == "safetensors":
            infos = _safetensors_infos(path)
        else:
            state = _load_bin(path)
            infos = {k: TensorInfo(k, path, v.dtype, tuple(v.shape)) for k, v in state.items()}
        if expected is not None:
            absent = sorted(set(expected) - set(infos))
            if absent:
                raise CheckpointError(
                    f"{path}: lacks tensor {absent[0]!r} (and {len(absent) - 1} more) that the index places there"
                )
            infos = {k: infos[k] for k in expected}
        self.infos.update(infos)

    def keys(self) -> list[str]:
        return list(self.infos)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_bin_cache"] = (None, {})  # memory-mapped tensors: re-opened where needed, never pickled
        return state

    def read_into(
        self,
        key: str,
        dest: torch.Tensor,
        *,
        dim: Optional[int] = None,
        start: int = 0,
        rows: Optional[torch.Tensor] = None,
    ) -> int:
        """Fill ``dest`` with tensor ``key`` (or elements ``[start, start + dest.shape[dim])`` of it
        along ``dim``, 0 or 1), reading byte ranges of the safetensors file straight into
        ``dest``'s memory: no copy of the tensor exists besides ``dest`` (a different dtype or a
        device tensor goes through a buffer of at most :data:`READ_CHUNK_BYTES`). ``rows``:
        ``dest`` row ``r`` is the file's row ``rows[r]`` (a row permutation; along ``dim`` 0 the
        indices are into the slice's rows). Returns bytes read. ``.bin`` files: :meth:`read` then copy."""
        info = self.infos.get(key)
        if info is None:
            raise CheckpointError(f"{self.directory}: no tensor {key!r}")
        if info.offset is None or dim not in (None, 0, 1) or (dim == 1 and len(info.shape) != 2):
            piece = self.read(key, dim, start, dest.shape[dim] if dim is not None else None)
            piece = piece if rows is None else piece[rows]
            dest.copy_(piece.view(dest.shape))
            return piece.numel() * piece.element_size()
        shape = info.shape or (1,)
        cols = math.prod(shape[1:])
        n_rows = dest.shape[0] if dest.dim() else 1
        width = dest.numel() // max(1, n_rows)
        src = (torch.arange(n_rows) if rows is None else rows.reshape(-1)) + (start if dim == 0 else 0)
        c0 = start if dim == 1 else 0
        item = torch.empty((), dtype=info.dtype).element_size()
        direct = dest.device.type == "cpu" and dest.dtype == info.dtype and dest.is_contiguous()
        flat = dest.reshape(n_rows, width)
        # runs of whole rows that follow each other in the file: one read each (a column slice:
        # one read per row); through a bounded buffer when dest cannot take the file's bytes
        follows = torch.cat([torch.tensor([False]), src[1:] - src[:-1] == 1]) if width == cols else None
        starts = [0] + (torch.nonzero(~follows[1:]).reshape(-1) + 1).tolist() if follows is not None else None
        runs = list(zip(starts, starts[1:] + [n_rows])) if starts is not None else [(r, r + 1) for r in range(n_rows)]
        per_chunk = n_rows if direct else max(1, READ_CHUNK_BYTES // max(1, width * item))
        read = 0
        with open(info.path, "rb", buffering=0) as handle:
            for a, b in runs:
                for lo in range(a, b, per_chunk):
                    hi = min(b, lo + per_chunk)
                    target = flat[lo:hi] if direct else torch.empty((hi - lo, width), dtype=info.dtype)
                    handle.seek(info.offset + (int(src[lo]) * cols + c0) * item)
                    view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
                    while view:
                        got = handle.readinto(view)
                        if not got:
                            raise CheckpointError(f"{info.path}: tensor {key!r} ends early (truncated?)")
                        view = view[got:]
                    if not direct:
                        flat[lo:hi].copy_(target)
                    read += target.numel() * item
        return read

    def read(self, key: str, dim: Optional[int] = None, start: int = 0, length: Optional[int] = None) -> torch.Tensor:
        """Tensor ``key``, or elements ``[start, start + length)`` of it along ``dim`` (a new tensor)."""
        info = self.infos.get(key)
        if info is None:
            raise CheckpointError(f"{self.directory}: no tensor {key!r}")
        index: tuple[slice, ...] = ()
        if dim is not None:
            length = info.shape[dim] - start if length is None else length
            index = (slice(None),) * dim + (slice(start, start + length),)
        try:
            if self.format == "safetensors":
                from safetensors import safe_open

                with safe_open(str(info.path), framework="pt", device="cpu") as handle:
                    piece = handle.get_slice(key)[index] if index else handle.get_tensor(key)
                return piece.contiguous()
            cached_path, state = self._bin_cache
            if cached_path != info.path:
                state = _load_bin(info.path)
                self._bin_cache = (info.path, state)
            tensor = state[key]
            return (tensor[index] if index else tensor).clone()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{info.path}: reading tensor {key!r} failed ({type(exc).__name__}: {exc})") from exc


def open_weight_files(directory: PathLike) -> WeightFiles:
    """Index the weights of a Hugging Face model directory (see :class:`WeightFiles`)."""
    return WeightFiles(directory)


def check_plan(files: WeightFiles, plan: Mapping[str, Source], ignore: Iterable[str] = ()) -> None:
    """Raise ``CheckpointError`` unless every source key exists with its expected shape and every
    checkpoint key feeds some parameter (keys matching a regex in ``ignore`` may be left over)."""
    ignored = [re.compile(pattern) for pattern in ignore]
    problems = []
    for name, source in plan.items():
        info = files.infos.get(source.key)
        if info is None:
            problems.append(f"missing tensor {source.key!r} (for parameter {name}, shape {list(source.shape)})")
        elif info.shape != tuple(source.shape):
            problems.append(
                f"{info.path.name}: tensor {source.key!r} has shape {list(info.shape)}, "
                f"parameter {name} needs {list(source.shape)}"
            )
    used = {source.key for source in plan.values()}
    for key, info in files.infos.items():
        if key not in used and not any(pattern.fullmatch(key) for pattern in ignored):
            problems.append(
                f"{info.path.name}: unexpected tensor {key!r} (shape {list(info.shape)}) that no parameter takes"
            )
    if problems:
        shown = "; ".join(problems[:12]) + (f"; and {len(problems) - 12} more" if len(problems) > 12 else "")
        raise CheckpointError(f"{files.directory}: does not match the model: {shown}")


@torch.no_grad()
def load_module_params(module: nn.Module, prefix: str, files: WeightFiles, plan: Mapping[str, Source]) -> int:
    """Fill every parameter under ``module`` (named ``prefix + name``) from ``files`` per ``plan``.

    A tensor-parallel parameter gets only its rank's slice, read as a slice. Returns bytes read.
    """
    bytes_read = 0
    for sub_name, sub in module.named_modules(prefix=prefix.rstrip(".")):
        for param_name, param in sub._parameters.items():
            if param is None:
                continue
            name = f"{sub_name}.{param_name}" if sub_name else param_name
            source = plan.get(name)
            if source is None:
                raise CheckpointError(f"{files.directory}: no checkpoint tensor is mapped to parameter {name}")
            dim = getattr(param, "_tp_shard_dim", None)
            tp_size = getattr(sub, "tp_size", 1)
            split = dim is not None and tp_size > 1
            info = files.infos[source.key]
            wanted = list(info.shape)
            if split:
                wanted[dim] = param.shape[dim]
            if tuple(wanted) != tuple(param.shape):
                raise CheckpointError(
                    f"{files.directory}: tensor {source.key!r} gives shape {wanted} for parameter "
                    f"{name} of shape {list(param.shape)}"
                )
            rows = None
            if source.transform is not None:  # a row permutation (the q/k rotary one): where each row reads
                count = param.shape[0]
                rows = source.transform(torch.arange(count).reshape(count, 1), dim if split else None).reshape(-1)
            start = sub.tp_rank * param.shape[dim] if split else 0
            bytes_read += files.read_into(source.key, param.data, dim=dim if split else None, start=start, rows=rows)
    return bytes_read


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(text: Union[str, int]) -> int:
    """Bytes from ``5GB`` (10^9, as Hugging Face counts), ``500MB``, ``2GiB`` or a plain number."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(
                f"size {text!r}: expected a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB), e.g. 5GB"
            )
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value < 1:
        raise ValueError(f"size {text!r} must be at least 1 byte")
    return value


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its name, shape and dtype (known before the tensor is produced)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def save_order_key(name: str) -> list[tuple]:
    """transformers 5's ``dot_natural_key``: the order ``save_pretrained`` cuts a loaded model's
    tensors into files in (see :func:`plan_layout`): dotted parts, numbers numerically first,
    words alphabetically, a word's trailing digits numerically."""
    parts: list[tuple] = []
    for part in name.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
            continue
        text = part.rstrip("0123456789")
        digits = part[len(text) :]
        parts.append((1, text, int(digits)) if digits else (1, text))
    return parts


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Cut ``specs`` (in order) into shards as ``save_pretrained`` does (``huggingface_hub``'s
    ``split_torch_state_dict_into_shards``): a tensor joins the current shard unless that would pass
    ``max_shard_bytes``, which then closes; a tensor bigger than the limit gets a shard of its own,
    placed *before* the still-open current shard."""
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if spec.nbytes > max_shard_bytes:
            shards.append([spec])
            continue
        if size + spec.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current or not shards:
        shards.append(current)
    return shards


@dataclass(frozen=True)
class ShardFile:
    """One safetensors file of an :class:`HFLayout`: its name, its header (length prefix, JSON,
    padding: the bytes before the data), its tensors, and where each tensor's data starts."""

    name: str
    header: bytes
    specs: tuple[TensorSpec, ...]
    data_offsets: dict[str, int]  # tensor name -> byte offset from the file's start

    @property
    def size(self) -> int:
        return len(self.header) + sum(spec.nbytes for spec in self.specs)


@dataclass(frozen=True)
class HFLayout:
    """The files of a Hugging Face weights directory, planned from names, shapes and dtypes alone
    (no tensor): what ``save_pretrained`` writes for the same tensors and ``max_shard_bytes``.

    ``index`` is ``model.safetensors.index.json``'s content (``None`` for one file): the
    ``weight_map`` and ``metadata`` ``total_size`` / ``total_parameters``, as transformers 5 writes
    them (every tensor a parameter, none shared)."""

    files: tuple[ShardFile, ...]
    index: Optional[dict[str, Any]]

    def locate(self, name: str) -> tuple[ShardFile, int]:
        """(file, byte offset of the data of tensor ``name`` in it)."""
        for shard in self.files:
            if name in shard.data_offsets:
                return shard, shard.data_offsets[name]
        raise KeyError(name)

    def index_text(self) -> str:
        """The index file's text, byte for byte as ``save_pretrained`` writes it."""
        return json.dumps(self.index, indent=2, sort_keys=True) + "\n"


def plan_layout(
    specs: list[TensorSpec], max_shard_bytes: int, *, metadata: Optional[dict[str, str]] = None
) -> HFLayout:
    """The :class:`HFLayout` of ``specs`` cut at ``max_shard_bytes``, the grouping transformers 5's
    ``save_pretrained`` chooses for a model loaded with ``from_pretrained``: it sorts the state dict
    by :func:`save_order_key` before cutting (``revert_weight_conversion``), so re-saving our export
    with transformers gives the same files. (A model built from a config, never loaded, is cut in
    its registration order instead: same tensors, same total, other boundaries.)"""
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError("plan_layout: duplicate tensor names")
    shards = plan_shards(sorted(specs, key=lambda spec: save_order_key(spec.name)), max_shard_bytes)
    count = len(shards)
    files = []
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        file_name = SAFE_SINGLE if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        for spec in shard:
            header[spec.name] = {
                "dtype": DTYPE_NAMES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
            weight_map[spec.name] = file_name
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        prefix = struct.pack("<Q", len(blob)) + blob
        starts, position = {}, len(prefix)
        for spec in shard:
            starts[spec.name] = position
            position += spec.nbytes
        files.append(ShardFile(file_name, prefix, tuple(shard), starts))
    index = None
    if count > 1:
        total_size = sum(spec.nbytes for spec in specs)
        total_parameters = sum(math.prod(spec.shape) for spec in specs)
        index = {"metadata": {"total_parameters": total_parameters, "total_size": total_size},
                 "weight_map": weight_map}  # fmt: skip
    return HFLayout(tuple(files), index)


def upload_directory(local: Path, url: str) -> None:
    """Publish the Hugging Face directory written at ``local`` to the fsspec ``url``
    (``objstore.filesystem``: credentials from the environment): the weight files first, then the
    index and ``config.json``, so a reader that finds the index finds every file; an earlier
    export's weight files there are removed first."""
    from lightning_zero.checkpoint import objstore

    fs, inner = objstore.filesystem(url)
    fs.makedirs(inner, exist_ok=True)
    for stale in fs.glob(f"{inner}/model*.safetensors") + fs.glob(f"{inner}/{SAFE_INDEX}"):
        fs.rm(stale)
    last = [SAFE_INDEX, "config.json"]
    for path in sorted(
        local.iterdir(), key=lambda item: (item.name in last, last.index(item.name) if item.name in last else 0)
    ):
        fs.put_file(str(path), f"{inner}/{path.name}")


def remove_stale_weights(out_dir: Path) -> None:
    """Delete the weight files and index of an earlier export from ``out_dir``."""
    for stale in list(out_dir.glob("model*.safetensors")) + list(out_dir.glob(SAFE_INDEX)):
        stale.unlink()


def write_safetensors_shards(
    out_dir: PathLike,
    specs: list[TensorSpec],
    produce: Callable[[TensorSpec], torch.Tensor],
    *,
    max_shard_bytes: int,
    metadata: Optional[dict[str, str]] = None,
) -> list[Path]:
    """Write ``specs`` as safetensors shards (+ index when more than one) into ``out_dir``, in one
    process: the :class:`HFLayout` of :func:`plan_layout`.

    ``produce(spec)`` is called once per tensor, in order, while its shard is being written; the
    result must have ``spec``'s shape (it is cast to ``spec.dtype``). Each shard is written under
    a ``.partial`` name and renamed when complete. Returns the shard paths.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = plan_layout(specs, max_shard_bytes, metadata=metadata)
    paths = []
    for shard in layout.files:
        path = out_dir / shard.name
        partial = path.with_name(path.name + ".partial")
        with open(partial, "wb") as handle:
            handle.write(shard.header)
            for spec in shard.specs:
                tensor = produce(spec)
                if tuple(tensor.shape) != tuple(spec.shape):
                    raise ValueError(
                        f"write_safetensors_shards: {spec.name} has shape {list(tensor.shape)}, planned {list(spec.shape)}"
                    )
                tensor = tensor.detach().to(device="cpu", dtype=spec.dtype).contiguous()
                handle.write(tensor.reshape(-1).view(torch.uint8).numpy().data)  # no copy
                del tensor
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
        paths.append(path)
    index = out_dir / SAFE_INDEX
    if layout.index is not None:
        index.write_text(layout.index_text())
    elif index.exists():
        index.unlink()
    return paths
