"""Pipeline parallelism x ZeRO through ZeroStrategy(pp=P), for tests/test_pipeline.py.

Usage: python tests/scripts/pp_parity.py OUT_DIR DEVICES CASE [CASE ...]
Every rank writes OUT_DIR/<case>.rank<r>.pt: per-step losses and the parameters it holds (its
stages' under pp: the test joins the pp ranks'). Every case trains the same tiny Llama (4 blocks)
on the same global batch (4 sequences a step), accumulating 2 batches per optimizer step, with norm
clipping: ddp on 2 ranks (2 sequences each), pp=2 on 2 ranks (the 4 sequences cut into
micro-batches), pp=2 x dp=2 on 4 ranks (2 sequences per dp rank); a tiny MoE likewise (ddp_moe, and
pp=2 x ep=2 on 4 ranks). The case in SAVES writes a checkpoint at step 2 that the one in RESUMES
continues to step 4 without pp.
"""

import os
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torch.distributed.pipelining as pipelining  # noqa: E402

from lightning_zero.pp.measure import MeasuredStage, schedule_stages  # noqa: E402

# every pipelined case's stages count the bytes they send and receive ([Note: counting pipeline bytes])
pipelining.PipelineStage = MeasuredStage

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.data import TokenDataModule  # noqa: E402
from lightning_zero.models import LlamaLM  # noqa: E402
from lightning_zero.models.moe import MoELM  # noqa: E402
from tests.scripts.harness import checkpointed_trainer  # noqa: E402

SEQ = 16
CONFIG = dict(name="tiny", vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=SEQ)
# validation (forward through the stages) once before training, after step 2 and at the end
TRAINER = {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2, "num_sanity_val_steps": 1, "limit_val_batches": 1,
           "val_check_interval": 4}  # fmt: skip
STEPS = 4
GLOBAL_BATCH = 4


def zero(stage: int, **knobs):
    return lambda: ZeroStrategy(stage=stage, bucket_mb=0.01, **knobs)


SCHEDULES = {
    "gpipe": dict(pp_schedule="gpipe"),
    "1f1b": dict(pp_schedule="1f1b"),
    "interleaved": dict(pp_schedule="interleaved_1f1b", pp_virtual_stages=2),
    "zb": dict(pp_schedule="interleaved_zb", pp_virtual_stages=2),
    "zbv": dict(pp_schedule="zbv"),
}
# case: (strategy, dp ranks)
CASES = {"ddp": (lambda: "ddp", 2), "resume_pp2_ckpt_pp1": (zero(2), 2)}
for _stage in (1, 2):
    for _name, _knobs in SCHEDULES.items():
        CASES[f"pp2_{_name}_zero{_stage}"] = (zero(_stage, pp=2, **_knobs), 1)
        # 2 sequences per dp rank: 2 micro-batches of one (zbv needs 2 pp = 4)
        CASES[f"pp2dp2_{_name}_zero{_stage}"] = (zero(_stage, pp=2, pp_microbatches=2, **_knobs), 2)
# pp=2 x tp=2 (sequence parallel) on 4 ranks: each tp rank sends its sequence shard to its peer stage
TP_SP = dict(tensor_parallel_size=2, sequence_parallel=True)
for _stage in (1, 2, 3):
    for _name in SCHEDULES:
        CASES[f"pp2tp2_{_name}_zero{_stage}"] = (zero(_stage, pp=2, **TP_SP, **SCHEDULES[_name]), 1)
# pp=2 x tp=2 without sequence parallelism: each tp rank sends its T/tp slice of the replicated stream, the next
# stage all-gathers it ([Note: sequence-parallel stages]); a MoE's stages tp-split likewise (with and without SP)
NO_SP = dict(tensor_parallel_size=2, sequence_parallel=False)
for _stage in (1, 2, 3):
    for _name in SCHEDULES:
        CASES[f"pp2tp2nosp_{_name}_zero{_stage}"] = (zero(_stage, pp=2, **NO_SP, **SCHEDULES[_name]), 1)
        CASES[f"pp2tp2moe_{_name}_zero{_stage}"] = (zero(_stage, pp=2, **NO_SP, **SCHEDULES[_name]), 1)
        CASES[f"pp2tp2spmoe_{_name}_zero{_stage}"] = (zero(_stage, pp=2, **TP_SP, **SCHEDULES[_name]), 1)
# hybrid sharding inside the stages: pp=2 x dp=2, ZeRO over shard groups of one dp rank, replicated over two; the
# gradient norm's replica spans both stages ([Note: pipeline ranks])
for _stage, _name in ((1, "1f1b"), (2, "zb"), (2, "interleaved"), (3, "1f1b")):
    CASES[f"pp2dp2hyb_{_name}_zero{_stage}"] = (
        zero(_stage, pp=2, shard_size=1, pp_microbatches=2, **SCHEDULES[_name]),
        2,
    )
