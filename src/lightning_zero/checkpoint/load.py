"""Opening, verifying and loading a sharded checkpoint into any layout; strict by default
([Note: strict loading])."""

from __future__ import annotations

import hashlib
import io
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer

import lightning_zero.checkpoint.objstore as objstore
from lightning_zero.checkpoint.dcp import (
    CheckpointError,
    ChunkLoadPlanner,
    SafeFileSystemReader,
    read_dcp_metadata,
    unpickle_dcp_metadata,
)
from lightning_zero.checkpoint.destinations import Location
from lightning_zero.checkpoint.objstore import DEFAULT_POLICY, Counter, StoragePolicy, is_url
from lightning_zero.checkpoint.objstore_dcp import ObjectReader, verify_objects
from lightning_zero.checkpoint.publish import DCP_METADATA_FILE, FORMAT, META_FILE, PathLike, sha256_of
from lightning_zero.checkpoint.ranks import all_gather_object, labelled, raise_any
from lightning_zero.checkpoint.state import decode, set_rng_state
from lightning_zero.checkpoint.targets import (
    RankPlacement,
    Targets,
    engine_entries,
    managed_names,
    module_entries,
    param_of_key,
    split_info,
)


def is_checkpoint(path: PathLike, storage: StoragePolicy = DEFAULT_POLICY) -> bool:
    """True for a directory holding a lightning_zero checkpoint's ``meta.json``, or a URL whose
    commit object resolves ([Note: commit objects] in ``objstore.py``)."""
    if is_url(path):
        try:
            return objstore.resolve(str(path), storage) is not None
        except (OSError, ValueError):
            return False
    return Path(path, META_FILE).is_file()


def refuse_plain_load(path: PathLike) -> None:
    """``ValueError`` when ``path`` is a sharded checkpoint that a plain ``torch.load`` (as in
    ``LightningModule.load_from_checkpoint``) cannot read, saying what to run instead."""
    if isinstance(path, (str, os.PathLike)) and is_checkpoint(path):
        raise ValueError(
            f"{path} is a sharded lightning_zero checkpoint (a directory: each rank's shard plus meta.json),"
            " which load_from_checkpoint cannot read. Resume it with a ZeRO strategy"
            " (Trainer(strategy=ZeroStrategy(...)).fit(model, ckpt_path=...); any stage, tp or number of ranks),"
            f" or consolidate it first: `lightning-zero export {path} model.safetensors` (one state dict) or"
            f" `lightning-zero export {path} OUT_DIR --format hf` (a Hugging Face Llama directory)."
        )


@dataclass
class OpenedCheckpoint:
    """A verified checkpoint: its ``meta.json`` and Lightning state, ready to load from."""

    path: Location  # the directory, or for a URL checkpoint the data prefix its commit names
    meta: dict[str, Any]
    state: dict[str, Any]
    rank_state: Optional[dict[str, Any]]
    storage: StoragePolicy = DEFAULT_POLICY
    reads: Counter = field(default_factory=Counter)  # bytes read from object storage (ranges and whole objects)
    files: dict[str, Any] = field(default_factory=dict)  # a URL checkpoint's commit: {object: {size, sha256}}

    def lightning_dict(self) -> dict[str, Any]:
        """What Lightning expects back from ``Strategy.load_checkpoint`` (tensors stay on disk)."""
        out = dict(self.state)
        out["state_dict"] = {}
        # every save but a weights-only one holds the optimizers' list, empty with no optimizer (as ddp's)
        if self.meta["optimizers"] or self.meta.get("with_optimizer"):
            out["optimizer_states"] = [{} for _ in self.meta["optimizers"]]
        return out


def _verify_file(root: Path, name: str, info: dict[str, Any], with_hash: bool) -> Optional[str]:
    path = root / name
    if not path.is_file():
        return f"{path}: missing"
    size = path.stat().st_size
    if size != info["size"]:
        return f"{path}: {size} bytes, expected {info['size']} (truncated or replaced)"
    if with_hash and sha256_of(path) != info["sha256"]:
        return f"{path}: sha256 does not match meta.json (corrupted or tampered with)"
    return None


