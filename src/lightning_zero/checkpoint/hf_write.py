"""Hugging Face safetensors written by every rank, with no gather: each rank writes the bytes of the
tensors it holds straight into their place in the final ``model-0000k-of-0000n.safetensors`` files.

[Note: no-gather Hugging Face export] The files' layout (names, dtypes, shapes, which file, every
tensor's byte offset) is a pure function of the model's shapes (:func:`~.hf.plan_layout`: what
``save_pretrained`` chooses for the same tensors and ``max_shard_size``), so every rank knows it
without any tensor moving. A rank's tensors are the rectangles a sharded save writes (fp32 master
ranges under ZeRO, TP slices, EP experts: ``checkpoint.targets``, in dense coordinates). A model
family maps each of its parameters to a Hugging Face tensor with a :class:`~.hf.Source` whose
``transform`` is at most a permutation of rows (the q/k rotary permutation, ``models/llama/hf.py``);
that permutation is found by transforming ``arange(rows)``. A rectangle's rows then land at known
byte offsets: consecutive rows whose destinations follow each other are one write. Ranks exchange
only the rectangles' coordinates (a few bytes each, ``all_gather_object``), so a tensor replicated
over ranks (a norm gain on every TP rank) is written once, by the lowest rank holding it, and a
tensor nobody covers fails on every rank before anything is written. Rank 0 creates each file at
its final size with its header, every rank writes its ranges with ``os.pwrite`` and fsyncs, and
rank 0 writes ``model.safetensors.index.json`` and ``config.json`` after every rank finished: an
export whose index is there is complete. Peak extra memory per rank: one write run cast to the
output dtype, at most :data:`CAST_CHUNK_BYTES`.

Where torch's ``HuggingFaceStorageWriter`` stands: it plans its files from DTensor/ShardedTensor
chunks and, with ``save_distributed``, writes one file *per rank* and then consolidates them into
the Hugging Face files in a second pass that reads every shard back (``consolidate_safetensors_
files``); it cannot express our flat ZeRO ranges (they are not rectangles of the dense tensor:
``checkpoint.dcp.range_pieces`` cuts them into up to three) nor the q/k row permutation, and its
consolidation is the gather this module avoids. Reading needs nothing from it either:
``checkpoint/hf.py``'s reader fills each parameter by byte ranges (:func:`~.hf.read_into`).

The byte sink is a local (or shared POSIX) directory (``pwrite`` at an offset) or a URL.

[Note: no-gather Hugging Face export to a URL] An object has one writer and no ``pwrite``, but an
S3 multipart upload has parts, and any client may upload any part of it: each file is cut into
parts of ``upload_part_mb`` (S3's minimum, 5 MiB, for every part but the last; more when a file
would need over 10,000), part ``g`` of all files' parts is owned by rank ``g % world``, and each
rank sends the bytes of its runs to the parts' owners (an ``all_to_all`` of coordinates and bytes,
one round of ``world`` parts at a time); the owner lays them beside the header bytes it knows (the
layout is every rank's), checks that every byte of the part arrived, and uploads it. Rank 0 starts
each file's upload, completes it from every part's ETag, and writes ``config.json`` and the index
last. The bytes of the export cross the network once more than a local write (to their parts'
owners), but no rank holds more than its own share and one round of parts, and every rank
uploads. A file system without multipart uploads (``memory://``, ``gs://``: gcsfs's resumable
uploads take their chunks in order from one writer) gets the same rounds with rank 0 owning every
part: rank 0 streams each file in order (:class:`~.objstore.UploadStream`), so its bytes pass
through rank 0 a round at a time, never the whole model. Until the index is written the export is
incomplete: the index of an earlier export there is removed first. A failed export aborts its
multipart uploads (no object appears) and raises on every rank.
"""

from __future__ import annotations

import json
import math
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist

