"""Llama presets, the decoder's numerics, and the LlamaLM LightningModule (single process, CPU)."""

from __future__ import annotations

import collections
import math

import lightning as L
import psutil
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_zero.models import Llama, LlamaConfig, LlamaLM, WarmupCosine, resolve_config
from lightning_zero.models.llama import apply_rope, rope_tables

# Meta's Llama 2 model card / Hugging Face configs: exact parameter counts.
PUBLISHED_PARAMS = {"7b": 6_738_415_616, "13b": 13_015_864_320, "70b": 68_976_648_192,
                    # Llama 3.1 and 3.2 (tied: the head is the embedding, counted once)
                    "llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496, "llama3_405b": 405_853_388_800,
                    "llama3_2_1b": 1_235_814_400, "llama3_2_3b": 3_212_749_824}  # fmt: skip


def small_config(**overrides) -> LlamaConfig:
    fields = dict(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
    return LlamaConfig(name="small", **{**fields, **overrides})


# ---- presets and configuration --------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_published_parameter_counts_on_meta_without_allocating(name):
    config = LlamaConfig.from_name(name)
    rss_before = psutil.Process().memory_info().rss
    with torch.device("meta"):
        model = Llama(config)
    rss_growth = psutil.Process().memory_info().rss - rss_before
    tensors = list(model.parameters()) + list(model.buffers())
    assert all(tensor.is_meta for tensor in tensors)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[name] == config.num_params()
    assert rss_growth < 64 * 2**20, f"building {name} on meta grew RSS by {rss_growth / 2**20:.0f} MiB"


def test_presets_are_llama2_shapes():
    seven, thirteen, seventy = (LlamaConfig.from_name(name) for name in ("7b", "13b", "70b"))
    assert (seven.dim, seven.n_layers, seven.n_heads, seven.ffn_dim) == (4096, 32, 32, 11008)
    assert (thirteen.dim, thirteen.n_layers, thirteen.n_heads, thirteen.ffn_dim) == (5120, 40, 40, 13824)
    assert (seventy.dim, seventy.n_layers, seventy.n_heads, seventy.n_kv_heads) == (8192, 80, 64, 8)
    assert seventy.ffn_dim == 28672 and seventy.head_dim == 128
    assert {c.vocab_size for c in (seven, thirteen, seventy)} == {32000}
    tiny = LlamaConfig.from_name("tiny")
    assert 1_000_000 < tiny.num_params() < 10_000_000
    assert sum(p.numel() for p in Llama(tiny).parameters()) == tiny.num_params()


def test_llama3_presets():
    from lightning_zero.hydra_config import compose

    for name in ("llama3_8b", "llama3_70b", "llama3_405b", "llama3_2_1b", "llama3_2_3b"):
        config = LlamaConfig.from_name(name)
        assert (config.vocab_size, config.n_kv_heads, config.rope_theta) == (128256, 8, 500000.0)
        assert config.rope_scaling["rope_type"] == "llama3" and config.tie_embeddings == name.startswith("llama3_2")
        assert config.rope_scaling["factor"] == (32.0 if name.startswith("llama3_2") else 8.0)
        assert LlamaConfig.from_name(name, n_layers=1).rope_scaling == config.rope_scaling  # presets not mutated
        cfg = compose([f"model={name}", "data.seq_len=128"])  # a conf/model option
        assert resolve_config(cfg.model.name) == config
    with torch.device("meta"):
        tied = Llama(LlamaConfig.from_name("llama3_2_1b"))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert set(tied.state_dict()) >= {"tok_embeddings.weight", "output.weight"}  # the alias is listed


def test_meta_state_dict_keys_match_meta_checkpoints():
    with torch.device("meta"):
        keys = set(Llama(LlamaConfig.from_name("7b")).state_dict())
    expected_block = {
        "attention_norm.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
        "attention.wo.weight", "ffn_norm.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
        "feed_forward.w3.weight",
    }  # fmt: skip
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    expected |= {f"layers.{i}.{key}" for i in range(32) for key in expected_block}
    assert keys == expected


def test_from_name_overrides_and_mapping_resolution():
    assert LlamaConfig.from_name("TINY", n_layers=2).n_layers == 2
    assert resolve_config({"name": "tiny", "dim": 128}).dim == 128
    custom = dict(vocab_size=10, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16, max_seq_len=8)
    assert resolve_config(custom).name == "custom"


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: LlamaConfig.from_name("8b"), r"unknown Llama preset '8b'; available: tiny, 7b, 13b, 70b"),
        (lambda: LlamaConfig.from_name("tiny", dimm=3), r"unknown field\(s\) \['dimm'\]"),
        (lambda: small_config(dim=60, n_heads=8), r"dim \(60\) must be divisible by n_heads \(8\)"),
        (lambda: small_config(n_kv_heads=3), r"n_heads \(4\) must be divisible by\s+n_kv_heads \(3\)"),
        (lambda: small_config(dim=36, n_heads=4), r"head_dim \(9\) must be even"),
        (lambda: small_config(n_layers=0), r"n_layers must be a positive int, got 0"),
        (lambda: resolve_config({"name": "mine", "dim": 8}), r"misses field\(s\) \['vocab_size'"),
        (lambda: LlamaLM("tiny", lr=0), r"lr must be > 0"),
        (lambda: LlamaLM("tiny", warmup_steps=10, max_steps=5), r"max_steps \(5\) must be >= warmup_steps \(10\)"),
        (lambda: LlamaLM("tiny", betas=(0.9,)), r"betas must be two numbers"),
    ],
)
def test_bad_configuration_raises_value_error(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# ---- the decoder ----------------------------------------------------------------------------


def test_tiny_forward_backward():
    config = LlamaConfig.from_name("tiny")
    model = Llama(config)
    idx = torch.randint(0, config.vocab_size, (2, 32))
    logits = model(idx)
    assert logits.shape == (2, 32, config.vocab_size)
    loss = model.loss_fn(logits, torch.randint(0, config.vocab_size, (2, 32)))
    assert abs(loss.item() - math.log(config.vocab_size)) < 1.5
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_attention_is_causal_and_too_long_input_is_refused():
    torch.manual_seed(0)
    model = Llama(small_config())
    idx = torch.randint(0, 64, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 64
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])
    with pytest.raises(ValueError, match="sequence length 65 exceeds max_seq_len \\(64\\)"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_rope_scores_depend_only_on_relative_position():
    cos, sin = rope_tables(head_dim=8, max_seq_len=32, theta=10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def score(q_pos: int, k_pos: int) -> torch.Tensor:
        rotated_q = apply_rope(q.view(1, 1, 1, 8), cos[q_pos : q_pos + 1], sin[q_pos : q_pos + 1])
        rotated_k = apply_rope(k.view(1, 1, 1, 8), cos[k_pos : k_pos + 1], sin[k_pos : k_pos + 1])
        return (rotated_q * rotated_k).sum()

    torch.testing.assert_close(score(5, 2), score(20, 17))
    torch.testing.assert_close(score(0, 0), (q * k).sum())


def test_grouped_query_attention_equals_repeated_kv_heads():
    """A GQA model computes what a full multi-head model does with each kv head copied to its group."""
    torch.manual_seed(0)
    gqa = Llama(small_config(n_heads=4, n_kv_heads=2))
    mha = Llama(small_config(n_heads=4, n_kv_heads=4))
    state = gqa.state_dict()
    for i in range(2):
        for name in ("wk", "wv"):
            weight = state[f"layers.{i}.attention.{name}.weight"]  # (kv_heads * head_dim, dim)
            state[f"layers.{i}.attention.{name}.weight"] = (
                weight.view(2, 16, 64).repeat_interleave(2, 0).reshape(64, 64)
            )
    mha.load_state_dict(state)
    idx = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(gqa(idx), mha(idx))


def test_init_weights_is_deterministic_and_materializes_meta_models():
    config = small_config()
    reference = Llama(config)
    reference.init_weights(torch.Generator().manual_seed(7))
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(7))
    for (name, expected), actual in zip(reference.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(actual, expected, msg=name)
    torch.testing.assert_close(model.rope_cos, reference.rope_cos)
    torch.testing.assert_close(model.rope_sin, reference.rope_sin)
    assert reference.norm.weight.eq(1).all()
    assert reference.output.weight.std().item() == pytest.approx(config.dim**-0.5, rel=0.1)


class _OpsInBackward(TorchDispatchMode):
    """Counts the aten ops that run (by name), to tell what a backward recomputes."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_activation_checkpointing_modes_give_the_same_losses_and_gradients():
    """false, "selective" and "full" train alike (1e-5); "selective" recomputes only attention's
    core (one SDPA forward and the rotary per block, no linear layer's matmul), "full" every block."""
    config = small_config()
    torch.manual_seed(0)
    model = Llama(config)
    idx = torch.randint(0, 64, (2, 16))

    def run(mode) -> tuple[torch.Tensor, list[torch.Tensor], collections.Counter]:
        model.zero_grad()
        model.activation_checkpointing = mode
        loss = model.loss_fn(model(idx[:, :-1]), idx[:, 1:])
        with _OpsInBackward() as ops:
            loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()], ops.counts

    results = {mode: run(mode) for mode in (False, "selective", "full", True)}
    loss_none, grads_none, ops_none = results[False]
    for mode, (loss, grads, _) in results.items():
        torch.testing.assert_close(loss, loss_none, rtol=1e-5, atol=1e-5)
        for plain, recomputed in zip(grads_none, grads):
            torch.testing.assert_close(
                recomputed, plain, rtol=1e-5, atol=1e-5, msg=f"activation_checkpointing={mode!r}"
            )
    assert model.activation_checkpointing == "full"  # True is "full"

    def forward_attention(counts):  # SDPA forward kernels (whichever backend ran)
        return sum(n for name, n in counts.items() if "scaled_dot_product" in name and "backward" not in name)

    ops_selective, ops_full = results["selective"][2], results["full"][2]
    assert forward_attention(ops_none) == 0
    assert forward_attention(ops_selective) == forward_attention(ops_full) == config.n_layers
    # selective: no linear recomputed (the same matmuls as backward without checkpointing) ...
    assert ops_selective["mm"] == ops_none["mm"]
    # ... full: each block's linear forwards again: wq wk wv wo w1 w3 (non-reentrant checkpoint
    # stops once every saved tensor is back: w2's product, the block's output, is never needed)
    assert ops_full["mm"] == ops_none["mm"] + 6 * config.n_layers
    with pytest.raises(ValueError, match="activation_checkpointing='partial'"):
        model.activation_checkpointing = "partial"
    with pytest.raises(ValueError, match=r"LlamaLM\(activation_checkpointing\)='some'"):
        LlamaLM(activation_checkpointing="some")


def test_loss_falls_on_a_learnable_task():
    """Each sequence repeats a random 4-token motif: after one period the next token is a copy."""
    torch.manual_seed(0)
    model = Llama(small_config(vocab_size=32, dim=64, n_layers=2, n_heads=4, n_kv_heads=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(120):
        batch = torch.randint(0, 32, (16, 4)).repeat(1, 9)[:, :33]  # (16, 33)
        loss = model.loss_fn(model(batch[:, :-1]), batch[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 3.0  # about ln(32) = 3.47 or above
    # Only the first period (4 of 32 targets) is unpredictable: the floor is about 4/32 * ln 32 = 0.43.
    assert sum(losses[-10:]) / 10 < 1.2, losses[-10:]


# ---- LlamaLM ---------------------------------------------------------------------------------


def test_warmup_cosine_schedule():
    schedule = WarmupCosine(warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert schedule(0) == pytest.approx(0.1)
    assert schedule(9) == pytest.approx(1.0)
    assert schedule(10) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.55)
    assert schedule(110) == pytest.approx(0.1)
    assert schedule(500) == pytest.approx(0.1)
    assert WarmupCosine(0, 10, 0.0)(0) == pytest.approx(1.0)


def test_training_step_and_optimizer_groups():
    module = LlamaLM(small_config(), lr=1e-3, weight_decay=0.1, warmup_steps=2, max_steps=10)
    module.configure_model()
    batch = torch.randint(0, 64, (2, 17))
    loss = module.training_step(batch, 0)
    assert loss.dim() == 0 and loss.requires_grad
    settings = module.configure_optimizers()
    decayed, plain = settings["optimizer"].param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and all(p.dim() == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(module.parameters()))
    assert settings["lr_scheduler"]["interval"] == "step"
    with pytest.raises(ValueError, match=r"integer token batch of shape \[B, T\+1\]"):
        module.training_step(torch.randn(2, 17), 0)


def test_loss_fn_attribute_is_used():
    module = LlamaLM(small_config())
    module.configure_model()
    module.model.loss_fn = lambda logits, targets: logits.sum() * 0 + 42.0
    assert module.training_step(torch.randint(0, 64, (2, 9)), 0).item() == 42.0


def test_trainer_fit_validate_and_test_log_loss_and_perplexity(tmp_path):
    torch.manual_seed(0)
    train = torch.randint(0, 64, (8, 4)).repeat(1, 5)[:, :17]
    loader = torch.utils.data.DataLoader(train, batch_size=4)
    uneven = torch.utils.data.DataLoader(train[:6], batch_size=4)  # batches of 4 and 2 samples
    module = LlamaLM(small_config(), lr=1e-3, warmup_steps=1, max_steps=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    assert {"train_loss", "val_loss", "val_ppl"} <= set(trainer.callback_metrics)

    (validated,) = trainer.validate(module, uneven, verbose=False)
    with torch.no_grad():
        expected = module.model.loss_fn(module.model(train[:6, :-1]), train[:6, 1:])  # token-weighted mean
    assert validated["val_loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert validated["val_ppl"] == pytest.approx(math.exp(expected.item()), rel=1e-5)
    (tested,) = trainer.test(module, uneven, verbose=False)
    assert tested["test_loss"] == pytest.approx(expected.item(), rel=1e-5)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    restored = LlamaLM.load_from_checkpoint(tmp_path / "last.ckpt")
    assert restored.config == module.config and restored.hparams.max_steps == 4
    for (name, expected), actual in zip(module.state_dict().items(), restored.state_dict().values()):
        torch.testing.assert_close(actual, expected, msg=name)
