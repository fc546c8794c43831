"""CheckpointLifecycle: the one owner of when, where and how a checkpoint is written (both doors).

[Note: checkpoint lifecycle] Every save is a :class:`SaveRecord` that moves through explicit
states, in this order, or ends ``abandoned``:

- ``requested``: a door asked (``ModelCheckpoint``, ``trainer.save_checkpoint``, a requeue,
  ``fabric.save``);
- ``agreed``: the step it belongs to is fixed. It is the door's count of optimizer steps (the
  Trainer's ``(epoch, global_step)``, Fabric's optimizer steps), the same number on every rank
  by construction, and every later decision about the save (share the host copy of an earlier
  save of the same step, or take a new one) is made from the requested steps alone, never from
  how far this rank's writer thread got, so every rank decides alike;
- ``staged``: the staging directory exists ([Note: staging names] in ``checkpoint/publish.py``);
  for a background save the host copy was taken before (``checkpoint/background.py``);
- ``written``: every rank wrote and hashed its files;
- ``published``: rank 0 swapped the staging directory into place (one ``renameat2`` exchange
  where Linux has it: never a moment without the target), the files and the parent directory
  synced ([Note: atomic publish] in ``checkpoint/__init__.py``);
- ``linked``: the ``last`` links that asked for it (``ModelCheckpoint(save_last="link")``) point
  at it; a link is only ever made to a published checkpoint, in one rename.

The lifecycle also owns what surrounds the saves:

- sync or background: ``async_checkpoint`` saves go to the writer thread while the door is
  between :meth:`open` and :meth:`close` (the Trainer's fit, Fabric's run); outside it (a
  ``trainer.save_checkpoint`` after ``fit``) a save is written before it returns, so the exit code
  of the process says whether it was written;
- waiting: the next save of another step, a load, the end of fit, a requeue and :meth:`close`
  wait for the save in flight; the wait is bounded by progress (no rank wrote a byte for
  ``collective_timeout`` seconds), not by time: a slow disk is not a dead rank. A wait that gives
  up abandons the save, and its host copy is never written into again;
- failures: :meth:`close` on the failure path, or a peer's failure, abandons the save in flight
  (the previous published checkpoint stays the newest); at interpreter exit a save still in
  flight is waited for (Fabric has no teardown), and a failure there ends the process with exit
  code 1. An abandoned save's thread may still be inside a collective of the saves' group at exit
  (the peers' threads wait for it too): finalizing the interpreter then would abort the process
  ("terminate called without an active exception", exit -6, [Note: nothing running at exit] in
  ``runtime/run.py``), so the exit gives it :data:`ABANDONED_GRACE_S` to end (a peer's exit
  ends its collective) and otherwise ends the process with exit code 1 without finalizing;
- leftovers: :meth:`restore_before_resolve` (every rank, before anything resolves ``"last"`` or
  SLURM's ``hpc_ckpt_<N>``: no process group needed) moves a checkpoint a killed publish left
  aside back and hides staging names of earlier releases; :meth:`clean` (rank 0, at the start and
  before a load) removes what killed saves left, with a warning.

The doors translate: ``trainer/checkpoints.py`` feeds it Lightning's hooks and ``ModelCheckpoint``'s
paths and links, ``fabric/checkpoint.py`` feeds it ``fabric.save``/``load``. Neither keeps state of
its own about a save; both reach it through the run (``runtime/run.py``), which builds it.
"""

from __future__ import annotations

import atexit
import io
import os
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

from lightning_zero.checkpoint.destinations import (
    Location,
    clean_any,
    link_checkpoint,
    location,
    parent_of,
    remove_any,
)
from lightning_zero.checkpoint.objstore import DEFAULT_POLICY, StoragePolicy, is_url
from lightning_zero.checkpoint.publish import PathLike
from lightning_zero.checkpoint.publish import restore_moved_aside as _restore_moved_aside


class SaveState(str, Enum):
    """The states of one save, in order ([Note: checkpoint lifecycle])."""

    REQUESTED = "requested"
    AGREED = "agreed"
    STAGED = "staged"
    WRITTEN = "written"
    PUBLISHED = "published"
    LINKED = "linked"
    ABANDONED = "abandoned"


ABANDONED_GRACE_S = 5.0  # at exit: how long an abandoned save's thread may take to leave its collective

_ORDER = [SaveState.REQUESTED, SaveState.AGREED, SaveState.STAGED, SaveState.WRITTEN, SaveState.PUBLISHED,
          SaveState.LINKED]  # fmt: skip


