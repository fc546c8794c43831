"""Expert parameters as their own ZeRO domain (issue 54, [Note: expert domain] in zero/domains.py).

A toy mixture of experts whose experts are split over the EP ranks (each EP rank holds and computes
with only its experts; tokens reach them by an all-gather over the EP group and come back by an
all-reduce) trains under the engine at stages 1-3 on 2 and 4 gloo ranks, ep = 2 and 4, with
gradient accumulation and clipping, and equals one process training the full model on every
rank's batch (ddp's arithmetic: the mean of the ranks' losses) to 1e-5 in losses and weights. One
expert is never routed to: as under ddp it keeps ``.grad = None`` and AdamW leaves it unchanged
(no weight decay), even though the expert at the same position on the other EP rank is used
([Note: parameters nobody used], per domain); and some experts get no token from one EP group in a
step while another group uses them (checked). Bytes per rank: expert parameters / ep, sharded over
the EDP group, equal ``ledger.model_state_bytes(..., expert_params=, ep=)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.zero.domains import mark_expert_param
from tests.distributed import run_ranks

DIM, EXPERTS, TOKENS, STEPS, MICRO, CLIP = 8, 4, 6, 3, 2, 0.05
NEVER = EXPERTS - 1  # the router's bias keeps this expert from ever being chosen


class _GatherTokens(torch.autograd.Function):
    """Forward: every EP rank's tokens, concatenated; backward: the summed gradient of this rank's."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        rows = grad.shape[0] // ctx.size
        return grad[ctx.rank * rows : (ctx.rank + 1) * rows], None


class _CombineTokens(torch.autograd.Function):
    """Forward: every EP rank's expert outputs summed, this rank's tokens kept; backward: gathered."""

    @staticmethod
    def forward(ctx, out, group):
        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), dist.get_world_size(group)
        out = out.contiguous().clone()
        dist.all_reduce(out, group=group)
        rows = out.shape[0] // ctx.size
        return out[ctx.rank * rows : (ctx.rank + 1) * rows]

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(ctx.size)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


