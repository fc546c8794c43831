"""The sync timeline's clock: host seconds on CPU, CUDA events on CUDA ([Note: device clock])."""

import time

import pytest
import torch

from lightning_zero.zero.timeline import DeviceClock, SyncTimeline


def test_cpu_timeline_measures_host_time_and_splits_hidden_from_exposed():
    timeline = SyncTimeline(clock=DeviceClock(torch.device("cpu")))
    assert not timeline.clock.uses_events
    launch = timeline.mark()
    time.sleep(0.05)
    timeline.add("backward_end", -1)  # 50 ms of the span before backward's end: hidden
    time.sleep(0.03)
    timeline.spans.append((launch, timeline.mark()))  # 30 ms after it: exposed
    assert timeline.comm_s == pytest.approx(0.08, abs=0.02)
    assert timeline.hidden_s == pytest.approx(0.05, abs=0.015)
    assert timeline.exposed_s == pytest.approx(0.03, abs=0.015)
    timeline.clear()
    assert timeline.comm_s == 0.0 and timeline.hidden_s == 0.0 and timeline.backward_end is None


@pytest.mark.gpu
def test_cuda_timeline_measures_device_time_not_host_time():
    """Kernels queued between marks take device time the host never waits for: events see it."""
    device = torch.device("cuda")
    timeline = SyncTimeline(clock=DeviceClock(device))
    assert timeline.clock.uses_events
    torch.cuda.synchronize()
    cycles = int(torch.cuda.get_device_properties(device).clock_rate * 1e3 * 0.05)  # ~50 ms of spinning
    launch = timeline.mark()
    host_start = time.perf_counter()
    torch.cuda._sleep(cycles)
    timeline.add("backward_end", -1)
    torch.cuda._sleep(cycles)
    done = timeline.mark()
    host_queued_s = time.perf_counter() - host_start
    timeline.spans.append((launch, done))
    assert isinstance(launch, torch.cuda.Event)
    assert timeline.comm_s > 0.05 and timeline.comm_s > 5 * host_queued_s
    assert timeline.hidden_s == pytest.approx(timeline.comm_s / 2, rel=0.3)
    assert timeline.exposed_s == pytest.approx(timeline.comm_s / 2, rel=0.3)


def test_snapshot_keeps_a_step_after_the_next_backward_clears():
    """The monitor reads the previous step's snapshot on CUDA (issue 46, item 6): the next
    backward's clear must leave it, spans, backward end and clock origin, as it was."""
    from lightning_zero.zero.timeline import SyncTimeline

    timeline = SyncTimeline()
    timeline.add("launch", 0)
    start = timeline.mark()
    timeline.add("backward_end", -1)
    timeline.spans.append((start, timeline.mark()))
    before = (timeline.comm_s, timeline.hidden_s, timeline.launched_buckets())
    snapshot = timeline.snapshot()
    timeline.clear()
    timeline.add("launch", 1)
    assert (snapshot.comm_s, snapshot.hidden_s, snapshot.launched_buckets()) == before
    assert timeline.comm_s == 0.0 and timeline.launched_buckets() == [1]
