"""Offload copies ([Note: offload copies] in zero/offload.py) and where loaded optimizer state goes."""

import pytest
import torch
from torch import nn

from lightning_zero.checkpoint.targets import state_device
from lightning_zero.zero.flat import FlatLayout, FlatParamGroup
from lightning_zero.zero.offload import OffloadCopies


@pytest.mark.parametrize(
    "key, options, expected",
    [
        ("step", {}, "cpu"),  # torch keeps a plain Adam's step on the host
        ("exp_avg", {}, "meta"),  # per-element state goes with the master
        ("step", {"capturable": True}, "meta"),
    ],
)
def test_loaded_state_goes_where_torch_keeps_it(key, options, expected):
    # The meta device stands in for a GPU: a master that is not on the host.
    master = nn.Parameter(torch.empty(4, device="meta"))
    other = nn.Parameter(torch.empty(4, device="meta"))
    optimizer = torch.optim.Adam([{"params": [other]}, {"params": [master], **options}], lr=1e-3)
    assert state_device(optimizer, master, key).type == expected


def _group(offload: bool, dtype: torch.dtype) -> FlatParamGroup:
    params = [nn.Parameter(torch.arange(6.0).view(2, 3)), nn.Parameter(torch.ones(5))]
    layout = FlatLayout(params, ["a", "b"], dp=1, bucket_numel=4)
    return FlatParamGroup(layout, dp_rank=0, compute_dtype=dtype, device=torch.device("cpu"), offload=offload)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_are_copied_once_when_read(dtype):
    group = _group(offload=True, dtype=dtype)
    copies = OffloadCopies(torch.device("cpu"))
    chunks = [torch.full((bucket.shard_numel,), 1.5, dtype=dtype) for bucket in group.layout.buckets]
    for _ in range(3):  # three micro batches hand over their reduced chunks; nothing is copied
        for master, chunk in zip(group.masters, chunks):
            copies.stage(master, chunk)
            chunk.add_(1.0)
    assert copies.counts["device_to_host"] == 0
    assert copies.flush() and not copies.flush()  # the second read finds nothing staged
    assert copies.counts["device_to_host"] == len(group.masters) == len(group.layout.buckets) > 1
    for master, chunk in zip(group.masters, chunks):
        assert master.grad.dtype == torch.float32 and master.grad is not chunk
        torch.testing.assert_close(master.grad, chunk.float())  # the last value, not a stale one
    master = group.masters[0]
    copies.stage(master, chunks[0])
    master.grad = None  # zero_grad(set_to_none=True) before the read: nothing to copy into
    copies.flush()
    assert master.grad is None


def test_updated_masters_go_back_once_per_chunk():
    group = _group(offload=True, dtype=torch.bfloat16)
    copies = OffloadCopies(torch.device("cpu"))
    for master in group.masters:
        master.data.fill_(2.0)
    copies.copy_masters_to_params(group)
    assert copies.counts["host_to_device"] == len(group.masters)
    assert all(bool((group.param_shard(bucket) == 2.0).all()) for bucket in group.layout.buckets)
    copies.before_host_update()  # no CUDA copy pending: returns at once
