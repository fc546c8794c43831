"""The pipeline layout: how many stages, which decoder blocks each holds, which stages a pp rank runs.

Pure arithmetic (no torch), so the planner and both doors check a layout before any process group
exists, with one rule each.

[Note: pipeline stages] The decoder splits into ``num_stages = pp * stages_per_rank`` consecutive
stages. Stage 0 also holds the embeddings, the last stage the final norm, the head and the loss.
Which stages a pp rank runs is the schedule's rule, as torch's schedules expect it:

- ``gpipe``, ``1f1b``: one stage per rank; rank ``r`` runs stage ``r``.
- ``interleaved_1f1b``, ``interleaved_zb``: ``virtual_stages`` per rank, round robin (Megatron's
  interleaving): rank ``r`` runs stages ``r, r + pp, r + 2 pp, ...``.
- ``zbv``: two stages per rank in a V: rank ``r`` runs stages ``r`` and ``2 pp - 1 - r`` (the
  first and the last stage live on rank 0, so the loss is computed where the embeddings are).

Split points: ``pp_layers`` (blocks per stage, given by hand) or :func:`balanced_split`, which
minimizes the costliest stage given each block's cost and what the first and last stage carry on
top (the embedding lookup, the head and its loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_zero.config import PP_SCHEDULES

SCHEDULES = PP_SCHEDULES
"""Every schedule name ``pp_schedule`` accepts (each is one of torch's: :data:`TORCH_SCHEDULES`)."""

TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
"""Our name -> the class in ``torch.distributed.pipelining`` that runs it."""

MULTI_STAGE = ("interleaved_1f1b", "interleaved_zb", "zbv")
"""Schedules that run more than one stage per rank."""

SPLIT_BACKWARD = ("interleaved_zb", "zbv")
"""Schedules that split each backward into its input-gradient (``I``) and weight-gradient (``W``) parts."""


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """Stages one pp rank runs under ``schedule`` (``zbv`` always 2; single-stage schedules 1)."""
    if schedule == "zbv":
        return 2
    return virtual_stages if schedule in MULTI_STAGE else 1


def balanced_split(
    block_costs: Sequence[float], num_stages: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> tuple[int, ...]:
    """Blocks per stage (each >= 1) minimizing the costliest stage, where stage 0 also carries
    ``first_extra`` and the last stage ``last_extra`` (in the blocks' unit).

    >>> balanced_split([1.0] * 8, 2)
    (4, 4)
    >>> balanced_split([1.0] * 8, 2, last_extra=2.0)
    (5, 3)
    """
    n = len(block_costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"balanced_split: {num_stages} stages need 1 <= stages <= blocks ({n})")
    # filled from the last stage back: ties leave the first stage the lightest (under 1F1B it keeps
    # the most micro-batches in flight)
    costs = [float(cost) for cost in reversed(block_costs)]

    def fill(limit: float) -> Optional[list[int]]:
        """From the last stage back, each takes as many blocks as keep it within ``limit`` while
        leaving one for every stage before it; ``None`` if some stage cannot. Taking the most late
        leaves the least to the first stage (which carries ``first_extra``): if any split fits
        ``limit``, this one does."""
        counts, start = [], 0
        for stage in range(num_stages):
            extra = (last_extra if stage == 0 else 0.0) + (first_extra if stage == num_stages - 1 else 0.0)
            stop = n - (num_stages - 1 - stage)  # leave a block for each later stage
            if stage == num_stages - 1:
                end = n
            else:
                end, load = start, extra
                while end < stop and load + costs[end] <= limit * (1 + 1e-12):
                    load, end = load + costs[end], end + 1
                end = max(end, start + 1)
            if extra + sum(costs[start:end]) > limit * (1 + 1e-12):
                return None
            counts.append(end - start)
            start = end
        return counts

    # the least feasible limit, by bisection between the largest single stage and everything on one
    low = max(costs) if costs else 0.0
    high = sum(costs) + first_extra + last_extra
    for _ in range(100):
        if high - low <= 1e-12 * max(high, 1.0):
            break
        middle = (low + high) / 2
        if fill(middle) is None:
            low = middle
        else:
            high = middle
    split = fill(high)
    assert split is not None  # high starts feasible and only moves to feasible limits
    return tuple(reversed(split))


@dataclass(frozen=True)
class PipelineLayout:
    """A checked pipeline split of an ``n_layers``-block decoder over ``pp`` ranks.

    Args:
        pp: pipeline-parallel ranks (the outermost mesh dimension: ``world = pp * dp * cp * tp``).
        schedule: one of :data:`SCHEDULES`.
        n_layers: decoder blocks of the model.
        microbatches: micro-batches one optimizer step's batch is cut into (each a forward and a
            backward through every stage).
        virtual_stages: stages per rank for the interleaved schedules (``zbv``: 2; others: 1).
        pp_layers: blocks per stage by hand (``num_stages`` entries, each >= 1, summing to
            ``n_layers``), or ``None`` for an even split (the planner passes a costed one).
    """

    pp: int
    schedule: str
    n_layers: int
    microbatches: int
    virtual_stages: int = 1
    pp_layers: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        for name in ("pp", "n_layers", "microbatches", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipelineLayout: {name} must be a positive int, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule={self.schedule!r} is not a schedule; pick one of {SCHEDULES}")
        if self.schedule in ("interleaved_1f1b", "interleaved_zb") and self.virtual_stages < 2:
            raise ValueError(
                f"pp_schedule={self.schedule!r} runs several stages per rank: set pp_virtual_stages >= 2 "
                f"(got {self.virtual_stages}), or use pp_schedule='1f1b'"
            )
        if self.schedule in ("gpipe", "1f1b") and self.virtual_stages != 1:
            raise ValueError(
                f"pp_schedule={self.schedule!r} runs one stage per rank, so pp_virtual_stages must be 1 "
                f"(got {self.virtual_stages}); for {self.virtual_stages} stages per rank use 'interleaved_1f1b'"
            )
        if self.schedule == "zbv" and self.virtual_stages not in (1, 2):
            raise ValueError(
                f"pp_schedule='zbv' runs exactly 2 stages per rank (a V); got pp_virtual_stages={self.virtual_stages}"
            )
        stages = self.num_stages
        if stages > self.n_layers:
            raise ValueError(
                f"pp({self.pp}) x stages per rank({self.local_stages}) = {stages} stages, but the model has "
                f"{self.n_layers} blocks: every stage needs at least one; lower pp or pp_virtual_stages"
            )
        if self.pp_layers is not None:
            layers = tuple(self.pp_layers)
            if len(layers) != stages or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers):
                raise ValueError(
                    f"pp_layers={list(layers)} must give {stages} positive block counts (one per stage: "
                    f"pp({self.pp}) x stages per rank({self.local_stages}))"
                )
            if sum(layers) != self.n_layers:
                raise ValueError(
                    f"pp_layers={list(layers)} sums to {sum(layers)}, but the model has {self.n_layers} blocks"
                )
            object.__setattr__(self, "pp_layers", layers)
        self._check_microbatches()

    def _check_microbatches(self) -> None:
        m, pp = self.microbatches, self.pp
        if self.schedule == "1f1b" and m < pp:
            raise ValueError(
                f"pp_schedule='1f1b' needs at least pp({pp}) micro-batches per step, got {m}: raise the batch's "
                f"micro-batch count (pp_microbatches) or use 'gpipe'"
            )
        if self.schedule in ("interleaved_1f1b", "interleaved_zb"):
            rounds = max(1, m // pp)
            if m % rounds != 0:
                raise ValueError(
                    f"pp_schedule={self.schedule!r} cuts {m} micro-batches into rounds of pp({pp}): {m} is not a "
                    f"multiple of {rounds} rounds; use a multiple of pp (e.g. {rounds * pp})"
                )
        if self.schedule == "zbv" and m < self.num_stages:
            raise ValueError(f"pp_schedule='zbv' needs at least {self.num_stages} micro-batches (2 x pp), got {m}")

    @property
    def local_stages(self) -> int:
        return stages_per_rank(self.schedule, self.virtual_stages)

    @property
    def num_stages(self) -> int:
        return self.pp * self.local_stages

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        """Blocks of each stage: ``pp_layers``, or as even as possible (the remainder to the middle
        stages, which carry neither the embeddings nor the head)."""
        if self.pp_layers is not None:
            return self.pp_layers
        stages = self.num_stages
        base, extra = divmod(self.n_layers, stages)
        counts = [base] * stages
        middle = list(range(1, stages - 1)) or list(range(stages))
        for i in range(extra):
            counts[middle[i % len(middle)]] += 1
        return tuple(counts)

    def stage_blocks(self, stage: int) -> range:
        """The decoder blocks (their indices in the full model) stage ``stage`` holds."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} outside 0..{self.num_stages - 1}")
        counts = self.layers_per_stage
        start = sum(counts[:stage])
        return range(start, start + counts[stage])

    def rank_stages(self, pp_rank: int) -> tuple[int, ...]:
        """The stages pp rank ``pp_rank`` runs, in torch's order ([Note: pipeline stages])."""
        if not 0 <= pp_rank < self.pp:
            raise ValueError(f"pp rank {pp_rank} outside 0..{self.pp - 1}")
        if self.schedule == "zbv":
            return (pp_rank, 2 * self.pp - 1 - pp_rank)
        return tuple(pp_rank + k * self.pp for k in range(self.local_stages))

    def stage_rank(self, stage: int) -> int:
        """The pp rank that runs ``stage`` (the inverse of :meth:`rank_stages`)."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} outside 0..{self.num_stages - 1}")
        if self.schedule == "zbv":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp
