"""torch.optim.Muon + AdamW under ZeroStrategy and ZeroFabricStrategy vs Lightning's ddp: stages
1-3, dp 2 and 4, tp, ep, bf16-mixed, resume across dp, tp and stage.

Two launches of ``tests/scripts/muon_parity.py`` (10 steps). What is compared, and why
(docs/optimizers.md, "How close to ddp"):

- ``exact`` cases (no accumulation, no clipping), dp=2: ZeRO's averaged gradients are ddp's bit
  for bit, so 10 Muon steps at stages 1-3 and through the Fabric door end on ddp's losses and
  weights exactly: the owner step is torch's step;
- accumulation 2 (micro batches before the last under no_sync, as ddp runs them) and clipping at
  dp=2: with ``exact_grad_norm`` (clipping's per-parameter norms whole, in torch's order) and, at
  stages 2-3, ``defer_grad_reduce`` (micro batches summed locally, reduced once, as ddp does),
  every gradient is ddp's bit for bit, so 10 steps end on ddp's losses and weights exactly, at
  stages 1-3 and through the Fabric door (``_xnorm`` cases);
- without them (dp 2 and 4, tp=2 x dp=2): ZeRO sums and clips in another order than ddp, so
  gradients differ in their last fp32 bit; Muon's bf16 Newton-Schulz can round that to the
  neighbouring bf16 value, and the weight moves by ``lr`` times one bf16 ulp of the update. Two
  ddp runs at dp 2 and dp 4 differ as much, so the tolerance is ``SPREAD`` times their gap,
  measured in the same launch. A per-shard
  Newton-Schulz (what the owners exist to avoid) misses by the update itself, ``lr`` per step;
- ep=2 MoE: after one step every expert matrix is ddp's up to one bf16 rounding of its update
  (each expert's matrix updated by its owner in the EDP group); after 10 steps within the same
  kind of bound (routing turns ulps into different expert choices, so 5e-2);
- the bytes the engine counts per step equal ``MatrixOwnerOptimizer.planned_bytes()``, and each
  rank holds exactly the momenta of the matrices it owns;
- resume: a checkpoint saved at step 4 and resumed in the same layout reproduces the
  uninterrupted run bit for bit; resumed at another stage, tp or dp it trains on as that
  layout's own run does.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import launch
from tests.ulps import ulp

STEPS = 10
CASES_2 = [
    "ddp_exact", "zero1_exact", "zero2_exact", "zero3_exact", "zero3_offload_exact", "fabric_ddp_exact", "fabric_zero2_exact",
    "fabric_zero3_exact", "ddp", "zero2", "zero1_xnorm", "zero2_defer_xnorm", "zero3_defer_xnorm", "fabric_ddp",
    "fabric_zero3", "fabric_zero3_defer_xnorm", "ddp_bf16", "zero3_bf16",
    "save_zero2", "resume_zero2_from_save_zero2", "resume_zero3_from_save_zero2", "fabric_ddp_exact_reload",
    "fabric_zero3_exact_reload",
]  # fmt: skip
CASES_4 = [
    "ddp_dp4", "zero2_dp4", "zero2_tp2", "ddp_moe", "zero2_defer_xnorm_ep2_moe", "ddp_moe_exact_1step",
    "zero2_ep2_moe_exact_1step", "resume_zero1_tp2_from_save_zero2", "resume_zero3_dp4_from_save_zero2",
]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    where = tmp_path_factory.mktemp("muon")
    launch("muon_parity.py", where, *CASES_2, timeout_s=900, ranks=2)
    launch("muon_parity.py", where, *CASES_4, timeout_s=900, ranks=4)  # resumes the 2-rank checkpoint

    def load(case: str) -> list[dict]:
        ranks = 4 if case in CASES_4 else 2
        return [torch.load(where / f"{case}.rank{r}.pt") for r in range(ranks)]

    load.where = where  # type: ignore[attr-defined]
    return load


def _mean_losses(results: list[dict]) -> list[float]:
    """Each micro batch's loss averaged over the ranks: the global batch's loss, whatever the dp size."""
    return [sum(values) / len(values) for values in zip(*(r["losses"] for r in results))]


def _gaps(reference: list[dict], results: list[dict]) -> tuple[float, float]:
    """(max |loss - reference| per micro batch, max |w - reference|) of a run against a reference
    on any number of ranks (the reference's parameters are whole on its rank 0)."""
    expected_losses, losses = _mean_losses(reference), _mean_losses(results)
    loss = max(abs(a - b) for a, b in zip(expected_losses[-len(losses) :], losses))
    weight = 0.0
    ref = reference[0]["params"]
    for got in results:
        for name, value in got["params"].items():
            weight = max(weight, (value - _expected(ref, got, name)).abs().max().item())
    return loss, weight


def _expected(ref: dict, got: dict, name: str) -> torch.Tensor:
    """The reference's tensor for ``got``'s ``name`` (an EP rank's rows of a stacked expert tensor)."""
    expected, value = ref[name], got["params"][name]
    if expected.shape == value.shape:
        return expected
    stacked = sorted({int(n.split(".")[1]) for n, v in got["params"].items() if v.shape != ref[n].shape})
    offset = got["offsets"][stacked.index(int(name.split(".")[1]))]
    return expected.narrow(0, offset, value.shape[0])


@pytest.mark.parametrize(
    "case, reference",
    [("zero1_exact", "ddp_exact"), ("zero2_exact", "ddp_exact"), ("zero3_exact", "ddp_exact"),
     ("zero3_offload_exact", "ddp_exact"),
     ("fabric_zero2_exact", "fabric_ddp_exact"), ("fabric_zero3_exact", "fabric_ddp_exact")],
)  # fmt: skip
def test_muon_equals_ddp_bit_for_bit_where_the_gradients_do(runs, case, reference):
    assert _gaps(runs(reference), runs(case)) == (0.0, 0.0)


@pytest.mark.parametrize(
    "case, reference",
    [("zero1_xnorm", "ddp"), ("zero2_defer_xnorm", "ddp"), ("zero3_defer_xnorm", "ddp"),
     ("fabric_zero3_defer_xnorm", "fabric_ddp")],
)  # fmt: skip
def test_muon_with_accumulation_and_clipping_equals_ddp_bit_for_bit_in_ddps_order(runs, case, reference):
    # [Note: exact gradient norm] and [Note: deferred gradient reduction]: ddp's sums, ddp's norm
    assert _gaps(runs(reference), runs(case)) == (0.0, 0.0)


@pytest.mark.parametrize(
    "case, reference",
    [("zero2", "ddp"), ("fabric_zero3", "fabric_ddp"), ("zero2_dp4", "ddp_dp4"), ("zero2_tp2", "ddp")],
)  # fmt: skip
def test_muon_with_accumulation_and_clipping_stays_within_bf16_rounding_of_ddp(runs, case, reference):
    loss, weight = _gaps(runs(reference), runs(case))
    print(f"muon {case} vs {reference}: max|loss - ddp| {loss:.3g}, max|w - ddp| {weight:.3g}")
    _assert_within_ddp_spread(runs, loss, weight)


SPREAD = 4  # [Note: tolerances in ulps]: how many ddp-vs-ddp spreads a non-exact layout may part by


def _assert_within_ddp_spread(runs, loss: float, weight: float) -> None:
    """Where ZeRO cannot add in ddp's order (dp=4's reduce-scatter, tp's split matmuls, stage 2
    without ``defer_grad_reduce``), its gradients differ from ddp's in the last bit, and Muon's bf16
    Newton-Schulz turns that into bf16 ulps of the update; so does ddp's own all-reduce order. The
    tolerance is derived from that, measured in the same launch on the same kernels rather than
    written as one machine's number: ``SPREAD`` times the gap between two correct ddp runs whose
    reductions sum in different orders (dp=4 vs dp=2), per quantity. A per-shard Newton-Schulz, a
    missing step or a wrong learning rate parts by ``lr`` per step, an order of magnitude more."""
    spread_loss, spread_weight = _gaps(runs("ddp"), runs("ddp_dp4"))
    assert 0 < spread_weight < 0.1 * 0.02 * STEPS, (spread_loss, spread_weight)  # a tenth of lr a step
    assert loss <= SPREAD * spread_loss and weight <= SPREAD * spread_weight, (loss, weight, spread_loss, spread_weight)


def test_muon_bf16_mixed_stays_near_ddp(runs):
    # ddp keeps fp32 weights under autocast, the engine bf16 weights with fp32 masters: the losses
    # (computed from bf16 activations either way) within 2 bf16 ulps of the loss
    losses = _mean_losses(runs("zero3_bf16"))
    assert all(math.isfinite(value) for value in losses)
    loss, _ = _gaps(runs("ddp_bf16"), runs("zero3_bf16"))
    assert loss <= 2 * ulp(max(losses), torch.bfloat16).item(), loss  # [Note: tolerances in ulps]


def test_muon_experts_stepped_per_matrix_within_the_edp_group(runs):
    # This MoE's gradients differ from ddp's in the last fp32 bit even without accumulation (its
    # AdamW parameters show it after one step), so an expert matrix may see one bf16 rounding flip
    # in its Newton-Schulz input: ~1e-4 at lr 0.02. An expert orthogonalized per shard, or stepped
    # as a 3-D whole, would be off by the update itself (lr * |O| ~ 5e-3).
    ref = runs("ddp_moe_exact_1step")[0]["params"]
    for got in runs("zero2_ep2_moe_exact_1step"):
        stacks = [name for name, value in got["params"].items() if value.shape != ref[name].shape]
        assert stacks, "no expert stack split over ep"
        for name in stacks:
            gap = (got["params"][name] - _expected(ref, got, name)).abs().max().item()
            assert gap < 1e-3, (name, gap)
    loss, weight = _gaps(runs("ddp_moe"), runs("zero2_defer_xnorm_ep2_moe"))
    print(f"muon zero2_defer_xnorm_ep2_moe vs ddp_moe: max|loss - ddp| {loss:.3g}, max|w - ddp| {weight:.3g}")
    assert loss < 1e-3 and weight < 5e-2, (loss, weight)


@pytest.mark.parametrize(
    "case", ["zero2", "zero2_defer_xnorm", "zero2_dp4", "zero2_tp2", "zero2_defer_xnorm_ep2_moe", "zero3_bf16"]
)
def test_muon_bytes_counted_equal_planned_and_state_spread_by_ownership(runs, case):
    results = runs(case)
    for result in results:
        planned, counted = result["planned"], result["counted"]
        for label, per_step in planned.items():
            assert counted.get(label, 0) == STEPS * per_step, (label, counted, planned)
        assert result["state_bytes"] == result["owned_bytes"]
    assert sum(r["planned"]["muon_to_owner"] + r["planned"]["muon_from_owner"] for r in results) > 0
    if "tp2" in case:
        assert all(r["planned"]["muon_tp_gather"] > 0 for r in results)
    # exact_grad_norm: AdamW's cut parameters travel to their norm owners once per clip (one a step)
    assert [r["counted"].get("grad_norm_to_owner", 0) for r in results] == [STEPS * r["norm"] for r in results]
    if "xnorm" in case and "ep2" not in case:
        assert sum(r["norm"] for r in results) > 0, "no AdamW parameter cut between chunks"


def test_muon_resume_in_the_same_layout_is_exact(runs):
    for straight, resumed in zip(runs("save_zero2"), runs("resume_zero2_from_save_zero2")):
        assert straight["losses"][-len(resumed["losses"]) :] == resumed["losses"]
        assert "muon_state_to_owner" in resumed["counted"]  # the momenta went back to their owners
        for name, value in resumed["params"].items():
            assert torch.equal(value, straight["params"][name]), name


@pytest.mark.parametrize(
    "resumed, straight",
    [("resume_zero3_from_save_zero2", "zero2"), ("resume_zero1_tp2_from_save_zero2", "zero2_tp2"),
     ("resume_zero3_dp4_from_save_zero2", "zero2_dp4")],
)  # fmt: skip
def test_muon_resume_across_stage_tp_and_dp(runs, resumed, straight):
    loss, weight = _gaps(runs(straight), runs(resumed))
    _assert_within_ddp_spread(runs, loss, weight)


def test_muon_fabric_full_file_is_ddps_and_loads_back_exactly(runs):
    # state_dict_type="full": torch's own optimizer.state_dict(), the momenta gathered from their owners
    ours, theirs = (
        torch.load(runs.where / f"full_{case}.pt", weights_only=False)
        for case in ("fabric_zero3_exact_reload", "fabric_ddp_exact_reload")
    )
    assert ours["muon"]["param_groups"] == theirs["muon"]["param_groups"]
    assert sorted(ours["muon"]["state"]) == sorted(theirs["muon"]["state"]) != []
    for index, state in theirs["muon"]["state"].items():
        assert torch.equal(ours["muon"]["state"][index]["momentum_buffer"], state["momentum_buffer"]), index
    # a fresh Fabric loads it (the momenta go back to their owners) and trains on as ddp does
    assert _gaps(runs("fabric_ddp_exact"), runs("fabric_zero3_exact_reload")) == (0.0, 0.0)
