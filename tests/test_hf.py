"""Hugging Face Llama in and out: logit parity with ``transformers``, pretrained init under every
layout, load memory under ZeRO-3, export round trip, strict loading, and bad input.

No downloads: the checkpoints are tiny ``transformers.LlamaForCausalLM`` models built here. The
multi-process Lightning cases run in one launch of ``tests/scripts/hf_init.py`` (2 gloo ranks).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_zero.checkpoint.dcp import CheckpointError  # noqa: E402
from lightning_zero.models import Llama, LlamaConfig  # noqa: E402
from lightning_zero.models.llama import LlamaLM, cross_entropy_loss  # noqa: E402
from tests.distributed import launch  # noqa: E402

# Grouped-query attention (4 heads, 2 KV heads), a non-default rope_theta; tp=2 divides everything.
HF_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0)  # fmt: skip
# ~42M parameters (168 MB in fp32) for the load-memory case; its largest unit (a block) is 12.6 MB.
MEM_SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5)  # fmt: skip
LAYOUTS = ("zero1", "zero2", "zero3", "tp2z2", "tp2z3")


def _hf_model(seed: int = 0, **overrides) -> "transformers.LlamaForCausalLM":
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**HF_SHAPE, **overrides})
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # transformers inits norms to 1: perturb them so a misplaced norm shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def _save_bin(model, path: Path, shards: int = 1) -> Path:
    """The legacy layout: config.json + pytorch_model.bin (a torch.save'd state dict), or
    ``shards`` pytorch_model-0000i-of-0000n.bin files + pytorch_model.bin.index.json."""
    path.mkdir(parents=True)
    model.config.to_json_file(str(path / "config.json"))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if shards == 1:
        torch.save(state, path / "pytorch_model.bin")
        return path
    keys, weight_map = list(state), {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: state[k] for k in keys[i::shards]}
        torch.save(part, path / name)
        weight_map |= {k: name for k in part}
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    model = _hf_model()
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="40KB")
    _save_bin(model, root / "bin")
    _save_bin(model, root / "bin_sharded", shards=3)
    return {"model": model, "root": root}


def _logits_match(ours: Llama, theirs, vocab: int) -> None:
    tokens = torch.randint(0, vocab, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Loading in one process
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["single", "sharded", "bin", "bin_sharded"])
def test_logits_match_transformers(hf, layout):
    path = hf["root"] / layout
    if layout == "sharded":
        assert len(list(path.glob("model-*.safetensors"))) > 2 and (path / "model.safetensors.index.json").is_file()
    ours = Llama.from_pretrained(path)
    assert ours.config.n_kv_heads == 2 and ours.config.rope_theta == 5000.0 and ours.config.norm_eps == 1e-5
    _logits_match(ours, hf["model"], HF_SHAPE["vocab_size"])


# Llama 3.x: rope scaling of each type over a 16-token original context, sequences of 48 tokens
# (where scaling changes the angles); theta 500000 as in Llama 3.
LLAMA3_SHAPE = dict(HF_SHAPE, rope_theta=500000.0, max_position_embeddings=64)
ROPE_CASES = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16),
    "linear": dict(rope_type="linear", factor=4.0),
    "dynamic": dict(rope_type="dynamic", factor=4.0),  # scales past max_position_embeddings (16 here)
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=16.0),
}  # fmt: skip
LONG = 48


def _rope_model(rope_type: str, seed: int = 5, **overrides) -> "transformers.LlamaForCausalLM":
    shape = dict(LLAMA3_SHAPE, rope_scaling=dict(ROPE_CASES[rope_type]), **overrides)
    if rope_type == "dynamic":
        shape["max_position_embeddings"] = 16
    return _hf_model(seed=seed, **shape)


def _max_logit_diff(ours: Llama, theirs, seq: int) -> float:
    tokens = torch.randint(0, HF_SHAPE["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (ours(tokens) - theirs(tokens).logits).abs().max().item()


@pytest.mark.parametrize("rope_type", list(ROPE_CASES))
def test_rope_scaling_logits_match_transformers_past_the_original_context(tmp_path, rope_type):
    import dataclasses

    model = _rope_model(rope_type)
    model.save_pretrained(tmp_path / rope_type)
    ours = Llama.from_pretrained(tmp_path / rope_type, max_seq_len=64)
    assert ours.config.rope_scaling["rope_type"] == rope_type and ours.config.rope_theta == 500000.0
    for seq in (12, LONG):  # inside and past the original context
        theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / rope_type).eval()  # dynamic: fresh cache
        assert _max_logit_diff(ours, theirs, seq) < 1e-5, (rope_type, seq)
    # The scaling matters there: the same weights without it are a different model.
    unscaled = Llama(dataclasses.replace(ours.config, rope_scaling=None))
    unscaled.load_state_dict(ours.state_dict())
    assert _max_logit_diff(unscaled, model, LONG) > 1e-3


def test_rope_scaling_read_from_rope_scaling_4x_spelling(tmp_path):
    model = _rope_model("llama3")
    model.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}  # how transformers 4.x wrote it
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    assert LlamaConfig.from_hf(tmp_path / "m").rope_scaling == {**ROPE_CASES["llama3"]}
    assert _max_logit_diff(Llama.from_pretrained(tmp_path / "m"), model, LONG) < 1e-5


def test_tied_llama32_style_model_is_one_parameter(tmp_path):
    from safetensors.torch import load_file

    model = _rope_model("llama3", seed=3, tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "tied")
    assert not any("lm_head" in key for key in load_file(tmp_path / "tied" / "model.safetensors"))
    ours = Llama.from_pretrained(tmp_path / "tied")
    assert ours.config.tie_embeddings and ours.output.weight is ours.tok_embeddings.weight
    assert sum(p.numel() for p in ours.parameters()) == ours.config.num_params()
    assert ours.config.num_params() == sum(p.numel() for p in model.parameters())  # transformers counts it once
    assert _max_logit_diff(ours, model, LONG) < 1e-5
    module = LlamaLM(init_from=str(tmp_path / "tied"))  # the Lightning path keeps the tie too
    module.configure_model()
    assert module.model.output.weight is module.model.tok_embeddings.weight


def test_from_pretrained_dtype(hf):
    ours = Llama.from_pretrained(hf["root"] / "sharded", dtype=torch.bfloat16)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert ours.rope_cos.dtype == torch.float32
    want = hf["model"].model.layers[1].mlp.down_proj.weight.to(torch.bfloat16)
    assert torch.equal(ours.layers[1].feed_forward.w2.weight, want)


def test_lightning_module_and_hydra_config_take_the_shape_from_config_json(hf):
    from lightning_zero.cli import build_module
    from lightning_zero.hydra_config import compose

    path = str(hf["root"] / "sharded")
    module = LlamaLM(init_from=path)
    module.configure_model()
    _logits_match(module.model, hf["model"], HF_SHAPE["vocab_size"])
    assert module.hparams.init_from == path

    import pickle

    clone = pickle.loads(pickle.dumps(LlamaLM(init_from=path)))  # start_method="spawn" pickles the module
    clone.configure_model()
    _logits_match(clone.model, hf["model"], HF_SHAPE["vocab_size"])

    cfg = compose(["model=hf", f"model.init_from={path}", "data.seq_len=32"])
    built = build_module(cfg)
    assert (built.config.dim, built.config.n_layers, built.config.max_seq_len) == (64, 2, 32)
    # a preset that disagrees with config.json is an error naming the fields
    with pytest.raises(ValueError, match=r"dim 256 \(config.json: 64\).*model=hf"):
        build_module(compose([f"model.init_from={path}"]))
    with pytest.raises(ValueError, match=r"n_layers 3 \(config.json: 2\)"):
        LlamaLM(config={"name": "hf", "n_layers": 3}, init_from=path)


# --------------------------------------------------------------------------------------------
# Bad input: a clear error naming the file and the tensor, before anything trains
# --------------------------------------------------------------------------------------------


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _drop_shard(path: Path) -> str:
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    return rf"{shard.name}: missing; model\.safetensors\.index\.json places \d+ tensor\(s\) there, e\.g\. 'model\."


def _truncate_shard(path: Path) -> str:
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    return rf"{shard.name}: truncated: .*model\.layers"


def _rewrite_single(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _wrong_shape(path: Path) -> str:
    def edit(tensors):
        tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1]

    _rewrite_single(path, edit)
    return r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj\.weight' has shape \[127, 64\], parameter layers\.1\.feed_forward\.w3\.weight needs \[128, 64\]"


def _missing_key(path: Path) -> str:
    _rewrite_single(path, lambda tensors: tensors.pop("model.norm.weight"))
    return r"missing tensor 'model\.norm\.weight' \(for parameter norm\.weight"


def _unexpected_key(path: Path) -> str:
    _rewrite_single(path, lambda tensors: tensors.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64)}))
    return r"model\.safetensors: unexpected tensor 'model\.layers\.2\.mlp\.up_proj\.weight' \(shape \[128, 64\]\)"


def _not_llama(path: Path) -> str:
    _edit_config(path, model_type="gemma", architectures=["GemmaForCausalLM"])
    return r"config\.json: model_type 'gemma'.*only these dense families"


def _rope_scaling(path: Path) -> str:
    _edit_config(path, rope_scaling={"rope_type": "longrope", "factor": 8.0}, rope_parameters=None)
    return r"config\.json: rope scaling 'longrope' is not supported; supported: linear, dynamic, yarn, llama3"


def _rope_keys(path: Path) -> str:
    _edit_config(path, rope_scaling=None, rope_parameters={"rope_type": "llama3", "factor": 8.0})
    return r"config\.json: rope scaling 'llama3' misses \['low_freq_factor', 'high_freq_factor'\]"


def _attention_bias(path: Path) -> str:
    _edit_config(path, attention_bias=True)
    return r"config\.json: attention_bias = True is not supported"


def _no_config(path: Path) -> str:
    (path / "config.json").unlink()
    return r"config\.json: missing"


def _no_weights(path: Path) -> str:
    for file in path.glob("model*"):
        file.unlink()
    return r"no weights found; expected model\.safetensors\.index\.json"


BAD_INPUT = {
    "missing shard": ("sharded", _drop_shard),
    "truncated shard": ("sharded", _truncate_shard),
    "wrong shape": ("single", _wrong_shape),
    "missing key": ("single", _missing_key),
    "unexpected key": ("single", _unexpected_key),
    "not llama": ("single", _not_llama),
    "rope scaling": ("single", _rope_scaling),
    "rope keys": ("single", _rope_keys),
    "attention bias": ("single", _attention_bias),
    "no config.json": ("single", _no_config),
    "no weights": ("single", _no_weights),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_fails_clearly_before_training(hf, tmp_path, case):
    layout, damage = BAD_INPUT[case]
    path = tmp_path / "model"
    shutil.copytree(hf["root"] / layout, path)
    pattern = damage(path)
    for attempt in (lambda: Llama.from_pretrained(path), lambda: LlamaLM(init_from=str(path))):
        with pytest.raises(ValueError, match=pattern):  # CheckpointError is a ValueError
            attempt()


def test_slice_reads_match_whole_tensors(hf):
    from lightning_zero.checkpoint.hf import open_weight_files

    for layout in ("sharded", "bin"):
        files = open_weight_files(hf["root"] / layout)
        whole = files.read("model.layers.0.self_attn.q_proj.weight")
        assert torch.equal(files.read("model.layers.0.self_attn.q_proj.weight", 0, 32, 32), whole[32:64])
        assert torch.equal(files.read("model.layers.0.self_attn.o_proj.weight", 1, 16, 16),
                           files.read("model.layers.0.self_attn.o_proj.weight")[:, 16:32])  # fmt: skip


def test_shard_writer_streams_within_the_shard_size(tmp_path):
    from lightning_zero.checkpoint.hf import TensorSpec, open_weight_files, parse_size, write_safetensors_shards

    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(123) == 123
    with pytest.raises(ValueError, match="size '5 parsecs'"):
        parse_size("5 parsecs")
    tensors = {f"t{i}": torch.randn(10, 10 + i) for i in range(5)}
    specs = [TensorSpec(name, tuple(t.shape), torch.bfloat16) for name, t in tensors.items()]
    produced = []

    def produce(spec):
        produced.append(spec.name)
        return tensors[spec.name]

    paths = write_safetensors_shards(tmp_path, specs, produce, max_shard_bytes=500)
    # bf16 sizes 200, 220, 240, 260, 280 bytes: shards [200, 220], [240, 260], [280], each <= 500
    assert produced == list(tensors) and len(paths) == 3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["t3"] == "model-00002-of-00003.safetensors" and index["metadata"]["total_size"] == 1200
    files = open_weight_files(tmp_path)
    for name, tensor in tensors.items():
        assert torch.equal(files.read(name), tensor.to(torch.bfloat16))


# --------------------------------------------------------------------------------------------
# Multi-process: one launch, many cases
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launched(hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_runs")
    torch.manual_seed(0)
    with torch.device("meta"):
        big = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MEM_SHAPE))
    big = big.to_empty(device="cpu")
    with torch.no_grad():
        for param in big.parameters():
            param.normal_(std=0.02)
    big.save_pretrained(out / "mem_model")
    num_params = sum(p.numel() for p in big.parameters())
    del big
    cases = [f"first-{layout}" for layout in LAYOUTS]
    mem_model = out / "mem_model"
    cases += [f"mem-zero3={mem_model}", "tune-zero2", "deep-zero2", "shallow-zero2"]
    # Llama 3.2-style: tied, llama3 rope scaling over an 8-token original context (the script's
    # sequences are 16 tokens), GQA, theta 500000; sharded safetensors.
    tied = _tied_rope_model()
    tied.save_pretrained(out / "tied_model", max_shard_size="40KB")
    cases += [f"tied-{layout}={out / 'tied_model'}" for layout in TIED_LAYOUTS]
    launch("hf_init.py", out, hf["root"] / "sharded", *cases, timeout_s=900)
    return {"out": out, "mem_params": num_params, "tied_model": tied, "tied_dir": out / "tied_model"}


TIED_LAYOUTS = ("ddp", "zero1", "zero2", "zero3", "tp2z3")


def _tied_rope_model() -> "transformers.LlamaForCausalLM":
    rope = dict(ROPE_CASES["llama3"], original_max_position_embeddings=8)
    return _hf_model(seed=11, **dict(LLAMA3_SHAPE, rope_scaling=rope, tie_word_embeddings=True))


def _transformers_loss(model, batch: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def _ranks(out: Path, case: str) -> list[dict]:
    return [torch.load(out / f"{case}.rank{rank}.pt", weights_only=False) for rank in (0, 1)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_init_from_first_loss_equals_the_pretrained_model(hf, launched, layout):
    reference = Llama.from_pretrained(hf["root"] / "single")
    for record in _ranks(launched["out"], f"first-{layout}"):
        batch = record["first_batch"]
        with torch.no_grad():
            want = cross_entropy_loss(reference(batch[:, :-1]), batch[:, 1:]).item()
        assert record["losses"][0] == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("layout", ["zero3", "tp2z3"])
def test_init_from_llama32_style_first_loss_equals_transformers(launched, layout):
    theirs = launched["tied_model"]
    for record in _ranks(launched["out"], f"tied-{layout}"):
        assert record["losses"][0] == pytest.approx(_transformers_loss(theirs, record["first_batch"]), abs=1e-5)


@pytest.mark.parametrize("layout", ["zero1", "zero2", "zero3"])
def test_tied_model_trains_like_ddp_and_stays_tied(launched, layout):
    from lightning_zero.planner.ledger import llama_param_counts

    reference = _ranks(launched["out"], "tied-ddp")
    for rank, record in enumerate(_ranks(launched["out"], f"tied-{layout}")):
        assert torch.equal(record["first_batch"], reference[rank]["first_batch"])
        assert len(record["losses"]) == 3
        assert record["losses"] == pytest.approx(reference[rank]["losses"], abs=1e-5), layout
        assert record["tied"] and reference[rank]["tied"]
        config = LlamaConfig.from_hf(launched["tied_dir"])
        assert record["engine_params"] == config.num_params() == llama_param_counts(config).total  # stored once


def test_tied_model_under_tp2_trains_like_one_dense_process_and_stays_tied(launched):
    from lightning_zero.planner.ledger import llama_param_counts

    records = _ranks(launched["out"], "tied-tp2z3")
    assert torch.equal(records[0]["first_batch"], records[1]["first_batch"])  # dp=1: one batch per step
    torch.manual_seed(0)
    dense = LlamaLM(init_from=str(launched["tied_dir"]), lr=1e-3, warmup_steps=1, max_steps=4)
    dense.configure_model()
    optimization = dense.configure_optimizers()
    optimizer, schedule = optimization["optimizer"], optimization["lr_scheduler"]["scheduler"]
    losses = []
    for batch in records[0]["batches"]:
        loss, _ = dense._loss(batch)
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert dense.model.output.weight is dense.model.tok_embeddings.weight
    config = dense.config
    for record in records:
        assert record["losses"] == pytest.approx(losses, abs=1e-5)
        assert record["tied"] and record["engine_params"] == llama_param_counts(config, tp=2).total


def test_tied_rope_scaled_export_hf_round_trip(launched, tmp_path):
    from safetensors.torch import load_file

    from lightning_zero.cli import main

    ckpt = launched["out"] / "tied-zero3" / "last.ckpt"
    main(["export", str(ckpt), str(tmp_path / "hf"), "--format", "hf", "--max-shard-size", "30KB"])
    main(["export", str(ckpt), str(tmp_path / "plain.safetensors")])
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    source = json.loads((launched["tied_dir"] / "config.json").read_text())
    assert written["tie_word_embeddings"] is True and written["rope_parameters"] == source["rope_parameters"]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]
    theirs, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # strict: nothing missing, unexpected, mismatched
    assert theirs.config.rope_parameters == source["rope_parameters"] and theirs.config.tie_word_embeddings
    ours = Llama(LlamaConfig.from_hf(tmp_path / "hf"))
    ours.load_state_dict(load_file(tmp_path / "plain.safetensors"))  # the alias is filled from the embedding
    assert ours.output.weight is ours.tok_embeddings.weight
    assert _max_logit_diff(ours, theirs.eval(), LONG) < 1e-5
    start = launched["tied_model"].model.embed_tokens.weight
    assert not torch.allclose(theirs.model.embed_tokens.weight, start)  # it was fine-tuned


def test_zero3_load_peak_memory_below_the_full_model(launched):
    full_bytes = launched["mem_params"] * 4  # the fp32 model
    for record in _ranks(launched["out"], "mem-zero3"):
        assert record["num_params"] == launched["mem_params"]
        if not record["reset"]:
            pytest.skip("cannot reset the peak-RSS mark (/proc/self/clear_refs) here")
        # What the engine keeps whatever the init (parameter and gradient shards: at dp 2 in fp32
        # together the model's size) is not load memory; what the load adds on top of it is the
        # unit being read plus read buffers. A load that materialized the model would add its size.
        kept = record["kept"]
        assert kept["params"] < 0.6 * full_bytes
        overhead = record["peak_load"] - record["rss_before"] - kept["total"]
        assert overhead < 0.5 * full_bytes, (overhead, full_bytes, record)


def test_round_trip_fine_tune_export_hf_transformers_loads_strictly(hf, launched, tmp_path):
    from safetensors.torch import load_file

    from lightning_zero.cli import main

    ckpt = launched["out"] / "tune" / "last.ckpt"
    main(["export", str(ckpt), str(tmp_path / "hf"), "--format", "hf", "--max-shard-size", "30KB"])
    main(["export", str(ckpt), str(tmp_path / "plain.safetensors")])
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    theirs, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = Llama(LlamaConfig.from_hf(tmp_path / "hf"))
    ours.load_state_dict(load_file(tmp_path / "plain.safetensors"))
    _logits_match(ours, theirs.eval(), HF_SHAPE["vocab_size"])  # rope_theta 5000 survives too
    start = hf["model"].model.layers[0].self_attn.o_proj.weight
    assert not torch.allclose(theirs.model.layers[0].self_attn.o_proj.weight, start)  # it was fine-tuned
    # bf16 export: dtype recorded, tensors bf16, our loader reads it back
    main(["export", str(ckpt), str(tmp_path / "bf16"), "--format", "hf", "--dtype", "bf16"])
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = Llama.from_pretrained(tmp_path / "bf16")
    assert torch.equal(
        back.layers[0].attention.wq.weight, ours.layers[0].attention.wq.weight.to(torch.bfloat16).float()
    )


def test_resume_with_unexpected_keys_fails_on_every_rank_and_changes_nothing(launched):
    for record in _ranks(launched["out"], "shallow-zero2"):
        error = record["error"]
        assert error is not None and error.startswith("CheckpointError")
        assert "9 unexpected tensor(s)" in error and "model.layers.1.attention.wq.weight [32, 32]" in error
        assert "strict_loading" in error
        assert record["steps"] == 0
        assert len(record["masters_before"]) > 0
        for before, after in zip(record["masters_before"], record["masters_after"]):
            assert torch.equal(before, after)


def test_partial_load_only_with_strict_loading_false(launched):
    from safetensors.torch import load_file

    from lightning_zero.checkpoint import export, load_model, open_checkpoint

    ckpt = launched["out"] / "deep" / "last.ckpt"
    saved = load_file(export(ckpt, launched["out"] / "deep.safetensors"))
    config = dict(name="strict", vocab_size=64, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
    for n_layers in (1, 3):  # the checkpoint has 2: unexpected keys, then missing keys
        torch.manual_seed(0)
        module = LlamaLM(config=dict(config, n_layers=n_layers))
        module.configure_model()
        before = {k: v.clone() for k, v in module.model.state_dict().items()}
        with pytest.raises(CheckpointError, match="unexpected" if n_layers == 1 else "missing from the checkpoint"):
            load_model(open_checkpoint(ckpt), module)
        assert all(torch.equal(before[k], v) for k, v in module.model.state_dict().items())
        load_model(open_checkpoint(ckpt), module, strict=False)
        for name, value in module.model.state_dict().items():
            want = saved.get(name, before[name])  # what the checkpoint lacks keeps its value
            assert torch.equal(value, want), name


# --------------------------------------------------------------------------------------------
# Fine-tuning recipes
# --------------------------------------------------------------------------------------------

FINETUNE = ("llama7b_finetune", "llama13b_finetune", "llama70b_finetune",
            "llama3_8b_finetune", "llama3_70b_finetune", "llama3_405b_finetune")  # fmt: skip


@pytest.mark.parametrize("recipe", FINETUNE)
def test_finetune_recipe_fits_and_needs_weights_and_data(recipe):
    import re

    from omegaconf import OmegaConf

    from lightning_zero.cli import build_module
    from lightning_zero.hydra_config import RECIPES_DIR, compose
    from lightning_zero.planner.report import plan_inputs_from_config

    cfg = compose([f"recipe={recipe}"])
    assert cfg.model.init_from == "required" and OmegaConf.is_missing(cfg.data, "path")
    with pytest.raises(ValueError, match="model.init_from=required: this recipe fine-tunes published weights"):
        build_module(cfg)
    llama3 = recipe.startswith("llama3")
    assert cfg.data.source == "memmap" and cfg.data.seq_len == (8192 if llama3 else 4096)
    assert cfg.optim.lr <= 3e-5 and cfg.optim.warmup_steps == 100 and cfg.trainer.max_steps == 2000
    assert cfg.trainer.precision == "bf16-mixed"
    tp = cfg.strategy.get("tensor_parallel_size", 1)
    tp = cfg.trainer.devices if tp == "auto" else int(tp)
    dp = cfg.trainer.devices * cfg.trainer.num_nodes // tp
    sequences = 128 if recipe == "llama3_405b_finetune" else 64  # 405B: dp=128 is the fewest it allows
    assert dp * cfg.data.batch_size * cfg.trainer.accumulate_grad_batches == sequences  # per step
    planned, _ = plan_inputs_from_config(cfg)
    plan = planned.plan()
    assert plan.fits, plan.verdict
    header = (RECIPES_DIR / f"{recipe}.yaml").read_text()
    shape = re.search(r"(\d+) nodes? x (\d+) GPUs", header)
    assert (int(shape.group(1)), int(shape.group(2))) == (cfg.trainer.num_nodes, cfg.trainer.devices)
    stated = float(re.search(rf"ZeRO-{cfg.strategy.stage} holds ([\d.]+) GiB", header).group(1))
    assert f"fits: {stated} GiB" in plan.verdict  # the comment quotes the planner


@pytest.mark.slow
def test_finetune_recipes_train_shrunk_from_a_tiny_checkpoint(tmp_path):
    from tests.test_cli import run_cli
    from tests.test_recipes import SHRINK

    tiny = LlamaConfig.from_name("tiny")  # the shape `model=tiny` asks for: config.json must agree
    model = _hf_model(vocab_size=tiny.vocab_size, hidden_size=tiny.dim, intermediate_size=tiny.ffn_dim,
                      num_hidden_layers=tiny.n_layers, num_attention_heads=tiny.n_heads,
                      num_key_value_heads=tiny.n_kv_heads, max_position_embeddings=512, rope_theta=10000.0)  # fmt: skip
    model.save_pretrained(tmp_path / "tiny_hf")
    sweep = tmp_path / "sweep"
    # 13b shrinks exactly like 7b (only the trainer group differs, which SHRINK replaces); 70b runs tp=2
    recipes = ("llama7b_finetune", "llama70b_finetune")
    proc = run_cli(["train", "-m", f"recipe={','.join(recipes)}", *SHRINK, "data=synthetic", "trainer.max_steps=2",
                    f"model.init_from={tmp_path / 'tiny_hf'}", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert proc.stdout.count("lightning-zero: 2 steps") == len(recipes)
    for job in range(len(recipes)):
        assert (sweep / str(job) / "checkpoints" / "last.ckpt").exists()
