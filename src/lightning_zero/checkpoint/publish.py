"""Writing a checkpoint directory safely: the temporary directory, hashed files, the atomic rename
([Note: atomic publish] in ``checkpoint/__init__.py``), and removal."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Optional, Union

from lightning_zero.checkpoint.ranks import broadcast_object
from lightning_zero.checkpoint.state import encode, rng_state
from lightning_zero.checkpoint.targets import RankPlacement

FORMAT = "lightning_zero.sharded/1"


META_FILE = "meta.json"


DCP_METADATA_FILE = ".metadata"


PathLike = Union[str, os.PathLike]


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (unwritable directory, disk full); nothing was published."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def begin_write(target: Path, layout: RankPlacement) -> Path:
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
    tmp, error = broadcast_object((str(tmp) if tmp else None, error), "ckpt_begin")
    if error:
        raise CheckpointWriteError(error)
    return Path(tmp)


def write_rank_file(tmp: Path, layout: RankPlacement) -> Optional[str]:
    try:
        fsync_write(tmp / f"rank{layout.rank}.json", json.dumps({"rng": encode(rng_state(), "rng")}))
    except OSError as exc:
        return f"cannot write {str(tmp)!r}: {exc}"
    return None


def publish(tmp: Path, target: Path) -> None:
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


def remove_checkpoint(path: PathLike) -> None:
    """Delete a checkpoint directory (or a plain file); call on one rank."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
