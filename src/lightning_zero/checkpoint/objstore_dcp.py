"""DCP's storage writer and reader for URL checkpoints ([Note: commit objects] in ``objstore.py``).

The writer is DCP's own file writer with three differences: its streams are
:class:`~lightning_zero.checkpoint.objstore.UploadStream` (parallel, bounded, hashed as they
upload), ``thread_count`` is the policy's ``upload_threads`` (a rank's items split into that many
objects of about equal bytes, serialized and uploaded at once), and ``.metadata`` is written in
place (DCP writes a temporary name and renames it: a copy plus a delete on S3). A stream's failure
in any of DCP's writer threads is raised by :meth:`ObjectWriter.write_data` (DCP's extra threads
would only print it and let the save go on without their items).

The reader fetches, in parallel, exactly the byte ranges of the items this rank's load plan names
(DCP's ``_StorageInfo`` offsets), then deserializes them as DCP's reader does.

[Note: shard hashes on URL loads] A POSIX load re-hashes every file, split over the ranks
(``load.open_checkpoint``); a URL load does the same without reading a byte twice where it can:
object ``__<r>_<k>.distcp`` (and ``rank<r>.json``) is re-hashed by rank ``r % world``
(:func:`verifier_rank`), which fetches it whole, in ``part_mb`` ranged parts in parallel, and takes
the ranges its own load needs from those bytes. In a same-layout resume rank ``r`` needs all of its
own objects anyway, so the check costs no extra byte; at another layout a rank fetches at most its
``1 / world`` of the checkpoint beyond its ranges. A mismatch raises :class:`CheckpointError` naming
the object before any tensor is copied (DCP agrees the failure on every rank, and ``load_model``
copies into the module only after the whole read succeeded). A load with no process group
(``export``) hashes every object at open (``load._open_url``), one object in memory at a time.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemBase, _FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

from lightning_zero.checkpoint.dcp import CheckpointError, SafeFileSystemReader, unpickle_dcp_metadata
from lightning_zero.checkpoint.objstore import (
    Counter,
    StoragePolicy,
    UploadError,
    UploadStream,
    bounded_map,
    filesystem,
    join,
)

DCP_METADATA_FILE = ".metadata"
_WRITTEN_BY = re.compile(r"^(?:__(\d+)_\d+\.distcp|rank(\d+)\.json)$")


def verifier_rank(name: str, world: int) -> Optional[int]:
    """The rank of ``world`` that re-hashes object ``name`` on a load ([Note: shard hashes on URL
    loads]): its writer's rank modulo ``world``; None for an object every rank hashes at open."""
    match = _WRITTEN_BY.match(name)
    if match is None:
        return None
    return int(match.group(1) or match.group(2)) % world


def part_ranges(size: int, policy: StoragePolicy) -> list[tuple[int, int]]:
    """``[start, end)`` of each ``part_mb`` part of an object of ``size`` bytes."""
    return [(start, min(size, start + policy.part_bytes)) for start in range(0, size, policy.part_bytes)]


def check_sha256(url: str, data: Any, info: dict[str, Any]) -> None:
    if hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise CheckpointError(f"{url}: sha256 does not match the commit (corrupted or replaced)")


def verify_objects(data: str, files: dict[str, dict[str, Any]], policy: StoragePolicy, counter: Counter) -> None:
    """Re-hash every object of ``files`` under the prefix ``data`` (``export``, no process group):
    one object in memory at a time, its parts fetched in parallel."""
    fs, root = filesystem(data, policy)
    for name in sorted(n for n in files if verifier_rank(n, 1) is not None):
        url = join(data, name)

        def fetch(span: tuple[int, int], name: str = name) -> bytes:
            got = fs.cat_file(f"{root.rstrip('/')}/{name}", start=span[0], end=span[1])
            counter.add(len(got))
            return got

        parts = bounded_map(fetch, part_ranges(files[name]["size"], policy), policy.upload_threads, policy.stall_s,
                            lambda span, url=url: f"reading {url!r} at {span[0]}")  # fmt: skip
        check_sha256(url, b"".join(parts), files[name])


