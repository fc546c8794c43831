"""Checkpoints at fsspec URLs (``s3://``, ``gs://``, ``memory://``): bounded uploads, ranged reads,
and the commit object that publishes a save without a rename.

[Note: commit objects] Object storage has no rename (s3fs's is a copy plus a delete), so a URL
checkpoint is published by one small object instead of a directory swap::

    s3://bucket/run/epoch=0-step=4.ckpt/
      commit.json               {"format", "data": "save-<hex>", "files": {name: {size, sha256}}}
      save-<hex>/meta.json      as in a local checkpoint (checkpoint/__init__.py)
      save-<hex>/.metadata
      save-<hex>/__<rank>_<k>.distcp   rank <rank>'s shards, k = 0 .. upload_threads - 1
      save-<hex>/rank<rank>.json

Every save writes a fresh ``save-<hex>`` prefix (the id is drawn by rank 0 and broadcast), so a
save of a name that exists never touches the published data. Every rank uploads its own objects
directly (in parallel, :class:`UploadStream`), hashing as it uploads; when every rank's objects and
``meta.json`` exist, rank 0 writes ``commit.json`` (one PUT: readers see the old commit or the
new one, never a half) listing each object of the save with its size and sha256, then deletes the
previous save's prefix. A reader resolves a checkpoint through its commit only
(:func:`resolve`); a prefix no commit names is a dead save's leftover, removed by the next save of
that name (:func:`remove_leftovers`) or at the next start, under the rule of [Note: two jobs, one
name]. A ``last`` link is a commit object too,
``{"link": "<name of the target>"}``: it follows the target's current commit, as a symlink follows
a name, and is rewritten in one PUT.

[Note: two jobs, one name] Object storage has no lock a crashed job would release, so two jobs
may save to the same checkpoint name at once (a requeued job beside its predecessor, or two runs
given one ``dirpath``). Each save id carries its job's token (drawn once per process on rank 0)
and its start time, ``save-<job>-<started>-<random>``, and a cleanup removes an uncommitted prefix
only when it is this job's (a job's saves run one at a time, so its own uncommitted prefix is a
dead or replaced save), or another job's started more than :data:`FOREIGN_LEFTOVER_S` (a day) ago:
no save runs for a day, so such a prefix is dead. Another job's save in flight is never removed;
whichever job writes ``commit.json`` last is the checkpoint the name selects (one PUT either way,
never a mix), and the prefix it replaced is removed by its own job's next save or after a day.
The prefix a commit names is never removed by a cleanup.

[Note: bounded uploads] Each object is uploaded by a thread of its own that writes parts of
``part_mb`` (a multipart upload on S3); the thread producing the bytes hands parts over through a
queue two deep, so serialization overlaps the upload. Every wait for that thread is bounded by
progress, not by time: when a part has not finished ``stall_s`` seconds after the last one did,
the producer raises :class:`UploadStalledError` naming the rank, the object and the bytes uploaded
so far (the stuck thread is a daemon and is abandoned). A slow link that still moves parts is
waited for; a dead one is an error within ``stall_s``. Ranged reads on load are bounded the same
way.

Loading verifies the commit: the size of every object (one listing), the sha256 of every object it
reads whole (``meta.json``, ``.metadata``, the rank files), and the sha256 of every shard, split
over the ranks as on a POSIX disk ([Note: shard hashes on URL loads] in ``objstore_dcp.py``).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import queue
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

COMMIT_FILE = "commit.json"
COMMIT_FORMAT = "lightning_zero.commit/1"
SAVE_PREFIX = "save-"
# save-<job>-<started, unix seconds>-<random> ([Note: two jobs, one name]); save-<12 hex>: before it
_SAVE_ID = re.compile(r"^save-(?:[0-9a-f]{12}|(?P<job>[0-9a-f]{8})-(?P<started>[0-9a-f]{8})-[0-9a-f]{6})$")
FOREIGN_LEFTOVER_S = 24 * 3600  # another job's uncommitted prefix is removed only once this old
_JOB = uuid.uuid4().hex[:8]  # this process's job token (rank 0 draws every save id)
_LINK_DEPTH = 8


def is_url(path: Any) -> bool:
    """True for an fsspec URL other than a local file (``s3://b/x``, ``memory://x``)."""
    if not isinstance(path, str) or "://" not in path:
        return False
    return path.split("://", 1)[0] not in ("", "file", "local")


def join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


def parent(url: str) -> str:
    protocol, rest = url.split("://", 1)
    return f"{protocol}://{posixpath.dirname(rest.rstrip('/'))}"


def basename(url: str) -> str:
    return posixpath.basename(url.rstrip("/"))


@dataclass(frozen=True)
class StoragePolicy:
    """How checkpoints at URLs are reached (local paths ignore it).

    Args:
        storage_options: passed to ``fsspec.url_to_fs`` as keywords (s3fs: ``key``, ``secret``,
            ``endpoint_url``, ``client_kwargs``...); credentials not given here come from the
            environment as the file system reads them (``AWS_*`` variables, ``~/.aws``, instance roles).
        upload_threads: objects each rank uploads at once; a rank's shards are split into this many
            objects of about equal bytes (DCP's ``thread_count``). Ranged reads on load use as many.
        part_mb: MiB per uploaded part (S3's multipart minimum is 5); also the unit of progress.
        stall_s: seconds an upload or a ranged read may go without finishing a part before it is
            an :class:`UploadStalledError` ([Note: bounded uploads]).
    """

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    upload_threads: int = 8
    part_mb: float = 8.0
    stall_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.storage_options, Mapping):
            raise ValueError(
                f"storage_options={self.storage_options!r}: give a dict of keywords for fsspec (e.g."
                ' {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}), or None.'
            )
        if isinstance(self.upload_threads, bool) or not isinstance(self.upload_threads, int) or self.upload_threads < 1:
            raise ValueError(
                f"upload_threads={self.upload_threads!r}: give an int >= 1 (objects a rank uploads at once)."
            )
        if isinstance(self.part_mb, bool) or not isinstance(self.part_mb, (int, float)) or not self.part_mb >= 5:
            raise ValueError(
                f"upload_part_mb={self.part_mb!r}: give a number of MiB >= 5 (S3's smallest multipart part)."
            )
        if isinstance(self.stall_s, bool) or not isinstance(self.stall_s, (int, float)) or not self.stall_s > 0:
            raise ValueError(f"upload_stall_s={self.stall_s!r}: give a number of seconds > 0.")

    @property
    def part_bytes(self) -> int:
        return int(self.part_mb * (1 << 20))


