"""Sharded checkpoints: every rank writes what it owns, any layout reads them, one command exports them.

A checkpoint is a directory (Lightning's ``*.ckpt`` path becomes a directory)::

    epoch=0-step=4.ckpt/
      meta.json            format, saved layout, parameter names and dense shapes, optimizer
                           hyperparameters, Lightning's non-tensor state (JSON, see
                           [Note: state codec] in checkpoint_state.py), sha256 of every file below
      .metadata            DCP's index of every saved rectangle (read with a restricted unpickler)
      __<rank>_0.distcp    the tensors rank <rank> owned: fp32 master values and optimizer state
      rank<rank>.json      that rank's RNG states

Tensors are keyed ``model.<name>`` (fp32 master values of parameters the optimizer steps; other
entries of the module's state dict as they are) and ``optim.<i>.<name>.<key>`` (state ``key`` of
optimizer ``i``, e.g. ``exp_avg``, for the elements of parameter ``name``; scalars such as Adam's
``step`` are stored once per parameter), all in dense coordinates (see
[Note: dense coordinates] in ``checkpoint_format.py``), so a load at another dp, tp or ZeRO stage
just reads other rectangles.

[Note: atomic publish] Ranks write into ``<name>.tmp-<token>`` next to the target. When every rank
has written and hashed its files (an all-gather of the per-rank file lists), rank 0 writes
``meta.json`` last, moves any previous checkpoint of that name aside, renames the temporary
directory into place and deletes the previous one. A directory without ``meta.json``, or under a
``.tmp-``/``.old-`` name, is never a checkpoint (Lightning's ``ckpt_path="last"`` matches
``last*.ckpt`` only), so a run killed mid-write leaves the previous checkpoint as the last one.

Loading verifies every file's size and sha256 against ``meta.json`` (spread over the ranks)
before anything is read into the model; a failure names the file and changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer
from torch.profiler import record_function

from lightning_zero.checkpoint_format import (
    ChunkLoadPlanner,
    ChunkSavePlanner,
    CheckpointError,
    DenseChunks,
    SafeFileSystemReader,
    dense_shape,
    range_pieces,
    read_dcp_metadata,
    storage_shape,
)
from lightning_zero.checkpoint_state import decode, encode, rng_state, set_rng_state

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "Layout",
    "OpenedCheckpoint",
    "export",
    "is_checkpoint",
    "load_model",
    "open_checkpoint",
    "apply_optimizer_state",
    "remove_checkpoint",
    "save_checkpoint",
]

FORMAT = "lightning_zero.sharded/1"
META_FILE = "meta.json"
DCP_METADATA_FILE = ".metadata"
PathLike = Union[str, os.PathLike]

# Test hook: called with a stage name ("shards_written") on every rank; fault tests kill a rank here.
_fault_hook: Optional[Callable[[str], None]] = None


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (unwritable directory, disk full); nothing was published."""


@dataclass(frozen=True)
class Layout:
    """Where this process sits: global rank, dp and tp coordinates, ZeRO stage, precision."""

    world_size: int = 1
    rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    stage: int = 0
    precision: str = "32-true"


# --------------------------------------------------------------------------------------------
# Collectives (all labelled; no-ops without a process group)
# --------------------------------------------------------------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextmanager
def _label(name: str) -> Iterator[None]:
    with record_function(f"lightning_zero::{name}"):
        yield


def _all_gather_object(value: Any, label: str) -> list[Any]:
    if not _distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    with _label(label):
        dist.all_gather_object(out, value)
    return out


def _broadcast_object(value: Any, label: str) -> Any:
    if not _distributed():
        return value
    box = [value]
    with _label(label):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _raise_any(errors: list[Optional[str]], kind: type[Exception]) -> None:
    """Raise ``kind`` on every rank if any rank reported an error (after an all-gather)."""
    messages = [f"rank {rank}: {error}" for rank, error in enumerate(errors) if error]
    if messages:
        raise kind("; ".join(messages))


