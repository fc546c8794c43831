"""Tolerances in ulps of the values compared, the one way the suite states a bf16 or fp16 tolerance.

[Note: tolerances in ulps] Two runs that round in low precision differ by roundings, and a rounding
moves a value by at most half a unit in its last place (ulp): at most 2**-8 of it in bf16, 2**-11
in fp16. A tolerance written as an absolute number (``atol=1e-6``) is one machine's observed gap: CPUs
without native bf16 (AMD EPYC before Zen 4, any AVX2-only x86) run other kernels, which sum in
another order, and the gap moves by orders of magnitude while staying a fraction of an ulp. A
tolerance stated in ulps of the compared values in the dtype that rounded them holds wherever that
dtype rounds the same way (IEEE round-to-nearest-even), and each table says why its count is what
the computation allows.

``magnitude="each"`` takes the ulp of each expected value; ``magnitude="max"`` the ulp of the
tensor's largest ``|expected|``, for values reached by sums and differences of operands of that size
(a trained weight that passes through zero carries the error of the updates that moved it, not an
ulp of its own tiny value); a number ``m`` the ulp at ``m``.

Weights trained by Adam in two runs that round differently part by more than roundings: a gradient
near zero whose last bits differ can turn Adam's normalized step the other way, ``2 lr`` whatever the
weight's size. :func:`adam_ulps` counts that bound in ulps of a tensor's largest weight; it catches a
missing or extra step and a wrong learning rate, and the losses (in ulps of each loss) catch the rest.
"""

from __future__ import annotations

import json
import os
from typing import Sequence, Union

import torch

Values = Union[torch.Tensor, Sequence[float], float]
Magnitude = Union[str, float]


def ulp(values: Values, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each ``|value|`` (float64): ``eps * 2**floor(log2|value|)`` for a
    normal value, the subnormal spacing below ``dtype``'s smallest normal."""
    info = torch.finfo(dtype)
    magnitude = torch.as_tensor(values, dtype=torch.float64).abs().clamp_min(info.tiny)
    return info.eps * torch.exp2(torch.floor(torch.log2(magnitude)))


def adam_ulps(expected: Values, dtype: torch.dtype, *, lr_sum: float, rounds: int = 0) -> float:
    """How far two runs' Adam-trained weights may part, in ulps of ``expected``'s largest ``|value|`` in
    ``dtype`` (use with ``magnitude="max"``): each step turned the other way moves a weight by at most
    ``2 lr`` (Adam's and AdamW's normalized step stays within ``lr`` for ``beta1**2 < beta2`` in the
    first steps), so ``2 * lr_sum`` over the steps' learning rates, plus ``rounds`` roundings of a
    weight held in ``dtype`` itself (bf16-true: one a step, each at most 1 ulp apart)."""
    largest = torch.as_tensor(expected, dtype=torch.float64).abs().max()
    return float(2 * lr_sum / ulp(largest, dtype)) + rounds


def ulps_apart(actual: Values, expected: Values, dtype: torch.dtype, *, magnitude: Magnitude = "each") -> float:
    """The largest ``|actual - expected|`` in ulps of ``expected`` in ``dtype`` (see :func:`assert_close_ulps`)."""
    got = torch.as_tensor(actual, dtype=torch.float64)
    want = torch.as_tensor(expected, dtype=torch.float64)
    if got.shape != want.shape:
        raise AssertionError(f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
    if want.numel() == 0:
        return 0.0
    if magnitude == "each":
        unit = ulp(want, dtype)
    elif magnitude == "max":
        unit = ulp(want.abs().max(), dtype)
    elif isinstance(magnitude, (int, float)) and not isinstance(magnitude, bool) and magnitude > 0:
        unit = ulp(magnitude, dtype)
    else:
        raise ValueError(f"magnitude={magnitude!r}: 'each', 'max' or a positive number")
    finite = got.isfinite() & want.isfinite()
    if not torch.equal(got[~finite].nan_to_num(), want[~finite].nan_to_num()):
        return float("inf")  # an inf or nan where the other has another value
    apart = torch.where(finite, (got - want).abs() / unit, torch.zeros_like(unit))
    return float(apart.max())


def assert_close_ulps(
    actual: Values, expected: Values, ulps: float, dtype: torch.dtype, *, magnitude: Magnitude = "each", msg: str = ""
) -> None:
    """``|actual - expected| <= ulps`` ulps of ``expected`` in ``dtype`` ([Note: tolerances in ulps]),
    elementwise; ``ulps=0`` asks for equality."""
    apart = ulps_apart(actual, expected, dtype, magnitude=magnitude)
    report = os.environ.get("LZ_ULPS_REPORT")  # a file: one JSON line per comparison, to tabulate the margins
    if report:
        with open(report, "a") as out:
            line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "msg": msg, "apart": apart,
                    "allowed": ulps, "dtype": str(dtype), "magnitude": magnitude}  # fmt: skip
            out.write(json.dumps(line) + "\n")
    if not apart <= ulps:
        got, want = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
        worst = float((got - want).abs().max()) if got.numel() else 0.0
        raise AssertionError(
            f"{msg + ': ' if msg else ''}{apart:.3g} ulps of {dtype} apart ({magnitude}), allowed {ulps} "
            f"(max |diff| {worst:.3g})"
        )