def open_checkpoint(
    path: PathLike, layout: Optional[RankPlacement] = None, storage: StoragePolicy = DEFAULT_POLICY
) -> OpenedCheckpoint:
    """Read and verify the checkpoint directory ``path``.

    With ``layout`` (a load into a running job) a collective over the default process group: every
    file's size is checked on every rank, the sha256 checks are split over the ranks and the
    verdict is agreed. Without it (``export``, one process reading a finished checkpoint on its
    own, inside a job or not: ``if trainer.is_global_zero: export(...)``) every check runs here
    and no other rank is asked. Raises :class:`CheckpointError` naming the first bad file; nothing
    is loaded anywhere. A URL is read through its commit object (:func:`_open_url`).
    """
    alone = layout is None
    layout = layout or RankPlacement()
    if is_url(path):
        return _open_url(str(path).rstrip("/"), layout, storage, alone=alone)
    root = Path(path)
    with labelled("ckpt_open"):
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
        raise_any([error] if alone else all_gather_object(error, "ckpt_verify"), CheckpointError)
        rank_file = root / f"rank{layout.rank}.json"
        rank_state = None
        if meta["layout"]["world_size"] == layout.world_size and rank_file.is_file():
            rank_state = decode(json.loads(rank_file.read_text()))
        return OpenedCheckpoint(root, meta, decode(meta["trainer_state"]), rank_state)


def _open_url(target: str, layout: RankPlacement, storage: StoragePolicy, *, alone: bool) -> OpenedCheckpoint:
    """[Note: commit objects]: the commit resolved, every object's size checked against it (one
    listing), ``meta.json``, ``.metadata`` and this rank's rank file checked by sha256 as they are
    read; the shards are re-hashed as they are read ([Note: shard hashes on URL loads] in
    ``objstore_dcp.py``), or here, every object, without a process group (``alone``)."""
    reads = Counter()
    with labelled("ckpt_open"):
        error, meta, rank_text = None, {}, None
        try:
            found = objstore.resolve(target, storage)
            if found is None:
                raise CheckpointError(f"{target}: no commit object; not a (complete) lightning_zero checkpoint")
            data, commit = found
            listed = objstore.sizes(data, storage)
            for name, info in sorted(commit["files"].items()):
                size = listed.get(name)
                if size is None:
                    raise CheckpointError(f"{objstore.join(data, name)}: missing")
                if size != info["size"]:
                    raise CheckpointError(
                        f"{objstore.join(data, name)}: {size} bytes, expected {info['size']} (truncated or replaced)"
                    )

            def checked(name: str) -> bytes:
                payload = objstore.read_bytes(objstore.join(data, name), storage)
                reads.add(len(payload))
                if hashlib.sha256(payload).hexdigest() != commit["files"][name]["sha256"]:
                    raise CheckpointError(f"{objstore.join(data, name)}: sha256 does not match the commit")
                return payload

            meta = _parse_meta(checked(META_FILE).decode(), objstore.join(data, META_FILE))
            if DCP_METADATA_FILE not in meta["files"]:
                raise CheckpointError(f"{objstore.join(data, META_FILE)}: lists no {DCP_METADATA_FILE}")
            unpickle_dcp_metadata(io.BytesIO(checked(DCP_METADATA_FILE)), objstore.join(data, DCP_METADATA_FILE))
            rank_name = f"rank{layout.rank}.json"
            if meta["layout"]["world_size"] == layout.world_size and rank_name in commit["files"]:
                rank_text = checked(rank_name).decode()
            if alone:
                verify_objects(data, commit["files"], storage, reads)
        except CheckpointError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - no credentials, no bucket, a stalled read
            error = f"{target}: cannot read ({type(exc).__name__}: {exc})"
        raise_any([error] if alone else all_gather_object(error, "ckpt_verify"), CheckpointError)
        rank_state = decode(json.loads(rank_text)) if rank_text is not None else None
        return OpenedCheckpoint(data, meta, decode(meta["trainer_state"]), rank_state, storage, reads, commit["files"])


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
    return _parse_meta(meta_path.read_text(errors="replace"), meta_path)


def _parse_meta(text: str, meta_path: Any) -> dict[str, Any]:
    try:
        meta = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta_path}: not valid JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{meta_path}: format {meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT!r}"
        )
    for key in ("layout", "params", "optimizers", "trainer_state", "files"):
        if key not in meta:
            raise CheckpointError(f"{meta_path}: missing {key!r}")
    return meta