# --------------------------------------------------------------------------------------------
# Which tensors a rank holds
# --------------------------------------------------------------------------------------------


def _tp_dim(param: Optional[torch.Tensor], layout: Layout) -> Optional[int]:
    if param is None or layout.tp_size == 1:
        return None
    return getattr(param, "_tp_shard_dim", None)


def managed_names(engine: Any) -> set[str]:
    """Names of the parameters whose fp32 masters the engine's optimizers step."""
    return {slot.name for group in engine.groups for slot in group.layout.slots}


def _add(state: dict[str, Any], key: str, size: tuple[int, ...], pieces: list) -> None:
    existing = state.get(key)
    if existing is None:
        state[key] = DenseChunks(size, pieces)
    else:
        existing.pieces.extend(pieces)


def _pieces_over(flat: torch.Tensor, pieces: list) -> list:
    """(offsets, view) per piece: ``flat`` holds the run the pieces were cut from."""
    return [(piece.offsets, flat[piece.start : piece.start + piece.numel].view(piece.sizes)) for piece in pieces]


@dataclass
class _Targets:
    """Tensors a rank saves or loads, plus where loaded values go afterwards."""

    tensors: dict[str, Any] = field(default_factory=dict)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (destination, staged)
    optimizer_states: list[dict[int, dict[str, torch.Tensor]]] = field(default_factory=list)


def _module_entries(module: nn.Module, skip: set[str], layout: Layout, targets: _Targets, *, load: bool) -> dict:
    """``model.<name>`` for every module state-dict entry not in ``skip`` (whole local tensors)."""
    params = dict(module.named_parameters())
    info = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name in skip or not isinstance(tensor, torch.Tensor):
            continue
        tensor = tensor.detach()
        tp_dim = _tp_dim(params.get(name), layout)
        size = storage_shape(dense_shape(tensor.shape, tp_dim, layout.tp_size))
        pieces = range_pieces(tensor.shape, 0, tensor.numel(), tp_dim=tp_dim, tp_rank=layout.tp_rank)
        if load:
            staged = torch.empty(tensor.numel(), dtype=tensor.dtype)
            targets.copies.append((tensor.reshape(-1) if tensor.is_contiguous() else tensor, staged))
            flat = staged
        else:
            flat = tensor.reshape(-1).cpu()
        _add(targets.tensors, f"model.{name}", size, _pieces_over(flat, pieces))
        info[name] = {"shape": list(dense_shape(tensor.shape, tp_dim, layout.tp_size)), "tp_dim": tp_dim}
    return info


def _optimizer_index(optimizers: list[Optimizer]) -> dict[int, int]:
    return {id(p): i for i, opt in enumerate(optimizers) for group in opt.param_groups for p in group["params"]}


