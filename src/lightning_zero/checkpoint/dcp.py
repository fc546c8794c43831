"""How owned ranges become torch.distributed.checkpoint (DCP) chunks, and how DCP files are read safely.

[Note: dense coordinates] Every tensor in a lightning_zero checkpoint is stored in *dense*
coordinates: the shape the parameter has in the plain, un-parallelized model (``Llama`` layout),
viewed as 2-D ``(shape[0], prod(shape[1:]))`` (1-D parameters stay 1-D). A rank saves what it owns
as rectangles of that dense tensor, DCP records every rectangle's offsets and sizes, and on load
DCP's planner reads, for each rectangle the *loading* rank wants, the overlapping parts of the
saved rectangles. Because both sides speak dense coordinates, any change of dp size, ZeRO stage or
TP size between save and load is a plain read of different rectangles: no conversion step.

A rank owns elements ``[lo, hi)`` of its (TP-local) parameter flattened row-major (see
``OwnedRange`` in ``zero/flat.py``). Such a run covers at most three rectangles of the local 2-D
view: a partial first row, a block of whole rows, a partial last row (:func:`range_pieces`). A
TP-local tensor sits inside the dense one at ``tp_rank * local_size`` along its split dimension
(``_tp_shard_dim`` 0: rows, 1: columns), so each local rectangle maps to one dense rectangle.

[Note: safe loading] DCP's own ``FileSystemReader`` unpickles the ``.metadata`` file with plain
``pickle``, and its default load planner unpickles "bytes" entries with ``weights_only=False``.
:class:`SafeFileSystemReader` reads ``.metadata`` with an unpickler that only knows DCP's metadata
dataclasses, ``torch.Size`` and dtypes, and refuses any checkpoint entry that is not a tensor;
:class:`ChunkLoadPlanner` refuses bytes entries too. Tensor payloads are read by DCP with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import math
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem, TensorWriteData, WriteItem, WriteItemType


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: missing, truncated, tampered or of another format."""


# --------------------------------------------------------------------------------------------
# Owned ranges -> dense rectangles
# --------------------------------------------------------------------------------------------


def storage_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The 1-D or 2-D view a parameter of ``shape`` is stored as (see [Note: dense coordinates])."""
    if len(shape) == 0:
        return (1,)
    if len(shape) == 1:
        return (int(shape[0]),)
    return (int(shape[0]), math.prod(int(size) for size in shape[1:]))


def dense_shape(local_shape: Sequence[int], tp_dim: Optional[int], tp_size: int) -> tuple[int, ...]:
    """Shape of the un-parallelized parameter whose TP-local slice has ``local_shape``."""
    shape = [int(size) for size in local_shape]
    if tp_dim is not None and tp_size > 1:
        shape[tp_dim] *= tp_size
    return tuple(shape)


@dataclass(frozen=True)
class Piece:
    """One rectangle of a flattened run: ``numel`` elements starting ``start`` into the run.

    ``offsets``/``sizes`` are in dense storage coordinates (see :func:`storage_shape`).
    """

    start: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def range_pieces(
    local_shape: Sequence[int], lo: int, hi: int, *, tp_dim: Optional[int] = None, tp_rank: int = 0
) -> list[Piece]:
    """Rectangles (dense coordinates) covering elements ``[lo, hi)`` of the flattened local tensor.

    ``tp_dim``: the dimension the parameter is split along over TP (``None``: not split); the
    local tensor is the ``tp_rank``-th slice. Splits along dimension 1 are supported for 2-D
    parameters only (as TP produces them).
    """
    if not 0 <= lo <= hi <= max(1, math.prod(local_shape)):
        raise ValueError(f"range_pieces: [{lo}, {hi}) is not inside a tensor of shape {tuple(local_shape)}")
    if tp_dim is not None and not (tp_dim == 0 or (tp_dim == 1 and len(local_shape) == 2)):
        raise ValueError(
            f"range_pieces: a TP split along dim {tp_dim} of a {len(local_shape)}-D parameter is not"
            " supported; lightning_zero checkpoints handle splits along dim 0, or dim 1 of 2-D weights"
        )
    view = storage_shape(local_shape)
    if lo == hi:
        return []
    if len(view) == 1:
        local = [(lo - lo, (lo,), (hi - lo,))]
    else:
        cols = view[1]
        r0, c0 = divmod(lo, cols)
        r1, c1 = divmod(hi, cols)
        local = []
        if r0 == r1:
            local.append((0, (r0, c0), (1, c1 - c0)))
        else:
            row = r0
            if c0:
                local.append((0, (r0, c0), (1, cols - c0)))
                row += 1
            if r1 > row:
                local.append(((row * cols) - lo, (row, 0), (r1 - row, cols)))
            if c1:
                local.append(((r1 * cols) - lo, (r1, 0), (1, c1)))
    shift = [0] * len(view)
    if tp_dim is not None:
        shift[tp_dim] = tp_rank * view[tp_dim]
    return [Piece(start, tuple(o + s for o, s in zip(offsets, shift)), tuple(sizes)) for start, offsets, sizes in local]


class DenseChunks:
    """Rectangles of one dense tensor held by this rank, as DCP sees them.

    Implements DCP's checkpointable protocol (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``) the way DTensor does, for arbitrary
    rectangles: saving writes each rectangle; loading fills each from the saved overlaps.
    """

    def __init__(self, size: Sequence[int], pieces: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
        self.global_size = torch.Size(size)
        self.pieces = pieces  # (offsets, tensor shaped like the rectangle)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        items = []
        for offsets, tensor in self.pieces:
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size())
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=chunk, properties=TensorProperties.create_from_tensor(tensor), size=self.global_size
                    ),
                )
            )
        return items

    def size(self) -> torch.Size:
        """The dense tensor's size (DCP compares it with the saved one)."""
        return self.global_size

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, tensor in self.pieces:
            if torch.Size(offsets) == index.offset:
                return tensor
        raise ValueError(f"no rectangle of {index.fqn} at offsets {tuple(index.offset or ())}")


