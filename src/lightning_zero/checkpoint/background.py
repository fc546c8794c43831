"""Saves that do not stop training: a host copy at the step boundary, the write in a thread.

[Note: background saves] With ``ZeroStrategy(async_checkpoint=True)`` a save waits only for
:func:`~lightning_zero.checkpoint.save.snapshot` (the trainer state as JSON, the RNG file, the
tensor map) and :func:`host_copy` (every tensor this rank writes, copied to host memory: pinned on
a device). Writing, hashing and the atomic publish (``save.write_snapshot``) run in a thread, over
a process group of their own (gloo, every rank, made at the first background save: a point every
rank reaches together), so its collectives never interleave with the training step's on the
default group. The files are the same bytes a synchronous save writes (the same tensors, values
taken at the same boundary).

One host copy is in flight at most (saves of the same step share it, written in turn): the next
save of another step, the end of fit (``on_train_end``), the requeue
before ``scontrol`` and a load wait for it (every rank, so an error it raised, agreed on every
rank, is raised on every rank there); a removal of an older checkpoint (``ModelCheckpoint``'s
top-k) waits until the newer one is published. A failure, or a SIGKILL, abandons it: its staging
directory is left, ``last`` is still the previous complete checkpoint, and the next start removes
the leftover ([Note: staging names] in ``publish.py``). The cost in host memory is one copy of
this rank's checkpoint tensors, kept from one save to the next: the next copy writes into it
(fresh pages are slower to fill than the copy itself).

[Note: host buffers before the first save] Fresh host pages cost more than the copy itself
(page faults: 2.5 GiB took 9 s on the 2-core benchmark machine, the same copy into touched pages
under 1 s), so a first save that allocated its copy would hold training for most of a
synchronous save. :meth:`BackgroundSaves.prepare` takes that memory earlier: after the first
optimizer step (the optimizer state exists then), a thread of its own allocates and writes every
page of buffers shaped as the save's tensors (pinned on a device), off the training loop; the first
save writes into them (waiting for that thread if it is still at work). The thread reads only
shapes and dtypes and issues no collective. The host memory is thus taken from the first optimizer
step on, not from the first save; without ``async_checkpoint`` nothing is taken.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_zero.checkpoint.dcp import DenseChunks
from lightning_zero.checkpoint.destinations import remove_any
from lightning_zero.checkpoint.objstore import DEFAULT_POLICY, StoragePolicy
from lightning_zero.checkpoint.publish import CheckpointWriteError, PathLike, WriteProgress
from lightning_zero.checkpoint.ranks import distributed
from lightning_zero.checkpoint.save import Snapshot, save_entries, write_snapshot
from lightning_zero.checkpoint.targets import RankPlacement, Targets


def _host_buffer(tensor: torch.Tensor, into: Optional[torch.Tensor]) -> torch.Tensor:
    """Where ``tensor``'s host copy goes: ``into`` (the previous save's buffer) when it fits, else a
    new one (pinned on a device)."""
    if into is not None and into.shape == tensor.shape and into.dtype == tensor.dtype:
        return into
    pinned = tensor.device.type != "cpu" and torch.cuda.is_available()
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)


def live_tensors(*, module: Any, engine: Any, optimizers: list, layout: RankPlacement, with_optimizer: bool) -> dict:
    """The tensors a save of this rank writes, as views of the live ones (nothing copied, on any
    device): what :meth:`BackgroundSaves.prepare` shapes its buffers from."""
    targets = Targets(keep_device=True)
    save_entries(targets, [{} for _ in optimizers], module=module, engine=engine, optimizers=optimizers,
                 layout=layout, with_optimizer=with_optimizer)  # fmt: skip
    return targets.tensors


def _each_tensor(tensors: dict[str, Any], fn: Any) -> dict[str, Any]:
    """``fn`` of every tensor and :class:`DenseChunks` piece of ``tensors``; other entries left out."""
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        if isinstance(value, DenseChunks):
            out[name] = DenseChunks(value.global_size, [(offsets, fn(piece)) for offsets, piece in value.pieces])
        elif isinstance(value, torch.Tensor):
            out[name] = fn(value)
    return out


def _tensors_of(tensors: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor and :class:`DenseChunks` piece of ``tensors``."""
    found: list[torch.Tensor] = []
    _each_tensor(tensors, found.append)
    return found