def _engine_entries(
    engine: Any,
    optimizers: list[Optimizer],
    layout: Layout,
    targets: _Targets,
    *,
    load: bool,
    state_kinds: list,
    with_state: bool = True,
) -> None:
    """``model.<name>`` from the fp32 masters and ``optim.<i>.<name>.<key>`` for owned ranges.

    ``state_kinds[i]``: ``{key: "chunk" | "scalar"}`` of optimizer ``i`` (when loading, from the
    checkpoint; when saving, filled in from the live state).
    """
    which = _optimizer_index(optimizers)
    targets.optimizer_states = [{} for _ in optimizers]
    for owned in engine.owned_ranges():
        tp_dim = _tp_dim(owned.param, layout)
        size = storage_shape(dense_shape(owned.shape, tp_dim, layout.tp_size))
        pieces = range_pieces(owned.shape, owned.param_lo, owned.param_hi, tp_dim=tp_dim, tp_rank=layout.tp_rank)
        lo, hi = owned.chunk_lo, owned.chunk_hi
        master = owned.master.detach()
        if load:
            staged = torch.empty(hi - lo, dtype=master.dtype)
            targets.copies.append((master[lo:hi], staged))
            _add(targets.tensors, f"model.{owned.name}", size, _pieces_over(staged, pieces))
        else:
            _add(targets.tensors, f"model.{owned.name}", size, _pieces_over(master[lo:hi].cpu(), pieces))
        index = which.get(id(owned.master))
        if index is None:  # stage 3: a frozen parameter's shard (no optimizer steps it)
            continue
        if load:
            state = targets.optimizer_states[index].setdefault(id(owned.master), {})
            for key, (kind, dtype) in state_kinds[index].items():
                if key not in state:
                    shape = master.shape if kind == "chunk" else ()
                    state[key] = torch.zeros(shape, dtype=getattr(torch, dtype), device=master.device)
                if kind == "chunk":
                    flat = state[key][lo:hi]
                    _add(targets.tensors, f"optim.{index}.{owned.name}.{key}", size, _pieces_over(flat, pieces))
                else:
                    targets.tensors[f"optim.{index}.{owned.name}.{key}"] = state[key]
            continue
        live = optimizers[index].state.get(owned.master, {}) if with_state else {}
        for key, value in live.items():
            if not torch.is_tensor(value):
                raise TypeError(
                    f"lightning_zero checkpoint: optimizer {index} state {key!r} is a {type(value).__name__};"
                    " only tensor optimizer state can be sharded"
                )
            if value.shape == master.shape:
                kind = "chunk"
                flat = value.detach()[lo:hi].cpu()
                _add(targets.tensors, f"optim.{index}.{owned.name}.{key}", size, _pieces_over(flat, pieces))
            elif value.numel() == 1:
                kind = "scalar"
                targets.tensors[f"optim.{index}.{owned.name}.{key}"] = value.detach().reshape(()).cpu()
            else:
                raise TypeError(
                    f"lightning_zero checkpoint: optimizer {index} state {key!r} has shape {tuple(value.shape)},"
                    f" neither the master chunk's {tuple(master.shape)} nor a scalar"
                )
            state_kinds[index][key] = [kind, str(value.dtype).removeprefix("torch.")]


