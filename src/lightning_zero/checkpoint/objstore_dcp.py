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
"""

from __future__ import annotations

import io
import pickle
import threading
from typing import Any, Optional

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemBase, _FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

from lightning_zero.checkpoint.dcp import SafeFileSystemReader, unpickle_dcp_metadata
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
    ``counter`` adds the bytes fetched."""

    def __init__(self, url: str, policy: StoragePolicy, counter: Optional[Counter] = None) -> None:
        super().__init__("/")
        self.path = url  # type: ignore[assignment]
        self.policy = policy
        self.counter = counter or Counter()

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

        def fetch(pair: tuple[Any, Any]) -> bytes:
            info = pair[1]
            data = fs.cat_file(f"{root.rstrip('/')}/{info.relative_path}", start=info.offset,
                               end=info.offset + info.length)  # fmt: skip
            self.counter.add(len(data))
            return data

        def what(pair: tuple[Any, Any]) -> str:
            return f"reading {join(str(self.path), pair[1].relative_path)!r} at {pair[1].offset}"

        payloads = bounded_map(fetch, items, self.policy.upload_threads, self.policy.stall_s, what)
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
