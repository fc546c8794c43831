"""Waiting on collectives: a time limit, polling, and a failure channel, so no rank waits for a dead peer.

[Note: collective timeout] Every wait on a collective of the engine uses ``collective_timeout``
seconds (``None``: the process group's own timeout). A wait that runs out raises an error saying
what this rank was waiting on and how far its backward got, instead of hanging for the process
group's own ``timeout`` (its default: docs/troubleshooting.md), far longer than any collective of a
healthy step. On CPU (gloo) the wait blocks in slices ([Note: sliced waits]) and checks the
limit and the failure channel between them. On GPU a wait does not block the host (it orders the
compute stream after the collective), so the limit is the NCCL watchdog's: the process group's
own timeout, which the strategy sets to ``collective_timeout`` ([Note: collective timeout on NCCL]).

[Note: collective timeout on NCCL] A ``work.wait(timeout)`` on NCCL blocks the host until the
collective completes (ProcessGroupNCCL's ``synchronizeInternal``): the overlap would be gone.
So on NCCL ``collective_timeout`` becomes the timeout of every process group the engine's
collectives use (the default group, the mesh's dp/tp groups, the hybrid layout's groups;
``_set_pg_timeout``, as torchtitan sets its training timeout), right after they are created
(:func:`hold_collective_timeout`, called by the strategy's ``setup_environment``). The watchdog
then ends a collective that ran past it, and with torch's default
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` tears the process down, printing the collective that timed
out: a desync costs ``collective_timeout`` (300 s), not Lightning's 30 minutes. The price: any
collective on those groups, Lightning's own barriers included, must finish within it, so a
rank-0-only phase between two barriers (a full single-file export of a large model) longer than
``collective_timeout`` needs a larger one. ``collective_timeout=None`` leaves the groups' own
timeouts (``ZeroStrategy(timeout=...)``).

[Note: sliced waits] On CPU a rank's gloo thread shares the core with the training thread, so how
a wait sleeps is on the step's path. A gloo work's ``wait(timeout)`` blocks on the work's
condition variable and returns the moment the collective completes (a slice that runs out raises
and leaves the work untouched); the engine's gloo collectives (the all-to-alls of
``collectives.py``, all-reduce, all-gather, broadcast) all honour it. The waiter therefore blocks
in slices of ``WAIT_SLICE_S`` on the c10d work under the handle (``Finishing.wire_work``), checking
the time limit and the failure channel between slices: no wake-ups while gloo works, and none
late. It used to poll ``is_completed()`` with sleeps growing to 1 ms, which woke the core up to a
thousand times a second beside gloo's thread and returned up to a sleep after the collective
ended. A handle with no c10d work under it (a test's fake) is still polled that way. A peer's
failure is seen within one slice after the watcher read it. The step time did not move with it
(an A/B inside one process pair, docs/benchmarks.md session 18): the change is in how a wait
sleeps, not a speed-up.

[Note: failure channel] A rank that fails -- its own exception anywhere in a step (the user's
``training_step``, a callback, backward, the optimizer step, validation), or an error of the
engine (a stage-3 divergence, a ``collective_timeout``) -- posts one line in the process group's
store before it does anything else: which global rank failed, with which exception, where. The
first line posted wins (``compare_set``): when several ranks fail, it names the first cause.
Every rank runs a daemon thread that polls that key, often on small jobs and less often on large
ones (``_poll_interval``: each poll is one request to the store's host, so the interval grows with
the world size; the numbers are in docs/troubleshooting.md). What follows:

- a *polled* wait (every wait of the engine on CPU) raises :class:`PeerFailedError` naming the
  failing rank and its exception within one poll;
- a *blocked* wait (a collective outside the engine, e.g. Lightning's own ``barrier``; every wait
  on GPU) ends when the failing process exits (gloo: its sockets close, the collective errors at
  once) or, on NCCL, when the watcher aborts the process groups a grace period after the message
  ([Note: NCCL abort]). The error raised there is then rewritten to name the failing rank;
- the failure path issues no collective: the strategy skips checkpoint-on-exception saves,
  barriers, and teardown's gathers (see ``ZeroStrategy``);
- [Note: NCCL abort] ``_abort_process_group()`` with no argument aborts every communicator (inside
  one NCCL group call, so they cannot deadlock each other) and clears the default group: what
  this rank runs next sees either the aborted collective's error or ``ValueError("Default process
  group has not been initialized ...")`` from the next ``dist`` call; ``failure_path``
  classifies both as a collective's error, so the error is rewritten to name the failing rank.
  torch documents the call for ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``; under its default the
  watchdog may tear the process down on the aborted work first, so the watcher writes the peer's
  message to stderr before it aborts (either way this rank's last words name the failing rank).
  A torch without the call fails at setup (:func:`abort_nccl_after`), not silently at the failure;
- global rank 0 usually hosts the store (a TCPStore on ``MASTER_ADDR``), which dies with it. When
  it fails it waits up to ``ACK_GRACE_S`` for every peer's watcher to acknowledge the line, so
  its exit does not take the message along.
"""