DEFAULT_POLICY = StoragePolicy()


class UploadError(OSError):
    """An upload to object storage failed; the message names the rank, the object and the bytes so far."""


class UploadStalledError(UploadError):
    """An upload (or a ranged read) made no progress for ``stall_s`` seconds ([Note: bounded uploads])."""


def filesystem(url: str, policy: StoragePolicy = DEFAULT_POLICY) -> tuple[Any, str]:
    """``(fsspec file system, path inside it)`` for ``url``."""
    import fsspec

    options = dict(policy.storage_options)
    # every rank writes objects the others list and read: no cached listings ([Note: commit objects])
    options.setdefault("use_listings_cache", False)
    try:
        return fsspec.url_to_fs(url, **options)
    except TypeError:  # a file system without listing caches
        options.pop("use_listings_cache")
        return fsspec.url_to_fs(url, **options)


# --------------------------------------------------------------------------------------------
# Bounded transfers
# --------------------------------------------------------------------------------------------


class Counter:
    """Bytes moved (thread-safe): what a benchmark or a test reads back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes


class UploadStream:
    """A write stream that uploads one object in parts from a thread of its own, hashing as it
    goes ([Note: bounded uploads]). ``tell`` counts the bytes written (DCP records offsets by it);
    ``close`` waits for the last part and the object's completion; ``on_done(size, sha256)`` then."""

    def __init__(
        self,
        fs: Any,
        path: str,
        url: str,
        policy: StoragePolicy,
        rank: int,
        *,
        progress: Optional[Callable[[int], None]] = None,
        on_done: Optional[Callable[[int, str], None]] = None,
    ) -> None:
        self._fs, self._path, self.url, self._policy, self._rank = fs, path, url, policy, rank
        self._progress, self._on_done = progress, on_done
        self._buffer = bytearray()
        self._written = 0
        self._uploaded = 0
        self._sha = hashlib.sha256()
        self._parts: queue.Queue = queue.Queue(maxsize=2)
        self._error: Optional[BaseException] = None
        self._done = threading.Event()
        self._moved = time.monotonic()  # the last time a part finished (or the upload began)
        self._closed = False
        self._worker = threading.Thread(target=self._upload, name="lightning_zero-upload", daemon=True)
        self._worker.start()

    # -- the producer's side ----------------------------------------------------------------
    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._sha.update(view)
        self._buffer += view
        self._written += len(view)
        if len(self._buffer) >= self._policy.part_bytes:
            part, self._buffer = self._buffer, bytearray()  # handed over whole: no copy
            self._hand_over(part)
        return len(view)

    def tell(self) -> int:
        return self._written

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        """Parts go when full; the rest at :meth:`close`."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._buffer:
            part, self._buffer = self._buffer, bytearray()
            self._hand_over(part)
        self._hand_over(None)
        while not self._done.wait(self._poll()):
            self._check_stall()
        if self._error is not None:
            raise self._failure(f"failed: {type(self._error).__name__}: {self._error}") from self._error
        if self._on_done is not None:
            self._on_done(self._written, self._sha.hexdigest())

    def abort(self) -> None:
        """The producer failed: stop the upload without completing the object."""
        self._closed = True
        try:
            self._parts.put_nowait(BaseException)
        except queue.Full:
            pass

    def __enter__(self) -> "UploadStream":
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def _poll(self) -> float:
        return min(0.2, self._policy.stall_s / 4)

    def _hand_over(self, part: Optional[bytearray]) -> None:
        while True:
            if self._error is not None:
                raise self._failure(f"failed: {type(self._error).__name__}: {self._error}") from self._error
            try:
                self._parts.put(part, timeout=self._poll())
                return
            except queue.Full:
                self._check_stall()

    def _check_stall(self) -> None:
        if time.monotonic() - self._moved > self._policy.stall_s:
            raise self._failure(f"stalled: no part finished for {self._policy.stall_s:g} s", UploadStalledError)

    def _failure(self, what: str, kind: type = UploadError) -> UploadError:
        return kind(
            f"rank {self._rank}: upload of {self.url!r} {what}, after {self._uploaded} of {self._written} bytes"
            " uploaded"
        )

    # -- the upload thread ----------------------------------------------------------------------
    def _upload(self) -> None:
        handle = None
        try:
            handle = self._fs.open(self._path, "wb", block_size=self._policy.part_bytes)
            self._moved = time.monotonic()
            while True:
                part = self._parts.get()
                if part is BaseException:  # aborted
                    return
                if part is None:
                    handle.close()
                    handle = None
                    self._moved = time.monotonic()
                    return
                handle.write(part)
                self._uploaded += len(part)
                self._moved = time.monotonic()
                if self._progress is not None:
                    self._progress(len(part))
        except BaseException as exc:  # noqa: BLE001 - raised by the producer
            self._error = exc
        finally:
            if handle is not None:  # aborted or failed: never completed into an object
                _discard(handle)
            self._done.set()


def _discard(handle: Any) -> None:
    """An aborted upload: drop its parts without completing the object, where the file system can."""
    try:
        if hasattr(handle, "discard"):
            handle.discard()
        handle.closed = True
    except Exception:  # noqa: BLE001 - best effort: an incomplete multipart upload is never an object
        pass


def bounded_map(
    fn: Callable[[Any], Any], items: list[Any], threads: int, stall_s: float, what: Callable[[Any], str]
) -> list:
    """``[fn(item) for item in items]`` on up to ``threads`` daemon threads; raises the first error, or
    :class:`UploadStalledError` naming ``what(item)`` of the oldest unfinished item once no item
    finished for ``stall_s`` seconds ([Note: bounded uploads])."""
    results: list[Any] = [None] * len(items)
    pending: queue.Queue = queue.Queue()
    for index in range(len(items)):
        pending.put(index)
    finished: queue.Queue = queue.Queue()
    started: dict[int, float] = {}

    def work() -> None:
        while True:
            try:
                index = pending.get_nowait()
            except queue.Empty:
                return
            started[index] = time.monotonic()
            try:
                finished.put((index, fn(items[index]), None))
            except BaseException as exc:  # noqa: BLE001 - raised by the caller
                finished.put((index, None, exc))

    for _ in range(min(threads, len(items))):
        threading.Thread(target=work, name="lightning_zero-transfer", daemon=True).start()
    done, moved = 0, time.monotonic()
    while done < len(items):
        try:
            index, result, error = finished.get(timeout=min(0.2, stall_s / 4))
        except queue.Empty:
            if time.monotonic() - moved > stall_s:
                waiting = [i for i in started if results[i] is None]
                name = what(items[min(waiting)]) if waiting else "a transfer"
                raise UploadStalledError(f"{name} stalled: nothing finished for {stall_s:g} s") from None
            continue
        if error is not None:
            raise error
        results[index], done, moved = result, done + 1, time.monotonic()
    return results


# --------------------------------------------------------------------------------------------
# Commit objects ([Note: commit objects])
# --------------------------------------------------------------------------------------------


def job_token() -> str:
    """This job's token in its save ids ([Note: two jobs, one name]): rank 0's process's."""
    return _JOB