# pp=2 x tp=2 x ep=2 on 8 ranks (by hand): each stage's 4 ranks, 2 tp positions each splitting the experts over ep
CASES["pp2tp2ep2moe_1f1b_zero1"] = (zero(1, pp=2, ep=2, pp_microbatches=2, **NO_SP, **SCHEDULES["1f1b"]), 2)
CASES["pp2tp2ep2spmoe_interleaved_zero2"] = (
    zero(2, pp=2, ep=2, pp_microbatches=2, **TP_SP, **SCHEDULES["interleaved"]),
    2,
)
# MoE (docs/pipeline.md): pp=2 x ep=2 on 4 ranks, each stage's 2 ranks splitting its MoE layers' experts and
# exchanging tokens; aux-free ([Note: MoE pipeline stages]), against ddp on the same MoE model
MOE_CONFIG = dict(CONFIG, name="tiny_moe_pp", n_experts=4, top_k=2, expert_ffn_dim=32, n_dense_layers=1,
                  aux_loss_coef=0.0, z_loss_coef=0.0)  # fmt: skip
CASES["ddp_moe"] = (lambda: "ddp", 2)
for _stage, _name in ((1, "1f1b"), (2, "interleaved"), (3, "1f1b"), (3, "interleaved")):
    CASES[f"pp2ep2_{_name}_zero{_stage}"] = (zero(_stage, pp=2, ep=2, pp_microbatches=2, **SCHEDULES[_name]), 2)
CASES["pp2moe_zbv_zero1"] = (zero(1, pp=2, **SCHEDULES["zbv"]), 1)  # ep=1: each stage holds all its experts
# stage 3: the stage's parameters held gathered for the whole schedule ([Note: stage 3 under a pipeline]); pp=2 x dp=2
# under every schedule in tests/test_pipeline_stage3.py's launch: 8 sequences a step (zbv needs 2 pp = 4 micro-batches
# of a dp rank's rows) against ddp on 4 ranks (2 sequences each)
CASES["pp2_1f1b_zero3"] = (zero(3, pp=2, **SCHEDULES["1f1b"]), 1)
CASES["ddp4"] = (lambda: "ddp", 4)
for _name, _knobs in SCHEDULES.items():
    CASES[f"pp2dp2_{_name}_zero3"] = (zero(3, pp=2, pp_microbatches=4, **_knobs), 2)
# ZBV at stages 1-2 on pp=2 x dp=2 needs the same 8 sequences (4 micro-batches of a dp rank's rows)
for _stage in (1, 2):
    CASES[f"pp2dp2_zbv4_zero{_stage}"] = (zero(_stage, pp=2, pp_microbatches=4, **SCHEDULES["zbv"]), 2)
EIGHT = {"ddp4", "pp2dp2_zbv4_zero1", "pp2dp2_zbv4_zero2", *(f"pp2dp2_{name}_zero3" for name in SCHEDULES)}
# pp=2 x cp=2 on 4 ranks: each cp rank sends its sequence slice to its peer stage; attention inside a
# stage over its cp group: Ulysses (4 heads split over cp=2) or, with 3 heads (RING_CONFIG), the ring.
# Their ddp references run on 4 ranks too (one sequence each), so the cp cases need no 2-rank launch.
RING_CONFIG = dict(CONFIG, dim=48, n_heads=3, n_kv_heads=1)
CASES["ddp4_cp"] = CASES["ddp4_ring"] = (lambda: "ddp", 4)
CASES["cp2tp2_zero1"] = (zero(1, cp=2, **TP_SP), 1)  # pp=1 tp x cp + SP: what pp2cp2tp2_* equal (docs/pipeline.md)
for _stage in (1, 2, 3):
    for _name in SCHEDULES:
        for _ring in ("", "ring"):
            _knobs = dict(pp=2, cp=2, **SCHEDULES[_name])
            CASES[f"pp2cp2{_ring}_{_name}_zero{_stage}"] = (zero(_stage, **_knobs), 1)
            CASES[f"pp2cp2tp2{_ring}_{_name}_zero{_stage}"] = (zero(_stage, **_knobs, **TP_SP), 1)
