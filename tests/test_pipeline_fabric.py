"""The Fabric door's ``pipeline_step`` runs what the Trainer door runs under pp (docs/pipeline.md,
"Under Fabric"): one 4-rank launch of tests/scripts/fabric_pp.py's hand loop (fp32, accumulation 2
under ``no_backward_sync``, ``fabric.clip_gradients``, AdamW, 3 steps) against the same loop on the
whole model in one process:

- pp=2 x tp=2 with sequence parallelism (a ``Llama``): each tp rank runs its sequence shard through
  its tp slice of the stage, the last stage's vocab-parallel loss; and without sequence parallelism;
- pp=2 x cp=2 (a ``Llama``): the loop cuts each batch (``context_slice``), each stage's attention
  runs over its cp group, the loss is the global token mean;
- pp=2 x ep=2 (a ``MoETransformer`` with a balance loss, a z-loss and the selection-bias update):
  each stage's experts split over its ep ranks, the terms per micro-batch ([Note: MoE pipeline
  stages]), so the reference loop runs the whole model over the same micro-batches; and the same
  MoE at pp=2 x tp=2 with sequence parallelism.
"""

import pytest
import torch

from tests.distributed import launch, rank_result

RANKS = 4
CASES = [
    "tp2-1f1b-zero1",
    "tp2nosp-zbv-zero2",
    "cp2-zbv-zero2",
    "moe-zbv-zero2",
    "moetp2-1f1b-zero1",
]  # more by hand: docs/pipeline.md


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_fabric")
    launch("fabric_pp.py", out, RANKS, *CASES, timeout_s=300, ranks=RANKS)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_fabric_pipeline_step_with_tp_or_ep_inside_the_stages_equals_one_process(trained, case):
    """Losses (the mean over the ranks: tp ranks report the same, dp ranks their rows'), every
    trained parameter (whole: tp slices are served joined; each ep rank's experts against its rows
    of the whole model's) and a forward-only evaluation equal the whole model's loop to 1e-5."""
    ranks = [rank_result(trained, case, rank) for rank in range(RANKS)]
    losses = torch.tensor([result["losses"] for result in ranks]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ranks[0]["want"]), rtol=0, atol=1e-5)
    names = {name for result in ranks for name in result["gaps"]}
    assert names == set(ranks[0]["names"]), case  # every parameter of the whole model, on some rank
    for result in ranks:
        assert max(result["gaps"].values()) < 1e-5, (case, result["gaps"])
    evaluated = sum(result["eval"][0] for result in ranks) / RANKS
    assert abs(evaluated - ranks[0]["eval"][1]) < 1e-5, case
