"""Writing a checkpoint directory safely: the temporary directory, hashed files, the atomic rename
([Note: atomic publish] in ``checkpoint/__init__.py``), and removal.

[Note: staging names] What a save writes before it publishes (the staging directory) and what it
moves aside while it publishes (the retired checkpoint) must never look like a checkpoint to
anything that scans a directory: Lightning's SLURM resume takes every name *containing*
``hpc_ckpt_`` and reads its digits as a version (a staging ``hpc_ckpt_1.ckpt.tmp-30179fcb00f7``
became version 130179007, a checkpoint that does not exist, and the requeued job died at start);
``ckpt_path="last"`` takes ``last*.ckpt``; ``ModelCheckpoint`` and users glob ``*.ckpt``. So both
are named ``.lightning_zero-staging-<token>-<hex of the target's name>`` and
``.lightning_zero-retired-<token>-<hex>``: hidden, with no ``hpc_ckpt_``, ``last`` or ``.ckpt`` in
them, and still telling which checkpoint they belong to. A save killed on the way leaves one
behind; :func:`clean_leftovers` (run by the strategy at the next start, with a warning) deletes
staging directories and retired checkpoints whose target exists, and moves a retired checkpoint
back whose target is missing (a kill between the two renames of :func:`publish`). Names of older
versions (``<target>.tmp-<token>``, ``<target>.old-<token>``) are cleaned the same way.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from torch.distributed.checkpoint.filesystem import FileSystem

from lightning_zero.checkpoint.ranks import broadcast_object
from lightning_zero.checkpoint.state import encode, rng_state
from lightning_zero.checkpoint.targets import RankPlacement

FORMAT = "lightning_zero.sharded/1"


META_FILE = "meta.json"


DCP_METADATA_FILE = ".metadata"


PathLike = Union[str, os.PathLike]


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (unwritable directory, disk full); nothing was published."""


STAGING, RETIRED = ".lightning_zero-staging-", ".lightning_zero-retired-"  # [Note: staging names]
_OURS = re.compile(r"^\.lightning_zero-(staging|retired)-[0-9a-f]{12}-([0-9a-f]*)$")
_LEGACY = re.compile(r"^(.+)\.(tmp|old)-[0-9a-f]{12}$")  # names before [Note: staging names]
_MAX_NAME = 255


def side_name(prefix: str, target: Path) -> str:
    """``<prefix><token>-<hex of target's name>`` ([Note: staging names]); the hex is left out
    when the name would pass the file-system limit (a leftover is then only ever deleted)."""
    token = uuid.uuid4().hex[:12]
    encoded = target.name.encode().hex()
    if len(prefix) + len(token) + 1 + len(encoded) > _MAX_NAME:
        encoded = ""
    return f"{prefix}{token}-{encoded}"


def _side_entry(path: Path) -> Optional[tuple[str, Optional[str]]]:
    """``(kind, target name or None)`` of a staging / retired directory of any version, else None."""
    match = _OURS.match(path.name)
    if match:
        kind, encoded = match.groups()
        try:
            return kind, bytes.fromhex(encoded).decode() if encoded else None
        except ValueError:
            return kind, None
    match = _LEGACY.match(path.name)
    if match and path.is_dir() and not path.is_symlink():
        return ("staging" if match.group(2) == "tmp" else "retired"), match.group(1)
    return None


def clean_leftovers(directory: PathLike) -> list[str]:
    """Remove what killed saves left in ``directory`` ([Note: staging names]); one line per action."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    done = []
    for path in sorted(directory.iterdir()):
        entry = _side_entry(path)
        if entry is None:
            continue
        kind, target_name = entry
        target = directory / target_name if target_name else None
        if kind == "retired" and target is not None and not os.path.lexists(target):
            os.replace(path, target)
            done.append(f"{str(target)!r} was moved aside by a save that was killed before it published;"
                        f" restored it from {path.name!r}")  # fmt: skip
            continue
        _remove(path)
        what = "the staging directory of a save that never finished" if kind == "staging" else (
            "a checkpoint replaced by a newer one of the same name (its removal was interrupted)")  # fmt: skip
        of = f" (for {target_name!r})" if target_name else ""
        done.append(f"removed {str(path)!r}: {what}{of}")
    return done


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()


class RecordingFileSystem(FileSystem):
    """DCP's file system, remembering the OS error of any failed write: torch's zip writer turns
    ``EFBIG``/``ENOSPC`` into "unexpected pos 704 vs 598", which names neither the file nor the
    cause; :func:`os_error_line` says both."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[str] = []

    @contextmanager
    def create_stream(self, path: Union[str, os.PathLike], mode: str) -> Iterator[io.IOBase]:
        try:
            with super().create_stream(path, mode) as stream:
                yield _Recording(stream, str(path), self.errors)  # type: ignore[misc]
        except OSError as exc:  # raised, e.g. by the flush at close
            self.errors.append(os_error_line(path, exc))
            raise


class _Recording:
    """A write stream that notes its first ``OSError`` (then raises it as before)."""

    def __init__(self, stream: io.IOBase, path: str, errors: list[str]) -> None:
        self._stream, self._path, self._errors = stream, path, errors

    def write(self, data: Any) -> int:
        try:
            return self._stream.write(data)
        except OSError as exc:
            self._errors.append(os_error_line(self._path, exc))
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def os_error_line(path: Union[str, os.PathLike], exc: OSError) -> str:
    """``cannot write '<path>': [Errno 27] File too large (EFBIG)``."""
    code = errno.errorcode.get(exc.errno or 0)
    return f"cannot write {str(path)!r}: {exc}" + (f" ({code})" if code else "")


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


def begin_write(target: Path, layout: RankPlacement, group: Optional[Any] = None) -> Path:
    """Create the staging directory ([Note: staging names]) beside ``target`` (rank 0), after
    removing stale ones of the same target, and check every rank can write there."""
    error, tmp = None, None
    if layout.rank == 0:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            for stale in target.parent.iterdir():
                if _side_entry(stale) == ("staging", target.name):
                    _remove(stale)
            tmp = target.parent / side_name(STAGING, target)
            tmp.mkdir()
        except OSError as exc:
            error = f"rank 0 cannot create a directory in {str(target.parent)!r} for the checkpoint: {exc}"
    tmp, error = broadcast_object((str(tmp) if tmp else None, error), "ckpt_begin", group)
    if error:
        raise CheckpointWriteError(error)
    return Path(tmp)


def rank_file_text() -> str:
    """This rank's ``rank<r>.json``: its RNG states, read now."""
    return json.dumps({"rng": encode(rng_state(), "rng")})


def write_rank_file(tmp: Path, layout: RankPlacement, text: Optional[str] = None) -> Optional[str]:
    try:
        fsync_write(tmp / f"rank{layout.rank}.json", rank_file_text() if text is None else text)
    except OSError as exc:
        return os_error_line(tmp / f"rank{layout.rank}.json", exc)
    return None


def publish(tmp: Path, target: Path) -> None:
    """Rank 0: swap ``tmp`` into ``target`` (see [Note: atomic publish])."""
    old = None
    if os.path.lexists(target):
        old = target.parent / side_name(RETIRED, target)
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        _remove(old)


def remove_checkpoint(path: PathLike) -> None:
    """Delete a checkpoint directory (or a plain file); call on one rank."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
