"""Tensor parallelism under the Fabric door at pp=1, with the optimizer built before ``fabric.setup(model,
optimizer)`` (Fabric's usual order): the split layers hold new Parameters, and the optimizer must step
them ([Note: optimizers built before the split] in runtime/parallelize.py). Before, the setup refused
the optimizer's tensors as "not parameters of the set-up model". One 2-rank launch
(tests/scripts/fabric_tp.py) against the same loop on the whole model in one process."""

import pytest
import torch

from tests.distributed import launch

CASES = ["zero1-sp", "zero2-nosp", "zero3-sp"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric_tp")
    launch("fabric_tp.py", out, *CASES, timeout_s=300)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_fabric_tp_with_the_optimizer_built_before_setup_trains_like_one_process(trained, case):
    for rank in range(2):
        result = torch.load(trained / f"{case}.rank{rank}.pt", weights_only=False)
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["want"]), rtol=0, atol=1e-5)
        assert len(result["gaps"]) == 21  # every parameter of the 2-block model, whole
        assert max(result["gaps"].values()) < 1e-5, result["gaps"]
        assert result["moved"] > 1e-2  # the run trained: a stale optimizer would leave this near 0
