"""tests/ulps.py, the suite's one way to state a bf16 or fp16 tolerance ([Note: tolerances in ulps])."""

import pytest
import torch

from tests.ulps import adam_ulps, assert_close_ulps, ulp, ulps_apart


def test_ulp_is_the_spacing_of_the_dtype_at_each_value():
    assert ulp([1.0, 1.5, 0.06, 5.0], torch.bfloat16).tolist() == [2**-7, 2**-7, 2**-12, 2**-5]
    assert ulp(1.0, torch.float16).item() == 2**-10 and ulp(1.0, torch.float32).item() == 2**-23
    assert ulp(0.0, torch.bfloat16).item() == torch.finfo(torch.bfloat16).tiny * 2**-7
    one = torch.tensor(1.0, dtype=torch.bfloat16)  # the next bf16 after 1.0 is one ulp up
    assert torch.nextafter(one, torch.tensor(2.0, dtype=torch.bfloat16)).item() - 1.0 == ulp(1.0, torch.bfloat16)


def test_assert_close_ulps_counts_in_the_expected_values_ulps():
    assert_close_ulps([1.0 + 2**-7, 4.0], [1.0, 4.0], 1, torch.bfloat16)
    with pytest.raises(AssertionError, match=r"2 ulps of torch.bfloat16 apart \(each\), allowed 1"):
        assert_close_ulps([1.0 + 2**-6], [1.0], 1, torch.bfloat16)
    # magnitude="max": the ulp of the largest expected value, for values passing through zero
    assert ulps_apart([1e-3, 0.06], [0.0, 0.06], torch.bfloat16, magnitude="max") == pytest.approx(1e-3 / 2**-12)
    assert ulps_apart([1e-3], [0.0], torch.bfloat16) > 1e30
    assert ulps_apart([0.01, 0.5], [0.0, 0.5], torch.bfloat16, magnitude=1.0) == pytest.approx(0.01 / 2**-7)
    assert_close_ulps([float("nan"), float("inf")], [float("nan"), float("inf")], 0, torch.float16)
    with pytest.raises(AssertionError, match="inf ulps"):
        assert_close_ulps([float("inf")], [1.0], 1e9, torch.float16)


def test_adam_ulps_is_two_learning_rates_a_step_plus_the_roundings():
    # 4 steps at lr 1e-2 in ulps of 0.06 (2**-12 in bf16), plus one rounding a step
    assert adam_ulps([0.06, -0.01], torch.bfloat16, lr_sum=4e-2, rounds=4) == pytest.approx(8e-2 / 2**-12 + 4)