from __future__ import annotations

import atexit
import itertools
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

ACK_GRACE_S = 2.0  # how long global rank 0 (the store's host) waits for its peers to read its message
NCCL_ABORT_GRACE_S = 2.0  # after a peer's message: time for this rank to reach its failure path first
MESSAGE_AFTER_ERROR_S = 1.0  # after a collective error: how long to look for the peer's message
REPORTED_GRACE_S = 2.0  # how long a rank waits for the failing rank to print its own error first
WAIT_SLICE_S = 0.02  # a CPU wait blocks this long at most between checks ([Note: sliced waits])


class CollectiveTimeoutError(RuntimeError):
    """A collective of the engine did not finish within ``collective_timeout`` seconds."""


class PeerFailedError(RuntimeError):
    """Another rank failed first; this rank stops instead of waiting for it ([Note: failure channel])."""


_CHANNELS = itertools.count()  # channels opened by this process: the same sequence on every rank
_WATCHING: "weakref.WeakSet[FailureChannel]" = weakref.WeakSet()  # channels whose watcher may still run


def _poll_interval(world_size: int) -> float:
    return min(1.0, max(0.05, world_size / 1000))


class FailureChannel:
    """The store key through which a failing rank tells every other rank why ([Note: failure channel]).

    Args:
        store: the process group's store (``None``: a channel that only remembers this rank's
            own failure, for a single process).
        key: the store key; the same on every rank, unique per training run.
        rank, world_size: this process's global rank and the world size.
        on_peer_failure: called once from the watcher thread when another rank's message arrives
            (the NCCL abort, see :func:`abort_nccl_after`).
    """

    def __init__(
        self,
        store: Any,
        key: str,
        *,
        rank: int,
        world_size: int,
        on_peer_failure: Optional[Callable[[], None]] = None,
    ) -> None:
        self.store = store if world_size > 1 else None
        self.key = key
        self.rank = rank
        self.world_size = world_size
        self.on_peer_failure = on_peer_failure
        self.posted = False  # this rank posted its own failure
        self._peer: Optional[tuple[int, str]] = None  # (global rank, message) of another rank's failure
        self._stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None
        if self.store is not None:
            self._watcher = threading.Thread(target=self._watch, name="lightning_zero-failure-watcher", daemon=True)
            self._watcher.start()
            _WATCHING.add(self)

    @classmethod
    def open(cls, **kwargs: Any) -> "FailureChannel":
        """A channel on the default process group's store (initialized). Its key numbers the
        channels this process opened: every rank opens them in the same order, as it creates
        process groups."""
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store (a fake backend): remember own failures only
            store = None
        key = f"lightning_zero/failure/{next(_CHANNELS)}"
        return cls(store, key, rank=dist.get_rank(), world_size=dist.get_world_size(), **kwargs)

    # -- this rank failed -----------------------------------------------------------------------
    def post(self, message: str, *, peers_alive: bool = True) -> None:
        """This rank failed with ``message``: tell the others (best effort, once). Global rank 0
        waits until every peer read it (at most ``ACK_GRACE_S``), unless a peer is known to be gone
        (``peers_alive=False``: this rank's error is a lost peer's, and it would never read)."""
        if self.posted or self._peer is not None:
            return
        self.posted = True
        if self.store is None:
            return
        try:
            first = self.store.compare_set(self.key, "", f"{self.rank}\n{message}").decode()
            if not first.startswith(f"{self.rank}\n"):  # another rank was first: its line stands
                return
            atexit.register(self._reported)
            if self.rank != 0 or not peers_alive:
                return
            deadline = time.monotonic() + ACK_GRACE_S
            while self.store.add(self.key + "/acks", 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.02)
        except Exception:  # noqa: BLE001 - the store is gone: this rank raises either way
            pass

    def post_for(self, origin: int, message: str) -> None:
        """Global rank ``origin`` is gone without a word (killed: its transfer with this rank failed
        and it posted nothing): post ``message`` in its name, so every rank's error names it. The
        first line still wins; ``origin`` will print nothing, so nobody waits for it to report."""
        if self.failed or self.store is None:
            self._peer = self._peer or (origin, message)
            return
        try:
            first = self.store.compare_set(self.key, "", f"{origin}\n{message}").decode()
            won = first == f"{origin}\n{message}"
            if won:
                self.store.set(self.key + "/reported", "1")
            if won and self.rank == 0:  # the store's host: the others read the line before it exits
                deadline = time.monotonic() + ACK_GRACE_S
                while self.store.add(self.key + "/acks", 0) < self.world_size - 2 and time.monotonic() < deadline:
                    time.sleep(0.02)
        except Exception:  # noqa: BLE001 - the store is gone: this rank raises either way
            first = f"{origin}\n{message}"
        line_origin, _, line = first.partition("\n")
        self._peer = (int(line_origin), line) if int(line_origin) != self.rank else (origin, message)

    def all_ranks_reach(self, tag: str, seconds: float) -> bool:
        """Count this rank in at ``tag`` (a counter in the store) and wait until every rank did
        (True), another rank failed (its error is raised), or ``seconds`` passed (False). For rare
        events only: one store request per poll."""
        if self.store is None:
            return True
        key = f"{self.key}/reach/{tag}"
        deadline = time.monotonic() + seconds
        try:
            count = self.store.add(key, 1)
            while count < self.world_size:
                self.check()
                if time.monotonic() > deadline:
                    return False
                time.sleep(_poll_interval(self.world_size))
                count = self.store.add(key, 0)
        except (RuntimeError, OSError) as err:  # the store is gone: some rank ended
            if isinstance(err, PeerFailedError):
                raise
            return False
        return True

    def _reported(self) -> None:
        """At exit, after Python printed this rank's traceback: the peers may raise now."""
        try:
            self.store.set(self.key + "/reported", "1")
        except Exception:  # noqa: BLE001 - the store is gone
            pass

    # -- another rank failed --------------------------------------------------------------------
    @property
    def peer_failure(self) -> Optional[tuple[int, str]]:
        """``(global rank, message)`` of another rank's failure, once this rank's watcher read it."""
        return self._peer

    @property
    def failed(self) -> bool:
        """This rank is on the failure path: it failed itself or knows another rank did."""
        return self.posted or self._peer is not None

    def peer_error(self) -> Optional[PeerFailedError]:
        """The error this rank raises because another rank failed, or ``None``."""
        if self._peer is None:
            return None
        origin, message = self._peer
        return PeerFailedError(
            f"lightning_zero: global rank {self.rank} stops because another rank failed (global rank {origin}):"
            f" {message}"
        )

    def check(self) -> None:
        """Raise :class:`PeerFailedError` if another rank failed (cheap: reads what the watcher saw)."""
        error = self.peer_error()
        if error is not None:
            raise error

    def read_now(self) -> Optional[PeerFailedError]:
        """:meth:`peer_error` after reading the key once now (not waiting for the watcher): after a
        collective with a rank that posts *before* it issues that collective, its message is there."""
        if self._peer is None and self.store is not None:
            self._read()
        return self.peer_error()

    def await_peer_error(self, seconds: float = MESSAGE_AFTER_ERROR_S) -> Optional[PeerFailedError]:
        """After a collective failed ("Connection closed by peer"): the failing peer posts before it
        exits, so look for its message for up to ``seconds``."""
        deadline = time.monotonic() + seconds
        while self._peer is None and self.store is not None and time.monotonic() < deadline:
            self._read()
            if self._peer is None:
                time.sleep(0.02)
        return self.peer_error()

    def await_reported(self, seconds: float = REPORTED_GRACE_S) -> None:
        """Wait until the failing peer printed its own error (it exited), at most ``seconds``,
        so the user reads that first."""
        if self._peer is None or self.store is None:
            return
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if self.store.check([self.key + "/reported"]):
                    return
            except Exception:  # noqa: BLE001 - the store's host exited: it printed already
                return
            time.sleep(0.05)

    def _read(self) -> bool:
        """Look at the key once; return whether there is nothing more to watch."""
        try:
            if not self.store.check([self.key]):
                return False
            origin, _, message = self.store.get(self.key).decode().partition("\n")
        except Exception:  # noqa: BLE001 - the store's host is gone: nothing more to read
            return True
        if int(origin) == self.rank:
            return True
        first = self._peer is None
        self._peer = (int(origin), message)
        if first:
            try:
                self.store.add(self.key + "/acks", 1)
            except Exception:  # noqa: BLE001
                pass
            if self.on_peer_failure is not None and not self.posted:
                # [Note: NCCL abort]: the watchdog may end this process before Python raises
                print(
                    f"lightning_zero (global rank {self.rank}): global rank {origin} failed: {message};"
                    " aborting this rank's NCCL process groups",
                    file=sys.stderr,
                    flush=True,
                )
                self.on_peer_failure()
        return True

    def _watch(self) -> None:
        interval = _poll_interval(self.world_size)
        while not self._stop.wait(interval):
            if self._peer is not None or self.posted or self._read():
                return

    def stop_watching(self) -> None:
        """Stop the watcher thread and wait for it (a store call it is in returns first)."""
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5)

    def close(self) -> None:
        """Stop watching; a clean end (nobody posted) removes the key."""
        self.stop_watching()
        if self.store is not None and not self.failed:
            try:
                self.store.delete_key(self.key)
            except Exception:  # noqa: BLE001 - best effort; the key names a run no one reuses
                pass