SAVES = {"pp2_1f1b_zero2": "pp2"}
RESUMES = {"resume_pp2_ckpt_pp1": "pp2"}
# tests/test_pipeline_checkpoints.py, one launch on 4 ranks (global batch 4 in every case): pp=2 x dp=2 and
# pp=1 x dp=4 (ZeRO-2, ddp's numbers) saving at steps 2 and 4 (and the Hugging Face layout from the live run
# after fit, HF_SAVES), each step-2 checkpoint resumed at another split, pp, schedule or dp; bf16-mixed
# against Lightning's ddp (1 sequence a rank)
CASES["save_pp2dp2"] = (zero(2, pp=2, pp_microbatches=2), 2)
CASES["save_pp1dp4"] = (zero(2), 4)
CASES["resume_pp2_ckpt_pp2_layers13"] = (zero(2, pp=2, pp_microbatches=2, pp_layers=[1, 3]), 2)
CASES["resume_pp2_ckpt_pp4"] = (zero(1, pp=4), 1)  # 4 micro-batches of one sequence, a block a stage
CASES["resume_pp2_ckpt_interleaved"] = (zero(2, pp=2, pp_microbatches=2, **SCHEDULES["interleaved"]), 2)
CASES["resume_pp1_ckpt_pp2"] = (zero(2, pp=2, pp_microbatches=2), 2)
CASES["ddp4_bf16"] = (lambda: "ddp", 4)
CASES["pp2dp2_bf16"] = (zero(2, pp=2, pp_microbatches=2), 2)
SAVES.update(save_pp2dp2="pp2dp2", save_pp1dp4="pp1dp4")
RESUMES.update(resume_pp2_ckpt_pp2_layers13="pp2dp2", resume_pp2_ckpt_pp4="pp2dp2",
               resume_pp2_ckpt_interleaved="pp2dp2", resume_pp1_ckpt_pp2="pp1dp4")  # fmt: skip
# the `last` checkpoint (step 2) of tests/scripts/pp_failure.py's kill case (rank 1 SIGKILLed mid-schedule at step 3)
CASES["resume_killed_last"] = (zero(2, pp=2, pp_microbatches=2), 2)
LAST_RESUMES = {"resume_killed_last": "kill"}  # case -> OUT_DIR/ckpts/<folder>/last.ckpt
PRECISION = {"ddp4_bf16": "bf16-mixed", "pp2dp2_bf16": "bf16-mixed"}  # the others: fp32
HF_SAVES = ("save_pp2dp2", "save_pp1dp4")  # ZeroStrategy.save_hf_pretrained(OUT_DIR/hf/<case>) after fit


