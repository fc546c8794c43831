"""The one place the Fabric door reaches into litdata (tests/test_litgpt_parallel.py fails when
litdata moves it).

[Note: litdata's ranks] A litdata ``StreamingDataset`` (LitGPT's ``TextFiles``, ``TinyLlama``,
...) splits its items over the processes it finds when it is built: ``_DistributedEnv.detect()``
reads ``torch.distributed``'s world size and rank into its ``distributed_env`` attribute, and
Fabric's sampler does not reach an iterable dataset. Under context (or tensor) parallelism the
ranks of one dp index must read the *same* items, so the door sets ``distributed_env`` to the dp
layout at ``fabric.setup_dataloaders`` (``ZeroFabricStrategy.process_dataloader``), before the
first iteration reads it. litdata has no public argument for it; the attribute and its class are
checked here, and a dataset that has neither is refused rather than left to feed the cp ranks
different tokens.
"""

from __future__ import annotations

from typing import Any


def split_streaming_over_dp(dataloader: Any, *, dp_size: int, dp_rank: int, num_nodes: int) -> None:
    """[Note: litdata's ranks]: a ``StreamingDataset`` behind ``dataloader`` reads dp rank
    ``dp_rank``'s items of ``dp_size``; any other dataloader is left as it is."""
    dataset = getattr(dataloader, "dataset", None)
    if type(dataset).__module__.split(".")[0] != "litdata":
        return
    from litdata.utilities.env import _DistributedEnv

    if not isinstance(getattr(dataset, "distributed_env", None), _DistributedEnv):
        raise RuntimeError(
            f"lightning_zero: {type(dataset).__name__} (litdata) has no distributed_env to split over the dp ranks"
            " ([Note: litdata's ranks] in fabric/_litdata_compat.py); this litdata version is not supported with"
            " cp > 1 or tp > 1"
        )
    dataset.distributed_env = _DistributedEnv(world_size=dp_size, global_rank=dp_rank, num_nodes=num_nodes)
