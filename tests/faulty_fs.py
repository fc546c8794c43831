"""A fault-injecting fsspec file system for the object-storage tests: ``faulty://bucket/key`` is
``s3://bucket/key`` on the tests' local S3 server, except that one armed upload fails, stalls or
SIGKILLs its process after N bytes.

Arm it with :func:`arm` (or the environment variable ``LZ_FAULT="<phase>:<mode>:<bytes>[:<rank>]"``
in a process a test starts). ``phase`` picks the object by name, one per write phase of a save
([Note: commit objects] in ``checkpoint/objstore.py``): ``rankfile`` (``rank<r>.json``), ``shard``
(``__<r>_<k>.distcp``), ``metadata`` (DCP's ``.metadata``), ``meta`` (``meta.json``), ``commit``
(``commit.json``). ``mode``: ``fail`` (``OSError`` after the first N bytes went up), ``stall`` (the
write blocks for good after N bytes), ``kill`` (SIGKILL of this process after N bytes). One upload
is struck, then the fault disarms itself."""

from __future__ import annotations

import errno
import os
import re
import signal
import threading
from typing import Any, Optional

import fsspec
from fsspec.spec import AbstractFileSystem

PHASES = {
    "rankfile": re.compile(r"/rank\d+\.json$"),
    "shard": re.compile(r"/__\d+_\d+\.distcp$"),
    "metadata": re.compile(r"/\.metadata$"),
    "meta": re.compile(r"/meta\.json$"),
    "commit": re.compile(r"/commit\.json$"),
}
_armed: Optional[tuple[str, str, int]] = None
_lock = threading.Lock()
STALLED = threading.Event()  # never set: a stalled write waits on it for good


def arm(phase: str, mode: str, after_bytes: int) -> None:
    global _armed
    if phase not in PHASES or mode not in ("fail", "stall", "kill"):
        raise ValueError(f"arm({phase!r}, {mode!r}): unknown phase or mode")
    _armed = (phase, mode, int(after_bytes))


def disarm() -> None:
    global _armed
    _armed = None


def _take(path: str) -> Optional[tuple[str, str, int]]:
    """The armed fault if it strikes the upload of ``path`` (then disarmed)."""
    global _armed
    with _lock:
        if _armed is not None and PHASES[_armed[0]].search("/" + path):
            fault, _armed = _armed, None
            return fault
    return None


class _FaultyWrite:
    """An upload that breaks once ``after`` bytes went through."""

    def __init__(self, handle: Any, path: str, mode: str, after: int) -> None:
        self._handle, self._path, self._mode, self._after = handle, path, mode, after
        self._sent = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        room = max(self._after - self._sent, 0)
        if room:
            self._handle.write(view[:room])
            self._sent += min(room, len(view))
        if len(view) > room:
            self._strike()
        return len(view)

    def close(self) -> None:
        if self._sent >= self._after:
            self._strike()
        self._handle.close()

    def discard(self) -> None:
        """The upload is abandoned: nothing of it may become an object."""
        self._handle.discard()
        self._handle.closed = True

    def _strike(self) -> None:
        if self._mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self._mode == "stall":
            STALLED.wait()
        raise OSError(errno.EIO, f"injected failure after {self._sent} bytes of {self._path}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


class FaultyFileSystem(AbstractFileSystem):
    """``faulty://`` -> the tests' S3 server (module docstring)."""

    protocol = "faulty"

    def __init__(self, **options: Any) -> None:
        options.pop("use_listings_cache", None)
        super().__init__()
        self.inner = fsspec.filesystem("s3", use_listings_cache=False, **options)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        handle = self.inner.open(path, mode, block_size=block_size, **kwargs)
        fault = _take(path) if "w" in mode else None
        return _FaultyWrite(handle, path, fault[1], fault[2]) if fault else handle

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self.inner.ls(path, detail=detail)

    def info(self, path: str, **kwargs: Any) -> Any:
        return self.inner.info(path)

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        return self.inner.cat_file(path, start=start, end=end)

    def rm(self, path: Any, recursive: bool = False, **kwargs: Any) -> None:
        self.inner.rm(path, recursive=recursive)

    def rm_file(self, path: str) -> None:
        self.inner.rm_file(path)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self.inner.exists(path)

    def isdir(self, path: str) -> bool:
        return self.inner.isdir(path)

    def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> None:
        self.inner.put_file(lpath, rpath)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.inner.mkdir(path, create_parents=create_parents)


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
if os.environ.get("LZ_FAULT"):  # "<phase>:<mode>:<bytes>[:<rank>]": only on that rank (RANK)
    _phase, _mode, _bytes, *_rank = os.environ["LZ_FAULT"].split(":")
    if not _rank or _rank[0] == os.environ.get("RANK", "0"):
        arm(_phase, _mode, int(_bytes))
