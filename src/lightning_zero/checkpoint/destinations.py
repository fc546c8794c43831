"""Where a save's files go: a local directory published by rename ([Note: atomic publish] in
``checkpoint/__init__.py``) or an fsspec URL published by a commit object ([Note: commit objects]
in ``objstore.py``). ``save.write_snapshot`` runs the same steps on either:
``begin`` (rank 0, agreed by broadcast), ``write_rank_file``, ``storage_writer`` (DCP's), ``files``
(this rank's names with size and sha256), ``publish`` (rank 0, ``meta.json`` last)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

import torch.distributed.checkpoint as dcp

import lightning_zero.checkpoint.objstore as objstore
from lightning_zero.checkpoint.objstore import StoragePolicy, is_url
from lightning_zero.checkpoint.objstore_dcp import ObjectWriter, UploadFileSystem
from lightning_zero.checkpoint.publish import (
    DCP_METADATA_FILE,
    META_FILE,
    CheckpointWriteError,
    RecordingFileSystem,
    WriteProgress,
    begin_write,
    clean_leftovers,
    fsync_write,
    link_atomically,
    publish,
    remove_checkpoint,
    sha256_of,
    write_rank_file,
)
from lightning_zero.checkpoint.ranks import broadcast_object
from lightning_zero.checkpoint.targets import RankPlacement

Location = Union[str, Path]


def location(path: Any) -> Location:
    """A URL stays a string (``Path`` would fold ``s3://`` into ``s3:/``); anything else is a ``Path``."""
    return path.rstrip("/") if is_url(path) else Path(path)


class LocalDestination:
    """A staging directory beside ``target``, swapped into place by rank 0."""

    def __init__(self, target: Path, layout: RankPlacement, group: Any, progress: Optional[WriteProgress]) -> None:
        self.target, self.layout, self.group, self.progress = target, layout, group, progress
        self.tmp = begin_write(target, layout, group)
        self.recording = RecordingFileSystem(progress)

    @property
    def errors(self) -> list[str]:
        return self.recording.errors

    def write_rank_file(self, text: str) -> Optional[str]:
        return write_rank_file(self.tmp, self.layout, text)

    def storage_writer(self) -> dcp.FileSystemWriter:
        writer = dcp.FileSystemWriter(str(self.tmp))
        writer.fs = self.recording  # names the file and the OS error of a failed write
        return writer

    def files(self) -> dict[str, dict[str, Any]]:
        rank = self.layout.rank
        mine = [p for p in self.tmp.iterdir() if p.name.startswith(f"__{rank}_") or p.name == f"rank{rank}.json"]
        if rank == 0:
            mine.append(self.tmp / DCP_METADATA_FILE)
        files = {}
        for path in mine:  # hashing reads every byte again: progress too
            files[path.name] = {"size": path.stat().st_size, "sha256": sha256_of(path)}
            if self.progress is not None:
                self.progress.wrote(files[path.name]["size"])
        return files

    def publish(self, meta: dict[str, Any]) -> None:
        fsync_write(self.tmp / META_FILE, json.dumps(meta))
        publish(self.tmp, self.target)


class ObjectDestination:
    """A fresh ``save-<hex>`` prefix of the URL ``target``, published by its commit object."""

    def __init__(
        self, target: str, layout: RankPlacement, group: Any, progress: Optional[WriteProgress], policy: StoragePolicy
    ) -> None:
        self.target, self.layout, self.policy = target, layout, policy
        self.uploads = UploadFileSystem(policy, layout.rank, progress)
        error, save_id = None, None
        if layout.rank == 0:
            try:
                objstore.remove_leftovers(target, policy)  # what a save of this name that died left
                save_id = objstore.new_save_id()
            except Exception as exc:  # noqa: BLE001 - no credentials, no bucket: raised on every rank
                error = f"rank 0 cannot prepare {target!r} for the checkpoint: {type(exc).__name__}: {exc}"
        save_id, error = broadcast_object((save_id, error), "ckpt_begin", group)
        if error:
            raise CheckpointWriteError(error)
        self.save_id = save_id
        self.data = objstore.join(target, save_id)

    @property
    def errors(self) -> list[str]:
        return self.uploads.errors

    def write_rank_file(self, text: str) -> Optional[str]:
        name = f"rank{self.layout.rank}.json"
        try:
            with self.uploads.create_stream(objstore.join(self.data, name), "wb") as stream:
                stream.write(text.encode())
        except objstore.UploadError as exc:  # names the rank and the object
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - gathered and raised on every rank
            return f"cannot write {objstore.join(self.data, name)!r}: {type(exc).__name__}: {exc}"
        return None

    def storage_writer(self) -> ObjectWriter:
        return ObjectWriter(self.data, self.uploads)

    def files(self) -> dict[str, dict[str, Any]]:
        return dict(self.uploads.files)  # hashed while they uploaded

    def publish(self, meta: dict[str, Any]) -> None:
        files = dict(meta["files"])
        files[META_FILE] = objstore.put_small(objstore.join(self.data, META_FILE), json.dumps(meta).encode(),
                                              self.policy, self.layout.rank)  # fmt: skip
        objstore.commit(self.target, self.save_id, files, self.policy)


def destination(
    target: Location, layout: RankPlacement, group: Any, progress: Optional[WriteProgress], policy: StoragePolicy
) -> Union[LocalDestination, ObjectDestination]:
    if isinstance(target, str):
        return ObjectDestination(target, layout, group, progress, policy)
    return LocalDestination(target, layout, group, progress)


def link_checkpoint(target: Location, link: Location, policy: StoragePolicy) -> None:
    """Rank 0: ``link`` follows the published ``target`` from now on (a symlink swapped in by
    rename locally; a link commit object at a URL)."""
    if isinstance(target, str) or isinstance(link, str):
        objstore.link(str(target), str(link), policy)
    else:
        link_atomically(target, link)


def remove_any(path: Location, policy: StoragePolicy) -> None:
    """Delete a checkpoint (or a plain file) at a local path or a URL; call on one rank."""
    if isinstance(path, str):
        objstore.remove(path, policy)
    else:
        remove_checkpoint(path)


def clean_any(directory: Location, policy: StoragePolicy) -> list[str]:
    """What killed saves left in ``directory`` removed (rank 0), one line per action."""
    if isinstance(directory, str):
        return objstore.clean_directory(directory, policy)
    return clean_leftovers(directory)


def parent_of(path: Location) -> Location:
    return objstore.parent(path) if isinstance(path, str) else path.parent
