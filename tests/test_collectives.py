"""``lightning_zero.comm.collectives`` on gloo: the reduce-scatter runs as an all-to-all plus a local sum
([Note: reduce-scatter on gloo]): the same result as an all-reduce's chunk, pollable before
``wait()``, counted at the reduce-scatter's logical bytes, in place or not, over the whole world
(dp rank 0 sends only the other chunks, the others all of theirs) and over a pair, in fp32 and
bf16; the all-gather over a pair is an all-to-all ([Note: all-gather on gloo]), in place or not,
pollable, exact, at the all-gather's logical bytes; a wait on any of them blocks in slices that
run out without harm ([Note: sliced waits]) (one 4-rank launch)."""

import time

import pytest
import torch
import torch.distributed as dist

from lightning_zero.comm.collectives import CommCounter, Finishing, all_gather, reduce_scatter
from lightning_zero.zero.waits import Waiter, _blocked_until_done, wire_work
from tests.distributed import run_ranks


def _rank_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(numel, generator=gen) * (1 + rank)).to(dtype)


def _poll_until_completed(work, what: str) -> None:
    """``work`` completes without ``wait()`` (a wait with a time limit can poll it)."""
    deadline = time.monotonic() + 30
    while not work.is_completed():
        assert time.monotonic() < deadline, f"{what} did not complete without wait()"
        time.sleep(1e-3)


def _check_group(group, members: list[int], dtype: torch.dtype) -> None:
    rank = dist.get_rank()
    if rank not in members:
        return
    size, me = len(members), members.index(rank)
    chunk = 1000
    full = _rank_input(rank, size * chunk, dtype)
    # The exact sum in fp64, and the rounding a sum of ``size`` values in ``dtype`` may add: each of
    # the ``size - 1`` additions rounds by at most half an ulp of a partial sum <= sum of |values|.
    exact = full.double()
    dist.all_reduce(exact, group=group)
    magnitude = full.double().abs()
    dist.all_reduce(magnitude, group=group)
    mine = slice(me * chunk, (me + 1) * chunk)
    exact, bound = exact[mine], (size - 1) * torch.finfo(dtype).eps * magnitude[mine] + 1e-30

    def assert_sum(result: torch.Tensor) -> None:
        assert result.dtype == dtype
        error = (result.double() - exact).abs()
        assert (error <= bound).all(), (error / bound).max()

    # Out of place, async: completes without wait() (a wait with a time limit polls it), then
    # wait() sums this rank's chunk.
    counter = CommCounter()
    output = torch.full((chunk,), float("nan"), dtype=dtype)
    work = reduce_scatter(output, full, group, async_op=True, counter=counter, label="rs")
    assert isinstance(work, Finishing)
    _poll_until_completed(work, "the gloo reduce-scatter")
    assert output.isnan().all(), "the sum lands in wait(), not before"
    work.wait()
    assert_sum(output)
    assert counter.bytes == {"rs": (size - 1) / size * full.numel() * full.element_size()}
    assert counter.calls == {"rs": 1}
    before = full.clone()
    assert torch.equal(full, before), "the input is left as it was"

    # In place (stage 1's bucket): this rank's chunk of the input receives the sum; synchronous.
    in_place = full.clone()
    view = in_place[me * chunk : (me + 1) * chunk]
    assert reduce_scatter(view, in_place, group) is None
    assert_sum(view)
    assert torch.equal(in_place[: me * chunk], full[: me * chunk]), "other ranks' chunks untouched"


def _check_all_gather(group, members: list[int], dtype: torch.dtype) -> None:
    rank = dist.get_rank()
    if rank not in members:
        return
    size, me = len(members), members.index(rank)
    chunk = 777
    expected = torch.cat([_rank_input(member, chunk, dtype) for member in members])
    mine = slice(me * chunk, (me + 1) * chunk)

    # Out of place, async, pollable before wait(); counted at (n-1)/n of the output.
    counter = CommCounter()
    output = torch.full((size * chunk,), float("nan"), dtype=dtype)
    source = _rank_input(rank, chunk, dtype)
    work = all_gather(output, source, group, async_op=True, counter=counter, label="ag")
    _poll_until_completed(work, "the gloo all-gather")
    work.wait()
    assert torch.equal(output, expected)
    assert torch.equal(source, _rank_input(rank, chunk, dtype)), "the input is left as it was"
    assert counter.bytes == {"ag": (size - 1) / size * output.numel() * output.element_size()}

    # In place (stages 1-2's parameter buckets): the input is this rank's slot of the output.
    in_place = torch.full((size * chunk,), float("nan"), dtype=dtype)
    in_place[mine] = _rank_input(rank, chunk, dtype)
    assert all_gather(in_place, in_place[mine], group) is None
    assert torch.equal(in_place, expected)


def _body(rank: int, world: int) -> None:
    pair = dist.new_group([1, 2])
    for dtype in (torch.float32, torch.bfloat16):
        _check_group(None, list(range(world)), dtype)
        _check_group(pair, [1, 2], dtype)
        _check_all_gather(None, list(range(world)), dtype)
        _check_all_gather(pair, [1, 2], dtype)
    _check_sliced_waits(pair)
    # A wrong size is refused before anything is sent.
    try:
        reduce_scatter(torch.empty(3), torch.empty(10), None)
    except ValueError as err:
        assert "group size (4)" in str(err)
    else:
        raise AssertionError("a reduce-scatter of 10 elements into 4 x 3 must be refused")


@pytest.mark.slow
def test_gloo_reduce_scatter_and_pair_all_gather_are_pollable_all_to_alls():
    run_ranks(_body, 4, timeout_s=120)


def _check_sliced_waits(pair) -> None:
    """[Note: sliced waits]: gloo's ``wait(timeout)`` on the engine's collectives returns when a
    slice runs out (the work stays intact) and at once when the collective completes."""
    rank = dist.get_rank()
    if rank not in (1, 2):
        return
    me = rank - 1
    source = _rank_input(rank, 2 * 500, torch.float32)
    launches = {
        "reduce-scatter": lambda: reduce_scatter(torch.empty(500), source, pair, async_op=True),
        "all-gather": lambda: all_gather(torch.empty(1000), source[:500], pair, async_op=True),
        "all-reduce": lambda: dist.all_reduce(source.clone(), group=pair, async_op=True),
    }
    for what, launch in launches.items():
        dist.barrier(group=pair)
        if me == 1:
            time.sleep(0.3)  # the peer launches late: rank 1's first slice runs out
        work = launch()
        wire = wire_work(work)
        assert isinstance(wire, dist.Work), (what, type(work))
        if me == 0:
            assert not _blocked_until_done(wire, None), f"{what}: a slice ran out, yet it reported done"
            assert not wire.is_completed(), f"{what}: the timed-out slice completed the work"
        Waiter(timeout_s=30, poll=True).wait(work, lambda what=what: what)
        assert wire.is_completed()
    expected = _rank_input(1, 1000, torch.float32) + _rank_input(2, 1000, torch.float32)
    output = torch.empty(500)
    work = reduce_scatter(output, source, pair, async_op=True)
    Waiter(timeout_s=30, poll=True).wait(work, lambda: "the checked reduce-scatter")
    assert torch.allclose(output, expected[me * 500 : (me + 1) * 500]), "a sliced wait returns the sum"