# --------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _begin(target: Path, layout: Layout) -> Path:
    """Create ``<target>.tmp-<token>`` (rank 0) and check every rank can write there."""
    error, tmp = None, None
    if layout.rank == 0:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            for stale in target.parent.glob(f"{target.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = target.parent / f"{target.name}.tmp-{uuid.uuid4().hex[:12]}"
            tmp.mkdir()
        except OSError as exc:
            error = f"cannot create {str(target.parent)!r} for the checkpoint: {exc}"
    tmp, error = _broadcast_object((str(tmp) if tmp else None, error), "ckpt_begin")
    if error:
        raise CheckpointWriteError(error)
    return Path(tmp)


def _write_rank_file(tmp: Path, layout: Layout) -> Optional[str]:
    try:
        _fsync_write(tmp / f"rank{layout.rank}.json", json.dumps({"rng": encode(rng_state(), "rng")}))
    except OSError as exc:
        return f"cannot write {str(tmp)!r}: {exc}"
    return None


def _publish(tmp: Path, target: Path) -> None:
    """Rank 0: swap ``tmp`` into ``target`` (see [Note: atomic publish])."""
    old = None
    if os.path.lexists(target):
        old = target.parent / f"{target.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


def save_checkpoint(
    path: PathLike,
    checkpoint: dict[str, Any],
    *,
    module: nn.Module,
    engine: Any,
    optimizers: list[Optimizer],
    layout: Layout,
) -> Path:
    """Write a sharded checkpoint of ``module`` (and ``engine``'s shards) to the directory ``path``.

    ``checkpoint``: Lightning's checkpoint dict; its ``state_dict`` and ``optimizer_states`` are
    ignored (tensors come from the engine: each rank writes only the ranges it owns), the rest is
    stored as JSON. When it has no ``optimizer_states`` (``save_weights_only``) no optimizer
    state is written. A collective over the default process group: every rank must call it.
    Raises :class:`CheckpointWriteError` on every rank if any rank cannot write; the previous
    checkpoint at ``path`` is then untouched.
    """
    target = Path(path)
    with _label("ckpt_save"):
        trainer_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        encoded_state = encode(trainer_state, "checkpoint")  # fails early, before any file exists
        tmp = _begin(target, layout)
        _raise_any(_all_gather_object(_write_rank_file(tmp, layout), "ckpt_rank_files"), CheckpointWriteError)

        targets = _Targets()
        with_optimizer = "optimizer_states" in checkpoint
        if with_optimizer and engine is not None and getattr(engine, "has_replicated_optimizers", lambda: False)():
            names = sorted({type(opt).__name__ for opt in optimizers if type(opt).__name__ in ("Adafactor",)})
            raise ValueError(
                f"lightning_zero checkpoint: {', '.join(names) or 'an optimizer'} steps replicated full masters"
                " (see [Note: non-element-wise optimizers] in zero/optimizer.py); its factored state is not"
                " saved by element ranges. Save the weights only (ModelCheckpoint(save_weights_only=True),"
                " or trainer.save_checkpoint(path, weights_only=True)), or use an element-wise optimizer."
            )
        kinds: list[dict] = [{} for _ in optimizers]
        skip: set[str] = set()
        if engine is not None:
            _engine_entries(engine, optimizers, layout, targets, load=False, state_kinds=kinds, with_state=with_optimizer)
            skip = managed_names(engine)
        params = _module_entries(module, skip, layout, targets, load=False)
        try:
            with _label("ckpt_dcp_save"):
                dcp.save(targets.tensors, storage_writer=dcp.FileSystemWriter(str(tmp)), planner=ChunkSavePlanner())
        except (Exception, CheckpointException) as exc:
            raise CheckpointWriteError(f"writing the shards of {str(target)!r} failed: {exc}") from exc
        if _fault_hook is not None:
            _fault_hook("shards_written")

        mine = [p for p in tmp.iterdir() if p.name.startswith(f"__{layout.rank}_") or p.name == f"rank{layout.rank}.json"]
        if layout.rank == 0:
            mine.append(tmp / DCP_METADATA_FILE)
        files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in mine}
        try:
            all_files = _all_gather_object(files, "ckpt_manifest")
            all_kinds = _all_gather_object(kinds, "ckpt_state_kinds")
            all_params = _all_gather_object(_managed_info(engine, layout) if engine is not None else {}, "ckpt_params")
        except RuntimeError as exc:  # a peer died or timed out mid-write (gloo/NCCL errors are RuntimeErrors)
            raise CheckpointWriteError(
                f"writing {str(target)!r}: a rank failed before every rank had written its shards ({exc});"
                " nothing was published, the previous checkpoint of that name is untouched"
            ) from exc

        error = None
        if layout.rank == 0:
            try:
                for rank_params in all_params:
                    params.update(rank_params)
                meta = {
                    "format": FORMAT,
                    "layout": asdict(layout),
                    "params": params,
                    "optimizers": _optimizer_meta(optimizers, all_kinds) if with_optimizer else [],
                    "export_prefix": _export_prefix(module, params),
                    "trainer_state": encoded_state,
                    "files": {name: info for rank_files in all_files for name, info in rank_files.items()},
                }
                _fsync_write(tmp / META_FILE, json.dumps(meta))
                _publish(tmp, target)
            except OSError as exc:
                error = f"publishing {str(target)!r} failed: {exc}"
        _raise_any([_broadcast_object(error, "ckpt_publish")], CheckpointWriteError)
        return target


def _managed_info(engine: Any, layout: Layout) -> dict[str, Any]:
    info = {}
    for owned in engine.owned_ranges():
        tp_dim = _tp_dim(owned.param, layout)
        info[owned.name] = {"shape": list(dense_shape(owned.shape, tp_dim, layout.tp_size)), "tp_dim": tp_dim}
    return info


def _optimizer_meta(optimizers: list[Optimizer], all_kinds: list[list[dict]]) -> list[dict[str, Any]]:
    meta = []
    for index, optimizer in enumerate(optimizers):
        kinds: dict[str, Any] = {}
        for rank_kinds in all_kinds:
            kinds.update(rank_kinds[index])
        groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        meta.append({"type": type(optimizer).__name__, "param_groups": encode(groups, f"optimizer {index}"), "state": kinds})
    return meta


