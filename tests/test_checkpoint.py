"""Sharded checkpoints at the function level (no Lightning): format pieces, resharding, export, safety.

Multi-process parts (two launches: 2 and 4 ranks) save a tiny Llama trained by ``ZeroEngine``
on 2 gloo ranks and load it at other layouts (dp 1 / 4, the other ZeRO stage, tp 2 -> 1); each rank dumps the dense values of
what it owns (master, Adam moments) and the test compares the assembled tensors exactly.
``STAGES`` lists the ZeRO stages saved (one 2-rank launch) and resharded between.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint.dcp import CheckpointError, range_pieces, read_dcp_metadata, storage_shape
from lightning_zero.checkpoint.state import decode, encode
from tests.distributed import run_ranks
from tests.engine_state import llama_step

STAGES = (1, 2, 3)
CONFIG = dict(name="ckpt", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


# --------------------------------------------------------------------------------------------
# Pure logic
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7,), (5, 6), (4, 3, 2)])
@pytest.mark.parametrize("tp_dim", [None, 0, 1])
def test_range_pieces_cover_the_range_exactly(shape, tp_dim):
    if tp_dim == 1 and len(shape) != 2:
        return
    numel = math.prod(shape)
    tp, tp_rank = 3, 1
    local = torch.arange(numel).reshape(shape)
    dense_shape = list(shape)
    if tp_dim is not None:
        dense_shape[tp_dim] *= tp
    dense = torch.full(storage_shape(dense_shape), -1)
    for lo in range(numel):
        for hi in range(lo, numel + 1):
            dense.fill_(-1)
            flat = local.reshape(-1)[lo:hi]
            pieces = range_pieces(shape, lo, hi, tp_dim=tp_dim, tp_rank=tp_rank)
            assert len(pieces) <= 3 and sum(p.numel for p in pieces) == hi - lo
            for p in pieces:
                region = dense
                for d, (o, s) in enumerate(zip(p.offsets, p.sizes)):
                    region = region.narrow(d, o, s)
                region.copy_(flat[p.start : p.start + p.numel].view(p.sizes))
            # the written elements are exactly local[lo:hi] at their dense positions
            view = local.reshape(storage_shape(shape))
            placed = dense
            if tp_dim is not None:
                placed = dense.narrow(tp_dim, tp_rank * view.shape[tp_dim], view.shape[tp_dim])
            got = placed.reshape(-1)
            want = torch.full_like(got, -1)
            want[lo:hi] = flat
            assert torch.equal(got, want), (lo, hi)


def test_state_codec_round_trip():
    import random

    import numpy as np

    state = {
        "epoch": 3,
        "loops": {"fit_loop": {"a": (1, 2.5, None), 5: [True, "x"]}},
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "score": torch.tensor(0.25),
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    }
    back = decode(json.loads(json.dumps(encode(state))))
    assert back["epoch"] == 3 and back["loops"]["fit_loop"]["a"] == (1, 2.5, None)
    assert back["loops"]["fit_loop"][5] == [True, "x"]
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"]) and back["rng"]["python"] == state["rng"]["python"]
    assert np.array_equal(back["rng"]["numpy"][1], state["rng"]["numpy"][1])
    assert torch.equal(back["bf16"], state["bf16"]) and back["score"].item() == 0.25


def test_state_codec_refuses_objects_with_the_key_path():
    with pytest.raises(TypeError, match=r"checkpoint\.callbacks\.cb"):
        encode({"callbacks": {"cb": object()}}, "checkpoint")


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_dcp_metadata_unpickler_refuses_globals(tmp_path):
    bad = tmp_path / ".metadata"
    bad.write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match=r"\.metadata: refusing to unpickle"):
        read_dcp_metadata(str(bad))
    assert not Path("PWNED").exists()


# --------------------------------------------------------------------------------------------
# Multi-process bodies
# --------------------------------------------------------------------------------------------


def _config():
    from lightning_zero.models.llama import LlamaConfig

    return LlamaConfig(**CONFIG)


def _optimizer(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
    )


def _dump_owned(engine, opt, path, tp_rank=0):
    """Each owned range: (name, lo, hi, master values, exp_avg, exp_avg_sq, step) in local coordinates."""
    rows = []
    for r in engine.owned_ranges():
        state = opt.state.get(engine.optimizer_tensor(r), {})  # the run's own state tensors
        get = lambda k, state=state: state[k].clone() if k in state else None  # noqa: E731
        rows.append((r.name, r.param_lo, r.param_hi, r.master.detach()[r.chunk_lo : r.chunk_hi].clone(),
                     get("exp_avg"), get("exp_avg_sq"), float(state["step"]) if "step" in state else None, tp_rank))  # fmt: skip
    torch.save(rows, path)


def _dp_groups(world, tp):
    """(dp_group, tp_group) for consecutive TP ranks, built identically on every rank."""
    import torch.distributed as dist

    rank = dist.get_rank()
    dp_group = tp_group = None
    for start in range(0, world, tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= rank < start + tp:
            tp_group = group
    for offset in range(tp):
        group = dist.new_group(list(range(offset, world, tp)))
        if rank % tp == offset:
            dp_group = group
    return dp_group, tp_group


def _save_body(rank, world, out, stage, tp):
    import torch.distributed as dist

    from lightning_zero.checkpoint import RankPlacement, save_checkpoint
    from lightning_zero.config import ZeroConfig
    from lightning_zero.models.llama import Llama
    from lightning_zero.zero.engine import EngineGroups, ZeroEngine

    torch.manual_seed(0)
    model = Llama(_config())
    dp_group, tp_group = _dp_groups(world, tp)
    if tp > 1:
        from lightning_zero.models.llama.parallelize import parallelize_llama

        parallelize_llama(model, tp_group)
    opt = _optimizer(model)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, bucket_mb=0.01), groups=EngineGroups(dp=dp_group))
    dp_rank, dp = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        llama_step(model, opt, engine, gen, dp_rank, dp)
    layout = RankPlacement(
        world_size=world, rank=rank, dp_size=dp, dp_rank=dp_rank, tp_size=tp, tp_rank=rank % tp, stage=stage
    )
    save_checkpoint(Path(out, "ckpt"), {"global_step": 2, "optimizer_states": []}, module=model, engine=engine,
                    optimizers=[opt], layout=layout)  # fmt: skip
    if tp == 1:
        _count_host_copies(Path(out, f"host_copies.rank{rank}.json"), model, engine, opt, layout)
    _dump_owned(engine, opt, Path(out, f"saved.rank{rank}.pt"), tp_rank=rank % tp)
    if tp > 1:
        from lightning_zero.tp import gather_tp_state_dict

        dense = gather_tp_state_dict(model, tp_group)
    else:
        engine.unshard_parameters()  # stage 3: parameters are views of freed storage until gathered
        dense = {k: v.clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(dense, Path(out, "dense.pt"))
    engine.close()


def _count_host_copies(path, model, engine, opt, layout):
    """``Tensor.cpu`` calls made while collecting what a save writes: a synchronous save's snapshot
    copies each device tensor to the host there; a background save's snapshot and the shapes its
    buffers are prepared from must not (on a GPU each would be a pageable device-to-host copy on
    the training thread, before the copy into the pinned buffers: [Note: background saves])."""
    from lightning_zero.checkpoint.background import live_tensors
    from lightning_zero.checkpoint.save import snapshot

    calls = []
    real_cpu = torch.Tensor.cpu

    def counted(self, *args, **kwargs):
        calls.append(self.is_floating_point())  # not the RNG states' bytes (JSON, a few KiB)
        return real_cpu(self, *args, **kwargs)

    entries = dict(module=model, engine=engine, optimizers=[opt], layout=layout)
    counts = {}
    torch.Tensor.cpu = counted
    try:
        for case, collect in {
            "sync": lambda: snapshot(Path(path).parent / "unused", {"optimizer_states": []}, **entries),
            "background": lambda: snapshot(
                Path(path).parent / "unused", {"optimizer_states": []}, **entries, keep_device=True
            ),  # fmt: skip
            "prepare": lambda: live_tensors(**entries, with_optimizer=True),
        }.items():
            calls.clear()
            collect()
            counts[case] = sum(calls)
    finally:
        torch.Tensor.cpu = real_cpu
    Path(path).write_text(json.dumps(counts))


def _save_stages(rank, world, out, stages, loads):
    """One 2-rank launch: a dp=2 checkpoint per stage under ``out/s<stage>``, a tp=2 one under
    ``out/tp``, then the 2-rank ``loads`` (see :func:`_load_body`)."""
    for stage in stages:
        Path(out, f"s{stage}").mkdir(exist_ok=True)
        _save_body(rank, world, str(Path(out, f"s{stage}")), stage, 1)
    Path(out, "tp").mkdir(exist_ok=True)
    _save_body(rank, world, str(Path(out, "tp")), 1, 2)
    _load_body(rank, world, str(Path(out, "load")), loads)


def _load_body(rank, world, out, cases):
    """``cases``: (checkpoint dir, tag, stage, dp) loaded one after another in this launch; dp is
    ``world`` or 1 (every rank its own dp=1 replica; rank 0 dumps)."""
    import torch.distributed as dist

    from lightning_zero.checkpoint import RankPlacement, apply_optimizer_state, load_model, open_checkpoint
    from lightning_zero.config import ZeroConfig
    from lightning_zero.models.llama import Llama
    from lightning_zero.zero.engine import EngineGroups, ZeroEngine

    singles = [dist.new_group([r]) for r in range(world)] if world > 1 else [None]  # every rank makes every group
    for src, tag, stage, dp in cases:
        torch.manual_seed(123)  # different initial weights: everything must come from the checkpoint
        model = Llama(_config())
        opt = _optimizer(model)
        dp_group = None if dp == world else singles[rank]
        engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, bucket_mb=0.003), groups=EngineGroups(dp=dp_group))
        dp_rank = rank if dp == world else 0
        layout = RankPlacement(world_size=world, rank=rank, dp_size=dp, dp_rank=dp_rank, stage=stage)
        opened = open_checkpoint(Path(src, "ckpt"), layout)
        states = load_model(opened, model, engine=engine, optimizers=[opt], layout=layout)
        apply_optimizer_state(opened, [opt], states)
        if dp == world or rank == 0:
            _dump_owned(engine, opt, Path(out, f"{tag}.rank{dp_rank}.pt"))
        engine.unshard_parameters()  # stage 3: gathers the refreshed shards
        if rank == 0:
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, Path(out, f"{tag}.params.pt"))
        engine.close()


def _assemble(files, shapes, tp_dims=None, tp=1):
    """Dense {name: {kind: tensor}} from dumped owned ranges (TP-local ranges placed by tp rank)."""
    dense = {}
    for file in files:
        for name, lo, hi, master, m, v, step, tp_rank in torch.load(file, weights_only=False):
            dim = (tp_dims or {}).get(name)
            local_shape = list(shapes[name])
            if dim is not None and tp > 1:
                local_shape[dim] //= tp
            entry = dense.setdefault(name, {k: torch.full(shapes[name], float("nan")) for k in ("master", "m", "v")})
            for kind, values in (("master", master), ("m", m), ("v", v)):
                local = torch.full(local_shape, float("nan"))
                local.reshape(-1)[lo:hi] = values
                target = (
                    entry[kind]
                    if dim is None or tp == 1
                    else entry[kind].narrow(dim, tp_rank * local_shape[dim], local_shape[dim])
                )
                mask = ~torch.isnan(local)
                target[mask] = local[mask]
            entry["step"] = step
    return dense


def _assert_same_dense(got, want):
    assert set(got) == set(want)
    for name in want:
        for kind in ("master", "m", "v"):
            assert not torch.isnan(want[name][kind]).any(), (name, kind)
            assert torch.equal(got[name][kind], want[name][kind]), (name, kind)
        assert got[name]["step"] == want[name]["step"]


def _cases(out, world):
    cases = [(str(out / f"s{s}"), f"w{w}_s{s}_to{t}", t, w) for w, s, t in RESHARD if w == world]
    if world == 1:
        cases.append((str(out / "tp"), "tp_to_dense", 1, 1))
    return cases


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """dp=2 checkpoints of every stage and a tp=2 one, loaded at dp 2 and dp 1 (each of the 2 ranks
    its own replica) in the same launch, then at dp 4: two launches."""
    out = tmp_path_factory.mktemp("ckpt_dp2")
    (out / "load").mkdir()
    run_ranks(_save_stages, world_size=2, args=(str(out), STAGES, _cases(out, 2) + _cases(out, 1)), timeout_s=120)
    run_ranks(_load_body, world_size=4, args=(str(out / "load"), _cases(out, 4)), timeout_s=120)
    return out


@pytest.fixture(scope="module")
def saved_dp2(saved):
    return saved / "s2"


def _shapes(out):
    return {k: tuple(v.shape) for k, v in torch.load(Path(out, "dense.pt")).items()}


# (world, saved stage, loaded stage): dp 2 -> 1 / 2 / 4 and every stage to another
RESHARD = [(1, 2, 1), (1, 3, 3), (2, 2, 1), (2, 2, 3), (2, 3, 2), (2, 3, 1), (4, 2, 2), (4, 3, 3)]


@pytest.mark.parametrize("world,saved_stage,stage", RESHARD)
def test_reshard_dp_and_stage(saved, world, saved_stage, stage):
    """dp 2 -> 1 / 2 / 4 and stage s -> t: every master value and Adam moment lands where it was."""
    tag = f"w{world}_s{saved_stage}_to{stage}"
    src = saved / f"s{saved_stage}"
    shapes = _shapes(src)
    want = _assemble(sorted(src.glob("saved.rank*.pt")), shapes)
    got = _assemble(sorted(saved.glob(f"load/{tag}.rank*.pt")), shapes)
    _assert_same_dense(got, want)
    params = torch.load(Path(saved, "load", f"{tag}.params.pt"))
    for name, value in params.items():
        assert torch.equal(value, want[name]["master"]), name  # compute params refreshed from masters


@pytest.mark.parametrize("stage", STAGES)
def test_a_background_save_leaves_device_tensors_to_its_own_copy(saved, stage):
    """[Note: background saves]: no tensor goes to pageable host memory while a background save
    (or the shapes of its prepared buffers) is collected; a synchronous save's does copy."""
    for rank in range(2):
        counts = json.loads(Path(saved, f"s{stage}", f"host_copies.rank{rank}.json").read_text())
        assert counts["background"] == counts["prepare"] == 0, counts
        assert counts["sync"] > 0, counts  # the count sees the copies a snapshot makes


