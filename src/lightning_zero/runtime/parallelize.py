"""The parallelize registry: one pushed step per model family, for both doors.

[Note: the parallelize registry] (torchtitan's ``models/*/parallelize.py``) A layout with
``tp``, ``ep`` or ``cp`` above 1 changes what a model computes, so each model family has one
function that applies the layout to it, in a fixed order: tensor parallelism, then expert
parallelism, then context parallelism, then pipeline stages (``pp``: the model is cut down to this
rank's stages, ``models/llama/pipeline.cut_llama``; [Note: the pipelined step] in
``runtime/pipeline.py``). The runtime calls it; the model never reaches up into its strategy for a
group. :data:`FAMILIES` maps each family to

- ``check(model, dims)``: the layout's one check against the model (heads, experts, the attention
  it can exchange), raising ``ValueError`` naming the fix; the doors call :func:`check_layout`
  before any process group starts (the Trainer door: the LightningModule is known then) or, under
  Fabric, where the model first arrives (``fabric.setup``), before anything is split, broadcast
  or sharded;
- ``parallelize(model, groups, counter=...)``: the step itself, given the layout's groups
  (``comm/mesh.py`` ``MeshGroups``: ``tp``, ``cp``, ``ep`` and the expert-data-parallel ``edp``
  named, as torchtitan's ``ParallelDims.build_mesh`` names ``ep`` and ``dp_shard_in_ep``).

The families: this project's ``Llama`` and ``MoETransformer`` (``lightning_zero.models``) and
LitGPT's ``GPT`` (``models/litgpt/parallelize.py``). A module that splits itself declares it with
``check_parallel_dims(dims)`` (on the module or its ``config``: [Note: layouts a model declares]);
the runtime checks it and applies nothing. Any other model asking for ``tp``, ``cp`` or ``ep`` is
refused, and the refusal names the families.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import nn

if TYPE_CHECKING:
    from lightning_zero.comm.collectives import CommCounter
    from lightning_zero.comm.mesh import MeshGroups, ParallelDims
    from lightning_zero.pp.layout import PipelineLayout


def _instance_of(module_name: str, class_name: str) -> Callable[[Any], bool]:
    """A matcher that imports nothing: no object is of a class whose module was never imported."""

    def matches(candidate: Any) -> bool:
        module = sys.modules.get(module_name)
        return module is not None and isinstance(candidate, getattr(module, class_name))

    return matches


@dataclass(frozen=True)
class ModelFamily:
    """One entry of [Note: the parallelize registry]."""

    name: str  # what a refusal lists
    matches: Callable[[Any], bool]
    check: Callable[[nn.Module, "ParallelDims"], None]
    parallelize: Callable[..., nn.Module]  # (model, plan, *, dims, counter) -> model: tp, ep, cp of dims


def _check_declared(model: nn.Module, dims: "ParallelDims") -> None:
    model.check_parallel_dims(dims)


def _cut_stages(model: nn.Module, plan: "ParallelPlan", dims: tuple[str, ...]) -> nn.Module:
    """The pp step, last, once: a Llama or a MoETransformer (a Llama whose blocks take the same
    inputs: ``models/moe/pipeline.py``) cut to this rank's stages."""
    if "pp" in dims and plan.pipeline is not None and plan.pipeline.pp > 1:
        if getattr(model, "pipeline_stages", None) is None:  # once
            from lightning_zero.models.llama.pipeline import cut_llama

            cut_llama(model, plan.pipeline, plan.groups.rank_in("pp"))
    return model


def _apply_llama(model: nn.Module, plan: "ParallelPlan", **kwargs: Any) -> nn.Module:
    from lightning_zero.models.llama.parallelize import apply_layout

    apply_layout(model, plan.groups, sequence_parallel=plan.sequence_parallel, **kwargs)
    return _cut_stages(model, plan, kwargs.get("dims", DIMENSIONS))


def _apply_moe(model: nn.Module, plan: "ParallelPlan", **kwargs: Any) -> nn.Module:
    from lightning_zero.models.moe.parallelize import apply_layout

    apply_layout(model, plan.groups, sequence_parallel=plan.sequence_parallel, **kwargs)
    return _cut_stages(model, plan, kwargs.get("dims", DIMENSIONS))


def _apply_litgpt(model: nn.Module, plan: "ParallelPlan", *, dims: tuple[str, ...], counter: Any = None) -> nn.Module:
    from lightning_zero.models.litgpt.parallelize import parallelize_litgpt

    if "tp" not in dims and "cp" not in dims:  # applied by the Fabric door, whole: both or neither
        return model
    return parallelize_litgpt(model, plan.groups, sequence_parallel=plan.sequence_parallel, counter=counter)


def _check_litgpt(model: nn.Module, dims: "ParallelDims") -> None:
    from lightning_zero.models.litgpt.parallelize import check_litgpt_layout

    check_litgpt_layout(model, dims)


FAMILIES: tuple[ModelFamily, ...] = (
    # a MoETransformer is a Llama: the more specific family first
    ModelFamily("lightning_zero.models.moe.MoETransformer (tp, ep, cp)",
                _instance_of("lightning_zero.models.moe.model", "MoETransformer"), _check_declared, _apply_moe),
    ModelFamily("lightning_zero.models.Llama (tp, cp)",
                _instance_of("lightning_zero.models.llama.model", "Llama"), _check_declared, _apply_llama),
    ModelFamily("litgpt.model.GPT and LoRA's GPT (tp, cp under Fabric)",
                _instance_of("litgpt.model", "GPT"), _check_litgpt, _apply_litgpt),
)  # fmt: skip

SELF_DECLARED = "a module of your own that splits itself and declares check_parallel_dims(dims)"


