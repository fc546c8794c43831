"""The dense families that reuse the Llama decoder (Qwen3: q/k norms and a head_dim of its own;
Qwen2.5: q/k/v biases; Mistral: sliding-window attention) against tiny random models of
transformers' own classes, and the no-gather Hugging Face export (``checkpoint/hf_write.py``).

No downloads. The multi-process cases run in one launch of ``tests/scripts/hf_export_run.py``
(4 gloo ranks, TP=2 x ZeRO-2): every family fine-tunes 3 steps, equal to one dense process, and
its no-gather export loads strictly in transformers with the index ``save_pretrained`` writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_zero.checkpoint.hf_write import save_hf_pretrained  # noqa: E402
from lightning_zero.checkpoint.targets import RankPlacement  # noqa: E402
from lightning_zero.models import Llama, LlamaConfig  # noqa: E402
from lightning_zero.models.llama import LlamaLM  # noqa: E402
from tests.distributed import launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)  # fmt: skip
# (config class, model class, what sets the family apart); the script's sequences are 16 tokens,
# the tests' 23: Mistral's window of 8 changes both.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=5000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),  # 4 heads x 24 != hidden 64
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
}
SHARD = "40KB"


def _hf_model(family: str, seed: int = 0):
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**SHAPE, **extra)).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb them so a misplaced one shows
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                param.add_(0.1 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    models = {}
    for family in FAMILIES:
        models[family] = _hf_model(family)
        models[family].save_pretrained(root / family, max_shard_size=SHARD)
    return {"root": root, "models": models}


def _tokens(seq: int = 23) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(1))


def _max_diff(ours, theirs, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(tokens) - theirs(tokens).logits).abs().max().item()


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "mistral"])
def test_family_logits_match_transformers(saved, family):
    ours = Llama.from_pretrained(saved["root"] / family)
    config = ours.config
    assert config.family == family
    assert (config.qk_norm, config.qkv_bias) == (family == "qwen3", family == "qwen2")
    assert config.head_dim == (24 if family == "qwen3" else 16)
    diff = _max_diff(ours, saved["models"][family], _tokens())
    print(f"\n{family}: max |logits - transformers| = {diff:.3g} (fp32)")
    assert diff <= 1e-5
    if family == "mistral":  # the window is in force: full causal attention gives other logits
        assert config.sliding_window == 8
        for layer in ours.layers:
            layer.attention.sliding_window = None
        assert _max_diff(ours, saved["models"][family], _tokens()) > 1e-3


def _index(path: Path) -> str:
    return (path / "model.safetensors.index.json").read_text()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_no_gather_export_in_one_process_round_trips_strictly(saved, family, tmp_path):
    ours = Llama.from_pretrained(saved["root"] / family)
    for dtype, torch_dtype in ((None, torch.float32), ("bf16", torch.bfloat16)):
        out = tmp_path / f"out-{dtype}"
        save_hf_pretrained(out, module=ours, engine=None, layout=RankPlacement(), dtype=dtype, max_shard_size=SHARD)
        back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True,
                                                                        dtype=torch_dtype)  # fmt: skip
        assert not any(info.values()), info  # strict: nothing missing, unexpected or mismatched
        back.save_pretrained(tmp_path / f"ref-{dtype}", max_shard_size=SHARD)
        assert _index(out) == _index(tmp_path / f"ref-{dtype}")  # byte for byte
        assert json.loads((out / "config.json").read_text())["model_type"] == family
        if dtype is None:
            assert _max_diff(ours, back, _tokens()) <= 1e-5
        again = Llama.from_pretrained(out)  # and back into ours
        assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values())) or (
            dtype is not None
        )


PRESETS = ("mistral_7b", "mistral_nemo_12b", "qwen2_5_0_5b", "qwen2_5_7b", "qwen3_0_6b", "qwen3_8b")


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_are_transformers_models_of_the_same_size(preset):
    """Each preset, written as config.json, is a transformers model with exactly our parameters."""
    from lightning_zero.models.llama.hf import hf_config_dict

    config = LlamaConfig.from_name(preset)
    values = hf_config_dict(config, torch.bfloat16)
    hf_config = transformers.AutoConfig.for_model(**values)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert type(model).__name__ == values["architectures"][0]
    assert model.num_parameters() == config.num_params()
    with torch.device("meta"):
        assert sum(p.numel() for p in Llama(config).parameters()) == config.num_params()


def test_import_reads_byte_ranges_within_the_largest_tensor(tmp_path):
    """Peak host memory of loading a model whose largest tensor is 16 MiB: the parameters are
    allocated first, then every unit is read (``tests/scripts/hf_import_memory.py``)."""
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "hf_import_memory.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    print("\nimport memory:", record)
    for case in ("fp32", "bf16_file"):
        assert record[case]["peak_growth"] <= 1.2 * record["largest_tensor"], record


# --------------------------------------------------------------------------------------------
# 4 ranks, TP=2 x ZeRO-2: one launch
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launched(saved, tmp_path_factory):
    import importlib.util

    out = tmp_path_factory.mktemp("hf_export_runs")
    cases = [f"{family}={saved['root'] / family}" for family in FAMILIES]
    cases.append(f"fabric-qwen2={saved['root'] / 'qwen2'}")  # ZeRO-3 over 4 ranks, tied, biases
    mixtral = _mixtral()
    mixtral.save_pretrained(out / "mixtral", max_shard_size=SHARD)
    cases.append(f"moe-mixtral={out / 'mixtral'}")  # ZeRO-2, ep=2: each rank holds 2 of 4 experts
    with pytest.MonkeyPatch.context() as monkeypatch:
        if importlib.util.find_spec("s3fs") and importlib.util.find_spec("moto"):  # the llama run also to s3://
            from tests.s3_server import new_bucket

            bucket = new_bucket(monkeypatch)
            monkeypatch.setenv("LZ_HF_URL", bucket.url)
            (out / "hf_url.json").write_text(json.dumps({"url": bucket.url, "options": bucket.storage_options()}))
        launch("hf_export_run.py", out, *cases, timeout_s=900, ranks=4)
    # Lightning's ddp on 2 ranks: the same dp=2 data split, the reference of the TP=2 x ZeRO-2 runs
    ddp = [f"{family}-ddp={saved['root'] / family}" for family in ("qwen3", "qwen2", "mistral")]
    launch("hf_init.py", out, saved["root"] / "llama", *ddp, timeout_s=600, ranks=2)
    return out


def _mixtral():
    torch.manual_seed(3)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64,
                                        num_local_experts=4, intermediate_size=48)  # fmt: skip
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.normal_(1.0, 0.2)
    return model


def _dense_replay(saved, family: str, records: list[dict]) -> LlamaLM:
    """One process, the same init and optimizer, each step on the union of the dp ranks' batches."""
    torch.manual_seed(0)
    dense = LlamaLM(init_from=str(saved["root"] / family), lr=1e-3, warmup_steps=1, max_steps=4)
    dense.configure_model()
    optimization = dense.configure_optimizers()
    optimizer, schedule = optimization["optimizer"], optimization["lr_scheduler"]["scheduler"]
    for step in range(len(records[0]["batches"])):
        distinct = []
        for record in records:
            if not any(torch.equal(record["batches"][step], seen) for seen in distinct):
                distinct.append(record["batches"][step])
        assert len(distinct) == 2  # dp = 2; the two TP ranks of a dp rank share its batch
        for record in records:
            loss, _ = dense._loss(record["batches"][step])
            assert record["losses"][step] == pytest.approx(loss.item(), abs=1e-5), (family, step)
        loss, _ = dense._loss(torch.cat(distinct))
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return dense


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "mistral"])
def test_tp2_zero2_trains_like_lightning_ddp(launched, family):
    """Each dp rank of TP=2 x ZeRO-2 (4 ranks) sees the batches of one ddp rank (2 ranks) and gets
    its losses, step by step."""
    ours = [torch.load(launched / f"{family}.rank{rank}.pt", weights_only=False) for rank in range(4)]
    ddp = [torch.load(launched / f"{family}-ddp.rank{rank}.pt", weights_only=False) for rank in range(2)]
    for record in ours:
        match = [ref for ref in ddp if all(torch.equal(a, b) for a, b in zip(ref["batches"], record["batches"]))]
        assert len(match) == 1 and len(record["losses"]) == len(match[0]["losses"]) == 3
        assert record["losses"] == pytest.approx(match[0]["losses"], abs=1e-5), family


