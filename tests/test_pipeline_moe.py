"""A MoE with a balance loss, a z-loss and DeepSeek's bias update under pipeline parallelism equals
Lightning ddp run on its micro-batches ([Note: MoE pipeline stages] in models/moe/pipeline.py;
tests/scripts/pp_moe_parity.py trains both): pp=2 x ep=2 on 4 ranks, fp32, clipping."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import launch_each, rank_result
from tests.scripts.pp_moe_parity import DDP_ACCUMULATE, PP_ACCUMULATE

RANKS = 4
# one launch: ddp, then 1F1B at ZeRO-1 and the zero-bubble ZBV at ZeRO-2 (the script runs every schedule)
CASES = ["ddp", "pp2ep2_1f1b_zero1", "pp2ep2_zbv_zero2"]


def joined(results, case: str) -> tuple[torch.Tensor, dict]:
    """Per-batch losses, the mean over the ranks (ddp's 4 batches of one sequence: two pp batches'
    micro-batches, so ddp's are averaged in pairs), and every parameter and router bias (each pp
    rank holds its stage's; its 2 ep ranks consecutive halves of each expert stack)."""
    ranks = [rank_result(results, case, rank) for rank in range(RANKS)]
    # what Lightning hands on_train_batch_end: the loss divided by accumulate_grad_batches
    accumulate = DDP_ACCUMULATE if case.startswith("ddp") else PP_ACCUMULATE
    losses = torch.tensor([result["losses"] for result in ranks]).mean(0) * accumulate
    if case.startswith("ddp"):
        return losses.view(-1, 2).mean(1), ranks[0]["params"]
    params: dict = {}
    for result in ranks:
        params.update(result["params"])
    for name in [name for name in params if ".experts." in name]:
        params[name] = torch.cat([result["params"][name] for result in ranks if name in result["params"]])
    return losses, params


def gaps(results, case: str) -> tuple[float, float]:
    """``(max |loss - ddp|, max |w - ddp|)`` of ``case`` (``_cap`` cases against ddp with the capacity factor)."""
    losses, params = joined(results, case)
    want_losses, want_params = joined(results, "ddp_cap" if case.endswith("_cap") else "ddp")
    assert losses.shape == want_losses.shape == (8,) and set(params) == set(want_params)
    weights = max(float((params[name] - value).abs().max()) for name, value in want_params.items())
    return float((losses - want_losses).abs().max()), weights


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return launch_each("pp_moe_parity.py", tmp_path_factory.mktemp("pp_moe"), [(RANKS, CASES)], timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES[1:])
def test_a_pipelined_moe_with_its_balancing_terms_equals_ddp_on_its_microbatches(trained, case):
    loss_gap, weight_gap = gaps(trained, case)
    assert loss_gap <= 1e-5 and weight_gap <= 1e-5, (loss_gap, weight_gap)
    params = joined(trained, case)[1]
    biases = [params[name] for name in params if name.endswith("router.bias")]  # compared above, as parameters
    assert len(biases) == 3 and any(bias.abs().sum() > 0 for bias in biases)  # the bias update moved them


def monitor_sums(results, case: str) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """What the expert-load monitor read over the run (``take_moe_stats`` after each batch, summed):
    assignments per (MoE layer, expert) summed over every rank, by layer index, and ``(balance, z)``
    (each batch's: summed over the rank's layers, averaged over its forwards) summed over the
    batches, then summed over the stages' ranks under pp and averaged over ddp's ranks (both: the
    64 micro-batches' terms over every layer, divided by 4)."""
    ranks = [rank_result(results, case, rank) for rank in range(RANKS)]
    loads: dict[int, torch.Tensor] = {}
    for result in ranks:
        load, _ = result["moe_stats"]
        for row, layer in enumerate(result["layers"]):
            loads[layer] = loads.get(layer, 0) + load[row]
    aux = torch.stack([result["moe_stats"][1] for result in ranks]).sum(0)
    return loads, aux / RANKS if case.startswith("ddp") else aux


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES[1:])
def test_the_expert_load_monitor_counts_every_stage_as_ddp(trained, case):
    loads, aux = monitor_sums(trained, case)
    want_loads, want_aux = monitor_sums(trained, "ddp")
    assert sorted(loads) == sorted(want_loads) == [1, 2, 3]
    for layer, load in want_loads.items():
        assert torch.equal(loads[layer], load), layer  # counts: exact
    torch.testing.assert_close(aux, want_aux, rtol=0, atol=1e-5)