class Block(nn.Module):
    """A dense layer, a top-1 router and ``EXPERTS / ep`` experts: one ``(DIM, DIM)`` Parameter each
    (an expert no token reaches is not run, so its parameter gets no gradient), or ``stacked``: one
    ``(EXPERTS / ep, DIM, DIM)`` Parameter, this EP rank's rows of the dense one (every expert
    runs, on zero rows where no token reached it, as ``models/moe`` does)."""

    def __init__(self, ep_size: int = 1, ep_rank: int = 0, group=None, stacked: bool = False) -> None:
        super().__init__()
        self.dense = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, EXPERTS)
        with torch.no_grad():
            self.router.bias[NEVER] = -100.0
        experts = [nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5) for _ in range(EXPERTS)]
        local = EXPERTS // ep_size
        self.offset = ep_rank * local
        self.experts = nn.ParameterList(experts[self.offset : self.offset + local])
        if stacked:
            self.experts = nn.ParameterList([nn.Parameter(torch.stack(list(self.experts)).detach())])
        for param in self.experts:
            mark_expert_param(param, shard_dim=0 if stacked else None)
        self.stacked = stacked
        self.group = group
        self.routed: list[list[int]] = []  # tokens per global expert this block ran, per forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (T, DIM)
        h = torch.tanh(self.dense(x))
        gate, choice = torch.softmax(self.router(h), dim=-1).max(dim=-1)
        if self.group is not None:  # EP: every EP rank's tokens come here, each rank runs its experts
            h = _GatherTokens.apply(h, self.group)
            gate = _GatherTokens.apply(gate, self.group)
            choices = [torch.empty_like(choice) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(choices, choice, group=self.group)
            choice = torch.cat(choices)
        out = (
            h + gate[:, None]
        ) * 0.0  # h and gate in the graph on every rank: every rank runs the exchanges' backward
        counts = [0] * EXPERTS
        local = list(self.experts[0]) if self.stacked else list(self.experts)
        for k, weight in enumerate(local):
            rows = (choice == self.offset + k).nonzero().flatten()
            counts[self.offset + k] = len(rows)
            if len(rows) or self.stacked:
                out = out.index_add(0, rows, gate[rows, None] * (h[rows] @ weight))
        self.routed.append(counts)
        if self.group is not None:
            out = _CombineTokens.apply(out, self.group)
        return x + out


class ToyMoE(nn.Module):
    def __init__(self, ep_size: int = 1, ep_rank: int = 0, group=None, stacked: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList([Block(ep_size, ep_rank, group, stacked) for _ in range(2)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()

    def check_parallel_dims(self, dims) -> None:
        """[Note: layouts a model declares]: its experts split over ep."""
        if EXPERTS % dims.ep or dims.cp != 1:
            raise ValueError(f"ToyMoE: ep({dims.ep}) must divide its {EXPERTS} experts, and cp({dims.cp}) be 1")


def _batches(world: int):
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(world, TOKENS, DIM, generator=gen) for _ in range(MICRO)] for _ in range(STEPS)]


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _reference(world: int):
    """One process, the full model, every rank's batch: ddp's mean of the ranks' losses."""
    model = ToyMoE()
    optimizer = _optimizer(model)
    losses = []
    for batch in _batches(world):
        optimizer.zero_grad()
        step_losses = [0.0] * world
        for x in batch:
            for rank in range(world):
                loss = model(x[rank]) / MICRO
                (loss / world).backward()
                step_losses[rank] += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        losses.append(step_losses)
    assert model.blocks[0].experts[NEVER].grad is None, "the never-routed expert must stay unused"
    weights = {name: param.detach().clone() for name, param in model.named_parameters()}
    return losses, weights


def _run(rank: int, world: int, stage: int, ep: int, expected) -> None:
    from lightning_zero.comm.mesh import ParallelDims, build_groups
    from lightning_zero.config import ZeroConfig
    from lightning_zero.ledger import model_state_bytes
    from lightning_zero.runtime.setup import broadcast_module_states
    from lightning_zero.zero.domains import ExpertDomain
    from lightning_zero.zero.engine import EngineGroups, ZeroEngine

    want_losses, want_weights, full_expert_numel = expected
    dims = ParallelDims(world_size=world, devices_per_node=world, ep=ep)
    groups = build_groups(dims)
    ep_rank = groups.rank_in("ep")
    model = ToyMoE(ep, ep_rank, groups.ep)
    broadcast_module_states(model, groups.dp_cp, groups.edp)
    optimizer = _optimizer(model)
    domain = ExpertDomain.from_mesh(groups)
    engine = ZeroEngine(
        model,
        [optimizer],
        ZeroConfig(stage=stage, bucket_mb=0.0005, collective_timeout=20),
        groups=EngineGroups(expert=domain),
    )
    sharded = engine.sharded_optimizer(optimizer)
    assert {group.dp_rank for group in engine.groups if group.domain is not None} == {groups.rank_in("edp")}
    for step, batch in enumerate(_batches(world)):
        optimizer.zero_grad()
        engine.begin_step("train")
        total = 0.0
        for micro, x in enumerate(batch):
            with engine.no_sync() if micro < MICRO - 1 else torch.enable_grad():
                loss = model(x[rank]) / MICRO
                engine.backward(loss)
            total += loss.item()
        sharded.clip_grad_norm_(CLIP)
        optimizer.step()
        engine.end_step_call()
        assert abs(total - want_losses[step][rank]) < 1e-5, (step, total, want_losses[step][rank])

    # bytes per rank: dense over dp*cp, experts / ep over edp (padded, as the engine holds them)
    dense = sum(g.layout.numel for g in engine.groups if g.domain is None)
    local_experts = sum(g.layout.numel for g in engine.groups if g.domain is not None)
    assert local_experts >= full_expert_numel // ep
    want = model_state_bytes(dense + ep * local_experts, stage=stage, dp=dims.dp_cp, param_bytes=4, grad_bytes=4,
                             optim_bytes_per_param=8, expert_params=ep * local_experts, ep=ep)  # fmt: skip
    got = engine.measured_bytes()
    assert (got["params"], got["grads"]) == (want.params, want.grads), (got, want)
    assert 8 * sum(m.numel() for g in engine.groups for m in g.masters) == want.optimizer

    engine.release_module()
    for name, param in model.named_parameters():
        if name.startswith("blocks.") and ".experts." in name:
            prefix, local = name.rsplit(".", 1)
            name = f"{prefix}.{int(local) + ep_rank * (EXPERTS // ep)}"  # this EP rank's global expert
        torch.testing.assert_close(param.detach(), want_weights[name], rtol=1e-5, atol=1e-5, msg=name)
    engine.close()


def _all_cases(rank: int, world: int, cases, expected) -> None:
    for case, want in zip(cases, expected):
        try:
            _run(rank, world, *case, want)
        except AssertionError as err:
            raise AssertionError(f"stage {case[0]}, ep {case[1]} on {world} ranks: {err}") from err
    _refuses_replicated_optimizers(world)


def _refuses_replicated_optimizers(world: int) -> None:
    from lightning_zero.comm.mesh import ParallelDims, build_groups
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.domains import ExpertDomain
    from lightning_zero.zero.engine import EngineGroups, ZeroEngine

    groups = build_groups(ParallelDims(world_size=world, devices_per_node=world, ep=2))
    model = ToyMoE(2, groups.rank_in("ep"), groups.ep)
    with pytest.raises(ValueError, match=r"Adafactor steps replicated full masters.*ep > 1"):
        ZeroEngine(model, [torch.optim.Adafactor(model.parameters())], ZeroConfig(stage=2),
                   groups=EngineGroups(expert=ExpertDomain.from_mesh(groups)))  # fmt: skip


def _expected(world: int, cases):
    losses, weights = _reference(world)
    full_expert_numel = sum(p.numel() for n, p in ToyMoE().named_parameters() if ".experts." in n)
    return [(losses, weights, full_expert_numel) for _ in cases]


def _routing_differs_between_ep_groups(world: int, ep: int) -> bool:
    """Whether, in some forward, an expert got tokens from one EP group and none from another."""
    model = ToyMoE()
    groups = world // ep
    for batch in _batches(world):
        for x in batch:
            per_group = []
            for group in range(groups):
                for block in model.blocks:
                    block.routed.clear()
                for rank in range(group * ep, (group + 1) * ep):
                    model(x[rank])
                per_group.append([[sum(col) for col in zip(*b.routed)] for b in model.blocks])
            for block in range(2):
                for expert in range(EXPERTS):
                    used = [per_group[g][block][expert] > 0 for g in range(groups)]
                    if any(used) and not all(used):
                        return True
    return False


@pytest.mark.parametrize("world, cases", [(2, [(1, 2), (2, 2), (3, 2)]), (4, [(1, 2), (2, 2), (3, 2), (3, 4), (2, 4)])])
def test_experts_train_like_ddp(world, cases):
    if world == 4:
        assert _routing_differs_between_ep_groups(4, 2), "the data should leave an expert idle in one EP group"
    run_ranks(_all_cases, world, args=(cases, _expected(world, cases)), timeout_s=300)


# -- checkpoints: an EP rank's stacked experts are rows of the dense tensor; resume on another ep ---


def _stacked_reference(world: int, steps: int):
    model = ToyMoE(stacked=True)
    optimizer = _optimizer(model)
    for batch in _batches(world)[:steps]:
        optimizer.zero_grad()
        for x in batch:
            for rank in range(world):
                (model(x[rank]) / MICRO / world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _train_stacked(rank, world, stage, ep, steps, out, *, load=None, save=None):
    """The stacked toy under ``(stage, ep)``: optionally loaded from ``load``, trained on ``steps``
    (step indices), optionally saved to ``save``; returns its dense weights (experts by rows)."""
    from lightning_zero.checkpoint import (
        RankPlacement,
        apply_optimizer_state,
        load_model,
        open_checkpoint,
        save_checkpoint,
    )
    from lightning_zero.comm.mesh import ParallelDims, build_groups
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.domains import ExpertDomain
    from lightning_zero.zero.engine import EngineGroups, ZeroEngine

    dims = ParallelDims(world_size=world, devices_per_node=world, ep=ep)
    groups = build_groups(dims)
    ep_rank = groups.rank_in("ep")
    model = ToyMoE(ep, ep_rank, groups.ep, stacked=True, seed=123 if load else 0)  # loaded: weights come from there
    optimizer = _optimizer(model)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, bucket_mb=0.0005, collective_timeout=20),
                        groups=EngineGroups(expert=ExpertDomain.from_mesh(groups)))  # fmt: skip
    layout = RankPlacement(world_size=world, rank=rank, dp_size=world, dp_rank=rank, stage=stage, ep_size=ep,
                           ep_rank=ep_rank)  # fmt: skip
    if load is not None:
        opened = open_checkpoint(load, layout)
        apply_optimizer_state(opened, [optimizer], load_model(opened, model, engine=engine, optimizers=[optimizer],
                                                              layout=layout))  # fmt: skip
    batches = _batches(world)
    for step in steps:
        optimizer.zero_grad()
        engine.begin_step("train")
        for micro, x in enumerate(batches[step]):
            with engine.no_sync() if micro < MICRO - 1 else torch.enable_grad():
                engine.backward(model(x[rank]) / MICRO)
        engine.sharded_optimizer(optimizer).clip_grad_norm_(CLIP)
        optimizer.step()
        engine.end_step_call()
    if save is not None:
        save_checkpoint(save, {"global_step": len(steps), "optimizer_states": []}, module=model, engine=engine,
                        optimizers=[optimizer], layout=layout)  # fmt: skip
    engine.release_module()
    weights = {}
    for name, param in model.named_parameters():
        value = param.detach().clone()
        if ".experts." in name and ep > 1:  # the dense tensor: every EP rank's rows
            parts = [torch.empty_like(value) for _ in range(ep)]
            dist.all_gather(parts, value, group=groups.ep)
            value = torch.cat(parts)
        weights[name] = value
    engine.close()
    return weights


def _resume_across_ep(rank, world, out, expected):
    from pathlib import Path

    saved = Path(out, "ep2")
    _train_stacked(rank, world, 2, 2, [0, 1], out, save=saved)
    for stage, ep in ((3, 1), (1, 4), (3, 2)):
        got = _train_stacked(rank, world, stage, ep, [2], out, load=saved)
        for name, want in expected.items():
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5, msg=f"stage {stage}, ep {ep}: {name}")


