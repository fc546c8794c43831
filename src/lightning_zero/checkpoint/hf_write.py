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

The byte sink is a local (or shared POSIX) directory: ``pwrite`` at an offset. An object store
has no such call (a file is one object from one writer), so a URL is refused before any collective;
the offline ``lightning-zero export CKPT OUT --format hf`` takes URLs on both sides (the checkpoint
read by byte ranges, ``checkpoint/objstore.py``; the directory written locally, then uploaded with
the index last: ``hf.upload_directory``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

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


def write_runs(
    fd: int,
    base: int,
    dest_rows: torch.Tensor,
    cols: int,
    offsets: tuple[int, ...],
    view: torch.Tensor,
    dtype: torch.dtype,
) -> int:
    """Write rectangle ``view`` (rows at ``offsets[0]``, columns from ``offsets[1]``) of a dense
    tensor stored as ``(rows, cols)`` into the file ``fd``, whose tensor data starts at byte
    ``base``, each row ``r`` going to row ``dest_rows[r]``. Returns bytes written."""
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
            position = base + int(starts[lo]) * item
            memory = memoryview(data)
            while memory:
                count = os.pwrite(fd, memory, position)
                memory, position = memory[count:], position + count
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
) -> HFLayout:
    """Write a Hugging Face directory at ``out`` from every rank's ``held`` tensors, no gather
    ([Note: no-gather Hugging Face export]). A collective over ``group`` (default: the world):
    every rank calls it with its own ``held`` (``{our name: DenseChunks}``, what a sharded save
    writes). ``dtype``: the written dtype (``None``: the held tensors'). Raises
    :class:`HFExportError` on every rank if any rank failed."""
    max_shard_bytes = parse_size(max_shard_size)
    if objstore.is_url(out):  # before any collective: every rank raises alike
        raise ValueError(
            f"save_hf_pretrained({str(out)!r}): the no-gather export writes byte ranges into files (os.pwrite) and an "
            "object store has none; write to a local or shared directory, or save a checkpoint to the URL and run "
            "lightning-zero export CKPT_URL OUT_URL --format hf (streamed, uploaded when written)"
        )
    out = Path(out)
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
    written = 0
    descriptors: dict[str, int] = {}
    try:
        destinations: dict[str, torch.Tensor] = {}
        for name, chunks in held.items():
            for offsets, view in chunks.pieces if name in export.sources else ():
                if owner[(name, tuple(offsets), tuple(view.shape))] != rank:
                    continue  # another rank holds the same rectangle and writes it
                for source, rows, cols, at, part in _writes(export.sources[name], tuple(offsets), view):
                    shard, base = layout.locate(source.key)
                    if shard.name not in descriptors:
                        descriptors[shard.name] = os.open(out / shard.name, os.O_WRONLY)
                    if rows is None and source.key not in destinations:
                        destinations = {source.key: row_destinations(source)}  # one tensor's map at a time
                    rows = destinations[source.key] if rows is None else rows
                    with torch.profiler.record_function("lightning_zero::hf_export_write"):
                        written += write_runs(descriptors[shard.name], base, rows, cols, at, part,
                                              specs[source.key].dtype)  # fmt: skip
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
            out_dtype = dtype or next((spec.dtype for spec in specs.values()), torch.float32)
            (out / CONFIG_FILE).write_text(json.dumps(export.config(out_dtype), indent=2) + "\n")
            if layout.index is not None:
                (out / SAFE_INDEX).write_text(layout.index_text())
        except OSError as exc:
            error = f"writing the index and config.json: {exc}"
    _raise_if_any([e for e in _gather(error, group)], "publishing")
    return layout


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
    return save_hf_sharded(out, export, held, dtype=names.get(dtype or ""), max_shard_size=max_shard_size)