def test_saved_weights_agree_across_stages(saved):
    """The same training at stage 1 / 2 / 3 gives the same weights (so resharding compares like with like)."""
    dense = {stage: torch.load(Path(saved, f"s{stage}", "dense.pt")) for stage in STAGES}
    for stage in STAGES[1:]:
        for name, value in dense[STAGES[0]].items():
            torch.testing.assert_close(
                dense[stage][name],
                value,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, stage=stage, name=name: f"stage {stage} {name}: {m}",
            )


def test_reshard_tp2_to_dense(saved):
    """tp 2 (dp 1) -> tp 1: row- and column-split weights and their Adam moments reassemble."""
    src = saved / "tp"
    dense = torch.load(Path(src, "dense.pt"))
    shapes = {k: tuple(v.shape) for k, v in dense.items()}
    meta = json.loads(Path(src, "ckpt", "meta.json").read_text())
    tp_dims = {name: info["tp_dim"] for name, info in meta["params"].items()}
    assert tp_dims["layers.0.attention.wo.weight"] == 1 and tp_dims["layers.0.attention.wq.weight"] == 0
    want = _assemble(sorted(src.glob("saved.rank*.pt")), shapes, tp_dims, tp=2)
    got = _assemble(sorted(saved.glob("load/tp_to_dense.rank*.pt")), shapes)
    _assert_same_dense(got, want)
    for name, value in torch.load(Path(saved, "load", "tp_to_dense.params.pt")).items():
        assert torch.equal(value, dense[name]), name


