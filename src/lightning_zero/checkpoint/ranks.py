"""Rank agreement for checkpoint I/O: object collectives (labelled, no-ops without a process group)
and raising one error on every rank when any rank failed."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch.distributed as dist
from torch.profiler import record_function


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextmanager
def labelled(name: str) -> Iterator[None]:
    with record_function(f"lightning_zero::{name}"):
        yield


def all_gather_object(value: Any, label: str, group: Optional[Any] = None) -> list[Any]:
    """Over ``group`` (``None``: the default group; a group of every rank, as the background saves use)."""
    if not distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    with labelled(label):
        dist.all_gather_object(out, value, group=group)
    return out


def broadcast_object(value: Any, label: str, group: Optional[Any] = None) -> Any:
    if not distributed():
        return value
    box = [value]
    with labelled(label):
        dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def raise_any(errors: list[Optional[str]], kind: type[Exception]) -> None:
    """Raise ``kind`` on every rank if any rank reported an error (after an all-gather)."""
    messages = [error if error.startswith(f"rank {rank}:") else f"rank {rank}: {error}"
                for rank, error in enumerate(errors) if error]  # fmt: skip
    if messages:
        raise kind("; ".join(messages))
