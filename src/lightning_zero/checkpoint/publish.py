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

[Note: staging in flight] A staging name alone does not say whether its save is dead: another job
(or another Fabric script) saving into the same directory has one in flight too, and deleting it
loses that job's checkpoint. So the process that creates a staging entry holds an exclusive
``flock`` on it (:func:`hold`) until it publishes or removes it (:func:`release`); the kernel drops
the lock when the process dies, however it dies. :func:`clean_leftovers` (and the stale-staging
removal of :func:`begin_write`) skips an entry whose lock another process holds, and entries this
process holds itself. Where ``flock`` is not supported, the entry counts as not held (the
behaviour before this note). Linux NFS clients map ``flock`` to byte-range locks across clients;
Lustre needs ``-o flock``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

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


_held: dict[str, int] = {}  # staging entries this process holds: path -> the fd carrying its flock


def hold(path: Path) -> None:
    """Lock the staging entry this process just created ([Note: staging in flight])."""
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # no flock here: unlocked, as before
        os.close(handle)
        return
    _held[str(path)] = handle


def release(path: Path) -> None:
    """The staging entry ``path`` was published or removed: drop its lock."""
    handle = _held.pop(str(path), None)
    if handle is not None:
        os.close(handle)


def in_flight(path: Path) -> bool:
    """Whether a live process (this one included) holds ``path``'s staging lock."""
    if str(path) in _held:
        return True
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no flock here
        return False
    finally:
        os.close(handle)  # closing drops the probe's own lock
    return False


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
    """Remove what killed saves left in ``directory`` ([Note: staging names]) after
    :func:`restore_moved_aside`; rank 0 only. One line per action."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    done = restore_moved_aside(directory)
    for path in sorted(directory.iterdir()):
        entry = _side_entry(path)
        if entry is None:
            continue
        kind, target_name = entry
        if kind == "retired" and target_name and not os.path.lexists(directory / target_name):
            continue  # restore_moved_aside could not move it back: keep it, never delete a checkpoint
        if kind == "staging" and in_flight(path):
            done.append(f"kept {str(path)!r}: a save in flight by a live process ([Note: staging in flight])")
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


class WriteProgress:
    """How far this rank's background write got: bytes written and steps passed (thread-safe
    enough: one writer thread adds, the training thread reads). With a ``store`` (the process
    group's), every rank adds its progress to one shared counter ``key`` at most every
    ``publish_s`` seconds, so a rank waiting in a collective for a slow peer sees the peer's
    bytes too ([Note: checkpoint lifecycle] in ``runtime/checkpoints.py``)."""

    def __init__(self, store: Any = None, key: str = "", publish_s: float = 0.5) -> None:
        self.store, self.key, self.publish_s = store, key, publish_s
        self.local = 0  # bytes and steps of this rank
        self._published = 0
        self._published_at = 0.0

    def wrote(self, nbytes: int) -> None:
        self.local += max(int(nbytes), 1)
        if self.store is not None and time.monotonic() - self._published_at >= self.publish_s:
            self.publish()

    def step(self) -> None:
        """A phase of the write passed (staged, files written, hashed, published)."""
        self.wrote(1)
        self.publish()

    def publish(self) -> None:
        delta, self._published = self.local - self._published, self.local
        self._published_at = time.monotonic()
        if self.store is not None and delta:
            try:
                self.store.add(self.key, delta)
            except Exception:  # noqa: BLE001 - the store's host is gone: local progress only
                self.store = None

    def total(self) -> int:
        """Every rank's progress (this rank's alone without a store)."""
        if self.store is not None:
            try:
                return int(self.store.add(self.key, 0)) + (self.local - self._published)
            except Exception:  # noqa: BLE001 - the store's host is gone
                self.store = None
        return self.local


class RecordingFileSystem(FileSystem):
    """DCP's file system, remembering the OS error of any failed write: torch's zip writer turns
    ``EFBIG``/``ENOSPC`` into "unexpected pos 704 vs 598", which names neither the file nor the
    cause; :func:`os_error_line` says both."""

    def __init__(self, progress: Optional["WriteProgress"] = None) -> None:
        super().__init__()
        self.errors: list[str] = []
        self.progress = progress

    @contextmanager
    def create_stream(self, path: Union[str, os.PathLike], mode: str) -> Iterator[io.IOBase]:
        try:
            with super().create_stream(path, mode) as stream:
                yield _Recording(stream, str(path), self.errors, self.progress)  # type: ignore[misc]
        except OSError as exc:  # raised, e.g. by the flush at close
            self.errors.append(os_error_line(path, exc))
            raise


class _Recording:
    """A write stream that notes its first ``OSError`` (then raises it as before)."""

    def __init__(self, stream: io.IOBase, path: str, errors: list[str], progress: Optional["WriteProgress"]) -> None:
        self._stream, self._path, self._errors, self._progress = stream, path, errors, progress

    def write(self, data: Any) -> int:
        try:
            written = self._stream.write(data)
        except OSError as exc:
            self._errors.append(os_error_line(self._path, exc))
            raise
        if self._progress is not None:
            self._progress.wrote(len(memoryview(data).cast("B")) if written is None else written)
        return written

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
                if _side_entry(stale) == ("staging", target.name) and not in_flight(stale):
                    _remove(stale)
            tmp = target.parent / side_name(STAGING, target)
            tmp.mkdir()
            hold(tmp)
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


def fsync_directory(path: Path) -> None:
    """Make ``path``'s entries (names created, renamed, removed in it) durable: a rename is only
    on disk once its directory is synced ([Note: atomic publish])."""
    try:
        handle = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a file system that cannot open directories: nothing to sync
        return
    try:
        os.fsync(handle)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # not supported for directories there
            raise
    finally:
        os.close(handle)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange(first: Path, second: Path) -> bool:
    """Swap the names ``first`` and ``second`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``);
    False where the platform or the file system cannot (nothing changed then)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # glibc before 2.28, or another libc
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV, errno.EPERM):
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE) of {str(first)!r} and {str(second)!r}: {os.strerror(code)}")


# Test hook: called with "moved_aside" between the two renames of the fallback publish.
_publish_hook: Optional[Callable[[str], None]] = None


def publish(tmp: Path, target: Path) -> None:
    """Rank 0: swap ``tmp`` into ``target`` (see [Note: atomic publish]): the staging directory's
    entries synced, then one atomic exchange of the two names where the platform has one (the
    old checkpoint then sits under the staging name: there is never a moment without ``target``),
    else the old one moved aside first; the parent directory synced before the old one is removed."""
    fsync_directory(tmp)
    release(tmp)  # [Note: staging in flight]: the lock goes with the name, which is now the target's
    if not os.path.lexists(target):
        os.replace(tmp, target)
        fsync_directory(target.parent)
        return
    if exchange(tmp, target):
        fsync_directory(target.parent)
        _remove(tmp)  # the old checkpoint, under the staging name
        return
    old = target.parent / side_name(RETIRED, target)
    os.replace(target, old)
    if _publish_hook is not None:
        _publish_hook("moved_aside")
    os.replace(tmp, target)
    fsync_directory(target.parent)
    _remove(old)


def link_atomically(target: Path, link: Path) -> None:
    """Rank 0: point the symlink ``link`` at ``target`` (relative, as ``ModelCheckpoint`` links),
    replacing what ``link`` was in one rename; the directory synced."""
    if link.is_dir() and not link.is_symlink():
        remove_checkpoint(link)
    staged = link.parent / side_name(STAGING, link)
    os.symlink(os.path.relpath(target, link.parent), staged)
    os.replace(staged, link)
    fsync_directory(link.parent)


def restore_moved_aside(directory: PathLike) -> list[str]:
    """Every rank, before anything resolves a checkpoint path in ``directory`` (``"last"``, SLURM's
    ``hpc_ckpt_<N>``), with no process group: a retired checkpoint whose target is missing is moved
    back, and names of older versions (``<target>.tmp-<token>``, ``<target>.old-<token>``) are
    renamed to the hidden ones of [Note: staging names] so nothing that scans the directory reads
    them. Idempotent, and safe when every rank runs it at once (the rename that loses the race
    finds its source gone). One line per action taken by this rank."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    done = []
    for path in sorted(directory.iterdir()):
        legacy = _LEGACY.match(path.name)
        if legacy and path.is_dir() and not path.is_symlink():
            target_name, kind, token = legacy.group(1), legacy.group(2), path.name.rsplit("-", 1)[1]
            prefix = STAGING if kind == "tmp" else RETIRED
            hidden = directory / f"{prefix}{token}-{target_name.encode().hex()}"[:_MAX_NAME]
            if _rename_once(path, hidden):
                done.append(f"renamed {path.name!r} (a {'staging' if kind == 'tmp' else 'retired'} directory of an"
                            f" earlier release) to {hidden.name!r}")  # fmt: skip
            path = hidden
        entry = _side_entry(path)
        if entry is None or entry[0] != "retired" or entry[1] is None:
            continue
        target = directory / entry[1]
        if not os.path.lexists(target) and _rename_once(path, target):
            done.append(f"{str(target)!r} was moved aside by a save that was killed before it published;"
                        f" restored it from {path.name!r}")  # fmt: skip
    return done


def _rename_once(source: Path, destination: Path) -> bool:
    """``source`` renamed to a ``destination`` that does not exist; False when another rank did it first."""
    try:
        if os.path.lexists(destination):
            return False
        os.rename(source, destination)
    except (FileNotFoundError, FileExistsError):
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    fsync_directory(destination.parent)
    return True


def remove_checkpoint(path: PathLike) -> None:
    """Delete a checkpoint directory (or a plain file); call on one rank."""
    path = Path(path)
    release(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