# --------------------------------------------------------------------------------------------
# Export and safety (single process, on the dp=2 checkpoint)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_loads_into_a_bare_llama_with_the_same_logits(saved_dp2, tmp_path, suffix):
    from lightning_zero.checkpoint import export
    from lightning_zero.models.llama import Llama

    out = export(Path(saved_dp2, "ckpt"), tmp_path / f"llama{suffix}")
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(out))
    else:
        state = torch.load(out, weights_only=True)
    dense = torch.load(Path(saved_dp2, "dense.pt"))
    fresh, reference = Llama(_config()), Llama(_config())
    fresh.load_state_dict(state, strict=True)
    reference.load_state_dict(dense)
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))
    assert torch.equal(fresh(idx), reference(idx))


def _copy(src, dst):
    shutil.copytree(Path(src, "ckpt"), dst)
    return dst


def _rehash(ckpt, name):
    from lightning_zero.checkpoint.publish import sha256_of as _sha256

    meta = json.loads(Path(ckpt, "meta.json").read_text())
    path = Path(ckpt, name)
    meta["files"][name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    Path(ckpt, "meta.json").write_text(json.dumps(meta))


def _fresh_model_and_params():
    from lightning_zero.models.llama import Llama

    model = Llama(_config())
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def _load_dense(ckpt, model):
    from lightning_zero.checkpoint import load_model, open_checkpoint

    load_model(open_checkpoint(ckpt), model)


@pytest.mark.parametrize("damage", ["flip", "truncate", "meta_json"])
def test_damaged_checkpoint_fails_naming_the_file_and_loads_nothing(saved_dp2, tmp_path, damage):
    ckpt = _copy(saved_dp2, tmp_path / "ckpt")
    shard = Path(ckpt, "__1_0.distcp")
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        match = "__1_0.distcp: sha256"
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
        match = "__1_0.distcp: .* bytes, expected"
    else:
        Path(ckpt, "meta.json").write_text(Path(ckpt, "meta.json").read_text()[:-20])
        match = "meta.json: not valid JSON"
    model, before = _fresh_model_and_params()
    with pytest.raises(CheckpointError, match=match):
        _load_dense(ckpt, model)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])


