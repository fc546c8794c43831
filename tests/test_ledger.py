import pytest

from lightning_zero.ledger import model_state_bytes

P = 7_500_000_000


@pytest.mark.parametrize(
    "stage, expected_gb",
    # The ZeRO paper, Figure 1: Psi = 7.5B, Nd = 64, K = 12.
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)],
)
def test_paper_figure_1(stage, expected_gb):
    total = model_state_bytes(P, stage=stage, dp=64).total
    assert round(total / 1e9, 1) == pytest.approx(expected_gb, abs=0.05)


def test_exact_terms_stage2():
    got = model_state_bytes(1000, stage=2, dp=4)
    assert (got.params, got.grads, got.optimizer) == (2000, 500, 3000)
    assert got["total"] == 5500


def test_fp32_adam_stage1():
    got = model_state_bytes(1024, stage=1, dp=2, param_bytes=4, grad_bytes=4, optim_bytes_per_param=8)
    assert got.as_dict() == {"params": 4096, "grads": 4096, "optimizer": 4096, "total": 12288}


@pytest.mark.parametrize("kwargs, match", [({"stage": 4, "dp": 2}, "stage"), ({"stage": 1, "dp": 0}, "dp")])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        model_state_bytes(10, **kwargs)