def supported_families() -> str:
    """The families a refusal names."""
    return "; ".join([family.name for family in FAMILIES] + [SELF_DECLARED])


def find_decoders(module: nn.Module) -> list[tuple[nn.Module, ModelFamily]]:
    """Every module of a registered family inside ``module`` (itself included), outermost first;
    nothing inside a found one is searched (a family's step covers its whole model)."""
    found: list[tuple[nn.Module, ModelFamily]] = []

    def visit(candidate: nn.Module) -> None:
        family = next((family for family in FAMILIES if family.matches(candidate)), None)
        if family is not None:
            found.append((candidate, family))
            return
        for child in candidate.children():
            visit(child)

    visit(module)
    return found


def _declared_check(module: Any) -> Optional[Callable[[Any], None]]:
    for owner in (module, getattr(module, "config", None)):
        check = getattr(owner, "check_parallel_dims", None)
        if callable(check):
            return check
    return None


def check_layout(dims: "ParallelDims", module: Any, *, door: str = "ZeroStrategy") -> None:
    """[Note: layouts a model declares] ``tp``, ``cp`` and ``ep`` above 1 change what the model
    computes (its layers, its sequence slice and attention, its experts and token dispatch), so
    the runtime cannot honour them for any module: the layout is checked here, once, against the
    model ([Note: the parallelize registry]), raising ``ValueError`` naming the fix. ``module``: the LightningModule (Trainer door, before any
    process group) or the model given to ``fabric.setup``. A module that declares
    ``check_parallel_dims`` is asked (a LightningModule of this project's families declares it for
    its model); else every registered decoder inside it is checked; a layout with ``tp``, ``cp``
    or ``ep`` above 1 and neither is refused, naming the families."""
    if dims.tp == 1 and dims.cp == 1 and dims.ep == 1:
        return
    declared = _declared_check(module)
    decoders = find_decoders(module) if isinstance(module, nn.Module) else []
    if declared is None and not decoders:
        asked = [name for name in ("tp", "cp", "ep") if getattr(dims, name) > 1]
        what = {
            "tp": "splits its layers over tp",
            "cp": "splits its sequences over cp",
            "ep": "splits its experts over ep",
        }
        raise ValueError(
            f"{door}({', '.join(f'{name}={getattr(dims, name)}' for name in asked)}): {type(module).__name__} does not"
            f" declare that it {' and '.join(what[name] for name in asked)} (no check_parallel_dims(dims) method on"
            " it or its config) and is no model family this project parallelizes; the families are:"
            f" {supported_families()}. Use such a model, or {' and '.join(f'{name}=1' for name in asked)}."
        )
    if declared is not None:
        declared(dims)
        return
    for decoder, family in decoders:
        family.check(decoder, dims)


DIMENSIONS = ("tp", "ep", "cp", "pp")  # the fixed order of every family's step


@dataclass(frozen=True)
class ParallelPlan:
    """What a door hands a model ([Note: the parallelize registry]): the layout's groups (``tp``,
    ``cp``, ``ep``, the expert-data-parallel ``edp``, ``dp_cp``: ``comm/mesh.py`` ``MeshGroups``)
    and the knob a family's step reads (``sequence_parallel``). The Fabric door applies it to the
    model given to ``fabric.setup``; the Trainer door hands it to the LightningModule
    (``receive_parallel_plan``) before ``configure_model``, which applies it to the model it
    builds: no model reaches into its strategy for a group."""

    groups: "MeshGroups"
    sequence_parallel: bool = False
    pipeline: Optional["PipelineLayout"] = None  # pp > 1: the checked split ([Note: pipeline stages])

    @property
    def dims(self) -> "ParallelDims":
        return self.groups.dims

    def apply(
        self, module: nn.Module, *, dims: tuple[str, ...] = DIMENSIONS, counter: Optional["CommCounter"] = None
    ) -> list[nn.Module]:
        """Each registered decoder inside ``module`` gets its family's step for ``dims`` (tp, ep, cp
        in that order, each applied once: a LightningModule may apply one on the meta device before
        it initializes, the rest after); returns the decoders. A module that declared
        ``check_parallel_dims`` and holds no registered decoder split itself: nothing is applied."""
        decoders = find_decoders(module)
        for decoder, family in decoders:
            family.parallelize(decoder, self, dims=dims, counter=counter)
        return [decoder for decoder, _ in decoders]


def hand_over(module: Any, plan: ParallelPlan) -> None:
    """The Trainer door's push: a LightningModule that applies the layout to the model it builds
    (``receive_parallel_plan(plan)``: this project's ``LlamaLM`` and ``MoELM``) gets ``plan`` before
    Lightning calls its ``configure_model``."""
    receive = getattr(module, "receive_parallel_plan", None)
    if callable(receive):
        receive(plan)


def rebind_optimizers(optimizers: list, module: nn.Module, names: dict[int, str]) -> None:
    """[Note: optimizers built before the split] Fabric's ``setup(model, optimizer)`` hands over
    optimizers built over the whole model before the parallelize step split it (a tp-split layer
    holds new Parameters; ep keeps this rank's experts) or cut it into pipeline stages: each now
    steps, for every parameter it was given, the one of the same name this rank holds, and drops
    those other ranks hold. A tensor that was never a parameter of the model stays, so the engine's
    own check names it. ``names``: the whole model's parameter names by ``id``, taken before the split."""
    held = dict(module.named_parameters())
    by_id = {id(param): name for name, param in held.items()}  # a parameter the split kept keeps its name
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            kept = []
            for param in group["params"]:
                name = by_id.get(id(param), names.get(id(param)))
                if name is None:
                    kept.append(param)  # not the model's: refused by the engine, naming the fix
                elif name in held:
                    kept.append(held[name])
            group["params"] = kept