from lightning_zero.checkpoint import objstore
from lightning_zero.checkpoint.hf import (
    SAFE_INDEX,
    HFLayout,
    Source,
    TensorSpec,
    parse_size,
    plan_layout,
    remove_stale_weights,
)

PathLike = Union[str, os.PathLike]
CAST_CHUNK_BYTES = 16 * 2**20  # the most a rank casts at once (fp32 masters -> the output dtype)
CONFIG_FILE = "config.json"


class HFExportError(RuntimeError):
    """A no-gather Hugging Face export failed on some rank (raised on every rank, naming them)."""


@dataclass(frozen=True)
class HFExport:
    """What a model family exports: ``sources`` (``{our parameter name: Source}``, each
    ``transform`` at most a row permutation; or a tuple of Sources for a stacked parameter whose
    row ``e`` is Hugging Face tensor ``e``: a layer's experts) and ``config(dtype)``
    (``config.json`` for the written dtype). ``aliases``: our names that are another parameter (a
    tied head), skipped."""

    sources: Mapping[str, Union[Source, tuple[Source, ...]]]
    config: Callable[[torch.dtype], dict[str, Any]]
    aliases: frozenset[str] = frozenset()


def row_destinations(source: Source) -> torch.Tensor:
    """``dest[r]``: the Hugging Face row our row ``r`` becomes (identity without a transform)."""
    rows = source.shape[0] if source.shape else 1
    if source.transform is None:
        return torch.arange(rows)
    moved = source.transform(torch.arange(rows).reshape(rows, 1), None).reshape(-1)  # moved[hf row] = our row
    if moved.numel() != rows or not torch.equal(moved.sort().values, torch.arange(rows)):
        raise ValueError(f"{source.key}: its transform is not a permutation of rows; no-gather export needs one")
    dest = torch.empty(rows, dtype=torch.long)
    dest[moved] = torch.arange(rows)
    return dest


def pwrite_all(fd: int, memory: memoryview, position: int) -> None:
    while memory:
        count = os.pwrite(fd, memory, position)
        memory, position = memory[count:], position + count


