"""A run driven by the user's own loop: the engine built when first needed, steps named by the model's forward.

The Fabric door (``fabric/strategy.py``) has no hook per step the way the Trainer has; what it has
is the set-up model and its optimizers. :class:`ForwardSteps` turns them into
:class:`~lightning_zero.runtime.run.ZeroRun`'s events, with nothing of Fabric in it:

- the engine is built over the module and every optimizer set up so far at the first call that
  needs it (the first forward, a load, a save), so both ``setup(model, opt)`` and LitGPT's order
  (``setup(model)``, the optimizer over ``model.parameters()``, then ``setup_optimizers(opt)``)
  build one engine with every optimizer; a meta-built model waits behind stand-ins until then
  (``runtime/deferred_init.py``);
- the step boundaries come from the model's forward hooks ([Note: Fabric step boundaries]);
- the optimizer steps are counted by the first optimizer's step post-hook: the monitor measures
  there, background saves get their host buffers there, the signals agree there.

[Note: Fabric step boundaries] The Trainer names each step through its hooks; under Fabric the
set-up model's forward does:

- a forward with grad enabled, when no training step is open, opens one (``begin_step("train")``);
  forwards before the backward belong to it; ``fabric.backward`` ends it (and with it the gradient
  sync). Each micro batch of a ``no_backward_sync`` loop is one such step, as under the Trainer's
  ``accumulate_grad_batches``. ``optimizer.step()`` frees every gathered unit (stage 3).
- a forward under ``torch.no_grad()`` / ``torch.inference_mode()`` outside a training step is one
  evaluation step (``begin_step("eval")`` ... ``end_eval_step()``): stage 3 gathers along the
  recorded evaluation schedule and frees everything after it. Token-by-token generation is one
  evaluation step per forward. Every rank must run the same number of such forwards.
- a grad-disabled forward inside an open training step (an EMA teacher) follows
  [Note: no_grad forwards in a training step] in ``zero/stage3/runtime.py``.

[Note: forwards on some ranks only] At stage 3 a forward needs every rank: the parameters are
shards, each unit is all-gathered before it runs. LitGPT's fine-tuning scripts run
``generate_example`` (a forward per new token, under ``no_grad``) on rank 0 only, while the other
ranks go on to ``fabric.barrier()`` (after validation) or ``fabric.all_reduce`` (when the last epoch
ends); under Lightning's FSDP the other ranks' collective and rank 0's all-gathers never meet, and
the run stalls until the process group's timeout. Here each of the door's collectives (``barrier``,
``all_reduce``, ``all_gather``, ``broadcast``) first takes part in the evaluation forwards other
ranks still run (:meth:`ZeroRun.serve_evaluating_peers`), as a rank whose evaluation loop ended
does (``engine.end_eval_loop``: one 16-byte exchange per call, and while a peer evaluates, the
recorded evaluation schedule's all-gathers: ``Stage3Runtime.end_eval_loop``), and returns once
every rank has arrived. A peer's forward must follow the recorded evaluation schedule (one forward
on every rank first: LitGPT's ``validate`` runs before each ``generate_example``), else the serving
ranks raise naming the fix. Skipped inside a training step (between its forward and
``fabric.backward``), where no rank evaluates; every rank takes the same decision, so the exchange
itself always meets.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Generator, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.runtime.deferred_init import DeferredInit
from lightning_zero.runtime.run import ZeroRun, in_backward

if TYPE_CHECKING:
    from lightning_zero.precision import PrecisionPolicy
    from lightning_zero.runtime.signals import AgreedSignals
    from lightning_zero.zero.engine import ZeroEngine


class ForwardSteps:
    """The set-up module and optimizers of a loop the user writes, over ``run``; ``precision`` is
    the door's current precision policy (Fabric sets its plugin after the strategy is built)."""

    def __init__(self, run: "ZeroRun", precision: Callable[[], "PrecisionPolicy"]) -> None:
        self.run = run
        self.precision = precision
        self.module: Optional[nn.Module] = None
        self.optimizers: list[Optimizer] = []
        # per optimizer, per param group: the parameter names in the user's order ([Note: full optimizer state])
        self.param_names: list[list[list[str]]] = []
        self.steps = 0  # optimizer steps taken (for the failure path's "training step N")
        self.train_step_open = False
        self._eval_forward = False
        self.init = DeferredInit()
        self._hooks: list[Any] = []
        self._after_forward_hook: Optional[Any] = None
        self.report: Any = None  # what gets the monitor's metrics: an object with ``log_dict(metrics, step=)``

    @property
    def where(self) -> str:
        return f"training step {self.steps + 1}"

    # -- the module and its optimizers --------------------------------------------------------------
    def set_module(self, module: nn.Module, value_dtype: Callable[[nn.Parameter], torch.dtype]) -> bool:
        """Adopt ``module`` (one model per run): the layout pushed into it ([Note: the parallelize
        registry]: under Fabric the model arrives after the launch, so it is checked and
        parallelized here, before anything is broadcast or sharded), then on the device with dp rank
        0's weights, its forward hooked, ``state_dict()`` serving ddp's values (``value_dtype``).
        ``False`` when it was adopted before."""
        if self.module is not None and self.module is not module:
            raise ValueError(
                "ZeroFabricStrategy: one model per strategy; fabric.setup was already called with another"
                f" {type(self.module).__name__}. Put the models in one nn.Module, or use one Fabric per model."
            )
        if self.module is not None:
            return False
        self.run.parallelize(module)
        self.module = module
        self.run.setup_module(module)
        # first of the module's forward pre-hooks (the engine's come after: [Note: Fabric step boundaries])
        # [Note: hooks under torch.compile] in zero/stage3/runtime.py: the engine is built (stage 3:
        # materialized) at the first forward, which must run eagerly, outside a compiled frame
        hook = torch.compiler.disable(self._before_forward)
        self._hooks.append(module.register_forward_pre_hook(hook, prepend=True))
        # stage 3, -mixed and tp-split parameters: gathered one parameter at a time, ddp's dense values
        self.run.serve_state_dicts(module, value_dtype, dense=True)
        if not self.optimizers:
            self.init.stand_in_for_meta_parameters(module, self.run.device)
        return True

    def add_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self.engine_has_optimizers() and optimizer not in self.optimizers:
            raise RuntimeError(
                f"ZeroFabricStrategy: {type(optimizer).__name__} was set up after the ZeRO engine was built (at"
                " the model's first forward, or fabric.load/save). Set up every optimizer before the first"
                " forward: fabric.setup(model, opt1, opt2) or fabric.setup_optimizers(opt1, opt2)."
            )
        if optimizer not in self.optimizers:
            self.optimizers.append(optimizer)
            optimizer.register_step_post_hook(self._count_step)
        return optimizer

    def engine_has_optimizers(self) -> bool:
        engine = self.run.engine
        return engine is not None and bool(engine.optimizers)

    def ensure_engine(self) -> "ZeroEngine":
        """The engine over the set-up module and every optimizer set up so far (built once; an
        engine built without optimizers, for a forward before any optimizer was set up, is rebuilt
        with them: one full gather)."""
        engine = self.run.engine
        if engine is not None and (engine.optimizers or not self.optimizers):
            return engine
        if self.module is None:
            raise RuntimeError("ZeroFabricStrategy: set up the model first (fabric.setup(model, ...)).")
        if engine is not None:  # built for a forward without optimizers (stage 3): rebuilt with them
            engine.release_module()
        self.init.restore_meta_parameters(self.module, self.optimizers)
        from lightning_zero.checkpoint.full_optimizer import record_param_names

        names = {id(param): name for name, param in self.module.named_parameters()}
        self.param_names = [record_param_names(optimizer, names) for optimizer in self.optimizers]
        with self.init.rng_stream(self.run.device):
            engine = self.run.build_engine(self.module, self.optimizers, self.precision())
        # last of the module's forward hooks: a step closes after the engine's own hooks ran
        if self._after_forward_hook is not None:
            self._after_forward_hook.remove()
        hook = torch.compiler.disable(self._after_forward)
        self._after_forward_hook = self.module.register_forward_hook(hook, always_call=True)
        # the flags ride on the phase markers, which run over the dense group: the world when there is
        # no tp and no pp ([Note: marker riders])
        dims = self.run.dims
        self.run.signals.ride(engine, markers_cover_world=dims is None or dims.dp_cp == dims.world_size)
        return engine

    # -- step boundaries ([Note: Fabric step boundaries]) ---------------------------------------------
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if in_backward():
            return
        if self.run.engine is None and not self.optimizers and self.run.config.stage != 3:
            return  # stages 1-2 without an optimizer: the module is whole on every rank, nothing to do
        engine = self.ensure_engine()
        if self.train_step_open:
            return
        if torch.is_grad_enabled():
            engine.begin_step("train")
            self.train_step_open = True
            if self.run.monitor is not None:
                self.run.monitor.micro_batch(engine, module, args, dims=self.run.dims)
        else:
            engine.begin_step("eval")
            self._eval_forward = True

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        engine = self.run.engine
        if in_backward() or engine is None:
            return
        if self._eval_forward:
            self._eval_forward = False
            engine.end_eval_step()
        elif self.train_step_open:
            engine.end_step_call()  # its backward follows

    @contextmanager
    def backward(self) -> Generator[None, None, None]:
        """Around the loss's backward: the gradient sync ends with it, and so does the training step."""
        if self.run.engine is None:
            yield
            return
        with self.run.noting_failures():
            self.run.pre_backward()
            yield
            self.run.post_backward()
        self.train_step_open = False

    def pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor, accumulate: int) -> torch.Tensor:
        """``pp > 1``: one batch through the schedule ([Note: the pipelined step] in runtime/pipeline.py);
        with grad enabled it opens the training step its backward closes."""
        pipeline = self.run.session.pipeline
        if pipeline is None:
            raise RuntimeError("ZeroFabricStrategy.pipeline_step: set pp > 1 and fabric.setup(model, optimizer) first")
        with self.run.noting_failures():
            if torch.is_grad_enabled() and self.run.engine is not None:
                self.run.engine.begin_step("train")
                self.train_step_open = True
            pipeline.grad_divisor = accumulate
            loss = pipeline.loss(inputs, targets)
            if torch.is_grad_enabled() and pipeline.aux is not None:  # a MoE's balancing terms, backwarded with it
                loss = loss + pipeline.aux.to(loss.dtype)
            return loss

    def pipelined_backward(self) -> bool:
        """``pp > 1``: the schedule's gradients handed to the engine in place of a backward, closing
        the training step; ``False`` (nothing done) when the loop is not pipelined."""
        if self.run.engine is None or self.run.session.pipeline is None:
            return False
        with self.run.noting_failures():
            self.run.session.pipelined_backward()
        self.train_step_open = False
        return True

    def no_sync(self, module: nn.Module) -> AbstractContextManager:
        """Gradients kept local (stage 1; stage 2 with ``defer_grad_reduce``; stage 2 otherwise
        reduce-scatters every micro batch, its memory promise)."""
        if module is not self.module:
            raise TypeError("no_backward_sync: pass the model set up with this strategy (fabric.setup's result).")
        if self.run.engine is None and not self.optimizers:
            warnings.warn("no_backward_sync before any optimizer was set up: nothing to skip", stacklevel=4)
            return nullcontext()
        return self.ensure_engine().no_sync()

    def serve_evaluating_peers(self) -> None:
        """[Note: forwards on some ranks only]: before one of the door's collectives."""
        self.run.serve_evaluating_peers(train_step_open=self.train_step_open)

    # -- after each optimizer step: the signals, the monitor, background saves' buffers ---------------
    def scheduler_signals(self) -> Optional["AgreedSignals"]:
        """[Note: signal boundaries] in runtime/signals.py: what every rank agreed on since the last
        optimizer step (``None``: go on; no boundary without a step since the last call)."""
        return self.run.signals.after_steps(self.steps, self._signal_exchange)

    def _signal_exchange(self) -> Callable[[list[int]], list[int]]:
        steps = self.steps
        return self.run.signals.exchange(self.run.device, failure=self.run.session.failure_channel,
                                         where=lambda: f"the end of optimizer step {steps}")  # fmt: skip

    def _count_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        engine = self.run.engine
        if optimizer is not self.optimizers[0]:
            return
        self.steps += 1
        if self.run.monitor is not None and engine is not None:
            self._monitor_step(engine)
        if self.module is not None and self.run.wants_host_buffers:
            self.run.prepare_saves(self.module, self.optimizers, self.precision().name, with_optimizer=True)

    def _monitor_step(self, engine: "ZeroEngine") -> None:
        monitor = self.run.monitor
        assert monitor is not None
        metrics = monitor.step_end(engine, self.module)
        if self.report is not None:
            self.report.log_dict(metrics, step=self.steps)
        message = monitor.overlap_warning(engine, metrics, metrics["zero/comm_s"], self.steps)
        if message is not None and self.run.is_global_zero:
            warnings.warn(message, stacklevel=2)

    def remove_hooks(self) -> None:
        for handle in [*self._hooks, self._after_forward_hook]:
            if handle is not None:
                handle.remove()
        self._hooks.clear()
        self._after_forward_hook = None