def _touched(spec: torch.Tensor) -> torch.Tensor:
    """A host tensor shaped as ``spec`` (a meta tensor) with every page written: no fault left."""
    return torch.empty(spec.shape, dtype=spec.dtype, pin_memory=torch.cuda.is_available()).zero_()


COPY_BATCH_BYTES = 64 << 20  # a host copy's batch ([Note: uploads overlap the host copy])


class HostCopy:
    """[Note: uploads overlap the host copy] The host copy of a background save, taken tensor by
    tensor on the training thread (:meth:`run`) while the writer thread already writes: the writer
    asks :meth:`wait_for` before it reads a tensor's bytes, and gets them as soon as that tensor's
    copy is done, not after the whole copy. So a save's first uploads (its rank file, then its
    shards' parts) overlap the copy of the rest, and the save is published earlier by up to the
    copy's duration; the training loop still waits for the whole copy (it may write the live
    tensors again right after), no longer.

    URL targets only (``BackgroundSaves.overlap_local``: False). The writer's early work competes
    with the copy for the same cores; for an upload that work is mostly waiting on the network,
    for a local directory it is serializing and writing at memory speed. Measured on the 2-core
    box (``benchmarks/bench_object_store.py``, docs/checkpoints.md): a 256 MiB local save
    overlapped held training 2.1x as long (0.53 s vs 0.25 s, median of 4 interleaved) and was not
    published sooner (1.03x, interval [0.80, 1.15]), so a local save copies first.

    The buffers are allocated (or taken from the previous copy: ``reuse``) before the writer
    starts, so DCP plans from their shapes; the copy then goes largest tensor first, the order in
    which DCP's writer threads take them (each of ``upload_threads`` objects is filled largest item
    first), the largest alone and then in batches of :data:`COPY_BATCH_BYTES`, one call each: the
    training thread waits for the GIL (which the writer's Python holds between its own waits) once
    per batch, not once per tensor of a model's hundreds. No extra memory: the copy is the one a background save always kept. A copy that fails
    (out of memory) releases the writer with the error, so the save fails on every rank, as any
    write error does; the training thread raises it too."""

    def __init__(self, tensors: dict[str, Any], reuse: Optional[dict[str, Any]] = None) -> None:
        reuse = reuse or {}  # [Note: host buffers before the first save]
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live tensor, its host buffer)
        self.tensors: dict[str, Any] = {}
        for name, value in tensors.items():
            old = reuse.get(name)
            if isinstance(value, DenseChunks):
                olds = old.pieces if isinstance(old, DenseChunks) and len(old.pieces) == len(value.pieces) else None
                pieces = []
                for index, (offsets, piece) in enumerate(value.pieces):
                    into = olds[index][1] if olds and olds[index][0] == offsets else None
                    pieces.append((offsets, self._buffer(piece, into)))
                self.tensors[name] = DenseChunks(value.global_size, pieces)
            elif isinstance(value, torch.Tensor):
                self.tensors[name] = self._buffer(value, old if isinstance(old, torch.Tensor) else None)
            else:
                self.tensors[name] = value
        self.nbytes = sum(host.numel() * host.element_size() for _, host in self.pairs)
        self._done: dict[int, Any] = {}  # data_ptr -> None (copied) or the device event that copies it
        self._all_done = False
        self._error: Optional[BaseException] = None
        self._changed = threading.Condition()

    def _buffer(self, live: torch.Tensor, into: Optional[torch.Tensor]) -> torch.Tensor:
        host = _host_buffer(live.detach(), into)
        self.pairs.append((live.detach(), host))
        return host

    def batches(self) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """The copy's order: largest tensor first, alone (the writer starts on it at once), then
        batches of up to :data:`COPY_BATCH_BYTES` on one device (one call each, see :meth:`run`)."""
        ordered = sorted(self.pairs, key=lambda pair: -pair[1].numel() * pair[1].element_size())
        batches: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        room = 0
        for live, host in ordered:
            nbytes = host.numel() * host.element_size()
            if not batches or nbytes > room or live.device != batches[-1][0][0].device:
                batches.append([])
                room = 0 if len(batches) == 1 else COPY_BATCH_BYTES
            batches[-1].append((live, host))
            room -= nbytes
        return batches

    def run(self) -> None:
        """Copy every tensor (the training thread), batch by batch, each batch released to the
        writer when done. One ``_foreach_copy_`` per batch: the training thread takes the GIL back
        once per batch, not once per tensor, while the writer runs Python beside it."""
        try:
            for batch in self.batches():
                on_device = batch[0][0].device.type != "cpu"
                self._copy([live for live, _ in batch], [host for _, host in batch], on_device)
                event = None
                if on_device and torch.cuda.is_available():
                    event = torch.cuda.Event()
                    event.record()
                with self._changed:
                    for _, host in batch:
                        self._done[host.data_ptr()] = event
                    self._changed.notify_all()
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the non-blocking copies are done before training writes again
        except BaseException as exc:
            with self._changed:
                self._error = exc
                self._changed.notify_all()
            raise
        with self._changed:
            self._all_done = True
            self._changed.notify_all()

    def _copy(self, lives: list[torch.Tensor], hosts: list[torch.Tensor], on_device: bool) -> None:
        torch._foreach_copy_(hosts, lives, non_blocking=on_device)

    def wait_for(self, tensor: torch.Tensor) -> None:
        """The writer: until ``tensor`` (a host buffer of this copy, or a view of one) holds its copy."""
        if tensor.numel() == 0:
            return
        key = tensor.data_ptr()
        with self._changed:
            while not self._all_done and key not in self._done and self._error is None:
                self._changed.wait()
            if self._error is not None:
                raise CheckpointWriteError(
                    f"the host copy of the save failed: {type(self._error).__name__}: {self._error}"
                )
            event = self._done.get(key)
        if event is not None:
            event.synchronize()