def _export_prefix(module: nn.Module, params: dict[str, Any]) -> str:
    """``"model."`` when every entry lives under ``module.model`` (``LlamaLM``), else ``""``."""
    inner = getattr(module, "model", None)
    if isinstance(inner, nn.Module) and params and all(name.startswith("model.") for name in params):
        return "model."
    return ""


# --------------------------------------------------------------------------------------------
# Open and verify
# --------------------------------------------------------------------------------------------


def is_checkpoint(path: PathLike) -> bool:
    """True for a directory holding a lightning_zero checkpoint's ``meta.json``."""
    return Path(path, META_FILE).is_file()


@dataclass
class OpenedCheckpoint:
    """A verified checkpoint: its ``meta.json`` and Lightning state, ready to load from."""

    path: Path
    meta: dict[str, Any]
    state: dict[str, Any]
    rank_state: Optional[dict[str, Any]]

    def lightning_dict(self) -> dict[str, Any]:
        """What Lightning expects back from ``Strategy.load_checkpoint`` (tensors stay on disk)."""
        out = dict(self.state)
        out["state_dict"] = {}
        if self.meta["optimizers"]:
            out["optimizer_states"] = [{} for _ in self.meta["optimizers"]]
        return out


def _verify_file(root: Path, name: str, info: dict[str, Any], with_hash: bool) -> Optional[str]:
    path = root / name
    if not path.is_file():
        return f"{path}: missing"
    size = path.stat().st_size
    if size != info["size"]:
        return f"{path}: {size} bytes, expected {info['size']} (truncated or replaced)"
    if with_hash and _sha256(path) != info["sha256"]:
        return f"{path}: sha256 does not match meta.json (corrupted or tampered with)"
    return None


def open_checkpoint(path: PathLike, layout: Optional[Layout] = None) -> OpenedCheckpoint:
    """Read and verify the checkpoint directory ``path``; a collective when a process group exists.

    Every file's size is checked on every rank; the sha256 checks are split over the ranks.
    Raises :class:`CheckpointError` naming the first bad file; nothing is loaded anywhere.
    """
    root = Path(path)
    layout = layout or Layout()
    with _label("ckpt_open"):
        error = None
        meta: dict[str, Any] = {}
        try:
            meta = _read_meta(root)
            names = sorted(meta["files"])
            if DCP_METADATA_FILE not in names:
                raise CheckpointError(f"{root / META_FILE}: lists no {DCP_METADATA_FILE}")
            for index, name in enumerate(names):
                problem = _verify_file(root, name, meta["files"][name], index % layout.world_size == layout.rank)
                if problem:
                    raise CheckpointError(problem)
            read_dcp_metadata(str(root / DCP_METADATA_FILE))
        except CheckpointError as exc:
            error = str(exc)
        _raise_any(_all_gather_object(error, "ckpt_verify"), CheckpointError)
        rank_file = root / f"rank{layout.rank}.json"
        rank_state = None
        if meta["layout"]["world_size"] == layout.world_size and rank_file.is_file():
            rank_state = decode(json.loads(rank_file.read_text()))
        return OpenedCheckpoint(root, meta, decode(meta["trainer_state"]), rank_state)


def _read_meta(root: Path) -> dict[str, Any]:
    meta_path = root / META_FILE
    if not root.exists():
        raise CheckpointError(f"{root}: no such checkpoint")
    if not root.is_dir():
        raise CheckpointError(
            f"{root}: a file, not a lightning_zero checkpoint (a directory with {META_FILE});"
            " load single-file Lightning checkpoints with a non-ZeRO strategy"
        )
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path}: missing; {root} is not a complete lightning_zero checkpoint")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta_path}: not valid JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: format {meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT!r}")
    for key in ("layout", "params", "optimizers", "trainer_state", "files"):
        if key not in meta:
            raise CheckpointError(f"{meta_path}: missing {key!r}")
    return meta