def test_malicious_pickles_are_not_executed(saved_dp2, tmp_path, monkeypatch):
    """A pickle payload in .metadata or in a tensor record, with meta.json re-hashed to match."""
    from lightning_zero.checkpoint import export

    monkeypatch.chdir(tmp_path)
    ckpt = _copy(saved_dp2, tmp_path / "ckpt_meta")
    Path(ckpt, ".metadata").write_bytes(pickle.dumps(_Evil()))
    _rehash(ckpt, ".metadata")
    model, before = _fresh_model_and_params()
    with pytest.raises(CheckpointError, match="refusing to unpickle posix.system|refusing to unpickle os.system"):
        _load_dense(ckpt, model)

    ckpt = _copy(saved_dp2, tmp_path / "ckpt_tensor")
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    evil = io.BytesIO()
    torch.save({"x": _Evil()}, evil)
    Path(ckpt, "__0_0.distcp").write_bytes(evil.getvalue())
    metadata = read_dcp_metadata(str(Path(ckpt, ".metadata")))
    for index, info in list(metadata.storage_data.items()):
        if info.relative_path == "__0_0.distcp":
            metadata.storage_data[index] = _StorageInfo("__0_0.distcp", 0, len(evil.getvalue()))
    Path(ckpt, ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(ckpt, ".metadata")
    _rehash(ckpt, "__0_0.distcp")
    with pytest.raises(CheckpointError):
        _load_dense(ckpt, model)
    with pytest.raises(CheckpointError):
        export(ckpt, tmp_path / "out.safetensors")
    assert not (tmp_path / "PWNED").exists()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])