def _dcp_load(opened: OpenedCheckpoint, tensors: dict[str, Any]) -> None:
    try:
        with labelled("ckpt_dcp_load"):
            reader = (ObjectReader(opened.path, opened.storage, opened.reads, opened.files) if isinstance(opened.path, str)
                      else SafeFileSystemReader(str(opened.path)))  # fmt: skip
            dcp.load(tensors, storage_reader=reader, planner=ChunkLoadPlanner())
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"{opened.path}: loading failed, nothing was changed: {exc}") from exc


def load_model(
    opened: OpenedCheckpoint,
    module: nn.Module,
    *,
    engine: Any = None,
    optimizers: Optional[list[Optimizer]] = None,
    layout: Optional[RankPlacement] = None,
    strict: bool = True,
) -> list[dict[int, dict[str, torch.Tensor]]]:
    """Load the weights (and, with an engine, the optimizer state of the owned ranges).

    Everything is read into fresh tensors first and copied into the module and the masters only
    when the whole read succeeded. With ``engine`` the compute parameters are refreshed from the
    masters (the engine's all-gather). Returns the optimizer states per optimizer (stepped tensor id ->
    state) for :func:`apply_optimizer_state`.

    [Note: strict loading] The checkpoint's tensors (names and dense shapes in ``meta.json``) must
    be exactly the module's, the tensors every rank holds together (under pipeline parallelism a
    rank holds only its stages'): a tensor the module lacks (a checkpoint of a deeper model), one the
    checkpoint lacks, or one of another shape raises ``CheckpointError`` on every rank, listing
    them with the shapes on both sides, before anything is read. ``strict=False`` (Lightning
    passes ``LightningModule.strict_loading``) is the deliberate partial load: tensors the module
    lacks are skipped, tensors the checkpoint lacks keep their current values (and fresh optimizer
    state); a shape mismatch still fails.
    """
    layout = layout or RankPlacement()
    optimizers = optimizers or []
    targets = Targets()
    kinds = [opt_meta["state"] for opt_meta in opened.meta["optimizers"]]
    if engine is not None:
        if kinds and len(kinds) != len(optimizers):
            raise CheckpointError(
                f"{opened.path}: saved with {len(kinds)} optimizer(s), the module configures {len(optimizers)}"
            )
        engine_entries(engine, optimizers, layout, targets, load=True, state_kinds=kinds or [{} for _ in optimizers])
        module_entries(module, managed_names(engine), layout, targets, load=True)
    else:
        module_entries(module, set(), layout, targets, load=True)
    missing = _check_fits(opened, _expected_params(module, engine, layout), strict)
    if missing:  # strict=False: leave what the checkpoint lacks as it is
        targets.tensors = {k: v for k, v in targets.tensors.items() if param_of_key(k) not in missing}
        targets.copies = [copy for copy in targets.copies if copy[0] not in missing]
    _dcp_load(opened, targets.tensors)
    with torch.no_grad():
        for _, destination, staged in targets.copies:
            destination.copy_(staged.view(destination.shape).to(destination.dtype))
    if engine is not None:
        engine.refresh_params_from_masters()
    return targets.optimizer_states


def _expected_params(module: nn.Module, engine: Any, layout: RankPlacement) -> dict[str, list[int]]:
    """``{name: dense shape}`` of every tensor the module saves (what ``meta.json`` lists)."""
    expected: dict[str, list[int]] = {}
    if engine is not None:
        for name, param in engine.managed_parameters().items():
            expected[name] = split_info(param.shape, param, layout)["shape"]
    params = dict(module.named_parameters())
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name not in expected and isinstance(tensor, torch.Tensor):
            expected[name] = split_info(tensor.shape, params.get(name), layout)["shape"]
    return expected