def test_checkpoint_resumes_exactly_on_another_ep(tmp_path):
    """Saved at ep=2 (stage 2, 4 ranks) after 2 steps; loaded at ep=1 (stage 3), ep=4 (stage 1) and
    ep=2 (stage 3), one more step equals one process's 3 steps: weights, masters and Adam state
    came back in dense coordinates."""
    run_ranks(_resume_across_ep, 4, args=(str(tmp_path), _stacked_reference(4, 3)), timeout_s=300)


def test_fabric_trains_experts_like_ddp(tmp_path):
    """The Fabric door with ``ep=2``, stages 1-3 (tests/scripts/fabric_ep.py asserts the numbers on
    each rank); a model that does not declare its layouts is refused at setup, naming ep; a full file
    saved at ep=2 (stage 3) continues under Fabric's ddp, and back under ep=2, as the ep=2 run does;
    our ``MoETransformer``, whose experts ``fabric.setup`` splits, trains as under Fabric's ddp
    (aux losses in the loss, the selection-bias update, accumulation and clipping)."""
    import json

    from tests.distributed import launch

    launch("fabric_ep.py", tmp_path, timeout_s=400)
    for rank in range(2):
        result = json.loads((tmp_path / f"fabric_ep.rank{rank}.json").read_text())
        assert all(result[f"stage{stage}"] < 1e-5 for stage in (1, 2, 3)), result
        assert result["expert_shape"] == [EXPERTS, DIM, DIM]  # the full file holds every expert
        assert result["full_file_vs_ddp"] < 1e-5 and result["full_file_back_to_ep2"] < 1e-5, result
        assert "ZeroStrategy(ep=2): Linear does not declare that it splits its experts over ep" in result["refused"]
        _check_fabric_moe(result, ["stage1_ep2", "stage2_ep2", "stage3_ep2", "stage3_meta_ep2"])