def is_moe(case: str) -> bool:
    return "moe" in case or "ep2" in case


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.rows: list[list[int]] = []  # each batch's rows, as one number each (the test compares sets)

        self.val_losses: list[float] = []
        self.gathered: tuple[int, int] = (0, 0)  # stage 3: most block elements gathered at once, of all
        self.held: tuple[int, int] = (0, 0)  # stage 3 under pp: most parameter and gradient bytes held whole
        self.sent: list[dict] = []  # stage 3: elements each training batch sent, per collective kind
        self.p2p: tuple[int, ...] = ()  # under pp: point-to-point bytes sent, received, and the plan's of both
        self._before: dict = {}

    def on_train_end(self, trainer, pl_module) -> None:
        engine = getattr(trainer.strategy, "engine", None)  # ddp has none
        runtime = engine.stage3 if engine is not None else None
        if runtime is not None:
            self.gathered = (runtime.high_water_numel, sum(unit.numel for unit in runtime.units[:-1]))
            # measured beside the plan: the parameters and the schedule's gradients held whole
            self.held = (runtime.held_whole_bytes, trainer.strategy.run.session.pipeline.held_grad_bytes)
        pipeline = getattr(getattr(getattr(trainer.strategy, "run", None), "session", None), "pipeline", None)
        if pipeline is not None:
            self.p2p = p2p_measured_and_planned(pipeline, len(self.rows[-1]), len(self.losses))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        self._before = dict(engine.counter.elements) if engine is not None else {}
        self.rows.append([int((row * torch.arange(1, row.numel() + 1)).sum()) for row in batch])

    def on_validation_end(self, trainer, pl_module) -> None:
        self.val_losses.append(float(trainer.callback_metrics["val_loss"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            now = engine.counter.elements
            self.sent.append({kind: now[kind] - self._before.get(kind, 0.0) for kind in now})


def p2p_measured_and_planned(pipeline, rows: int, batches: int) -> tuple[int, int, int, int]:
    """The bytes this rank's stages sent and received over every training schedule, beside the plan's
    for ``batches`` steps of ``rows`` sequences (``pp/cost.py``, what ``lightning-zero plan`` prints)."""
    from lightning_zero.planner.pipeline import StageShape
    from lightning_zero.pp.cost import p2p_bytes_per_step

    stages = [stage for schedule in pipeline._schedules.values() for stage in schedule_stages(schedule)]
    layout, dims = pipeline.layout, pipeline.groups.dims
    shape = StageShape(micro_batch=rows // layout.microbatches, seq_len=SEQ, dim=CONFIG["dim"], act_bytes=4, tp=dims.tp,
                       cp=dims.cp)  # fmt: skip
    planned = p2p_bytes_per_step(layout, pipeline.pp_rank, shape.boundary)
    return (sum(stage.sent_bytes for stage in stages), sum(stage.received_bytes for stage in stages),
            planned.sent * batches, planned.received * batches)  # fmt: skip


def data_module(dp: int, global_batch: int = GLOBAL_BATCH) -> TokenDataModule:
    """The same global batch of ``global_batch`` sequences a step, over ``dp`` ranks."""
    return TokenDataModule(
        source="synthetic", seq_len=SEQ, batch_size=global_batch // dp, vocab_size=64, val_fraction=0.25, seed=3,
        synthetic_tokens=64 * SEQ + 1,
    )  # fmt: skip


def run(name: str, devices: int, out_dir: str) -> None:
    make_strategy, dp = CASES[name]
    L.seed_everything(42, verbose=False)
    if is_moe(name):
        model = MoELM(MOE_CONFIG, lr=1e-2, warmup_steps=1, max_steps=STEPS)
    else:
        model = LlamaLM(RING_CONFIG if "ring" in name else CONFIG, lr=1e-2, warmup_steps=1, max_steps=STEPS)
    data = data_module(dp, 8 if name in EIGHT else GLOBAL_BATCH)
    record = Record()
    trainer, ckpt_path = checkpointed_trainer(
        out_dir, name, SAVES, RESUMES, devices=devices, strategy=make_strategy(), max_steps=STEPS, callbacks=[record],
        precision=PRECISION.get(name, "32-true"), **TRAINER,
    )  # fmt: skip
    if name in LAST_RESUMES:
        ckpt_path = os.path.join(out_dir, "ckpts", LAST_RESUMES[name], "last.ckpt")
    trainer.fit(model, data, ckpt_path=ckpt_path)
    if name in HF_SAVES:
        trainer.strategy.save_hf_pretrained(os.path.join(out_dir, "hf", name))
    # predict: the logits of 2 fixed sequences, one per dp rank of ddp, both on each pp rank of pp=2
    count = 4 if name in EIGHT else 2  # ddp on 4 ranks in EIGHT: one row each
    rows = torch.randint(0, 64, (count, SEQ), generator=torch.Generator().manual_seed(11))
    mesh = getattr(trainer.strategy, "device_mesh", None)
    cp_group = mesh["cp"].get_group() if mesh is not None and "cp" in (mesh.mesh_dim_names or ()) else None
    if cp_group is not None:  # each cp rank predicts from its slice of every sequence (cp/batch.py)
        import torch.distributed as dist

        from lightning_zero.cp.batch import context_slices

        cp = dist.get_world_size(cp_group)
        (rows,) = context_slices((rows,), cp, dist.get_rank(cp_group))
    if dp > count:  # 2 rows over 4 dp ranks (a whole model on each): each rank forwards both rows itself
        with torch.no_grad():
            predicted = model.model(rows)
    else:
        predicted = torch.cat(trainer.predict(model, torch.utils.data.DataLoader(rows, batch_size=count // dp)))
    if cp_group is not None:  # the slices' logits joined along the sequence
        slices = [torch.empty_like(predicted) for _ in range(cp)]
        dist.all_gather(slices, predicted.contiguous(), group=cp_group)
        predicted = torch.cat(slices, dim=1)
    params = model.model.state_dict()
    if mesh is not None and "tp" in (mesh.mesh_dim_names or ()) and mesh["tp"].size() > 1:  # dense params, logits
        import torch.distributed as dist

        from lightning_zero.tp import gather_tp_state_dict

        group = mesh["tp"].get_group()
        params = gather_tp_state_dict(model.model, group)
        shards = [torch.empty_like(predicted) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, predicted.contiguous(), group=group)
        predicted = torch.cat(shards, dim=-1)  # the head's logits are vocab-split over tp
    torch.save(
        {
            "predicted": predicted,
            "losses": record.losses,
            "val_losses": record.val_losses,
            "gathered": record.gathered,
            "sent": record.sent,
            "held": record.held,
            "p2p": record.p2p,
            "rows": record.rows,
            "params": {k: v.float() for k, v in params.items()},
        },
        os.path.join(out_dir, f"{name}.rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    out, devices = sys.argv[1], int(sys.argv[2])
    for case in sys.argv[3:]:
        run(case, devices, out)