def test_unwritable_directory_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path):
    """Single process, no engine: an unwritable target names the path; an existing one survives."""
    from lightning_zero.checkpoint import CheckpointWriteError, RankPlacement, save_checkpoint
    from lightning_zero.models.llama import Llama

    model, before = _fresh_model_and_params()
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    with pytest.raises(CheckpointWriteError, match="not_a_dir"):
        save_checkpoint(
            blocker / "last.ckpt", {"global_step": 1}, module=model, engine=None, optimizers=[], layout=RankPlacement()
        )
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
    # publishing over an existing checkpoint replaces it whole; a stale temp dir is never "last"
    target = tmp_path / "last.ckpt"
    save_checkpoint(target, {"global_step": 1}, module=model, engine=None, optimizers=[], layout=RankPlacement())
    staging = f".lightning_zero-staging-0123456789ab-{'last.ckpt'.encode().hex()}"
    (tmp_path / staging).mkdir()  # what a rank killed mid-write leaves behind ([Note: staging names])
    other = Llama(_config())
    save_checkpoint(target, {"global_step": 2}, module=other, engine=None, optimizers=[], layout=RankPlacement())
    reloaded = Llama(_config())
    _load_dense(target, reloaded)
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, other.state_dict()[name])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "not_a_dir"]


def test_load_from_checkpoint_on_a_sharded_directory_names_export(tmp_path):
    from lightning_zero.checkpoint.publish import META_FILE
    from lightning_zero.models import LlamaLM

    sharded = tmp_path / "last.ckpt"
    sharded.mkdir()
    (sharded / META_FILE).write_text("{}")
    with pytest.raises(ValueError, match=r"sharded lightning_zero checkpoint.*lightning-zero export"):
        LlamaLM.load_from_checkpoint(str(sharded))