class UploadFileSystem(FileSystemBase):
    """DCP's file system interface over fsspec, for writing: every stream an :class:`UploadStream`;
    each finished object's size and sha256 kept in ``files`` (name -> info), errors in ``errors``."""

    def __init__(self, policy: StoragePolicy, rank: int, progress: Optional[Any] = None) -> None:
        self.policy, self.rank, self.progress = policy, rank, progress
        self.files: dict[str, dict[str, Any]] = {}
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def create_stream(self, path: Any, mode: str) -> UploadStream:
        if mode != "wb":
            raise ValueError(f"UploadFileSystem streams are written only, not {mode!r}")
        url = str(path)
        fs, inner = filesystem(url, self.policy)
        name = url.rsplit("/", 1)[1]

        def done(size: int, sha256: str) -> None:
            with self._lock:
                self.files[name] = {"size": size, "sha256": sha256}

        wrote = self.progress.wrote if self.progress is not None else None
        return _Noting(UploadStream(fs, inner, url, self.policy, self.rank, progress=wrote, on_done=done), self.errors)

    def concat_path(self, path: Any, suffix: str) -> str:
        return join(str(path), suffix)

    def rename(self, path: Any, new_path: Any) -> None:
        raise NotImplementedError("object storage has no rename ([Note: commit objects] in objstore.py)")

    def init_path(self, path: Any) -> str:
        return str(path)

    def mkdir(self, path: Any) -> None:
        """Prefixes need no creating."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def exists(self, path: Any) -> bool:
        return False  # a fresh save prefix: nothing is there yet

    def rm_file(self, path: Any) -> None:
        raise NotImplementedError


class _Noting:
    """An :class:`UploadStream` in a ``with``: its failure noted in ``errors`` (then raised)."""

    def __init__(self, stream: UploadStream, errors: list[str]) -> None:
        self.stream, self.errors = stream, errors

    def __enter__(self) -> UploadStream:
        return self.stream

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        try:
            self.stream.__exit__(kind, value, traceback)
        except BaseException as exc:
            self.errors.append(str(exc))
            raise
        if isinstance(value, UploadError):  # names the rank, the object and the bytes already
            self.errors.append(str(value))
        elif value is not None:
            self.errors.append(f"writing {self.stream.url!r} failed: {type(value).__name__}: {value}")


class ObjectWriter(_FileSystemWriter):
    """DCP's writer into the save prefix ``url`` (see the module's docstring)."""

    def __init__(self, url: str, fs: UploadFileSystem) -> None:
        super().__init__(url, single_file_per_rank=True, sync_files=False, thread_count=fs.policy.upload_threads)
        self.fs = fs
        self.path = url

    def write_data(self, plan: Any, planner: Any) -> Future:
        result = super().write_data(plan, planner)
        if self.fs.errors:
            raise OSError("; ".join(self.fs.errors))
        return result

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        storage = {}
        for write_results in results:
            storage.update({result.index: result.storage_data for result in write_results})
        metadata.storage_data = storage
        metadata.storage_meta = StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)
        with self.fs.create_stream(join(self.path, DCP_METADATA_FILE), "wb") as stream:
            pickle.dump(metadata, stream)


class ObjectReader(SafeFileSystemReader):
    """DCP's reader of the save prefix ``url``: the ranges this rank needs, fetched in parallel;
    ``counter`` adds the bytes fetched. ``files`` (the commit's ``{name: {size, sha256}}``): the
    objects this rank re-hashes are fetched whole and checked ([Note: shard hashes on URL loads])."""

    def __init__(
        self, url: str, policy: StoragePolicy, counter: Optional[Counter] = None, files: Optional[dict] = None
    ) -> None:
        super().__init__("/")
        self.path = url  # type: ignore[assignment]
        self.policy = policy
        self.counter = counter or Counter()
        self.files = files or {}

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        url = join(str(self.path), DCP_METADATA_FILE)
        fs, inner = filesystem(url, self.policy)
        data = bounded_map(fs.cat_file, [inner], 1, self.policy.stall_s, lambda _: f"reading {url!r}")[0]
        self.counter.add(len(data))
        metadata = unpickle_dcp_metadata(io.BytesIO(data), url)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        fs, root = filesystem(str(self.path), self.policy)
        items = [(req, self.storage_data[req.storage_index]) for req in plan.items]
        rank, world = (
            (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
        )
        whole = sorted(name for name in self.files if verifier_rank(name, world) == rank)
        # one fetch per part of an object re-hashed here, one per range of the other objects
        spans = [
            (name, start, end) for name in whole for start, end in part_ranges(self.files[name]["size"], self.policy)
        ]
        ranged = [index for index, (_, info) in enumerate(items) if info.relative_path not in whole]
        spans += [
            (items[i][1].relative_path, items[i][1].offset, items[i][1].offset + items[i][1].length) for i in ranged
        ]

        def fetch(span: tuple[str, int, int]) -> bytes:
            data = fs.cat_file(f"{root.rstrip('/')}/{span[0]}", start=span[1], end=span[2])
            self.counter.add(len(data))
            return data

        def what(span: tuple[str, int, int]) -> str:
            return f"reading {join(str(self.path), span[0])!r} at {span[1]}"

        fetched = bounded_map(fetch, spans, self.policy.upload_threads, self.policy.stall_s, what)
        objects: dict[str, bytes] = {}
        for name in whole:  # checked before any tensor is copied
            objects[name] = b"".join(data for (of, _, _), data in zip(spans, fetched) if of == name)
            check_sha256(join(str(self.path), name), objects[name], self.files[name])
        payloads: list[Any] = [None] * len(items)
        for index, data in zip(ranged, fetched[len(fetched) - len(ranged) :]):
            payloads[index] = data
        for index, (_, info) in enumerate(items):
            if payloads[index] is None:
                payloads[index] = memoryview(objects[info.relative_path])[info.offset : info.offset + info.length]
        for (req, info), data in zip(items, payloads):
            view = _create_file_view(io.BytesIO(data), 0, len(data))
            stream = self.transforms.transform_load_stream(req, info.transform_descriptors or (), view)
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(stream.read(-1)))
                continue
            tensor = torch.load(io.BytesIO(stream.read(-1)), map_location="cpu", weights_only=True)
            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise ValueError(f"{req.storage_index}: read {tuple(tensor.size())}, expected {tuple(target.size())}")
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        future: Future = Future()
        future.set_result(None)
        return future
