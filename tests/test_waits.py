"""The failure channel and the engine's waits, without a process group (a dict as the store)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_zero.zero import waits
from lightning_zero.zero.waits import CollectiveTimeoutError, FailureChannel, PeerFailedError, Waiter


class DictStore:
    """The few TCPStore calls the channel makes, on one dict shared by the "ranks"."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with self.lock:
            if key not in self.data and expected == "":
                self.data[key] = desired.encode()
            return self.data.get(key, b"")

    def check(self, keys: list[str]) -> bool:
        return all(key in self.data for key in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            return value

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


class Pending:
    """A work handle that completes when told to."""

    def __init__(self, error: Exception | None = None) -> None:
        self.done = threading.Event()
        self.error = error

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> bool:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return True


class SlicedWork(dist.Work):
    """A c10d work that completes when told to and counts how it is waited on: ``wait(timeout)``
    blocks at most ``timeout`` and then raises, as gloo's does ([Note: sliced waits])."""

    def __init__(self) -> None:
        super().__init__()
        self.done = threading.Event()
        self.slices: list[timedelta] = []
        self.polls = 0

    def is_completed(self) -> bool:
        self.polls += 1
        return self.done.is_set()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if timeout > timedelta(0):
            self.slices.append(timeout)
            if not self.done.wait(timeout.total_seconds()):
                raise RuntimeError("Operation timed out!")
        self.done.wait()
        return True


def _ranks(store, world=2, **kwargs):
    return [FailureChannel(store, "k", rank=r, world_size=world, **kwargs) for r in range(world)]


def test_the_first_failure_posted_wins_and_every_peer_reads_it_within_a_poll():
    store = DictStore()
    seen = []
    channels = _ranks(store, world=3, on_peer_failure=lambda: seen.append(1))
    channels[1].post("ValueError: first")
    channels[2].post("ValueError: second")  # a later failure does not replace the cause
    deadline = time.monotonic() + 2
    # the watcher publishes peer_failure, then calls on_peer_failure: wait for both
    while (channels[0].peer_failure is None or not seen) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert channels[0].peer_failure == (1, "ValueError: first")
    assert channels[2].failed and channels[2].posted
    assert channels[1].peer_failure is None and channels[1].failed  # its own failure is not a peer's
    error = channels[0].peer_error()
    assert isinstance(error, PeerFailedError) and "another rank failed (global rank 1): ValueError: first" in str(error)
    with pytest.raises(PeerFailedError, match="global rank 0 stops"):
        channels[0].check()
    assert seen == [1]  # rank 0 only: rank 2 had failed itself and needs no abort
    assert int(store.data["k/acks"]) >= 1
    for channel in channels:
        channel.close()
    assert "k" in store.data  # a failed run's line stays for the peers


def test_global_rank_0_waits_for_its_peers_to_read_its_line(monkeypatch):
    """Rank 0 hosts the store: its exit would take the message along, so it waits for the acks."""
    store = DictStore()
    monkeypatch.setattr(waits, "ACK_GRACE_S", 5.0)
    rank0, rank1 = _ranks(store)
    started = time.monotonic()
    rank0.post("RuntimeError: boom")
    took = time.monotonic() - started
    assert rank1.peer_failure == (0, "RuntimeError: boom") and took < 2.0, took


def test_await_reported_waits_until_the_failing_rank_printed_its_error():
    store = DictStore()
    rank0, rank1 = _ranks(store)
    rank1.post("ValueError: x")
    assert rank0.await_peer_error() is not None
    threading.Timer(0.3, rank1._reported).start()
    started = time.monotonic()
    rank0.await_reported(seconds=5)
    assert 0.2 < time.monotonic() - started < 3


def test_a_clean_close_removes_the_key_and_stops_the_watcher():
    store = DictStore()
    channels = _ranks(store)
    for channel in channels:
        channel.close()
    assert not channels[0].failed and "k" not in store.data
    channels[0]._watcher.join(1)
    assert not channels[0]._watcher.is_alive()


def test_a_polled_wait_raises_the_peer_failure_and_a_failed_collective_names_the_peer():
    store = DictStore()
    rank0, rank1 = _ranks(store)
    waiter = Waiter(timeout_s=None, poll=True, failure=rank0)
    stuck = Pending()
    threading.Timer(0.2, rank1.post, args=("ValueError: a bad batch",)).start()
    started = time.monotonic()
    with pytest.raises(PeerFailedError, match="ValueError: a bad batch"):
        waiter.wait(stuck, lambda: "the all-gather of unit 'blocks.0'")
    assert time.monotonic() - started < 2
    # a blocked wait (GPU) whose collective fails because the peer exited: the error names the peer
    lost = Pending(RuntimeError("Connection closed by peer"))
    lost.done.set()
    with pytest.raises(PeerFailedError, match="global rank 1"):
        Waiter(poll=False, failure=rank0).wait(lost, lambda: "x")


def test_a_wait_without_a_peer_message_still_times_out_naming_what_it_waited_on():
    store = DictStore()
    rank0, _ = _ranks(store)
    with pytest.raises(CollectiveTimeoutError, match="bucket 3"):
        Waiter(timeout_s=0.2, poll=True, failure=rank0).wait(Pending(), lambda: "bucket 3")
    failed = Pending(RuntimeError("Connection closed by peer"))
    failed.done.set()
    with pytest.raises(RuntimeError, match=r"bucket 3 failed after .* Connection closed"):
        Waiter(timeout_s=None, poll=False).wait(failed, lambda: "bucket 3")


def test_global_rank_0_does_not_wait_for_a_peer_that_is_gone(monkeypatch):
    """Rank 0's own error is a lost peer's (SIGKILL): nobody will read its line, so no grace."""
    store = DictStore()
    monkeypatch.setattr(waits, "ACK_GRACE_S", 5.0)
    rank0 = FailureChannel(store, "k", rank=0, world_size=2)
    started = time.monotonic()
    rank0.post("RuntimeError: Connection reset by peer", peers_alive=False)
    assert time.monotonic() - started < 0.5 and rank0.posted
    started = time.monotonic()
    FailureChannel(DictStore(), "k", rank=0, world_size=2).post("RuntimeError: boom")  # a live peer never acks
    assert time.monotonic() - started >= 4.5


def test_a_cpu_wait_blocks_on_the_work_in_slices_and_returns_when_it_completes():
    """[Note: sliced waits]: no polling of ``is_completed()`` while gloo works, no sleep past the end."""
    store = DictStore()
    rank0, _ = _ranks(store)
    work = SlicedWork()
    threading.Timer(0.25, work.done.set).start()
    started = time.monotonic()
    Waiter(timeout_s=30, poll=True, failure=rank0).wait(work, lambda: "bucket 0")
    assert time.monotonic() - started < 0.25 + waits.WAIT_SLICE_S + 0.1
    assert len(work.slices) >= 0.25 / waits.WAIT_SLICE_S - 1, work.slices  # blocked, slice after slice
    assert all(timedelta(milliseconds=1) <= s <= timedelta(seconds=waits.WAIT_SLICE_S) for s in work.slices)
    assert work.polls <= len(work.slices) + 2, work.polls  # asked once per slice that ran out, not in a loop
    # Between slices the limit and the failure channel are still checked.
    with pytest.raises(CollectiveTimeoutError, match="bucket 1"):
        Waiter(timeout_s=0.2, poll=True, failure=rank0).wait(SlicedWork(), lambda: "bucket 1")
    rank0b, rank1b = _ranks(DictStore())
    threading.Timer(0.2, rank1b.post, args=("ValueError: a bad batch",)).start()
    with pytest.raises(PeerFailedError, match="ValueError: a bad batch"):
        Waiter(timeout_s=None, poll=True, failure=rank0b).wait(SlicedWork(), lambda: "bucket 2")


def test_a_rank_gone_without_a_word_is_posted_in_its_name_unless_a_line_came_first():
    """``post_for`` ([Note: a pipeline neighbour gone] in runtime/pipeline.py): a survivor posts a
    killed rank's line in its name, so every rank's error names the rank gone, and nobody waits for
    it to print; a line already posted (a rank that raised) stays the cause."""
    store = DictStore()
    rank0, rank1, rank2 = _ranks(store, world=3)
    rank0.post_for(1, "global rank 1 left the pipeline without a word")
    assert rank0.peer_failure == (1, "global rank 1 left the pipeline without a word")
    assert "stops because another rank failed (global rank 1): global rank 1 left" in str(rank0.peer_error())
    assert rank2.await_peer_error(seconds=2) is not None and rank2.peer_failure[0] == 1
    started = time.monotonic()
    rank2.await_reported(seconds=5)  # set at once: rank 1 prints nothing
    assert time.monotonic() - started < 1
    for channel in (rank0, rank1, rank2):
        channel.close()

    store = DictStore()
    rank0, rank1, rank2 = _ranks(store, world=3)
    rank2.post("ValueError: its own")
    rank0.post_for(1, "global rank 1 left the pipeline without a word")
    assert rank0.peer_failure == (2, "ValueError: its own") and "k/reported" not in store.data
    for channel in (rank0, rank1, rank2):
        channel.close()