# --------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------


def _dcp_load(opened: OpenedCheckpoint, tensors: dict[str, Any]) -> None:
    try:
        with _label("ckpt_dcp_load"):
            dcp.load(tensors, storage_reader=SafeFileSystemReader(str(opened.path)), planner=ChunkLoadPlanner())
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"{opened.path}: loading failed, nothing was changed: {exc}") from exc


def load_model(
    opened: OpenedCheckpoint,
    module: nn.Module,
    *,
    engine: Any = None,
    optimizers: Optional[list[Optimizer]] = None,
    layout: Optional[Layout] = None,
) -> list[dict[int, dict[str, torch.Tensor]]]:
    """Load the weights (and, with an engine, the optimizer state of the owned ranges).

    Everything is read into fresh tensors first and copied into the module and the masters only
    when the whole read succeeded. With ``engine`` the compute parameters are refreshed from the
    masters (the engine's all-gather). Returns the optimizer states per optimizer (master id ->
    state) for :func:`apply_optimizer_state`.
    """
    layout = layout or Layout()
    optimizers = optimizers or []
    targets = _Targets()
    kinds = [opt_meta["state"] for opt_meta in opened.meta["optimizers"]]
    if engine is not None:
        if kinds and len(kinds) != len(optimizers):
            raise CheckpointError(
                f"{opened.path}: saved with {len(kinds)} optimizer(s), the module configures {len(optimizers)}"
            )
        _engine_entries(engine, optimizers, layout, targets, load=True, state_kinds=kinds or [{} for _ in optimizers])
        _module_entries(module, managed_names(engine), layout, targets, load=True)
    else:
        _module_entries(module, set(), layout, targets, load=True)
    _dcp_load(opened, targets.tensors)
    with torch.no_grad():
        for destination, staged in targets.copies:
            destination.copy_(staged.view(destination.shape).to(destination.dtype))
    if engine is not None:
        _refresh_params_from_masters(engine)
    return targets.optimizer_states


def _refresh_params_from_masters(engine: Any) -> None:
    """Compute parameters from the loaded fp32 masters: stages 1-2 all-gather the full
    parameters; stage 3 only refreshes each rank's parameter shard (gathered on use)."""
    if getattr(engine, "stage3", None) is not None:
        for group in engine.groups:
            copy = getattr(group, "copy_masters_to_params", None)
            if copy is not None:
                copy()
        return
    for sharded in engine.optimizers:
        sharded.all_gather_params()


def apply_optimizer_state(
    opened: OpenedCheckpoint, optimizers: list[Optimizer], states: list[dict[int, dict[str, torch.Tensor]]]
) -> None:
    """Install loaded optimizer state and the saved param-group hyperparameters (lr, betas, ...)."""
    saved = opened.meta["optimizers"]
    if not saved:
        return
    for index, (optimizer, opt_meta) in enumerate(zip(optimizers, saved)):
        groups = decode(opt_meta["param_groups"])
        if len(groups) != len(optimizer.param_groups):
            raise CheckpointError(
                f"{opened.path}: optimizer {index} was saved with {len(groups)} param groups,"
                f" now has {len(optimizer.param_groups)}"
            )
        for group, saved_group in zip(optimizer.param_groups, groups):
            group.update(saved_group)
        masters = {id(p): p for group in optimizer.param_groups for p in group["params"]}
        for master_id, state in (states[index] if index < len(states) else {}).items():
            optimizer.state[masters[master_id]] = state


def restore_rng(opened: OpenedCheckpoint) -> bool:
    """Restore this rank's RNG states if the checkpoint was saved at the same world size."""
    if opened.rank_state is None:
        return False
    set_rng_state(opened.rank_state["rng"])
    return True


def remove_checkpoint(path: PathLike) -> None:
    """Delete a checkpoint directory (or a plain file); call on one rank."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


from lightning_zero.checkpoint_export import export  # noqa: E402  (re-exported for the CLI)