@atexit.register
def _stop_watchers() -> None:
    """Before the interpreter finalizes: no watcher may be inside a store call while the store (and
    its C++ threads) are torn down -- that aborts the process ("terminate called ...")."""
    for channel in list(_WATCHING):
        channel.stop_watching()


def abort_nccl_after(grace_s: float = NCCL_ABORT_GRACE_S) -> Callable[[], None]:
    """An ``on_peer_failure`` for NCCL: ``grace_s`` after a peer's message, abort every process
    group, so a collective stuck waiting for the dead peer returns with an error ([Note: failure
    channel], [Note: NCCL abort]). gloo needs none: the peer's exit closes its sockets.

    Raises ``RuntimeError`` now (at setup, not at the failure) if this torch has no
    ``_abort_process_group``: a survivor could then only end at ``collective_timeout``."""
    abort_all = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort_all is None:
        raise RuntimeError(
            f"lightning_zero: torch {torch_version()} has no torch.distributed.distributed_c10d._abort_process_group;"
            " the NCCL failure path needs it to end a collective waiting for a dead peer (docs/gpu.md)."
        )

    def abort() -> None:
        def later() -> None:
            time.sleep(grace_s)
            try:
                abort_all()
            except ValueError:  # "Invalid process group specified or has been destroyed": already gone
                pass

        threading.Thread(target=later, name="lightning_zero-nccl-abort", daemon=True).start()

    return abort


