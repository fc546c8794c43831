"""``save_checkpoint``: every rank writes what it owns; rank 0 publishes the directory."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer

from lightning_zero.checkpoint.dcp import (
    ChunkSavePlanner,
)
from lightning_zero.checkpoint.destinations import Location, destination, location
from lightning_zero.checkpoint.objstore import DEFAULT_POLICY, StoragePolicy
from lightning_zero.checkpoint.publish import (
    FORMAT,
    CheckpointWriteError,
    PathLike,
    WriteProgress,
    rank_file_text,
)
from lightning_zero.checkpoint.ranks import all_gather_object, broadcast_object, labelled, raise_any
from lightning_zero.checkpoint.state import encode
from lightning_zero.checkpoint.targets import (
    RankPlacement,
    Targets,
    engine_entries,
    managed_names,
    module_entries,
    split_info,
    state_entries,
)

# Test hook: called with a stage name ("shards_written") on every rank; fault tests kill a rank here.
_fault_hook: Optional[Callable[[str], None]] = None


@dataclass
class Snapshot:
    """What a save writes, taken at the step boundary: the trainer state as JSON, this rank's RNG
    file, the tensors to write (the live ones, or host copies: :func:`host_copy`), and what
    ``meta.json`` needs from the model and the optimizers."""

    target: Location
    encoded_state: Any
    rng_file: str
    tensors: dict[str, Any]
    params: dict[str, Any]
    managed: dict[str, Any]
    kinds: list[dict]
    optimizer_groups: list[tuple[str, Any]]  # (type name, encoded param groups) per optimizer
    with_optimizer: bool
    had_state: list[bool]  # per optimizer: whether it held any state on this rank
    has_inner_model: bool
    # the writer waits on it before reading a tensor still being copied ([Note: uploads overlap the
    # host copy] in background.py); None: every tensor is there
    ready: Optional[Callable[[Any], None]] = None


def snapshot(
    path: PathLike,
    checkpoint: dict[str, Any],
    *,
    module: nn.Module,
    engine: Any,
    optimizers: list[Optimizer],
    layout: RankPlacement,
    keep_device: bool = False,
    optimizer_shards: Any = None,
) -> Snapshot:
    """The first half of :func:`save_checkpoint`: no file and no collective, only reads (but for
    a matrix optimizer's state, sent from its owners first: [Note: Muon state in checkpoints]).

    ``keep_device``: the snapshot's tensors stay views of the live (device) tensors, for a caller
    that copies them itself (:func:`~lightning_zero.checkpoint.background.host_copy`); else every
    device tensor is copied to the host here. ``optimizer_shards``:
    where the optimizers' state lives when the engine that stepped them is closed ([Note:
    optimizer state after the loop] in ``zero/flat.py``); None: the engine's own."""
    trainer_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    encoded_state = encode(trainer_state, "checkpoint")  # fails early, before any file exists
    targets = Targets(keep_device=keep_device)
    with_optimizer = "optimizer_states" in checkpoint
    replicated = getattr(engine, "has_replicated_optimizers", lambda: False)() if engine is not None else False
    if optimizer_shards is not None:
        replicated = optimizer_shards.replicated
        if with_optimizer and optimizer_shards.whole_matrices:  # [Note: optimizer state after the loop]
            raise ValueError(
                "lightning_zero checkpoint: a matrix optimizer (Muon) keeps each momentum whole on its owner, and"
                " the engine that would spread it over the ranks for a save is closed (after fit, or the Fabric"
                " strategy's teardown); save inside the run (ModelCheckpoint, fabric.save before the teardown), or"
                " the weights only (trainer.save_checkpoint(path, weights_only=True))."
            )
    if with_optimizer and replicated:
        names = sorted({type(opt).__name__ for opt in optimizers if type(opt).__name__ in ("Adafactor",)})
        raise ValueError(
            f"lightning_zero checkpoint: {', '.join(names) or 'an optimizer'} steps replicated full masters"
            " (see [Note: non-element-wise optimizers] in zero/replicated_optimizer.py); its factored state"
            " is not saved by element ranges. Save the weights only (ModelCheckpoint(save_weights_only=True),"
            " or trainer.save_checkpoint(path, weights_only=True)), or use an element-wise optimizer."
        )
    kinds: list[dict] = [{} for _ in optimizers]
    # Matrix optimizers (Muon) keep each momentum whole on its owner: the one collective of a
    # snapshot gives every rank its runs first ([Note: Muon state in checkpoints], every rank saves)
    staged = [opt for opt in getattr(engine, "optimizers", []) if hasattr(opt, "stage_range_state")]
    for sharded in staged if with_optimizer else []:
        sharded.stage_range_state()
    try:
        params = save_entries(targets, kinds, module=module, engine=engine, optimizers=optimizers, layout=layout,
                              with_optimizer=with_optimizer, optimizer_shards=optimizer_shards)  # fmt: skip
    finally:
        for sharded in staged:
            sharded.drop_range_state()
    managed = _managed_info(engine, layout) if engine is not None else {}
    groups = [
        (type(opt).__name__, encode([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                                    f"optimizer {index}"))
        for index, opt in enumerate(optimizers)
    ]  # fmt: skip
    inner = getattr(module, "model", None)
    return Snapshot(
        target=location(path), encoded_state=encoded_state, rng_file=rank_file_text(), tensors=targets.tensors,
        params=params, managed=managed, kinds=kinds,
        optimizer_groups=groups, with_optimizer=with_optimizer, has_inner_model=isinstance(inner, nn.Module),
        had_state=[bool(opt.state) for opt in optimizers],
    )  # fmt: skip


def save_entries(
    targets: Targets,
    kinds: list[dict],
    *,
    module: nn.Module,
    engine: Any,
    optimizers: list[Optimizer],
    layout: RankPlacement,
    with_optimizer: bool,
    optimizer_shards: Any = None,
) -> dict[str, Any]:
    """The tensors a save writes into ``targets`` (the live ones: reads only), the optimizer state
    kinds into ``kinds``; returns the module entries' shapes for ``meta.json``. The optimizers'
    state comes from ``optimizer_shards`` when given, else from ``engine``."""
    skip: set[str] = set()
    if engine is not None:
        engine_entries(engine, optimizers, layout, targets, load=False, state_kinds=kinds,
                       with_state=with_optimizer and optimizer_shards is None)  # fmt: skip
        skip = managed_names(engine)
    if with_optimizer and optimizer_shards is not None:
        state_entries(optimizer_shards, optimizers, layout, targets, load=False, state_kinds=kinds)
    return module_entries(module, skip, layout, targets, load=False)


def save_checkpoint(
    path: PathLike,
    checkpoint: dict[str, Any],
    *,
    module: nn.Module,
    engine: Any,
    optimizers: list[Optimizer],
    layout: RankPlacement,
    storage: StoragePolicy = DEFAULT_POLICY,
) -> Location:
    """Write a sharded checkpoint of ``module`` (and ``engine``'s shards) to the directory ``path``.

    ``checkpoint``: Lightning's checkpoint dict; its ``state_dict`` and ``optimizer_states`` are
    ignored (tensors come from the engine: each rank writes only the ranges it owns), the rest is
    stored as JSON. When it has no ``optimizer_states`` (``save_weights_only``) no optimizer
    state is written. A collective over the default process group: every rank must call it.
    Raises :class:`CheckpointWriteError` on every rank if any rank cannot write; the previous
    checkpoint at ``path`` is then untouched. :func:`snapshot` then :func:`write_snapshot`
    (``checkpoint/background.py`` runs the second half in a thread).
    """
    with labelled("ckpt_save"):
        taken = snapshot(path, checkpoint, module=module, engine=engine, optimizers=optimizers, layout=layout)
        return write_snapshot(taken, layout, storage=storage)


def write_snapshot(
    taken: Snapshot,
    layout: RankPlacement,
    group: Optional[Any] = None,
    *,
    progress: Optional[WriteProgress] = None,
    on_state: Optional[Callable[[str], None]] = None,
    storage: StoragePolicy = DEFAULT_POLICY,
) -> Location:
    """The second half of :func:`save_checkpoint`: every rank writes its files, rank 0 publishes.
    Collectives over ``group`` (``None``: the default group). ``progress`` counts the bytes
    written; ``on_state`` hears ``"staged"``, ``"written"`` and ``"published"`` as they happen
    ([Note: checkpoint lifecycle] in ``runtime/checkpoints.py``). A URL target is written to
    object storage as ``storage`` says ([Note: commit objects] in ``objstore.py``)."""

    def reached(state: str) -> None:
        if progress is not None:
            progress.step()
        if on_state is not None:
            on_state(state)

    target = taken.target
    where = destination(target, layout, group, progress, storage)
    reached("staged")
    raise_any(all_gather_object(where.write_rank_file(taken.rng_file), "ckpt_rank_files", group),
              CheckpointWriteError)  # fmt: skip
    try:
        with labelled("ckpt_dcp_save"):
            dcp.save(taken.tensors, storage_writer=where.storage_writer(), planner=ChunkSavePlanner(taken.ready),
                     process_group=group)  # fmt: skip
    except (Exception, CheckpointException) as exc:
        raise CheckpointWriteError(_shards_failed(target, exc, where.errors, layout.rank, group)) from exc
    if _fault_hook is not None:
        _fault_hook("shards_written")

    files = where.files()
    try:
        all_files = all_gather_object(files, "ckpt_manifest", group)
        all_kinds = all_gather_object((taken.kinds, taken.had_state), "ckpt_state_kinds", group)
        all_params = all_gather_object(taken.managed, "ckpt_params", group)
    except RuntimeError as exc:  # a peer died or timed out mid-write (gloo/NCCL errors are RuntimeErrors)
        raise CheckpointWriteError(
            f"writing {str(target)!r}: a rank failed before every rank had written its shards ({exc});"
            " nothing was published, the previous checkpoint of that name is untouched"
        ) from exc
    reached("written")

    error = None
    if layout.rank == 0:
        try:
            params = dict(taken.params)
            for rank_params in all_params:
                params.update(rank_params)
            meta = {
                "format": FORMAT,
                "layout": asdict(layout),
                "params": params,
                "optimizers": _optimizer_meta(taken.optimizer_groups, all_kinds) if taken.with_optimizer else [],
                "with_optimizer": taken.with_optimizer,
                "export_prefix": "model." if taken.has_inner_model and _all_under_model(params) else "",
                "trainer_state": taken.encoded_state,
                "files": {name: info for rank_files in all_files for name, info in rank_files.items()},
            }
            where.publish(meta)
        except CheckpointWriteError as exc:  # an optimizer's state found nowhere: raised on every rank below
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - OSError locally; any fsspec error at a URL: raised on every rank
            error = f"publishing {str(target)!r} failed: {type(exc).__name__}: {exc}"
    raise_any([broadcast_object(error, "ckpt_publish", group)], CheckpointWriteError)
    reached("published")
    return target


def _shards_failed(target: Location, exc: BaseException, errors: list[str], rank: int, group: Optional[Any]) -> str:
    """The message every rank raises when DCP's write failed: which rank could not write which
    file and why (the OS error), when the ranks can still agree on it (DCP raised its
    ``CheckpointException`` on every rank); else DCP's own error."""

    def ranked(index: int, line: str) -> str:
        return line if line.startswith(f"rank {index}:") else f"rank {index}: {line}"

    lines = [ranked(rank, errors[0])] if errors else []
    if isinstance(exc, CheckpointException):
        try:
            gathered = all_gather_object(errors[0] if errors else None, "ckpt_write_errors", group)
            lines = [ranked(index, line) for index, line in enumerate(gathered) if line]
        except RuntimeError:  # a peer is gone: this rank's own line only
            pass
    if not lines:
        return f"writing the shards of {str(target)!r} failed: {exc}"
    fix = (
        "Check the credentials, the bucket and the network, or raise upload_stall_s for a slow store."
        if isinstance(target, str)
        else "Free space, raise the quota or file-size limit (ulimit -f), or save to another directory."
    )
    return (
        f"writing the shards of {str(target)!r} failed: {'; '.join(lines)}. Nothing was published: the"
        f" checkpoint saved before is still the newest. {fix}"
    )


def _managed_info(engine: Any, layout: RankPlacement) -> dict[str, Any]:
    info = {}
    for owned in engine.owned_ranges():
        info[owned.name] = split_info(owned.shape, owned.param, layout)
    return info


def _optimizer_meta(groups: list[tuple[str, Any]], all_kinds: list[tuple[list[dict], list[bool]]]) -> list[dict]:
    """Per optimizer: its type, param groups, state kinds and ``had_state`` (it held state on some
    rank: a load that finds no state kinds then says so, [Note: optimizer state after the loop])."""
    meta = []
    for index, (type_name, param_groups) in enumerate(groups):
        kinds: dict[str, Any] = {}
        for rank_kinds, _ in all_kinds:
            kinds.update(rank_kinds[index])
        had_state = any(rank_had[index] for _, rank_had in all_kinds)
        if had_state and not kinds:  # the state is somewhere no save reads: never publish it as empty
            raise CheckpointWriteError(
                f"lightning_zero checkpoint: optimizer {index} ({type_name}) holds state that this save found no"
                " element range for; nothing was published (please report this)"
            )
        meta.append({"type": type_name, "param_groups": param_groups, "state": kinds, "had_state": had_state})
    return meta


def _all_under_model(params: dict[str, Any]) -> bool:
    """``"model."`` is the export prefix when every entry lives under ``module.model`` (``LlamaLM``)."""
    return bool(params) and all(name.startswith("model.") for name in params)
