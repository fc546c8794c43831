"""When each gradient collective ran, on the clock of the device that runs it.

[Note: device clock]
On CPU (gloo) a collective runs on host threads while the main thread goes on, so host time
(``time.perf_counter``) is the truth: a bucket's span is launch -> end of ``work.wait()``.
On CUDA with NCCL the host returns from both the launch and ``work.wait()`` at once (the wait only
makes the current stream wait for NCCL's stream), so host times measure nothing. There each mark
is a CUDA event recorded on the current stream: the launch mark is where NCCL's stream starts
waiting for this stream, and the mark after ``work.wait()`` is where this stream passes the
collective's completion, which is the later of "the collective finished" and "compute reached the
wait". A span that ends at backward's end mark (plus the few kernels until the wait) was hidden;
what runs past it is exposed, exactly what the step pays. Events are read (and synchronized) only
when a figure is asked for, so a step that is not logged pays nothing but the event records; the
monitor reads the previous step's (``SyncTimeline.snapshot``), whose events are done by then, so
reading them does not wait for the device to drain this step. (A span on the compute stream also
includes the time a collective queued behind earlier ones on NCCL's stream: ``comm_s`` is an upper
bound of the wire time; ``exposed_s``, what runs past backward's end, is what the step pays.)
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

Mark = Union[float, "torch.cuda.Event"]


class DeviceClock:
    """Marks points in the device's own timeline: host seconds on CPU, CUDA events on CUDA."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.uses_events = device is not None and device.type == "cuda"
        self._origin: Optional[Mark] = None

    def mark(self) -> Mark:
        if not self.uses_events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._origin is None:
            self._origin = event
        return event

    def reset(self) -> None:
        """Forget the origin: the next mark starts a new timeline (one per backward)."""
        self._origin = None

    def seconds(self, mark: Mark) -> float:
        """``mark`` in seconds on one axis shared by every mark since the last :meth:`reset`."""
        if not self.uses_events:
            return float(mark)
        mark.synchronize()
        return self._origin.elapsed_time(mark) / 1e3


@dataclass
class SyncTimeline:
    """What happened during the last backward, in order (for overlap checks and the monitor).

    ``comm_s`` sums each bucket's collective time, from its launch to the end of its wait.
    ``hidden_s`` is the part of it that ran before backward ended (overlapped with backward
    compute); ``exposed_s = comm_s - hidden_s``. With ``overlap_comm=False`` every launch comes
    after backward ends, so all of it is exposed. ``launch`` events carry the bucket's index in
    the flat layout (``(group position, bucket index)`` flattened by the reducer). Spans and the
    backward end are marks of :class:`DeviceClock` (see [Note: device clock]); ``events`` keeps
    host order only, for ordering checks.
    """

    events: list[tuple[str, int, float]] = field(default_factory=list)  # (kind, bucket, host time)
    spans: list[tuple[Mark, Mark]] = field(default_factory=list)  # (launch, done) per bucket
    backward_end: Optional[Mark] = None
    clock: DeviceClock = field(default_factory=DeviceClock)

    def mark(self) -> Mark:
        return self.clock.mark()

    def add(self, kind: str, bucket: int) -> None:
        self.events.append((kind, bucket, time.perf_counter()))
        if kind == "backward_end":
            self.backward_end = self.clock.mark()

    def clear(self) -> None:
        self.events.clear()
        self.spans.clear()
        self.backward_end = None
        self.clock.reset()

    def snapshot(self) -> "SyncTimeline":
        """A copy that the next backward's :meth:`clear` leaves alone: the monitor reads the
        previous step's figures on CUDA, whose events completed while this step ran, so reading
        them does not wait for the device ([Note: device clock])."""
        return SyncTimeline(list(self.events), list(self.spans), self.backward_end, copy.copy(self.clock))

    def _span_seconds(self) -> list[tuple[float, float]]:
        return [(self.clock.seconds(launch), self.clock.seconds(done)) for launch, done in self.spans]

    @property
    def comm_s(self) -> float:
        return sum(done - launch for launch, done in self._span_seconds())

    @property
    def hidden_s(self) -> float:
        if self.backward_end is None:
            return 0.0
        end = self.clock.seconds(self.backward_end)
        return sum(max(0.0, min(done, end) - launch) for launch, done in self._span_seconds())

    @property
    def exposed_s(self) -> float:
        return self.comm_s - self.hidden_s

    def index_of(self, kind: str) -> int:
        for i, event in enumerate(self.events):
            if event[0] == kind:
                return i
        return -1

    def launched_buckets(self) -> list[int]:
        return [bucket for kind, bucket, _ in self.events if kind == "launch"]