def new_save_id() -> str:
    return f"{SAVE_PREFIX}{job_token()}-{int(time.time()):08x}-{uuid.uuid4().hex[:6]}"


def removable(name: str, now: Optional[float] = None) -> bool:
    """Whether a cleanup may remove the uncommitted save prefix ``name`` ([Note: two jobs, one
    name]): this job's, an id from before job tokens, or another job's started
    :data:`FOREIGN_LEFTOVER_S` ago."""
    match = _SAVE_ID.match(name)
    if match is None:
        return False
    if match.group("job") is None or match.group("job") == job_token():
        return True
    return (now if now is not None else time.time()) - int(match.group("started"), 16) > FOREIGN_LEFTOVER_S


def put_small(url: str, data: bytes, policy: StoragePolicy, rank: int = 0) -> dict[str, Any]:
    """Upload ``data`` to ``url`` as one object, bounded by progress; returns its size and sha256."""
    fs, path = filesystem(url, policy)
    done: dict[str, Any] = {}
    stream = UploadStream(fs, path, url, policy, rank, on_done=lambda size, sha: done.update(size=size, sha256=sha))
    with stream:
        stream.write(data)
    return done


def read_bytes(url: str, policy: StoragePolicy) -> bytes:
    fs, path = filesystem(url, policy)
    return bounded_map(fs.cat_file, [path], 1, policy.stall_s, lambda _: f"reading {url!r}")[0]


