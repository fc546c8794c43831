"""A sampler and a data loader that remember how far an epoch got, so a resumed run continues
with the next unseen batch on any number of ranks."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start an epoch part-way through its permutation.

    [Note: data position] Rank ``r`` of ``dp`` takes permutation positions ``r, r + dp, ...``, so
    after ``k`` batches of ``B`` per rank the whole run has consumed exactly the first
    ``k * B * dp`` positions of the epoch's permutation (a prefix). ``start_position`` skips that
    prefix and deals the rest round-robin again, over however many ranks the resumed run has: at
    the same dp the resumed run sees exactly the batches the uninterrupted one would; at another
    dp it sees the same remaining samples of the epoch in the same global order, grouped into
    batches of the new global size. A new epoch starts from position 0.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start_position = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start_position = 0
        super().set_epoch(epoch)

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        if len(order) < self.total_size:  # DistributedSampler pads when not drop_last
            order += order[: self.total_size - len(order)]
        remaining = order[self.start_position : self.total_size]
        per_rank = len(remaining) // self.num_replicas
        return iter(remaining[self.rank : per_rank * self.num_replicas : self.num_replicas])


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` with ``state_dict``/``load_state_dict`` (Lightning saves them in the fit
    loop's checkpoint state) holding the epoch and the global positions consumed so far.

    ``len()`` stays the full epoch's batch count, as Lightning expects from a resumed loader.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._iter_start = 0
        self._yielded = 0

    def __iter__(self):
        sampler = self.sampler
        self._iter_start, self._yielded = sampler.start_position, 0
        for batch in super().__iter__():
            self._yielded += 1
            yield batch
        sampler.start_position = 0

    def __len__(self) -> int:
        sampler = self.sampler
        return (sampler.total_size // sampler.num_replicas) // self.batch_size

    def state_dict(self) -> dict:
        sampler = self.sampler
        consumed = self._iter_start + self._yielded * self.batch_size * sampler.num_replicas
        return {"epoch": sampler.epoch, "consumed": consumed, "seed": sampler.seed, "num_samples": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        sampler = self.sampler
        if state.get("seed") != sampler.seed or state.get("num_samples") != len(self.dataset):
            raise ValueError(
                f"ResumableDataLoader.load_state_dict: the checkpoint's data (seed {state.get('seed')},"
                f" {state.get('num_samples')} samples) is not this loader's (seed {sampler.seed},"
                f" {len(self.dataset)} samples); resume with the same data and seed"
            )
        sampler.epoch = int(state["epoch"])
        sampler.start_position = int(state["consumed"])
        self._iter_start, self._yielded = sampler.start_position, 0