def write_runs(
    sink: Callable[[int, memoryview], None],
    base: int,
    dest_rows: torch.Tensor,
    cols: int,
    offsets: tuple[int, ...],
    view: torch.Tensor,
    dtype: torch.dtype,
) -> int:
    """Write rectangle ``view`` (rows at ``offsets[0]``, columns from ``offsets[1]``) of a dense
    tensor stored as ``(rows, cols)`` into a file whose tensor data starts at byte ``base``, each
    row ``r`` going to row ``dest_rows[r]``: ``sink(position, bytes)`` per contiguous run (at most
    :data:`CAST_CHUNK_BYTES`). Returns bytes written."""
    view = view.reshape(view.shape[0], -1) if view.dim() > 1 else view.reshape(-1, 1)
    r0, c0 = offsets[0], (offsets[1] if len(offsets) > 1 else 0)
    n_rows, width = view.shape
    if n_rows == 0 or width == 0:
        return 0
    starts = dest_rows[r0 : r0 + n_rows] * cols + c0  # destination element of each row's first column
    breaks = torch.nonzero(starts[1:] - starts[:-1] != width).reshape(-1) + 1  # contiguity ends there
    bounds = [0, *breaks.tolist(), n_rows]
    item = torch.empty((), dtype=dtype).element_size()
    rows_per_chunk = max(1, CAST_CHUNK_BYTES // max(1, width * item))
    written = 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        for lo in range(a, b, rows_per_chunk):
            hi = min(b, lo + rows_per_chunk)
            data = view[lo:hi].to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
            sink(base + int(starts[lo]) * item, memoryview(data))
            written += data.nbytes
            del data
    return written


def _gather(obj: Any, group: Optional[Any]) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    with torch.profiler.record_function("lightning_zero::hf_export_exchange"):
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
    return out


def _raise_if_any(errors: list[Optional[str]], what: str) -> None:
    failed = [(rank, error) for rank, error in enumerate(errors) if error]
    if failed:
        raise HFExportError(f"no-gather Hugging Face export: {what} failed on rank(s) "
                            + "; ".join(f"{rank}: {error}" for rank, error in failed))  # fmt: skip


def _sources(entry: Union[Source, tuple[Source, ...]]) -> tuple[Source, ...]:
    return entry if isinstance(entry, tuple) else (entry,)


def plan_export(
    export: HFExport,
    dtypes: Mapping[str, torch.dtype],
    *,
    dtype: Optional[torch.dtype],
    max_shard_bytes: int,
    metadata: Optional[dict[str, str]] = None,
) -> tuple[HFLayout, dict[str, TensorSpec]]:
    """The :class:`HFLayout` of ``export``: each tensor in ``dtype``, else its held dtype
    (``dtypes``, over all ranks); ``{Hugging Face key: TensorSpec}`` beside it."""
    specs = {source.key: TensorSpec(source.key, tuple(source.shape), dtype or dtypes.get(name, torch.float32))
             for name, entry in export.sources.items() for source in _sources(entry)}  # fmt: skip
    return plan_layout(list(specs.values()), max_shard_bytes, metadata=metadata), specs


def _writes(entry: Union[Source, tuple[Source, ...]], offsets: tuple[int, ...], view: torch.Tensor) -> list[tuple]:
    """``(source, rows: None or the one row, cols, offsets, view)`` per Hugging Face tensor a held
    rectangle feeds: itself, or for a stacked parameter (storage ``(E, rest)``) one row each."""
    if isinstance(entry, Source):
        cols = math.prod(entry.shape[1:]) if len(entry.shape) > 1 else 1
        return [(entry, None, cols, offsets, view)]
    c0 = offsets[1] if len(offsets) > 1 else 0
    rows = view.reshape(view.shape[0], -1)
    return [(entry[offsets[0] + i], torch.zeros(1, dtype=torch.long), math.prod(entry[offsets[0] + i].shape),
             (0, c0), rows[i : i + 1]) for i in range(rows.shape[0])]  # fmt: skip


def save_hf_sharded(
    out: PathLike,
    export: HFExport,
    held: Mapping[str, Any],
    *,
    dtype: Optional[torch.dtype] = None,
    max_shard_size: Union[str, int] = "50GB",
    group: Optional[Any] = None,
    metadata: Optional[dict[str, str]] = None,
    storage: objstore.StoragePolicy = objstore.DEFAULT_POLICY,
) -> HFLayout:
    """Write a Hugging Face directory at ``out`` (a local path, or a URL reached as ``storage``
    says: [Note: no-gather Hugging Face export to a URL]) from every rank's ``held`` tensors, no
    gather ([Note: no-gather Hugging Face export]). A collective over ``group`` (default: the world):
    every rank calls it with its own ``held`` (``{our name: DenseChunks}``, what a sharded save
    writes). ``dtype``: the written dtype (``None``: the held tensors'). Raises
    :class:`HFExportError` on every rank if any rank failed."""
    max_shard_bytes = parse_size(max_shard_size)
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    error: Optional[str] = None
    unknown = sorted(set(held) - set(export.sources) - set(export.aliases))
    if unknown:
        error = f"parameters {unknown} have no Hugging Face name in this model family's export"
    mine = [(name, tuple(offsets), tuple(view.shape), view.dtype) for name, chunks in held.items()
            if name in export.sources for offsets, view in chunks.pieces]  # fmt: skip
    everyone = _gather((mine, error), group)  # coordinates only, no tensor data
    _raise_if_any([e for _, e in everyone], "planning")
    owner: dict[tuple, int] = {}
    dtypes: dict[str, torch.dtype] = {}
    for source_rank, (pieces, _) in enumerate(everyone):
        for name, offsets, sizes, held_dtype in pieces:
            owner.setdefault((name, offsets, sizes), source_rank)
            dtypes.setdefault(name, held_dtype)
    covered: dict[str, int] = {}
    for name, _, sizes in owner:
        covered[name] = covered.get(name, 0) + math.prod(sizes)
    numel = {name: sum(math.prod(s.shape) for s in _sources(entry)) for name, entry in export.sources.items()}
    gaps = [f"{name} ({covered.get(name, 0)} of {numel[name]} elements)"
            for name in export.sources if covered.get(name, 0) != numel[name]]  # fmt: skip
    if gaps:
        raise HFExportError(f"no-gather Hugging Face export: the ranks together do not hold exactly {gaps[:6]}")
    layout, specs = plan_export(export, dtypes, dtype=dtype, max_shard_bytes=max_shard_bytes, metadata=metadata)
    runs = _runs(export, held, owner, rank, layout, specs)
    out_dtype = dtype or next((spec.dtype for spec in specs.values()), torch.float32)
    config_text = json.dumps(export.config(out_dtype), indent=2) + "\n"
    if objstore.is_url(out):
        _upload_export(str(out).rstrip("/"), layout, runs, config_text, group, storage)
        return layout
    out = Path(out)
    if rank == 0:
        try:
            out.mkdir(parents=True, exist_ok=True)
            remove_stale_weights(out)
            for shard in layout.files:
                with open(out / shard.name, "wb") as handle:
                    handle.write(shard.header)
                    handle.truncate(shard.size)
        except OSError as exc:
            error = f"creating the files in {out}: {exc}"
    _raise_if_any([e for e in _gather(error, group)], "creating the files")
    descriptors: dict[str, int] = {}
    try:
        for file_name, base, rows, cols, at, part, out_type in runs:
            if file_name not in descriptors:
                descriptors[file_name] = os.open(out / file_name, os.O_WRONLY)
            fd = descriptors[file_name]
            with torch.profiler.record_function("lightning_zero::hf_export_write"):
                write_runs(lambda position, memory, fd=fd: pwrite_all(fd, memory, position), base, rows, cols, at,
                           part, out_type)  # fmt: skip
        for fd in descriptors.values():
            os.fsync(fd)
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        error = f"{type(exc).__name__}: {exc}"
    finally:
        for fd in descriptors.values():
            os.close(fd)
    _raise_if_any([e for e in _gather(error, group)], "writing")
    if rank == 0:
        try:
            (out / CONFIG_FILE).write_text(config_text)
            if layout.index is not None:
                (out / SAFE_INDEX).write_text(layout.index_text())
        except OSError as exc:
            error = f"writing the index and config.json: {exc}"
    _raise_if_any([e for e in _gather(error, group)], "publishing")
    return layout


def _runs(export: HFExport, held: Mapping[str, Any], owner: dict[tuple, int], rank: int, layout: HFLayout,
          specs: dict[str, TensorSpec]) -> Iterator[tuple]:  # fmt: skip
    """``(file name, data base, dest rows, cols, offsets, view, dtype)``: the :func:`write_runs`
    this rank does (the rectangles it is the lowest holder of)."""
    destinations: dict[str, torch.Tensor] = {}
    for name, chunks in held.items():
        for offsets, view in chunks.pieces if name in export.sources else ():
            if owner[(name, tuple(offsets), tuple(view.shape))] != rank:
                continue  # another rank holds the same rectangle and writes it
            for source, rows, cols, at, part in _writes(export.sources[name], tuple(offsets), view):
                shard, base = layout.locate(source.key)
                if rows is None and source.key not in destinations:
                    destinations = {source.key: row_destinations(source)}  # one tensor's map at a time
                rows = destinations[source.key] if rows is None else rows
                yield shard.name, base, rows, cols, at, part, specs[source.key].dtype


# --------------------------------------------------------------------------------------------
# To a URL ([Note: no-gather Hugging Face export to a URL])
# --------------------------------------------------------------------------------------------

MAX_PARTS = 10_000  # S3's limit per multipart upload


@dataclass(frozen=True)
class _Part:
    file: str
    number: int  # 1-based, within its file
    start: int  # byte range of the file
    end: int
    last: bool  # the file's last part


def plan_parts(layout: HFLayout, part_bytes: int) -> list[_Part]:
    """Every file's parts, in order: ``part_bytes`` each (more where a file would need over
    :data:`MAX_PARTS`), the last one shorter."""
    parts = []
    for shard in layout.files:
        size = max(part_bytes, -(-shard.size // MAX_PARTS))
        starts = list(range(0, shard.size, size)) or [0]
        for number, start in enumerate(starts, start=1):
            parts.append(_Part(shard.name, number, start, min(shard.size, start + size), number == len(starts)))
    return parts


def _exchange_bytes(outboxes: list[bytes], group: Optional[Any]) -> list[bytes]:
    """``outboxes[r]`` sent to rank ``r``; returns what each rank sent here (an all-to-all)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return list(outboxes)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    with torch.profiler.record_function("lightning_zero::hf_export_send_parts"):
        sizes = torch.tensor([len(box) for box in outboxes], dtype=torch.int64, device=device)
        incoming = torch.empty_like(sizes)
        dist.all_to_all_single(incoming, sizes, group=group)
        payload = torch.frombuffer(bytearray(b"".join(outboxes)), dtype=torch.uint8) if any(outboxes) else \
            torch.empty(0, dtype=torch.uint8)  # fmt: skip
        received = torch.empty(int(incoming.sum()), dtype=torch.uint8, device=device)
        dist.all_to_all_single(received, payload.to(device) if device is not None else payload,
                               incoming.tolist(), sizes.tolist(), group=group)  # fmt: skip
    data, boxes, at = received.cpu().numpy().tobytes(), [], 0
    for size in incoming.tolist():
        boxes.append(data[at : at + size])
        at += size
    return boxes


class _PartSink:
    """Where this rank's runs go: the bytes of each part it does not own, kept until that part's
    round (``pending``); :meth:`__call__` is :func:`write_runs`' sink, for one file."""

    def __init__(self, parts: list[_Part]) -> None:
        self.by_file: dict[str, list[tuple[int, _Part]]] = {}
        for index, part in enumerate(parts):
            self.by_file.setdefault(part.file, []).append((index, part))
        self.pending: dict[int, list[tuple[int, bytes]]] = {}  # part index -> (offset in the part, bytes)
        self.file = ""

    def __call__(self, position: int, memory: memoryview) -> None:
        end = position + len(memory)
        for index, part in self.by_file[self.file]:
            lo, hi = max(position, part.start), min(end, part.end)
            if lo < hi:
                self.pending.setdefault(index, []).append(
                    (lo - part.start, bytes(memory[lo - position : hi - position]))
                )


def _upload_export(url: str, layout: HFLayout, runs: Iterator[tuple], config_text: str, group: Optional[Any],
                   policy: objstore.StoragePolicy) -> None:  # fmt: skip
    """[Note: no-gather Hugging Face export to a URL]: a collective over ``group``."""
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    fs, root = objstore.filesystem(url, policy)
    multipart = hasattr(fs, "call_s3")  # s3fs: any client may upload any part
    parts = plan_parts(layout, policy.part_bytes)
    owners = [index % world if multipart else 0 for index in range(len(parts))]
    headers = {shard.name: shard.header for shard in layout.files}
    error: Optional[str] = None
    uploads: dict[str, str] = {}  # file -> multipart upload id
    if rank == 0:
        try:
            _remove_index_and_stale(fs, root, layout)
            for shard in layout.files if multipart else ():
                bucket, key, _ = fs.split_path(f"{root}/{shard.name}")
                uploads[shard.name] = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = f"starting the upload of {url!r}: {type(exc).__name__}: {exc}"
    uploads, error = _broadcast((uploads, error), group)
    if error:
        raise HFExportError(f"no-gather Hugging Face export: {error}")
    sink = _PartSink(parts)
    try:
        for file_name, base, rows, cols, at, part, out_type in runs:
            sink.file = file_name
            with torch.profiler.record_function("lightning_zero::hf_export_write"):
                write_runs(sink, base, rows, cols, at, part, out_type)
    except Exception as exc:  # noqa: BLE001 - the rounds go on (every rank takes part), then it is raised
        error = f"{type(exc).__name__}: {exc}"
    etags: list[tuple[str, int, str]] = []
    streams: dict[str, objstore.UploadStream] = {}
    for first in range(0, len(parts), world):
        round_parts = range(first, min(first + world, len(parts)))
        outboxes: list[list] = [[] for _ in range(world)]
        for index in round_parts:
            outboxes[owners[index]].append((index, sink.pending.pop(index, [])))
        received = _exchange_bytes([pickle.dumps(box) for box in outboxes], group)
        if error is not None:
            continue
        try:
            assembled: dict[int, bytearray] = {}
            filled: dict[int, int] = {}
            for box in received:
                for index, pieces in pickle.loads(box):
                    part = parts[index]
                    buffer = assembled.setdefault(index, bytearray(part.end - part.start))
                    header = headers[part.file][part.start : part.end]
                    if index not in filled:
                        buffer[: len(header)] = header
                        filled[index] = len(header)
                    for offset, data in pieces:
                        buffer[offset : offset + len(data)] = data
                        filled[index] += len(data)
            for index in sorted(assembled):
                part = parts[index]
                if filled[index] != part.end - part.start:
                    raise HFExportError(f"{part.file} bytes [{part.start}, {part.end}): {filled[index]} arrived")
                if multipart:
                    etags.append((part.file, part.number, _upload_part(fs, root, part, uploads, assembled[index],
                                                                       policy, rank)))  # fmt: skip
                    continue
                if part.file not in streams:
                    streams[part.file] = objstore.UploadStream(fs, f"{root}/{part.file}", f"{url}/{part.file}", policy,
                                                               rank)  # fmt: skip
                streams[part.file].write(assembled[index])
                if part.last:
                    streams.pop(part.file).close()
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = f"{type(exc).__name__}: {exc}"
    for stream in streams.values():
        stream.abort()
    everyone = _gather((etags, error), group)
    if rank == 0:
        error = _finish_upload(fs, root, url, layout, uploads, everyone, config_text, policy)
    _raise_if_any([_broadcast(error, group)], "uploading")


def _upload_part(fs: Any, root: str, part: _Part, uploads: dict[str, str], data: bytearray,
                 policy: objstore.StoragePolicy, rank: int) -> str:  # fmt: skip
    bucket, key, _ = fs.split_path(f"{root}/{part.file}")

    def put(body: bytes) -> str:
        return fs.call_s3("upload_part", Bucket=bucket, Key=key, PartNumber=part.number,
                          UploadId=uploads[part.file], Body=body)["ETag"]  # fmt: skip

    return objstore.bounded_map(put, [bytes(data)], 1, policy.stall_s,
                                lambda _: f"rank {rank}: uploading part {part.number} of {key!r}")[0]  # fmt: skip


def _finish_upload(fs: Any, root: str, url: str, layout: HFLayout, uploads: dict[str, str], everyone: list,
                   config_text: str, policy: objstore.StoragePolicy) -> Optional[str]:  # fmt: skip
    """Rank 0: complete every file from the parts' ETags (or abort them all if a rank failed),
    then ``config.json`` and the index, last."""
    failed = [f"rank {r}: {e}" for r, (_, e) in enumerate(everyone) if e]
    try:
        if failed:
            for file_name, upload in uploads.items():
                bucket, key, _ = fs.split_path(f"{root}/{file_name}")
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
            return "; ".join(failed)
        by_file: dict[str, list[dict]] = {}
        for etags, _ in everyone:
            for file_name, number, etag in etags:
                by_file.setdefault(file_name, []).append({"PartNumber": number, "ETag": etag})
        for file_name, upload in uploads.items():
            bucket, key, _ = fs.split_path(f"{root}/{file_name}")
            fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
                       MultipartUpload={"Parts": sorted(by_file[file_name], key=lambda p: p["PartNumber"])})  # fmt: skip
        objstore.put_small(f"{url}/{CONFIG_FILE}", config_text.encode(), policy)
        if layout.index is not None:
            objstore.put_small(f"{url}/{SAFE_INDEX}", layout.index_text().encode(), policy)
    except Exception as exc:  # noqa: BLE001 - raised on every rank
        return "; ".join(failed + [f"rank 0: completing {url!r}: {type(exc).__name__}: {exc}"])
    return None


def _remove_index_and_stale(fs: Any, root: str, layout: HFLayout) -> None:
    """Rank 0, first: an earlier export's index (the export is incomplete until the new one is
    written) and weight files the new layout does not have."""
    try:
        names = [posixpath_name(entry) for entry in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return
    keep = {shard.name for shard in layout.files}
    for name in names:
        if name == SAFE_INDEX or (name.startswith("model") and name.endswith(".safetensors") and name not in keep):
            fs.rm_file(f"{root}/{name}")


def posixpath_name(entry: str) -> str:
    return entry.rstrip("/").rsplit("/", 1)[-1]


def _broadcast(value: Any, group: Optional[Any]) -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    with torch.profiler.record_function("lightning_zero::hf_export_exchange"):
        dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def held_tensors(module: Any, engine: Any, layout: Any) -> dict[str, Any]:
    """``{parameter name: DenseChunks}``: what this rank holds of ``module``'s parameters in dense
    coordinates (the fp32 master ranges the engine owns, and the module's other tensors), exactly
    what a sharded save would write for them; read only, nothing copied on the host."""
    from lightning_zero.checkpoint.save import save_entries
    from lightning_zero.checkpoint.targets import Targets

    targets = Targets()
    save_entries(targets, [], module=module, engine=engine, optimizers=[], layout=layout, with_optimizer=False)
    params = {name for name, _ in module.named_parameters()}
    return {key[len("model.") :]: chunks for key, chunks in targets.tensors.items() if key[len("model.") :] in params}


def save_hf_pretrained(
    out: PathLike,
    *,
    module: Any,
    engine: Any,
    layout: Any,
    dtype: Optional[str] = None,
    max_shard_size: Union[str, int] = "50GB",
    storage: objstore.StoragePolicy = objstore.DEFAULT_POLICY,
) -> HFLayout:
    """The no-gather export of a live run ([Note: no-gather Hugging Face export]): ``module`` (a
    LightningModule or model) supplies ``hf_export()`` (:class:`HFExport`); every rank of the
    world calls this. ``dtype``: ``fp32``, ``bf16``, ``fp16`` or ``None`` (the masters' dtype)."""
    hook = getattr(module, "hf_export", None)
    if hook is None:
        raise ValueError(
            f"save_hf_pretrained: {type(module).__name__} has no hf_export(); the Hugging Face layout is a model "
            "family's (LlamaLM / Llama: Llama, Mistral, Qwen2.5, Qwen3)"
        )
    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype is not None and dtype not in names:
        raise ValueError(f"save_hf_pretrained(dtype={dtype!r}): expected one of {sorted(names)} or None")
    parse_size(max_shard_size)
    export = hook()
    held = held_tensors(module, engine, layout)
    return save_hf_sharded(out, export, held, dtype=names.get(dtype or ""), max_shard_size=max_shard_size,
                           storage=storage)  # fmt: skip