def sizes(prefix: str, policy: StoragePolicy) -> dict[str, int]:
    """``{name: bytes}`` of the objects directly under ``prefix`` (one listing, bounded)."""
    fs, path = filesystem(prefix, policy)

    def listing(inner: str) -> list[dict[str, Any]]:
        try:
            return fs.ls(inner, detail=True, refresh=True) if _has_refresh(fs) else fs.ls(inner, detail=True)
        except FileNotFoundError:
            return []

    entries = bounded_map(listing, [path], 1, policy.stall_s, lambda _: f"listing {prefix!r}")[0]
    return {posixpath.basename(e["name"].rstrip("/")): int(e.get("size") or 0) for e in entries
            if e.get("type") != "directory"}  # fmt: skip


def read_commit(target: str, policy: StoragePolicy) -> Optional[dict[str, Any]]:
    """The commit object of ``target`` (a checkpoint URL or a link), or None when it has none."""
    fs, path = filesystem(target, policy)
    try:
        text = read_bytes(join(target, COMMIT_FILE), policy)
    except FileNotFoundError:
        return None
    try:
        commit = json.loads(text)
    except ValueError:
        return None
    if not isinstance(commit, dict) or commit.get("format") != COMMIT_FORMAT:
        return None
    return commit


def resolve(target: str, policy: StoragePolicy) -> Optional[tuple[str, dict[str, Any]]]:
    """``(URL of the save's data prefix, its commit)`` of the checkpoint or link ``target``,
    following links by name; None when no commit is there (never written, or a dead first save)."""
    for _ in range(_LINK_DEPTH):
        commit = read_commit(target, policy)
        if commit is None:
            return None
        if "link" in commit:
            target = join(parent(target), commit["link"])
            continue
        if not _SAVE_ID.match(str(commit.get("data", ""))):
            return None
        return join(target, commit["data"]), commit
    return None


