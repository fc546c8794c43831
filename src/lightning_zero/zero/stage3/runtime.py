"""Stage-3 runtime: gathers, prefetches and frees units around forward and backward.

Which unit every rank gathers next is agreed in ``schedule.py`` ([Note: gather schedule],
[Note: dynamic execution]); how a rank that finds the ranks out of step stops them all is
``abort.py`` ([Note: abort channel]).

[Note: one runtime module] What is left here is one state machine: the hooks,
the following of the open schedule and the step boundaries all read and write the same few
fields (``open_kind``, ``phase``, ``in_backward``, each unit's ``gathered``/``prefetched``/
``backward_uses``), and every hook's meaning depends on all of them. Split across files, a reader
would have to hold three files open to follow one forward; the parts with a state of their own
(agreement messages, the abort path, units) live beside it.

[Note: phases] The phase comes from the caller (the strategy), never from grad mode:
:meth:`Stage3Runtime.begin_step` opens a *training* or *evaluation* step, and the all-gathers
until the step is closed belong to that step's schedule -- several forward/backward pairs (manual
optimization), the backward that follows, every forward of an evaluation step. A step is closed by
the next ``begin_step``, by the end of its backward once the step method returned, by
:meth:`end_eval_step`, or by a forward outside the step methods. Such an out-of-step forward (a
callback running the model) gathers each unit on demand with an agreement among ranks, and frees
it after (the root: after the top module's forward, or at the next step / optimizer step at the
latest).

[Note: no_grad forwards in a training step] A forward that runs with grad disabled inside a
training step (an EMA teacher, sampling from the student every N steps) takes no part in backward,
and how often it runs may change from step to step (the same on every rank). So it is kept out of
the training schedule: each unit it reaches is gathered on demand, after an agreement among ranks
(one tiny all-gather of ``(kind, unit index)``, as for out-of-step forwards), and freed after that
unit's forward -- unless it was already gathered (prefetched along the schedule, or the root held
for the step): then it is used as it is and left gathered, its schedule entry untouched. The
recorded schedule, its prefetch and the bytes of the training forward/backward stay those of a
step without such forwards. A grad-disabled forward whose inputs require grad is the first pass of
a reentrant activation checkpoint (``torch.utils.checkpoint`` runs it under ``no_grad``) and
follows the schedule as before.

[Note: skipped units and gradient buckets] The gradient reducer launches its buckets' reduce-scatters
strictly in one global order and, with its pool of ``max_buckets_in_flight`` buffers full, waits for
the oldest one before the next bucket fills. A rank that skips a unit's backward (a block skipped
from step 2 on, or a loss reaching no trainable parameter) would launch that unit's bucket only at
the end of backward -- after the backward all-gathers it still issues for the other ranks -- while
those ranks, waiting in the pool on that very reduce-scatter, never issue the gathers: a deadlock
across the two process groups. So when a rank consumes a *backward* entry of the schedule it did
not reach, it tells the reducer (``on_unit_skipped_in_backward`` -> ``GradReducer.mark_absent``)
that the unit's parameters get zero gradients in this backward, and their bucket launches right
after that gather, where the other ranks launch it. A backward that reached no unit at all is
flushed by the reducer before its final launches (``flush_backward``: the remaining backward
entries are gathered, and their buckets launched, in schedule order). Every rank thus issues
gathers and reduce-scatters in the same interleaving, and the pool stays bounded.

[Note: freeing in backward] A unit is gathered again by a hook on its forward outputs before its
backward runs, and freed when its backward is done: an autograd function applied to the unit's
inputs (those that require grad) runs when the gradient w.r.t. the inputs is computed -- after
every use of the unit's weights, frozen ones included (a LoRA block still needs its frozen base
to carry the gradient to its input after the adapters have their gradients). Units whose inputs
need no gradient (the embedding) are freed when backward ends. This is FSDP2's
``RegisterPostBackwardFunction``.

[Note: activation checkpointing] A forward inside backward is a recompute: it gathers the unit
(as a backward gather of the schedule) and never frees it; the post-backward function applied to
the recomputed inputs frees it (``use_reentrant=True``: its nested backward runs it). The first
hook that sees a backward queues the end-of-backward callback on that (outermost) backward and
tells the gradient reducer, so a reentrant checkpoint's nested backward never ends the sync early:
one reduce-scatter per bucket per backward.

[Note: hooks under torch.compile] The engine's module hooks (this runtime's unit and root hooks,
stages 1-2's parameter-gather wait in ``param_gather.py``, the Fabric strategy's step hooks) are
registered wrapped in ``torch.compiler.disable``: under ``torch.compile(model)`` (LitGPT's
``pretrain``) each runs eagerly, a graph break at the unit's edges, and dynamo compiles the
compute between them. Traced, they failed: the Fabric strategy builds the engine at the first
forward, and stage 3's materialization swaps the meta parameters' storage, which dynamo holds weak
references to ("Cannot swap t1 because it has weakref associated with it"); at stages 1-2 dynamo
traced into the collectives and recompiled on every new byte count of the communication counter.
FSDP2's hooks are kept out of dynamo the same way (without compiled autograd). Dynamo does not
guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``): graphs compiled for
the model class before the engine's hooks existed (a compiled forward before ``fabric.setup``, an
earlier model of the same class in the process) are reused without them; call
``torch._dynamo.reset()`` before setting up such a model. Tested with ``backend="aot_eager"``
against Fabric ddp compiled alike (tests/test_fabric_contracts.py).

[Note: stage 3 under a pipeline] Under ``pp > 1`` torch's schedule runs every micro-batch's
forward and backward of this rank's stages interleaved (1F1B: a forward of micro-batch ``i + 1``
between the backwards of ``i`` and ``i + 2``), and its zero-bubble schedules compute weight
gradients with ``torch.autograd.grad`` where no hook sees a unit's backward. Gathering per unit
use would gather each unit ``2 m`` times a step (``m`` micro-batches) in an order the schedule, not
the module, decides. So :meth:`Stage3Runtime.held_whole` gathers every unit once at the start of
the schedule (following the recorded training schedule, with its prefetch: the same order on every
rank of the stage's dp group), keeps them gathered, hooks off, for every micro-batch's forward and
backward, and frees them when the schedule ends; the gradients the schedule left are
reduce-scattered once, handed in by the pipeline door ([Note: gradients handed in] in
``zero/engine.py``). The units are all of the rank's stages (``v`` under the interleaved
schedules, two under ZBV, which the schedule alternates between), and the block spans the
zero-bubble schedules' weight-gradient actions too, wherever they fall: nothing is freed or reduced
before the schedule's last action, whichever door (the Trainer's step, Fabric's ``pipeline_step``)
runs it. The cost: the stage's full parameters are held for the whole schedule
(``docs/pipeline.md``), as stages 1-2 hold them always; what stage 3 still saves is the optimizer
state and, outside the step, the parameters. Such a model is built whole and then cut
(``runtime/run.py`` ``model_build``): a meta-device build materializes only this rank's units,
drawing their initializers in another order than ddp's whole model (Fabric's
``init_module(empty_init=True)`` builds it whole too under ``pp > 1``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_zero.comm.collectives import CommCounter, local_only
from lightning_zero.zero.domains import gather_group
from lightning_zero.zero.stage3.abort import AbortChannel
from lightning_zero.zero.stage3.schedule import (
    DEMAND,
    DEMAND_HELD,
    DONE,
    EVAL,
    NEED,
    UNIT,
    Agreement,
    Schedule,
)
from lightning_zero.zero.stage3.units import Unit
from lightning_zero.zero.waits import Waiter

if TYPE_CHECKING:
    from lightning_zero.config import ZeroConfig


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward marks the unit's backward done."""

    @staticmethod
    def forward(ctx: Any, runtime: "Stage3Runtime", unit: Unit, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.runtime, ctx.unit = runtime, unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        ctx.runtime._post_backward(ctx.unit)
        return (None, None, *grads)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Stage3Runtime:
    """Gathers, prefetches and frees units around forward and backward (see the notes above).

    Args:
        units: the units, root last.
        ag_group: process group for parameter all-gathers (a clone of the dp group).
        config: the knobs (``lightning_zero.config.ZeroConfig``); read here: ``prefetch_blocks``,
            the units whose all-gather is started ahead of the one running.
        counter: logical bytes sent are added here.
        top: the module the engine wraps; a forward of it outside the step methods frees the
            root it gathered.
        root_holders: modules that directly register a root-stored parameter
            ([Note: shared parameters] in ``units.py``); they gather the root on demand.
        optimizers: torch optimizers stepping the shards; after each ``step()`` every gathered
            unit is freed (its full parameters are stale), so the next use re-gathers.
        waiter: how an all-gather is waited on (``collective_timeout``, polling, the failure
            channel through which a divergence is posted: [Note: abort channel] in ``abort.py``).
    """

    def __init__(
        self,
        units: list[Unit],
        ag_group: dist.ProcessGroup,
        config: "ZeroConfig",
        *,
        counter: CommCounter,
        top: Optional[nn.Module] = None,
        root_holders: Iterable[nn.Module] = (),
        optimizers: Iterable[torch.optim.Optimizer] = (),
        waiter: Optional[Waiter] = None,
    ) -> None:
        self.units = units
        self.root = units[-1]
        self.ag_group = ag_group
        self.config = config
        self.counter = counter
        self.schedules: dict[str, Schedule] = {}
        self.phase: Optional[str] = None  # "train" / "eval" while the strategy runs a step method
        self.open_kind: Optional[str] = None  # the schedule gathers belong to, until closed
        self.in_backward = False
        self.held_whole_step = False  # every unit gathered, hooks off ([Note: stage 3 under a pipeline])
        self.held_whole_bytes = 0  # most bytes of full unit buffers held_whole kept so far
        self.step = 0
        self.high_water_forward = 0  # most non-root units gathered at once during forward
        self.high_water_backward = 0
        self.gathered_numel = 0  # elements of non-root units gathered now
        # most of them at once so far ([Note: gathered working set] in gather_order.py)
        self.high_water_numel = 0
        self.on_backward_begin: Optional[Callable[[], None]] = None  # the reducer's, see notes
        # The reducer's: the trainable parameters of a unit whose backward this rank skipped, or
        # whose backward is over (those of them that got no gradient count as zeros).
        self.on_unit_skipped_in_backward: Optional[Callable[[list[nn.Parameter]], None]] = None
        # The reducer's: a phase turned dynamic; launch reduce-scatters only once backward ended.
        self.on_dynamic: Optional[Callable[[], None]] = None
        self.waiter = waiter if waiter is not None else Waiter()
        self.dp_size = dist.get_world_size(ag_group)
        self.dp_rank = dist.get_rank(ag_group)
        self.device = next((u.groups[0].shard_buffer.device for u in units if u.groups), torch.device("cpu"))
        self.channel = AbortChannel(
            self.waiter, lambda: f"during {self._what()} of step {self.step} on dp rank {self.dp_rank}"
        )
        self.agreement = Agreement(units, ag_group, self.device, self.channel)
        self._handles: list[Any] = []
        # [Note: hooks under torch.compile]: each hook runs eagerly, a graph break at the unit's edges
        eager = torch.compiler.disable
        for unit in units:
            if unit.module is not None:
                self._handles.append(
                    unit.module.register_forward_pre_hook(eager(self._make_pre_forward(unit)), with_kwargs=True)
                )
                self._handles.append(unit.module.register_forward_hook(eager(self._make_post_forward(unit))))
        if self.root.groups:
            holders = {id(m): m for m in root_holders}
            if top is not None:
                holders[id(top)] = top
            for module in holders.values():
                self._handles.append(module.register_forward_pre_hook(eager(self._root_pre_forward), with_kwargs=True))
                self._handles.append(module.register_forward_hook(eager(self._make_root_post_forward(module is top))))
        for optimizer in optimizers:
            self._handles.append(optimizer.register_step_post_hook(self._after_optimizer_step))

    # -- gathering ------------------------------------------------------------------------------
    def _start_gather(self, unit: Unit) -> None:
        if unit.gathered:
            return
        with record_function(f"lightning_zero::all_gather_unit::{unit.name}"):
            for group in unit.groups:
                group.allocate()
                unit.works.extend(group.start_all_gather(gather_group(group, self.ag_group), self.counter))
        unit.gathered = True
        if unit is not self.root:
            self.gathered_numel += unit.numel
            self.high_water_numel = max(self.high_water_numel, self.gathered_numel)

    def _gather_again(self, unit: Unit) -> None:
        """Issue a gathered unit's all-gathers once more (a schedule entry skipped while in use)."""
        self._wait(unit)
        with record_function(f"lightning_zero::all_gather_unit::{unit.name}"):
            for group in unit.groups:
                unit.works.extend(group.start_all_gather(gather_group(group, self.ag_group), self.counter))
        self._wait(unit)

    def _wait(self, unit: Unit) -> None:
        if unit.works:
            with record_function(f"lightning_zero::wait_all_gather::{unit.name}"):
                for work in unit.works:
                    self.channel.wait(work, f"the all-gather of unit {unit.name!r}")
            unit.works.clear()

    def _free(self, unit: Unit) -> None:
        if not unit.gathered:
            return
        self._wait(unit)
        with record_function(f"lightning_zero::free_unit::{unit.name}"):
            for group in unit.groups:
                group.free()
        unit.gathered = False
        if unit is not self.root:
            self.gathered_numel -= unit.numel
        unit.prefetched = False

    def _free_all(self) -> None:
        for unit in self.units:
            self._free(unit)

    def _gathered_blocks(self) -> int:
        return sum(1 for unit in self.units[:-1] if unit.gathered)

    # -- schedules ([Note: gather schedule] in schedule.py) -------------------------------------
    def _what(self) -> str:
        if self.open_kind is None:
            return "a forward outside the step methods"
        phase = "training" if self.open_kind == "train" else "evaluation"
        return f"{phase} {'backward' if self.in_backward else 'forward'}"

    def _reach(self, unit: Unit) -> None:
        """Gather ``unit`` (following the open schedule) and wait for it; prefetch the next ones."""
        if not unit.groups:
            return
        if unit.gathered and not unit.prefetched:  # still gathered from an earlier use
            schedule = self._open_schedule()
            if schedule is not None and schedule.holds(unit.index):  # kept from its forward
                schedule.position += 1
                self._prefetch(schedule)
            self._wait(unit)
            return
        kind = self.open_kind
        if kind is None:  # out of step: on demand, agreed every time
            self.agreement.agree(unit, self._what(), self.step)
            self._start_gather(unit)
            self._wait(unit)
            return
        schedule = self.schedules.setdefault(kind, Schedule())
        if schedule.dynamic:
            self._reach_dynamic(unit)
            return
        if not schedule.recorded:
            everyone = self.agreement.exchange(UNIT, unit.index)
            if any(pair != (UNIT, unit.index) for pair in everyone):
                self._turn_dynamic(schedule, everyone, self._what())
                if not self._serve_round(everyone, unit):
                    self._reach_dynamic(unit)
                return
            schedule.order.append(unit.index)
            schedule.in_backward.append(self.in_backward)
            self._start_gather(unit)
            self._wait(unit)
            return
        order = schedule.order
        try:
            found = order.index(unit.index, schedule.position)
        except ValueError:
            self.channel.abort(
                f"lightning_zero ZeRO-3: dp rank {self.dp_rank} ran module {unit.name!r} during {self._what()} of"
                f" step {self.step} more often than in the first {kind} step (or out of the recorded order)."
                " Every rank must run the same modules the same number of times per step."
            )
        for position in range(schedule.position, found):  # ran on other ranks, not here: keep in step
            self._consume_entry(schedule, position)
        schedule.position = found + 1
        if schedule.held[found]:  # gathered since its forward on every rank that needs it here
            self.channel.abort(
                f"lightning_zero ZeRO-3: dp rank {self.dp_rank} freed module {unit.name!r} between its forward"
                f" and its backward in step {self.step} (an optimizer step or a forward outside the step"
                " methods in between?); the other ranks keep it gathered there and issue no all-gather."
            )
        self._start_gather(unit)
        unit.prefetched = False
        self._prefetch(schedule)
        self._wait(unit)

    def _open_schedule(self) -> Optional[Schedule]:
        """The open step's schedule (recorded or not: :meth:`Schedule.holds` asks)."""
        return self.schedules.get(self.open_kind) if self.open_kind is not None else None

    def _prefetch(self, schedule: Schedule) -> None:
        """Start the all-gathers of the ``prefetch_blocks`` entries after the one just consumed
        (a held entry gathers nothing: [Note: held into backward])."""
        end = schedule.position + self.config.prefetch_blocks
        for position in range(schedule.position, min(end, len(schedule.order))):
            ahead_unit = self.units[schedule.order[position]]
            if not schedule.held[position] and not ahead_unit.gathered:
                self._start_gather(ahead_unit)
                ahead_unit.prefetched = True

    # -- dynamic phases ([Note: dynamic execution] in schedule.py) -------------------------------
    def _turn_dynamic(self, schedule: Schedule, everyone: list[tuple[int, int]], what: str) -> None:
        """The first step's agreement found the ranks running different modules: from now on this
        phase agrees on every gather (every rank saw the same exchange, so all turn together)."""
        self.agreement.check_dynamic(everyone, what, self.step)
        schedule.dynamic = True
        if self.on_dynamic is not None:
            self.on_dynamic()

    def _dynamic_if_units_idle(self, kind: str, schedule: Schedule) -> None:
        """A unit with parameters that ran on no rank in a phase's first step (LayerDrop that
        dropped it everywhere, a tower no batch needed yet) may run later, where the recorded
        schedule has no place for it: such a phase turns dynamic too ([Note: dynamic execution]).
        The first step's gathers were agreed, so every rank finds the same units idle."""
        if not self.agreement.warn_idle_units(kind, schedule):
            return
        schedule.dynamic = True
        if self.on_dynamic is not None:
            self.on_dynamic()

    def _reach_dynamic(self, unit: Unit) -> None:
        """Rounds of agreement until ``unit`` is gathered here (each round gathers one unit some
        rank needs now, on every rank)."""
        while not self._serve_round(self.agreement.exchange(NEED, unit.index), unit):
            pass

    def _serve_until_done(self) -> None:
        """Take part in the other ranks' gathers until no rank needs a unit in this step."""
        while not self._serve_round(self.agreement.exchange(DONE, 0), None):
            pass

    def _serve_round(self, everyone: list[tuple[int, int]], mine: Optional[Unit]) -> bool:
        """One round: every rank gathers the lowest-indexed unit any rank asked for (a rank that
        did not ask frees it at once). True when this rank's need is met: ``mine`` is gathered, or
        (``mine=None``) no rank asked for anything."""
        served = self.agreement.served(everyone, self._what(), self.step)
        if served is None:
            return mine is None
        if served is mine:
            self._start_gather(mine)
            self._wait(mine)
            return True
        if served.gathered:  # held here (the root, a unit in use): join the gather, keep it
            self._gather_again(served)
        else:
            self._start_gather(served)
            self._free(served)
        return False

    def _off_schedule(self, args: Any, kwargs: Any) -> bool:
        """A forward (not a recompute) that keeps out of the open training schedule
        ([Note: no_grad forwards in a training step])."""
        if self.open_kind != "train" or self.in_backward or torch.is_grad_enabled():
            return False
        flat, _ = tree_flatten((args, kwargs))
        return not any(isinstance(x, torch.Tensor) and x.requires_grad for x in flat)

    def _gather_on_demand(self, unit: Unit) -> bool:
        """Gather ``unit`` for a no_grad forward inside a training step, agreed among ranks; return
        whether this call gathered it (then its forward frees it) or found it gathered already."""
        if not unit.groups:
            return False
        held = unit.gathered
        everyone = self.agreement.exchange(DEMAND_HELD if held else DEMAND, unit.index)
        if any(kind not in (DEMAND, DEMAND_HELD) or value != unit.index for kind, value in everyone):
            self.agreement.disagree(everyone, "a no_grad forward inside a training step", self.step)
        if all(kind == DEMAND_HELD for kind, _ in everyone):
            self._wait(unit)
            return False
        if held:  # gathered here but not on some other rank: join its all-gather, keep the unit
            self._gather_again(unit)
            return False
        self._start_gather(unit)
        self._wait(unit)
        return True

    def _consume_entry(self, schedule: Schedule, position: int) -> None:
        """Issue what the recorded entry ``position`` issues on every rank, for a unit this rank
        did not reach there; a held entry issues nothing ([Note: held into backward])."""
        unit = self.units[schedule.order[position]]
        if not schedule.held[position]:
            self._consume_skipped(unit, schedule.in_backward[position])
        elif self.on_unit_skipped_in_backward is not None:
            self.on_unit_skipped_in_backward(unit.trainable)  # [Note: skipped units and gradient buckets]

    def _consume_skipped(self, unit: Unit, backward_entry: bool = False) -> None:
        if unit.prefetched:
            self._free(unit)
        elif unit.gathered:
            self._gather_again(unit)
        else:
            self._start_gather(unit)
            self._free(unit)
        if backward_entry and self.on_unit_skipped_in_backward is not None:
            # [Note: skipped units and gradient buckets]
            self.on_unit_skipped_in_backward(unit.trainable)

    def flush_backward(self) -> None:
        """A backward ends that reached no unit on this rank (its loss reached no trainable
        parameter), called by the reducer before it launches the remaining buckets: issue the
        backward gathers the other ranks run now, in schedule order ([Note: skipped units and
        gradient buckets]). In a dynamic phase: serve the other ranks' gathers until every rank's
        backward ended, so no rank waits on a reduce-scatter while a peer still gathers
        ([Note: dynamic execution])."""
        schedule = self.schedules.get(self.open_kind) if self.open_kind == "train" else None
        if schedule is not None and schedule.dynamic:
            self._serve_until_done()
            return
        if self.in_backward or schedule is None or not schedule.recorded:
            return
        while schedule.position < len(schedule.order) and schedule.in_backward[schedule.position]:
            position = schedule.position
            schedule.position += 1
            self._consume_entry(schedule, position)

    def _close(self) -> None:
        """Close the open step: flush what its schedule still expects, free everything."""
        kind = self.open_kind
        if kind is None:
            return
        schedule = self.schedules.setdefault(kind, Schedule())
        if not schedule.recorded and not schedule.dynamic and not local_only(self.dp_size):
            # The first step of a phase: a rank whose step ended while a peer still gathers (its
            # modules were a prefix of the peer's) finds out here, not in the next step.
            everyone = self.agreement.exchange(DONE, 0)
            if any(pair != (DONE, 0) for pair in everyone):
                self._turn_dynamic(schedule, everyone, self._what())
                self._serve_round(everyone, None)
        if not schedule.recorded and not schedule.dynamic and self.dp_size > 1:
            self._dynamic_if_units_idle(kind, schedule)
        if schedule.dynamic:
            self._serve_until_done()
        elif schedule.recorded:
            for position in range(schedule.position, len(schedule.order)):
                self._consume_entry(schedule, position)
        if not schedule.recorded:
            schedule.finish_recording()
        schedule.position = 0
        self.open_kind = None
        for unit in self.units:
            unit.backward_uses = 0
            unit.forward_frees.clear()  # left by a forward that raised
        self._free_all()

    # -- backward bookkeeping -------------------------------------------------------------------
    def _note_backward(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        if self.on_backward_begin is not None:
            self.on_backward_begin()

    def _on_backward_end(self) -> None:
        for unit in self.units:
            unit.backward_uses = 0
        self._free_all()
        self.in_backward = False
        if self.phase is None:  # the step method returned: this backward ends the step
            self._close()

    def _post_backward(self, unit: Unit) -> None:
        unit.backward_uses -= 1
        if unit.backward_uses <= 0:  # a unit run twice is freed after its first use's backward
            self._free(unit)
            if self.on_unit_skipped_in_backward is not None:
                # Parameters of the unit that got no gradient here (an idle expert inside it) are
                # zeros now: their bucket launches where it does on the ranks that used them
                # ([Note: skipped units and gradient buckets]).
                self.on_unit_skipped_in_backward(unit.trainable)

    def _wrap_inputs(self, unit: Unit, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not positions:
            return None
        wrapped = _PostBackward.apply(self, unit, *(flat[i] for i in positions))
        for i, tensor in zip(positions, wrapped):
            flat[i] = tensor
        return tree_unflatten(flat, spec)

    # -- hooks ----------------------------------------------------------------------------------
    def _make_pre_forward(self, unit: Unit):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            if self.held_whole_step:  # [Note: stage 3 under a pipeline]
                return None
            if _in_backward():  # activation-checkpoint recompute
                self._note_backward()
                self._reach(unit)
                if unit.backward_uses == 0 and torch.is_grad_enabled():
                    # The original forward ran without grad (use_reentrant=True): the nested
                    # backward of this recompute is where the unit's backward happens.
                    unit.backward_uses += 1
                    return self._wrap_inputs(unit, args, kwargs)
                return None  # non-reentrant: the original forward's post-backward frees it
            else:
                if self.open_kind is not None and self.phase is None and not self.in_backward:
                    self._close()  # a forward after the step method returned: the step is over
                if self._off_schedule(args, kwargs):  # no backward will follow: nothing to count
                    unit.forward_frees.append(self._gather_on_demand(unit))
                    self.high_water_forward = max(self.high_water_forward, self._gathered_blocks())
                    return None
                unit.forward_frees.append(None)
                self._reach(unit)
                self.high_water_forward = max(self.high_water_forward, self._gathered_blocks())
            if torch.is_grad_enabled():
                # Every forward under grad counts; a use whose inputs need no gradient never
                # reports its backward done, so such a unit is freed when backward ends.
                unit.backward_uses += 1
                return self._wrap_inputs(unit, args, kwargs)
            return None

        return hook

    def _make_post_forward(self, unit: Unit):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self.held_whole_step:
                return output
            if _in_backward():
                return output  # recompute: backward needs the unit; its post-backward frees it
            if torch.is_grad_enabled():
                for tensor in _tensors(output):
                    if tensor.requires_grad:
                        tensor.register_hook(self._make_pre_backward(unit))
            frees = unit.forward_frees.pop() if unit.forward_frees else None
            if frees is None:  # the usual rule: freed, unless held into its backward
                schedule = self._open_schedule()
                frees = schedule is None or not schedule.holds(unit.index)
            if frees:
                self._free(unit)
            return output

        return hook

    def _make_pre_backward(self, unit: Unit):
        def hook(grad: torch.Tensor) -> None:
            self._note_backward()
            self._reach(unit)
            self.high_water_backward = max(self.high_water_backward, self._gathered_blocks())

        return hook

    def _root_pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.held_whole_step:
            return
        if _in_backward():
            self._note_backward()
        else:
            if self.open_kind is not None and self.phase is None and not self.in_backward:
                self._close()
            if self._off_schedule(args, kwargs):
                self.root.forward_frees.append(self._gather_on_demand(self.root))
                return
            self.root.forward_frees.append(None)
        self._reach(self.root)

    def _make_root_post_forward(self, is_top: bool):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if _in_backward() or self.held_whole_step:
                return output
            if torch.is_grad_enabled():
                for tensor in _tensors(output):
                    if tensor.requires_grad:
                        tensor.register_hook(self._root_pre_backward)
            frees = self.root.forward_frees.pop() if self.root.forward_frees else None
            if frees:  # a no_grad forward in a training step gathered it: freed after
                self._free(self.root)
            elif frees is None and is_top and self.open_kind is None and not self.in_backward:
                self._free(self.root)  # an out-of-step forward of the whole model: freed after
            return output

        return hook

    def _root_pre_backward(self, grad: torch.Tensor) -> None:
        self._note_backward()
        self._reach(self.root)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._free_all()  # gathered parameters are stale now; the next use gathers the new ones

    # -- step boundaries (called by the strategy) ------------------------------------------------
    def begin_step(self, phase: str = "train") -> None:
        """Open a training (``"train"``) or evaluation (``"eval"``) step; closes the previous one
        and gathers the root unit."""
        if phase not in ("train", "eval"):
            raise ValueError(f"Stage3Runtime.begin_step(phase={phase!r}): must be 'train' or 'eval'")
        if self.in_backward:
            return
        self._close()
        if phase == "eval":
            self._eval_step_agreement()
        self.step += 1
        self.phase = phase
        self.open_kind = phase
        self._reach(self.root)

    @contextmanager
    def held_whole(self) -> Iterator[None]:
        """Inside an open training step: every unit gathered once (along the recorded schedule),
        kept gathered with the hooks off, freed on the way out ([Note: stage 3 under a pipeline])."""
        if self.open_kind != "train" or self.in_backward:
            raise RuntimeError("lightning_zero ZeRO-3: held_whole runs inside a training step, outside backward")
        for unit in self.units:
            self._reach(unit)
        self.high_water_forward = max(self.high_water_forward, self._gathered_blocks())
        self.held_whole_bytes = max(self.held_whole_bytes, self.gathered_bytes())
        self.held_whole_step = True
        try:
            yield
        finally:
            self.held_whole_step = False
            self._free_all()

    def end_step_call(self) -> None:
        """The step method returned; its backward (automatic optimization) may still follow."""
        self.phase = None

    def end_eval_step(self) -> None:
        """After an evaluation step: close its schedule and free everything."""
        self.phase = None
        if not self.in_backward:
            self._close()

    def _eval_step_agreement(self) -> None:
        everyone = self.agreement.exchange(EVAL, 1)
        if any(kind != EVAL for kind, _ in everyone):
            names = self.agreement.describe_all(everyone)
            raise RuntimeError(
                f"lightning_zero ZeRO-3: ranks are out of step at the start of evaluation step {self.step + 1} ({names})."
            )

    def end_eval_loop(self) -> None:
        """This rank's evaluation loop ended. While other ranks still run evaluation steps (uneven
        numbers of batches per rank, or a forward on some ranks only: [Note: forwards on some ranks
        only] in ``runtime/forward_steps.py``), serve their all-gathers by replaying the recorded
        evaluation schedule; return once every rank is done (collective over the gather group)."""
        self.end_eval_step()
        while True:
            everyone = self.agreement.exchange(EVAL, 0)
            if all(pair == (EVAL, 0) for pair in everyone):
                return
            schedule = self.schedules.get("eval")
            running = [r for r, pair in enumerate(everyone) if pair == (EVAL, 1)]
            if schedule is None or not schedule.recorded or any(kind != EVAL for kind, _ in everyone):
                names = self.agreement.describe_all(everyone)
                self.channel.abort(
                    f"lightning_zero ZeRO-3: dp rank {self.dp_rank} ended its evaluation loop (or waits in a"
                    f" collective) while dp ranks {running} still evaluate ({names}), and no evaluation step ran"
                    " on every rank before, whose all-gathers it could replay. Give every rank the same number"
                    " of evaluation batches (a DistributedSampler pads them); for a forward on some ranks only"
                    " (LitGPT's generate_example on rank 0), run one no_grad forward on every rank first"
                    " (LitGPT's validate does), or run it on every rank."
                )
            for index in schedule.order:
                unit = self.units[index]
                self._start_gather(unit)
                self._free(unit)

    def unshard(self) -> None:
        """Give every parameter its own full tensor again (after training; collective over dp)."""
        if not self.in_backward:
            self._close()
        self.phase = None
        for unit in self.units:
            self._free(unit)
            self._start_gather(unit)
            self._wait(unit)
            for group in unit.groups:
                for slot in group.layout.slots:
                    slot.param.data = slot.param.data.clone()
            self._free(unit)

    def held_numel(self, kind: str = "train") -> int:
        """Elements the recorded ``kind`` schedule keeps gathered from forward into backward,
        gathering them once instead of twice per forward/backward pair ([Note: held into backward])."""
        schedule = self.schedules.get(kind)
        if schedule is None or schedule.dynamic:  # ``held`` is empty until the schedule is recorded
            return 0
        return sum(self.units[index].numel for index, held in zip(schedule.order, schedule.held) if held)

    def gathered_bytes(self) -> int:
        """Bytes of full unit buffers gathered now: the working set (a unit in use, prefetched, or
        held into backward), not model state."""
        return sum(group.full_buffer.untyped_storage().nbytes() for unit in self.units for group in unit.groups)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _tensors(output: Any) -> Iterable[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)
    elif hasattr(output, "to_tuple"):  # Hugging Face ModelOutput
        yield from _tensors(output.to_tuple())
