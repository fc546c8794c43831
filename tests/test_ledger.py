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


# Llama 3 memory per rank, by hand (bf16-mixed: 2-byte params and grads, fp32 master 4 + Adam
# moments 8 per element of the dp shard). Per tp rank: embedding V d / tp; a block
# (2 d^2 + 2 d kv + 3 d f) / tp + 2 d (norms replicated); final norm d; head V d / tp, 0 when tied.
LLAMA3_TABLES = {
    # 8B, ZeRO-1, tp 2, dp 4: 128256*4096/2 = 262,668,288; block (33,554,432 + 8,388,608 +
    # 176,160,768) / 2 + 8192 = 109,060,096; 2 * 262,668,288 + 32 * 109,060,096 + 4096 = 4,015,263,744.
    ("llama3_8b", 1, 2, 8): dict(params=2 * 4_015_263_744, grads=2 * 4_015_263_744,
                                 master_weights=4 * 4_015_263_744 // 4, optimizer_moments=8 * 4_015_263_744 // 4),
    # 70B, ZeRO-3, dp 64: every term over 64 of 70,553,706,496.
    ("llama3_70b", 3, 1, 64): dict(params=2 * 70_553_706_496 // 64, grads=2 * 70_553_706_496 // 64,
                                   master_weights=4 * 70_553_706_496 // 64, optimizer_moments=8 * 70_553_706_496 // 64),
    # 405B, ZeRO-3, tp 2, dp 128: 128256*16384/2 = 1,050,673,152; block: wq, wo 536,870,912, wk, wv
    # (kv = 8 * 128) 33,554,432, ffn 2,617,245,696: / 2 + 32,768 = 1,593,868,288.
    # Total 2 * 1,050,673,152 + 126 * 1,593,868,288 + 16,384 = 202,928,766,976.
    ("llama3_405b", 3, 2, 256): dict(params=2 * 202_928_766_976 // 128, grads=2 * 202_928_766_976 // 128,
                                     master_weights=4 * 202_928_766_976 // 128,
                                     optimizer_moments=8 * 202_928_766_976 // 128),
    # 3.2 1B (tied: the head is the embedding, counted once), ZeRO-2, dp 8: 1,235,814,400 in all.
    ("llama3_2_1b", 2, 1, 8): dict(params=2 * 1_235_814_400, grads=2 * 1_235_814_400 // 8,
                                   master_weights=4 * 1_235_814_400 // 8, optimizer_moments=8 * 1_235_814_400 // 8),
    # 3.2 3B (tied), ZeRO-3, dp 8: 3,212,749,824 = 394,002,432 + 28 * 100,669,440 + 3072.
    ("llama3_2_3b", 3, 1, 8): dict(params=2 * 3_212_749_824 // 8, grads=2 * 3_212_749_824 // 8,
                                   master_weights=4 * 3_212_749_824 // 8, optimizer_moments=8 * 3_212_749_824 // 8),
}  # fmt: skip


@pytest.mark.parametrize("name, stage, tp, world", list(LLAMA3_TABLES))
def test_llama3_memory_per_rank_by_hand(name, stage, tp, world):
    from lightning_zero.models import LlamaConfig
    from lightning_zero.planner import plan_run

    config = LlamaConfig.from_name(name)
    plan = plan_run(config, stage=stage, world_size=world, devices_per_node=8, tp=tp, micro_batch=1, seq_len=8192,
                    hardware="h100_80gb", simulate=False)  # fmt: skip
    got = {key: plan.memory.as_dict()[key] for key in ("params", "grads", "master_weights", "optimizer_moments")}
    assert got == LLAMA3_TABLES[(name, stage, tp, world)]
    assert plan.num_params == config.num_params()