def _check_fits(opened: OpenedCheckpoint, expected: dict[str, list[int]], strict: bool) -> set[str]:
    """See [Note: strict loading]; returns the names this rank holds that the checkpoint lacks
    (non-strict only).

    The model is what every rank holds together: under pipeline parallelism each rank holds only its
    stages' tensors (the others' are in the checkpoint, not unexpected), so the ranks' expected
    tensors are gathered (as the save gathers what each rank wrote) and every rank judges the
    same union, raising the same error."""
    saved = {name: list(info["shape"]) for name, info in opened.meta["params"].items()}
    everyone = all_gather_object(expected, "ckpt_check_fits")
    union: dict[str, list[int]] = {}
    mismatched: dict[str, list[int]] = {}
    for held in everyone:
        for name, shape in held.items():
            union.setdefault(name, shape)
            if name in saved and saved[name] != shape:
                mismatched.setdefault(name, shape)
    unexpected = sorted(set(saved) - set(union))
    missing = sorted(set(union) - set(saved))
    problems = []
    if mismatched:
        problems.append(
            "shape mismatch: "
            + ", ".join(f"{n} checkpoint {saved[n]} vs model {mismatched[n]}" for n in sorted(mismatched))
        )
    if strict and unexpected:
        problems.append(
            f"{len(unexpected)} unexpected tensor(s) in the checkpoint that the model lacks: "
            + ", ".join(f"{n} {saved[n]}" for n in unexpected)
        )
    if strict and missing:
        problems.append(
            f"{len(missing)} tensor(s) of the model missing from the checkpoint: "
            + ", ".join(f"{n} {union[n]}" for n in missing)
        )
    if problems:
        error = f"{opened.path}: does not fit the model, nothing was loaded; " + "; ".join(problems)
        if not mismatched:
            error += (
                ". To load only the matching tensors on purpose, set strict_loading = False on the LightningModule"
                " (CLI: strict_loading=false)"
            )
        raise CheckpointError(error)
    return set(expected) - set(saved)


def apply_optimizer_state(
    opened: OpenedCheckpoint,
    optimizers: list[Optimizer],
    states: list[dict[int, dict[str, torch.Tensor]]],
    *,
    rank: int = 0,
) -> None:
    """Install loaded optimizer state and the saved param-group hyperparameters (lr, betas, ...).
    An optimizer the checkpoint holds no state for, where it should, is named in a warning (global
    ``rank`` 0): :func:`missing_optimizer_state`."""
    saved = opened.meta["optimizers"]
    if rank == 0:
        for line in missing_optimizer_state(opened, optimizers):
            warnings.warn(line, stacklevel=2)
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
        stepped = {id(p): p for group in optimizer.param_groups for p in group["params"]}
        for tensor_id, state in (states[index] if index < len(states) else {}).items():
            optimizer.state[stepped[tensor_id]] = state


def missing_optimizer_state(opened: OpenedCheckpoint, optimizers: list[Optimizer]) -> list[str]:
    """What a load into ``optimizers`` would otherwise restore silently without any state: one line
    per optimizer that the checkpoint lists no state for although it had some when saved (or, from a
    writer before ``had_state`` was recorded, that may have had some), or that the checkpoint does
    not list at all (a save after validate, test or predict without fit holds no optimizer, as
    ddp's). The optimizer then starts from zero state: Adam's moments restart, and the resumed run
    drifts from an uninterrupted one ([Note: optimizer state after the loop] in zero/flat.py)."""
    saved = opened.meta["optimizers"]
    lines = []
    for index, optimizer in enumerate(optimizers):
        name = type(optimizer).__name__
        if index >= len(saved):
            lines.append(
                f"{opened.path}: holds no state for optimizer {index} ({name}): it was saved with {len(saved)}"
                " optimizer(s) (a save after validate, test or predict without a fit holds none); the optimizer"
                " starts from zero state. Resume from a checkpoint saved during or after fit to continue exactly."
            )
        elif not saved[index]["state"] and saved[index].get("had_state", True):
            lines.append(
                f"{opened.path}: holds no state for optimizer {index} ({saved[index]['type']}) although it had"
                " some when saved (trainer.save_checkpoint after fit lost it before issue 61 was fixed); the"
                " optimizer starts from zero state, so the run drifts from an uninterrupted one. Resume from a"
                " checkpoint saved during fit (ModelCheckpoint) to continue exactly."
            )
    return lines


def restore_rng(opened: OpenedCheckpoint) -> bool:
    """Restore this rank's RNG states if the checkpoint was saved at the same world size."""
    if opened.rank_state is None:
        return False
    set_rng_state(opened.rank_state["rng"])
    return True