def commit(target: str, save_id: str, files: dict[str, Any], policy: StoragePolicy) -> None:
    """Publish the save ``save_id`` of ``target`` (its objects all exist): one PUT of the commit
    object, then the objects of earlier saves of ``target`` removed."""
    body = {"format": COMMIT_FORMAT, "data": save_id, "files": files, "created": time.time()}
    put_small(join(target, COMMIT_FILE), json.dumps(body).encode(), policy)
    try:
        remove_leftovers(target, policy, keep=save_id)
    except Exception:  # noqa: BLE001 - published already; the next save of this name removes them
        pass


def link(target: str, link_url: str, policy: StoragePolicy) -> None:
    """``link_url`` (e.g. ``.../last.ckpt``) follows ``target`` from now on: one PUT."""
    if link_url.rstrip("/") == target.rstrip("/"):
        return
    fs, path = filesystem(link_url, policy)
    for name in _save_prefixes(fs, path):  # it was a checkpoint of its own (save_last=True before)
        fs.rm(posixpath.join(path, name), recursive=True)
    name = basename(target) if parent(target) == parent(link_url) else target
    body = {"format": COMMIT_FORMAT, "link": name, "created": time.time()}
    put_small(join(link_url, COMMIT_FILE), json.dumps(body).encode(), policy)


def _save_prefixes(fs: Any, path: str) -> list[str]:
    try:
        entries = fs.ls(path, detail=False, refresh=True) if _has_refresh(fs) else fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    return sorted(name for name in (posixpath.basename(e.rstrip("/")) for e in entries) if _SAVE_ID.match(name))


def _has_refresh(fs: Any) -> bool:
    return getattr(fs, "protocol", None) in ("s3", "s3a", ("s3", "s3a"), "gs", "gcs", ("gs", "gcs"))


def remove_leftovers(target: str, policy: StoragePolicy, keep: Optional[str] = None) -> list[str]:
    """Delete the ``save-*`` prefixes of ``target`` that neither its commit nor ``keep`` names and
    that :func:`removable` allows ([Note: two jobs, one name]). One line per prefix removed."""
    fs, path = filesystem(target, policy)
    found = read_commit(target, policy)  # read now: another job may have committed since ours
    kept = {keep, found.get("data") if found else None}
    done = []
    for name in _save_prefixes(fs, path):
        if name not in kept and removable(name):
            fs.rm(posixpath.join(path, name), recursive=True)
            done.append(f"removed {join(target, name)!r}: the objects of a save no commit names (a save that"
                        " died, or one a newer save replaced)")  # fmt: skip
    return done


def clean_directory(directory: str, policy: StoragePolicy) -> list[str]:
    """:func:`remove_leftovers` of every checkpoint in ``directory`` (rank 0, at a run's start)."""
    fs, path = filesystem(directory, policy)
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    done = []
    for entry in sorted(entries):
        name = posixpath.basename(entry.rstrip("/"))
        if fs.isdir(entry) and _save_prefixes(fs, entry):
            done += remove_leftovers(join(directory, name), policy)
    return done


def remove(target: str, policy: StoragePolicy) -> None:
    """Delete a URL checkpoint (or link): its commit first (it is gone at once), then its objects."""
    fs, path = filesystem(target, policy)
    commit_path = posixpath.join(path, COMMIT_FILE)
    if fs.exists(commit_path):
        fs.rm_file(commit_path)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def newest_link(directories: list[str], policy: StoragePolicy, pattern: re.Pattern) -> Optional[str]:
    """The newest committed entry named like ``pattern`` (``last*.ckpt``) in ``directories``: what
    ``ckpt_path="last"`` means for URL directories (resolved through commits only)."""
    best: Optional[tuple[float, str]] = None
    for directory in directories:
        fs, path = filesystem(directory, policy)
        try:
            entries = fs.ls(path, detail=False)
        except FileNotFoundError:
            continue
        for entry in entries:
            name = posixpath.basename(entry.rstrip("/"))
            if not pattern.match(name):
                continue
            url = join(directory, name)
            found = read_commit(url, policy)
            if found is not None and resolve(url, policy) is not None:
                created = float(found.get("created", 0.0))
                if best is None or created > best[0]:
                    best = (created, url)
    return best[1] if best else None