def torch_version() -> str:
    import torch

    return torch.__version__


def hold_collective_timeout(groups: list[Optional[dist.ProcessGroup]], timeout_s: Optional[float]) -> list[Any]:
    """[Note: collective timeout on NCCL] Make ``collective_timeout`` the NCCL watchdog's timeout
    of every group in ``groups`` (``None``: the default group) whose backend is NCCL; returns the
    groups it set. ``timeout_s=None`` (the user asked for the process group's own timeout) and
    gloo groups (their waits are sliced and limited here) are left alone."""
    if timeout_s is None:
        return []
    done: list[Any] = []
    for group in groups:
        target = group if group is not None else dist.group.WORLD
        if any(target is seen for seen in done) or dist.get_backend(target) != "nccl":
            continue
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if set_timeout is None:
            raise RuntimeError(
                f"lightning_zero: torch {torch_version()} has no torch.distributed.distributed_c10d._set_pg_timeout:"
                f" collective_timeout={timeout_s:g} s cannot hold on NCCL. Pass collective_timeout=None and"
                " ZeroStrategy(timeout=timedelta(...)) for the process group's own limit."
            )
        set_timeout(timedelta(seconds=timeout_s), target)
        done.append(target)
    return done


@dataclass
class Waiter:
    """How the engine waits on a collective: the time limit, whether to poll, the failure channel.

    ``poll=True`` (CPU/gloo) blocks on the work in slices of ``WAIT_SLICE_S`` and checks, between
    slices, the time limit and whether another rank failed -- when there is a time limit or a
    failure channel ([Note: sliced waits]). ``poll=False`` (GPU)
    only calls ``wait()`` (polling would block the CPU until the GPU catches up): there a failing
    peer ends the wait by the NCCL abort, and the error names it.
    """

    timeout_s: Optional[float] = None
    poll: bool = True
    failure: Optional[FailureChannel] = None

    def wait(self, work: Any, describe: Callable[[], str]) -> None:
        """Wait on ``work``; raise naming ``describe()`` on timeout, or the failing peer."""
        if self.failure is not None:
            self.failure.check()
        if not self.poll or (self.timeout_s is None and self.failure is None) or work.is_completed():
            self._finish(work, describe, 0.0)
            return
        started = time.perf_counter()
        deadline = None if self.timeout_s is None else started + self.timeout_s
        wire = wire_work(work)
        delay = 1e-5
        while not (_blocked_until_done(wire, deadline) if wire is not None else work.is_completed()):
            now = time.perf_counter()
            if deadline is not None and now > deadline:
                raise CollectiveTimeoutError(
                    f"lightning_zero: collective_timeout: waited {now - started:.1f} s (limit {self.timeout_s:g} s)"
                    f" for {describe()}. Another rank is most likely stuck before this collective or issued a"
                    " different one (an exception on that rank, a skipped or extra backward/optimizer step,"
                    " different control flow per rank); see its own error. Raise"
                    " ZeroStrategy(collective_timeout=...) if a collective legitimately takes this long."
                )
            if self.failure is not None:
                self.failure.check()
            if wire is None:  # a handle without a c10d work: poll
                time.sleep(delay)
                delay = min(2 * delay, 1e-3)
        self._finish(work, describe, time.perf_counter() - started)

    def _finish(self, work: Any, describe: Callable[[], str], waited: float) -> None:
        try:
            work.wait()
        except RuntimeError as err:  # the collective failed (a peer went away, the group timed out)
            peer = self.failure.await_peer_error() if self.failure is not None else None
            if peer is not None:
                raise peer from err
            raise RuntimeError(f"lightning_zero: {describe()} failed after {waited:.1f} s: {err}") from err


def wire_work(work: Any) -> Optional[dist.Work]:
    """The c10d work that ``work`` (a c10d work, or a handle that finishes one:
    ``collectives.Finishing``) completes with, or ``None`` ([Note: sliced waits])."""
    inner = getattr(work, "wire_work", work)
    return inner if isinstance(inner, dist.Work) else None


def _blocked_until_done(wire: dist.Work, deadline: Optional[float]) -> bool:
    """Block on ``wire`` for one slice (less when ``deadline`` is nearer); True once it completed,
    with or without an error (``Waiter._finish`` raises that). c10d reads a zero timeout as "no
    limit", hence the 1 ms floor."""
    seconds = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.perf_counter())
    try:
        wire.wait(timedelta(seconds=max(seconds, 1e-3)))
    except RuntimeError:  # the slice ran out ("Operation timed out!"), or the collective failed
        return wire.is_completed()
    return True
