"""The order of a recorded stage-3 schedule as plain arithmetic: which entries stay gathered from
their forward ([Note: held into backward] in ``schedule.py``) and the most elements gathered at
once. No torch: the engine's schedule and the planner (``planner/workload.py``) share it.

[Note: gathered working set] Besides its shards, a rank holds the units in flight: on reaching an
entry of the recorded schedule it has that entry's unit gathered and starts the all-gathers of the
next ``prefetch_blocks`` entries (a held entry gathers nothing but counts against that window); a
unit is freed after its forward (unless held into its backward) and after its backward, before the
next entry is reached (its post-backward function runs before the hook on its input's producer).
:func:`gathered_high_water` walks a schedule that way and returns the most elements gathered at
once; the root unit (a tied embedding) is gathered beside them for the whole step. For a decoder
that is ``(prefetch_blocks + 1)`` blocks in the middle of the model, but at its ends the embedding
or the head with ``prefetch_blocks`` blocks: a 0.44B Llama with a 49M-element embedding and
35M-element blocks holds 84M elements at ``prefetch_blocks=1``, not twice its largest unit. The
planner's "stage-3 gathered blocks" row is this function of its own order
(``planner/workload.gathered_numel``), and the engine measures the same
(``Stage3Runtime.high_water_numel``).
"""

from __future__ import annotations


def held_entries(order: list[int], in_backward: list[bool]) -> list[bool]:
    """Per entry of a recorded schedule (unit indices, and whether each was gathered for a
    backward): True where the unit stays gathered from the forward entry just before it, so the
    entry issues no all-gather ([Note: held into backward]). The planner asks the same of its
    model's forward/backward order."""
    return [
        position > 0
        and in_backward[position]
        and not in_backward[position - 1]
        and order[position] == order[position - 1]
        for position in range(len(order))
    ]


def gathered_high_water(order: list[int], in_backward: list[bool], numel: dict[int, int], prefetch: int) -> int:
    """Most elements of non-root units gathered at once on a rank that follows the recorded
    schedule ``order`` / ``in_backward`` entry by entry ([Note: gathered working set]);
    ``numel``: each non-root unit's gathered elements (the root, recorded as the first entry and
    gathered for the whole step, is left out); ``prefetch``: ``prefetch_blocks``. The planner's
    "stage-3 gathered blocks" row is this (plus the root), the engine's
    ``Stage3Runtime.high_water_numel`` measures it."""
    held = held_entries(order, in_backward)
    gathered: set[int] = set()
    total = most = 0  # total: the elements of ``gathered``, kept as a running sum (a search walks many orders)

    def gather(unit: int) -> None:
        nonlocal total
        if unit not in gathered:
            gathered.add(unit)
            total += numel.get(unit, 0)

    for position, unit in enumerate(order):
        gather(unit)
        for ahead in range(position + 1, min(position + 1 + prefetch, len(order))):
            if not held[ahead]:
                gather(order[ahead])
        most = max(most, total)
        keep = position + 1 < len(order) and held[position + 1]  # stays gathered into its backward
        if not keep:
            gathered.discard(unit)
            total -= numel.get(unit, 0)
    return most