@dataclass
class SaveRecord:
    """One save: where, the agreed step, its state, and the links waiting for its publish.

    ``advance`` is called by the training thread and by the writer thread; the links are made by
    the thread that publishes (rank 0), under the record's lock, so a link asked for while the
    save is being published is made exactly once, after the publish."""

    path: Location
    step: Any
    background: bool
    link_on_rank: bool  # this rank makes the links (global rank 0)
    storage: StoragePolicy = DEFAULT_POLICY
    state: SaveState = SaveState.REQUESTED
    links: list[Location] = field(default_factory=list)
    history: list[tuple[str, float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def advance(self, state: str) -> None:
        new = SaveState(state)
        with self._lock:
            done = (SaveState.PUBLISHED, SaveState.LINKED, SaveState.ABANDONED)
            if (new is SaveState.ABANDONED and self.state in done) or (
                new is not SaveState.ABANDONED
                and (self.state is SaveState.ABANDONED or _ORDER.index(new) <= _ORDER.index(self.state))
            ):
                return
            self.state = new
            self.history.append((new.value, time.time()))
            if new is SaveState.PUBLISHED:
                self._make_links()

    def _make_links(self) -> None:
        if self.link_on_rank:
            for link in self.links:
                link_checkpoint(self.path, link, self.storage)
        if self.links:
            self.state = SaveState.LINKED
            self.history.append((SaveState.LINKED.value, time.time()))

    def link(self, link: Location) -> bool:
        """Ask for ``link`` to point at this save once published; False: it is published already
        (the caller links now) or abandoned (no link is made to it)."""
        with self._lock:
            if self.state in (SaveState.PUBLISHED, SaveState.LINKED, SaveState.ABANDONED):
                return False
            self.links.append(link)
            return True


class CheckpointLifecycle:
    """[Note: checkpoint lifecycle]: every save of one run, from request to link or abandonment.

    Args:
        async_checkpoint: saves while open are written by a background thread
            (``checkpoint/background.py``); the training loop waits only for the host copy.
        stall_s: how long a wait for a background save accepts no progress on any rank
            (``collective_timeout``); ``None``: no bound.
        failed: whether this rank failed or knows a peer did ([Note: failure path] in
            ``runtime/failure.py``): no collective then, so no save, and :meth:`close` abandons.
        is_global_zero: whether this is global rank 0 (it publishes, links and removes).
        storage: how checkpoint paths that are URLs are reached (:func:`storage_policy`).
    """

    def __init__(
        self,
        *,
        async_checkpoint: bool,
        stall_s: Optional[float],
        failed: Callable[[], bool],
        is_global_zero: Callable[[], bool],
        storage: StoragePolicy = DEFAULT_POLICY,
    ) -> None:
        self.async_checkpoint = async_checkpoint
        self.storage = storage
        self.stall_s = stall_s
        self._failed = failed
        self._is_global_zero = is_global_zero
        self.writer: Any = None  # checkpoint/background.py's BackgroundSaves, made at the first need
        self.records: list[SaveRecord] = []
        self.is_open = False
        self._at_exit = False
        self._abandoned: list[threading.Thread] = []  # writer threads abandoned while still running
        self._cleaned: set[Location] = set()

    # -- leftovers ------------------------------------------------------------------------------
    @staticmethod
    def restore_before_resolve(directories: list[PathLike]) -> list[str]:
        """Every rank, before ``"last"`` / ``hpc_ckpt_<N>`` is resolved in ``directories`` (no
        process group yet): what a killed publish moved aside is moved back; staging names of
        earlier releases are hidden. Idempotent; ranks may run it at once."""
        done = []
        for directory in sorted({Path(d) for d in directories if not is_url(d)}):  # a URL moves nothing aside
            done += _restore_moved_aside(directory)
        return done

    def clean(self, directories: list[PathLike], barrier: Callable[[], None]) -> None:
        """Rank 0 restores and removes what killed saves left in ``directories``, with a warning
        per action ([Note: staging names]); then every rank meets at ``barrier``."""
        if self._is_global_zero():
            for directory in sorted({location(d) for d in directories}, key=str):
                for line in clean_any(directory, self.storage):
                    warnings.warn(f"lightning_zero: {line}", stacklevel=3)
        barrier()

    def clean_once(self, directory: PathLike, barrier: Callable[[], None]) -> None:
        """:meth:`clean` of ``directory`` the first time this run saves there (Fabric, which has no
        start that knows its checkpoint directories); every rank calls it."""
        directory = location(directory)
        if directory not in self._cleaned:
            self._cleaned.add(directory)
            self.restore_before_resolve([directory])
            self.clean([directory], barrier)

    # -- open / close ---------------------------------------------------------------------------
    def open(self) -> None:
        """The door's run starts (fit, a Fabric run): ``async_checkpoint`` saves go to the background."""
        self.is_open = True

    def close(self) -> Optional[BaseException]:
        """The door's run ends: wait for the save in flight (abandon it on the failure path);
        returns its error for the door to raise after its own teardown. Later saves are synchronous."""
        self.is_open = False
        error = None
        if self.writer is not None:
            try:
                self.writer.abandon() if self._failed() else self.writer.wait()
            except BaseException as exc:  # noqa: BLE001 - a background save failed: the door raises it
                error = exc
                self.writer.abandon()
            self._keep_abandoned(self.writer)
            self.writer.close()
            self.writer = None
        return error

    # -- saves ----------------------------------------------------------------------------------
    def background(self) -> bool:
        return self.async_checkpoint and self.is_open

    def _writer(self) -> Any:
        from lightning_zero.checkpoint.background import BackgroundSaves

        if self.writer is None:
            self.writer = BackgroundSaves(self.stall_s, self.storage)
        return self.writer

    def save(
        self,
        path: PathLike,
        checkpoint: dict[str, Any],
        *,
        step: Any,
        module: Any,
        engine: Any,
        optimizers: list,
        layout: Any,
        optimizer_shards: Any = None,
        storage_options: Optional[Mapping[str, Any]] = None,
    ) -> Optional[SaveRecord]:
        """Save ``checkpoint`` (Lightning's dict: the non-tensor state; tensors come from
        ``module`` / ``engine`` / ``optimizers``; ``optimizer_shards`` as
        ``save.snapshot`` takes it) to ``path`` for the agreed ``step``; every rank calls it.
        ``storage_options`` (a door's per-save ones: ``trainer.save_checkpoint(storage_options=)``)
        are added to the run's for this save of a URL.
        ``None`` on the failure path (no save: it needs every rank)."""
        from lightning_zero.checkpoint.save import snapshot, write_snapshot

        if self._failed():
            return None
        background = self.background()
        storage = self._storage(storage_options)
        record = SaveRecord(location(path), step, background, self._is_global_zero(), storage)
        self.records.append(record)
        record.advance(SaveState.AGREED)
        started = time.perf_counter()
        if not background:
            self.wait()  # a save in flight (same process, earlier run) is published first
            taken = snapshot(path, checkpoint, module=module, engine=engine, optimizers=optimizers, layout=layout,
                             optimizer_shards=optimizer_shards)  # fmt: skip
            try:
                write_snapshot(taken, layout, on_state=record.advance, storage=storage)
            except BaseException:
                record.advance(SaveState.ABANDONED)
                raise
            return record
        taken = snapshot(path, checkpoint, module=module, engine=engine, optimizers=optimizers, layout=layout,
                         keep_device=True, optimizer_shards=optimizer_shards)  # fmt: skip
        writer = self._writer()
        if not writer.start(taken, layout, started, record):
            record.advance(SaveState.ABANDONED)
        elif not self._at_exit:
            self._at_exit = True
            atexit.register(self._wait_at_exit)
        return record

    def save_file(
        self, path: PathLike, write: Callable[[BinaryIO], None], storage_options: Optional[Mapping[str, Any]] = None
    ) -> Optional[SaveRecord]:
        """One file at ``path`` written by global rank 0 (``write(handle)``, e.g. a ``torch.save``
        into the open staging file), published atomically (staged under a hidden name, synced,
        renamed, the directory synced); its error is raised on every rank. Every rank calls it (a
        broadcast)."""
        from lightning_zero.checkpoint.objstore import put_small
        from lightning_zero.checkpoint.publish import (
            STAGING,
            CheckpointWriteError,
            fsync_directory,
            hold,
            release,
            side_name,
        )
        from lightning_zero.checkpoint.ranks import broadcast_object

        if self._failed():
            return None
        self.wait()
        path = location(path)
        record = SaveRecord(path, None, False, self._is_global_zero(), self._storage(storage_options))
        self.records.append(record)
        record.advance(SaveState.AGREED)
        error = None
        if self._is_global_zero() and isinstance(path, str):  # one PUT is atomic: no staging name
            try:
                record.advance(SaveState.STAGED)
                buffer = io.BytesIO()
                write(buffer)
                put_small(path, buffer.getvalue(), record.storage)
                record.advance(SaveState.WRITTEN)
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                error = f"global rank 0 could not write {path!r}: {type(exc).__name__}: {exc}"
        elif self._is_global_zero():
            staged = path.parent / side_name(STAGING, path)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                record.advance(SaveState.STAGED)
                with open(staged, "wb") as handle:
                    hold(staged)  # [Note: staging in flight]
                    write(handle)
                    handle.flush()
                    os.fsync(handle.fileno())
                record.advance(SaveState.WRITTEN)
                release(staged)
                os.replace(staged, path)
                fsync_directory(path.parent)
            except Exception as exc:  # noqa: BLE001 - disk full, permissions: raised on every rank below
                error = f"global rank 0 could not write {str(path)!r}: {type(exc).__name__}: {exc}"
                remove_any(staged, self.storage)
        error = broadcast_object(error, "ckpt_file_publish")
        if error is not None:
            record.advance(SaveState.ABANDONED)
            raise CheckpointWriteError(f"{error}. Nothing was published; an earlier file of that name is untouched.")
        record.advance(SaveState.PUBLISHED)
        return record

    def _storage(self, storage_options: Optional[Mapping[str, Any]]) -> StoragePolicy:
        """The run's policy, with a door's per-save ``storage_options`` added."""
        if not storage_options:
            return self.storage
        return replace(self.storage, storage_options={**self.storage.storage_options, **_plain(storage_options)})

    def prepare(self, tensors: dict[str, Any]) -> None:
        """[Note: host buffers before the first save] in ``checkpoint/background.py``."""
        if self.async_checkpoint:
            self._writer().prepare(tensors)

    @property
    def prepared(self) -> bool:
        return self.writer is not None and self.writer.prepared

    def in_flight(self) -> Optional[SaveRecord]:
        """The newest background save not yet published (or abandoned), if any."""
        for record in reversed(self.records):
            if record.background and record.state not in (SaveState.PUBLISHED, SaveState.LINKED,
                                                          SaveState.ABANDONED):  # fmt: skip
                return record
        return None

    def wait(self) -> None:
        """Until the background saves in flight are published; raises their error on every rank."""
        if self.writer is not None:
            self.writer.wait()

    def link(self, target: PathLike, link: PathLike) -> None:
        """Rank 0: ``link`` -> ``target`` once ``target`` is published (now, if it is)."""
        target, link = location(target), location(link)
        pending = next((r for r in reversed(self.records) if r.path == target), None)
        if pending is not None and pending.link(link):
            return
        if pending is not None and pending.state is SaveState.ABANDONED:
            return  # never link to a checkpoint that was not published: the old link stays
        link_checkpoint(target, link, self.storage)

    def remove(self, path: PathLike) -> None:
        """Rank 0: remove ``path`` once the save in flight is published (now without one)."""
        if self.writer is not None:
            self.writer.remove_after(location(path))
        else:
            remove_any(location(path), self.storage)

    def before_load(self, path: PathLike, barrier: Callable[[], None]) -> None:
        """A load of ``path``: the save in flight published, ``path``'s directory restored and
        cleaned (a moved-aside ``path`` is back before it is read)."""
        self.wait()
        directory = parent_of(location(path))
        self.restore_before_resolve([directory])
        self.clean([directory], barrier)

    def _keep_abandoned(self, writer: Any) -> None:
        stuck = getattr(writer, "_stuck", None)
        if stuck is not None and stuck.is_alive():
            self._abandoned.append(stuck)

    def _wait_at_exit(self) -> None:
        """Interpreter exit with a save in flight (no teardown ran: Fabric): publish it, or end the
        process with exit code 1 saying why. An abandoned save's thread still running: exit code 1
        without finalizing once it had :data:`ABANDONED_GRACE_S` to end ([Note: checkpoint lifecycle])."""
        if self.writer is not None and self.writer.in_flight:
            if self._failed():
                self.writer.abandon()
            else:
                try:
                    self.writer.wait()
                except BaseException:  # noqa: BLE001 - the exit code must say the save failed
                    traceback.print_exc()
                    _exit_now("the background checkpoint save in flight at exit failed")
        if self.writer is not None:
            self._keep_abandoned(self.writer)
        deadline = time.monotonic() + ABANDONED_GRACE_S
        for thread in self._abandoned:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in self._abandoned):
            _exit_now("an abandoned background checkpoint save was still in a collective at exit; the last"
                      " published checkpoint is the newest")  # fmt: skip


def storage_policy(config: Any) -> StoragePolicy:
    """The :class:`StoragePolicy` of a ``ZeroConfig`` (``storage_options``, ``upload_threads``,
    ``upload_stall_s``); Hydra's nested configs become plain dicts for fsspec."""
    return StoragePolicy(storage_options=_plain(config.storage_options or {}), upload_threads=config.upload_threads,
                         stall_s=config.upload_stall_s)  # fmt: skip


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _exit_now(why: str) -> None:
    """End the process with exit code 1 without finalizing the interpreter (threads inside C++ calls)."""
    print(f"lightning_zero: {why}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