def _loads_strictly_like_the_dense_replay(saved, launched, family, out, tmp_path, seconds_key):
    """The TP=2 x ZeRO-2 run's export at ``out`` loads strictly in transformers with the dense
    replay's logits (1e-5), and its index is ``save_pretrained``'s. Returns the dense replay."""
    records = [torch.load(launched / f"{family}.rank{rank}.pt", weights_only=False) for rank in range(4)]
    dense = _dense_replay(saved, family, records)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    diff = _max_diff(dense.model, theirs.eval(), _tokens())
    print(f"\n{family}: TP=2 x ZeRO-2 export ({seconds_key}), max |logits - transformers| = {diff:.3g}; "
          f"export {max(r[seconds_key] for r in records):.2f} s")  # fmt: skip
    assert diff <= 1e-5
    theirs.save_pretrained(tmp_path / "ref", max_shard_size=SHARD)
    assert _index(out) == _index(tmp_path / "ref")
    return dense


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_zero2_trains_like_one_dense_process_and_exports_without_gather(saved, launched, family, tmp_path):
    out = launched / f"{family}-hf"
    dense = _loads_strictly_like_the_dense_replay(saved, launched, family, out, tmp_path, "export_s")
    assert len(list(out.glob("model-*.safetensors"))) > 2
    # the offline, streamed export of the run's checkpoint writes the same tensors into the same files
    from safetensors.torch import load_file

    from lightning_zero.models.llama.hf import export_hf

    offline = export_hf(launched / f"{family}.ckpt", tmp_path / "offline", max_shard_size=SHARD)
    assert _index(offline) == _index(out)
    assert json.loads((offline / "config.json").read_text()) == json.loads((out / "config.json").read_text())
    for file in out.glob("model-*.safetensors"):
        mine, streamed = load_file(file), load_file(offline / file.name)
        assert mine.keys() == streamed.keys() and all(torch.equal(mine[k], streamed[k]) for k in mine)
    if family == "llama":  # to a URL: written, then uploaded (index and config.json last)
        import fsspec

        export_hf(launched / f"{family}.ckpt", "memory://hf-export/llama", max_shard_size=SHARD)
        fs = fsspec.filesystem("memory")
        assert sorted(Path(p).name for p in fs.ls("/hf-export/llama", detail=False)) == sorted(
            p.name for p in offline.iterdir()
        )
        for file in offline.iterdir():
            assert fs.cat_file(f"/hf-export/llama/{file.name}") == file.read_bytes()
        # a live export to a URL without multipart uploads: streamed in order through rank 0, the same bytes
        save_hf_pretrained("memory://hf-export/live", module=dense.model, engine=None, layout=RankPlacement())
        save_hf_pretrained(tmp_path / "live", module=dense.model, engine=None, layout=RankPlacement())
        for file in (tmp_path / "live").iterdir():
            assert fs.cat_file(f"/hf-export/live/{file.name}") == file.read_bytes()