def _lookup(state_dict: dict[str, Any], index: MetadataIndex) -> Any:
    obj = state_dict[index.fqn]
    if isinstance(obj, DenseChunks):
        return obj.__get_tensor_shard__(index)
    if isinstance(obj, torch.Tensor):
        return obj
    raise CheckpointError(f"checkpoint entry {index.fqn!r} is not a tensor")


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default planner, for flat state dicts of tensors and :class:`DenseChunks`.
    ``ready(tensor)``: called by the writer before a tensor's bytes are read, to wait until they
    are there ([Note: uploads overlap the host copy] in ``background.py``); ``None``: they are."""

    def __init__(self, ready: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.ready = ready

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _lookup(self.state_dict, index)

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if self.ready is not None and isinstance(data, torch.Tensor):
            self.ready(data)
        return data


class ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner for :class:`DenseChunks` targets; never unpickles bytes entries."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Optional[Metadata] = None, is_coordinator: bool = False
    ) -> None:
        # DefaultLoadPlanner would first run DCP's _init_state_dict, which replaces any leaf that is
        # not a Tensor/DTensor (our DenseChunks) with None; the state dict here is flat already.
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; lightning_zero checkpoints"
            " hold only tensors, and loading refuses to unpickle anything else"
        )


# --------------------------------------------------------------------------------------------
# Safe metadata reading
# --------------------------------------------------------------------------------------------

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    (_DCP_METADATA, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: any other global (a function, a class) is refused."""

    def __init__(self, file: io.BufferedIOBase, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.path}: refusing to unpickle {module}.{name}; the DCP metadata of a lightning_zero"
            " checkpoint holds only tensor layouts. The file was tampered with or is not ours."
        )


def read_dcp_metadata(path: str) -> Metadata:
    """The DCP ``.metadata`` at ``path``, read with the restricted unpickler; tensors entries only."""
    try:
        handle = open(path, "rb")
    except OSError as error:
        raise CheckpointError(f"{path}: unreadable DCP metadata ({type(error).__name__}: {error})") from error
    with handle:
        return unpickle_dcp_metadata(handle, path)


def unpickle_dcp_metadata(handle: Any, path: str) -> Metadata:
    """:func:`read_dcp_metadata` of an open binary ``handle`` (``path`` names it in errors)."""
    try:
        metadata = _MetadataUnpickler(handle, path).load()
    except CheckpointError:
        raise
    except Exception as error:  # truncated or garbage pickle
        raise CheckpointError(f"{path}: unreadable DCP metadata ({type(error).__name__}: {error})") from error
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{path}: not a DCP metadata file")
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"{path}: entry {fqn!r} is {type(entry).__name__}, not a tensor; lightning_zero checkpoints"
                " hold only tensors"
            )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`read_dcp_metadata` in place of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_dcp_metadata(str(self._get_metadata_path(rank)))
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
