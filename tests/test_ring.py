"""[Note: ring bytes]: the one formula the counter, the planner, calibration and benchmarks share."""

import pytest

from lightning_zero.comm.ring import ring_sent, ring_steps


@pytest.mark.parametrize(
    ("kind", "ranks", "sent", "steps"),
    [
        ("all_reduce", 8, 2 * 7 / 8 * 1024, 14),
        ("reduce_scatter", 8, 7 / 8 * 1024, 7),
        ("all_gather", 4, 3 / 4 * 1024, 3),
        ("all_to_all", 2, 512, 1),
        ("broadcast", 2, 512, 1),
        ("all_gather", 1, 0, 0),  # a group of one sends nothing
    ],
)
def test_ring_sent_and_steps(kind, ranks, sent, steps):
    assert ring_sent(kind, 1024, ranks) == sent
    assert ring_steps(kind, ranks) == steps


def test_ring_sent_is_exact_for_integer_payloads():
    # payload x (n-1) first, then / n: the counter's byte counts stay exact integers where they divide
    assert ring_sent("all_reduce", 3 * 2**40, 3) == 4 * 2**40
    assert ring_sent("reduce_scatter", 6 * 10**15 + 3, 3) == 4 * 10**15 + 2


def test_unknown_kind_names_the_choices():
    with pytest.raises(ValueError, match="all_reduce"):
        ring_sent("gather", 1024, 2)