def _check_fabric_moe(result: dict, cases: list[str]) -> None:
    """Our MoETransformer (8 experts), split by ``fabric.setup``, against Fabric's ddp
    (tests/scripts/fabric_ep.py ``moe_model``)."""
    for case in cases:
        moe = result[f"moe_{case}"]
        assert moe["loss"] < 1e-5 and moe["weights"] < 1e-5, (case, moe)
        ep = int(case.rsplit("_ep", 1)[1])
        assert moe["expert_rows"] == 8 // ep and moe["bias_moved"] > 0, (case, moe)  # this rank's experts; bias moved
        assert {"moe_dispatch", "moe_combine", "moe_dispatch_grad"} <= set(moe["counted"]), moe


def test_fabric_moe_transformer_on_four_ranks(tmp_path):
    """4 ranks: ``MoETransformer`` under ``ZeroFabricStrategy`` at ep=2 (stage 2: experts sharded over
    an EDP group of 2) and ep=4 (stage 3), against Fabric's ddp on 4 ranks."""
    import json

    from tests.distributed import launch

    launch("fabric_ep.py", tmp_path, "moe", timeout_s=300, ranks=4)
    for rank in range(4):
        _check_fabric_moe(
            json.loads((tmp_path / f"fabric_ep.rank{rank}.json").read_text()), ["stage2_ep2", "stage3_ep4"]
        )


def test_moe_transformer_declares_ep():
    """``MoETransformer.check_parallel_dims`` (what the Fabric door asks at ``fabric.setup``) accepts
    an ``ep`` that divides the experts and refuses the rest naming the fix, before any collective."""
    from lightning_zero.comm.mesh import ParallelDims
    from lightning_zero.models.moe import MoETransformer, resolve_moe_config

    with torch.device("meta"):
        model = MoETransformer(resolve_moe_config({"name": "tiny_moe_shared", "n_experts": 6}))
    model.check_parallel_dims(ParallelDims(world_size=6, devices_per_node=6, ep=3))
    with pytest.raises(ValueError, match=r"ep\(4\) does not divide n_experts\(6\).*pick ep from \[1, 2, 3, 6\]"):
        model.check_parallel_dims(ParallelDims(world_size=4, devices_per_node=4, ep=4))