def test_tp2_zero2_no_gather_export_to_s3_loads_strictly_in_transformers(saved, launched, tmp_path):
    """[Note: no-gather Hugging Face export to a URL]: the TP=2 x ZeRO-2 llama run (4 ranks) also
    exported to s3:// (moto): each file a multipart upload whose parts the ranks uploaded. Downloaded,
    it loads strictly in transformers with the dense replay's logits, its index is save_pretrained's,
    and every file is the local export's byte for byte."""
    if not (launched / "hf_url.json").exists():
        pytest.skip("s3fs / moto not installed (pip install lightning-zero[test])")
    import fsspec

    where = json.loads((launched / "hf_url.json").read_text())
    fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **where["options"])
    fs.get(f"{where['url']}/llama-hf/", str(tmp_path / "from-s3"), recursive=True)
    got, local = tmp_path / "from-s3", launched / "llama-hf"
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in local.iterdir())
    for file in local.iterdir():
        assert (got / file.name).read_bytes() == file.read_bytes(), file.name
    _loads_strictly_like_the_dense_replay(saved, launched, "llama", got, tmp_path, "url_export_s")


def test_fabric_zero3_no_gather_export_loads_strictly(saved, launched, tmp_path):
    out = launched / "fabric-qwen2-hf"
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert _max_diff(Llama.from_pretrained(saved["root"] / "qwen2"), theirs.eval(), _tokens()) <= 1e-5
    theirs.save_pretrained(tmp_path / "ref", max_shard_size=SHARD)
    assert _index(out) == _index(tmp_path / "ref")


def test_sliding_window_refuses_ring_attention_and_keeps_ulysses():
    from lightning_zero.comm.mesh import ParallelDims
    from lightning_zero.models.llama.model import check_llama_layout

    config = LlamaConfig(name="window", vocab_size=64, dim=48, n_layers=1, n_heads=6, n_kv_heads=3, ffn_dim=64,
                         max_seq_len=64, sliding_window=8, family="mistral")  # fmt: skip
    ring = ParallelDims(world_size=4, devices_per_node=4, cp=4)  # 6 heads do not split over 4: the ring
    with pytest.raises(ValueError, match="sliding window of 8 tokens, which ring attention does not apply"):
        check_llama_layout(config, ring, owner="Llama", seq_len=16)
    with pytest.warns(UserWarning, match="ring attention"):  # the window never bites: the ring, stated
        check_llama_layout(config, ring, owner="Llama", seq_len=8)
    with pytest.warns(UserWarning):  # Ulysses (2 divides 6 heads; kv heads repeat): allowed
        check_llama_layout(config, ParallelDims(world_size=2, devices_per_node=2, cp=2), owner="Llama", seq_len=16)


def test_expert_parallel_no_gather_export_loads_strictly(launched):
    """ZeRO-2 with ep=2: each rank writes the experts it holds into the per-expert tensors."""
    out = launched / "moe-mixtral-hf"
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    source = transformers.AutoModelForCausalLM.from_pretrained(launched / "mixtral").eval()
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (theirs.eval()(idx).logits - source(idx).logits).abs().max().item() == 0.0  # the same weights
    assert len(list(out.glob("model-*.safetensors"))) > 2