def host_copy(tensors: dict[str, Any], reuse: Optional[dict[str, Any]] = None) -> tuple[dict[str, Any], int]:
    """Copies of every tensor (and :class:`DenseChunks` rectangle) in host memory, written into
    ``reuse`` (a previous copy of the same entries, no longer read, or the buffers
    :meth:`BackgroundSaves.prepare` filled) where shapes match; all at once (:class:`HostCopy`).
    Returns the copies and their bytes."""
    copy = HostCopy(tensors, reuse)
    copy.run()
    return copy.tensors, copy.nbytes


class BackgroundSaves:
    """[Note: background saves]: the writer of :class:`~lightning_zero.runtime.checkpoints.CheckpointLifecycle`
    (which owns every save's state): one host copy in flight; ``wait`` raises what its saves raised.

    Saves of the same step (``ModelCheckpoint``'s top-k file and ``last.ckpt``) share that host
    copy and are written one after the other: only the first one copies. Whether a save shares is
    decided by what the training thread asked for (the same step as the copy kept since the last
    wait), never by how far this rank's thread got, so every rank decides the same.

    Args:
        stall_s: :meth:`wait` gives up when no rank wrote a byte (nor passed a phase) of the saves
            in flight for this long (``collective_timeout``); ``None``: waits as long as it takes.
            A slow disk that still writes is waited for.
        storage: how a URL target is written ([Note: commit objects] in ``objstore.py``).
    """

    GROUP_TIMEOUT = timedelta(hours=6)  # the saves' own gloo group: progress, not this, bounds a wait

    def __init__(self, stall_s: Optional[float] = None, storage: StoragePolicy = DEFAULT_POLICY) -> None:
        self.stall_s = stall_s
        self.storage = storage
        self.group: Any = None
        self.progress = WriteProgress()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stuck: Optional[threading.Thread] = None  # abandoned while it may still write
        self._running = False  # the thread still takes saves from the queue
        self._queue: list[tuple[Snapshot, RankPlacement, Any]] = []
        self._host: Optional[tuple[Any, dict[str, Any]]] = None  # (step, host copy) since the last wait
        self._buffers: dict[str, Any] = {}  # the last host copy: the next copy's buffers
        self._error: Optional[BaseException] = None
        self._removals: list[PathLike] = []
        self.last_stall_s = 0.0  # how long the last save held the training loop
        self.last_host_bytes = 0  # host bytes of the last copy
        self.copies = 0  # host copies taken (a save that shared one took none)
        self._preparing: Optional[threading.Thread] = None  # filling the first save's buffers
        self._prepared: dict[str, Any] = {}
        self.prepare_error: Optional[BaseException] = None  # the first save then allocates its own
        self.prepared_bytes = 0  # host bytes the prepared buffers took
        self.prepare_s = 0.0  # how long their thread took (off the training loop)
        self.prepare_wait_s = 0.0  # how long the first save waited for that thread (part of its stall)
        self.fresh_bytes = 0  # host bytes the saves' copies allocated (not reused, not prepared): all saves
        self.overlap_local = False  # a local target: the writer starts after the whole copy (HostCopy's Note)

    @property
    def prepared(self) -> bool:
        """:meth:`prepare` ran, or a save made buffers of its own."""
        return self._preparing is not None or bool(self._buffers)

    def prepare(self, tensors: dict[str, Any]) -> None:
        """[Note: host buffers before the first save]: fill buffers shaped as ``tensors`` (the live
        tensors a save writes: only their shapes and dtypes are read, here) in a thread; once."""
        if self.prepared:
            return
        spec = _each_tensor(tensors, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
        self._preparing = threading.Thread(
            target=self._fill, args=(spec,), name="lightning_zero-checkpoint-buffers", daemon=True
        )
        self._preparing.start()

    def _fill(self, spec: dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            buffers = _each_tensor(spec, _touched)
        except (MemoryError, RuntimeError) as exc:  # out of (pinned) host memory: the first save allocates
            self.prepare_error = exc
            return
        self.prepared_bytes = sum(t.numel() * t.element_size() for t in _tensors_of(buffers))
        self.prepare_s = time.perf_counter() - started
        self._prepared = buffers

    def _take_prepared(self) -> None:
        """The prepared buffers become the next copy's (waiting for their thread if at work)."""
        if self._preparing is None:
            return
        waited = time.perf_counter()
        self._preparing.join()  # at once when done: it stays set, so buffers are prepared once
        self.prepare_wait_s += time.perf_counter() - waited
        if not self._buffers:
            self._buffers = self._prepared
        self._prepared = {}

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def start(self, taken: Snapshot, layout: RankPlacement, started: float, record: Any) -> bool:
        """Write ``taken`` in the background (every rank, in the same order), for ``record`` (a
        :class:`~lightning_zero.runtime.checkpoints.SaveRecord`: its ``step``; ``advance(state)``
        hears the states): from the host copy kept since the last wait when it is of the same
        step and tensors, else from a new one, after the saves in flight are done. Returns whether
        it was queued (False: a save of the same step failed already, on every rank)."""
        host = self._host
        if self._stuck is not None and self._stuck.is_alive():
            raise CheckpointWriteError(
                f"cannot save {str(taken.target)!r} in the background: an earlier background save stopped writing"
                " and its thread still holds the saves' process group; the last published checkpoint is the newest"
            )
        if record.step is not None and host is not None and host[0] == record.step:
            if host[1].keys() == taken.tensors.keys():
                taken.tensors, taken.ready = host[1], None  # copied whole before the first save's start returned
                with self._lock:
                    if self._error is not None:  # that save failed (on every rank): this one is not written
                        return False
                    self._queue.append((taken, layout, record))
                    if not self._running:  # the thread is done with the earlier ones: a new one writes it
                        self._launch()
                self.last_stall_s = time.perf_counter() - started
                return True
        self.wait()
        if self.group is None and distributed():
            self.group = dist.new_group(backend="gloo", timeout=self.GROUP_TIMEOUT)
            store = dist.distributed_c10d._get_default_store()
            self.progress = WriteProgress(store, f"lightning_zero/ckpt_progress/{self.group.group_name}")
        self._take_prepared()
        reused = {t.data_ptr() for t in _tensors_of(self._buffers)}
        copy = HostCopy(taken.tensors, self._buffers)  # [Note: uploads overlap the host copy]
        overlap = isinstance(taken.target, str) or self.overlap_local  # a URL: its uploads start at once
        taken.tensors, self.last_host_bytes = copy.tensors, copy.nbytes
        taken.ready = copy.wait_for if overlap else None
        self.copies += 1
        self.fresh_bytes += sum(t.numel() * t.element_size() for t in _tensors_of(taken.tensors)
                                if t.data_ptr() not in reused)  # fmt: skip
        self._buffers = taken.tensors  # written again by the next save of another step, once this one is done
        self._host = (record.step, taken.tensors)
        if not overlap:
            copy.run()
        with self._lock:
            self._queue = [(taken, layout, record)]
            self._launch()  # writes each tensor as soon as its copy is done
        if overlap:
            copy.run()
        self.last_stall_s = time.perf_counter() - started
        return True

    def _launch(self) -> None:
        """A writer thread for the queue (the lock held)."""
        self._running = True
        self._thread = threading.Thread(target=self._drain, name="lightning_zero-checkpoint-writer", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue or self._error is not None:
                    for _, _, record in self._queue:
                        record.advance("abandoned")
                    self._queue, self._running = [], False
                    return
                taken, layout, record = self._queue.pop(0)
            try:
                write_snapshot(taken, layout, self.group, progress=self.progress, on_state=record.advance,
                               storage=getattr(record, "storage", self.storage))  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - raised by wait(), on the training thread
                record.advance("abandoned")
                with self._lock:
                    self._error = exc

    def wait(self) -> None:
        """Until the saves in flight are published; raise their error (``CheckpointWriteError``),
        else do the removals that waited for them. Bounded by progress: it raises
        :class:`CheckpointStalledError` (and abandons the saves) once no rank wrote for ``stall_s``."""
        thread = self._thread
        if thread is not None:
            seen, since = self.progress.total(), time.monotonic()
            poll = 0.5 if self.stall_s is None else min(0.5, max(self.stall_s / 4, 0.01))
            while True:
                thread.join(poll)
                if not thread.is_alive():
                    break
                now, total = time.monotonic(), self.progress.total()
                if total != seen:
                    seen, since = total, now
                elif self.stall_s is not None and now - since > self.stall_s:
                    self.abandon()
                    raise CheckpointStalledError(
                        f"lightning_zero: the background checkpoint save wrote nothing on any rank for"
                        f" {self.stall_s:g} s (collective_timeout); a rank is most likely gone or stuck. It is"
                        " abandoned; the last published checkpoint is the newest."
                    )
        # the thread is done: every queued save written or abandoned
        self._thread = None
        self._host = None
        error, self._error = self._error, None
        removals, self._removals = self._removals, []
        if error is not None:
            raise error
        for path in removals:
            remove_any(path, self.storage)

    def remove_after(self, path: PathLike) -> None:
        """Rank 0: remove ``path`` now, or once the save in flight is published (at the next wait;
        never if it fails: the older checkpoint is then still the newest complete one)."""
        if self._thread is not None:
            self._removals.append(path)
        else:
            remove_any(path, self.storage)

    def abandon(self) -> None:
        """A failure, or a wait that gave up: stop waiting for the saves in flight (their daemon
        thread dies with the process); their host copy is never written into again."""
        with self._lock:
            for _, _, record in self._queue:
                record.advance("abandoned")
            self._queue, self._running = [], False
        if self._thread is not None and self._thread.is_alive():
            self._stuck = self._thread
        self._thread, self._host, self._error, self._removals = None, None, None, []
        self._buffers = {}  # an abandoned save may still read them

    def close(self) -> None:
        """Destroy the saves' process group, unless an abandoned save may still be in it."""
        alive = self._stuck is not None and self._stuck.is_alive()
        if self.group is not None and not alive:
            dist.destroy_process_group(self.group)
            self.group = None


class CheckpointStalledError(CheckpointWriteError):
    """No rank wrote a byte of the background save for ``collective_timeout`` seconds."""
