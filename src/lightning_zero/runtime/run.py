"""ZeroRun: the one runtime object of a run on this rank; both doors only translate their hooks into its events.

[Note: one runtime object] A run owns its layout and process groups, its engine, its checkpoint
lifecycle, its scheduler signals, its monitor and its failure channel. All of them hang off one
:class:`ZeroRun`, built from the config's policies (``config.layout`` becomes ``ParallelDims`` at
:meth:`plan_layout`; ``config.runtime``: the monitor and the collective timeout;
``config.checkpointing``: background saves and object storage) -- the session-plus-lifecycle
wiring written once. A door is a translation table from its framework's hooks to these events,
as torchtitan's trainer calls ``CheckpointManager.save(step)`` and nothing else:

===========================  ==========================================  ===========================================
event                        Trainer door (``trainer/strategy.py``)      Fabric door (``fabric/strategy.py``)
===========================  ==========================================  ===========================================
plan_layout, start           ``setup_environment``                       ``setup_environment``
push_layout / parallelize    ``setup_environment`` (to the module)       ``setup_module`` (into the model)
setup_module, serve_...      ``setup``                                   ``setup_module``
build_engine                 ``setup``                                   first forward, save or load
                                                                         (``runtime/forward_steps.py``)
train_step, eval_step        ``training_step``, ``validation_step``, ..  the model's forward hooks
                                                                         ([Note: Fabric step boundaries])
backward, no_sync            ``pre_/post_backward``,                     ``backward``, ``no_backward_sync``
                             ``block_backward_sync``
after an optimizer step      ``optimizer_step``: :meth:`prepare_saves`   the step post-hook: :meth:`optimizer_stepped`
save, before_load            ``save_checkpoint``, ``load_checkpoint``    ``save_checkpoint``, ``load_checkpoint``
note_failure                 ``on_exception``, a step's exception        ``sys.excepthook``, ``note_failure``
teardown                     ``teardown``                                ``teardown`` (and ``quiesce`` at exit)
===========================  ==========================================  ===========================================

``tests/test_structure.py`` fails when a door builds a ``ZeroSession`` or a ``CheckpointLifecycle``
itself, or grows past 400 lines.
"""

from __future__ import annotations

import atexit
import weakref
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Generator, Optional

import torch
from torch import nn

from lightning_zero.config import ZeroConfig
from lightning_zero.runtime.checkpoints import CheckpointLifecycle, storage_policy
from lightning_zero.runtime.monitor import Monitor
from lightning_zero.runtime.session import ZeroSession
from lightning_zero.runtime.signals import AgreedStop, SignalBoundary

if TYPE_CHECKING:
    from lightning_zero.checkpoint import RankPlacement
    from lightning_zero.comm.mesh import ParallelDims
    from lightning_zero.precision import PrecisionPolicy
    from lightning_zero.runtime.restore import CheckpointRestore
    from lightning_zero.zero.engine import ZeroEngine


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a hook fired by a recomputation)."""
    return torch._C._current_graph_task_id() != -1


class ZeroRun:
    """One rank's run: :attr:`session` (layout, groups, failure channel, engine), :attr:`checkpoints`
    (:class:`~lightning_zero.runtime.checkpoints.CheckpointLifecycle`), :attr:`signals` (the
    scheduler signals' boundary, [Note: signal boundaries]) and :attr:`monitor` (``None`` with
    ``monitor=False``), and the events both doors give ([Note: one runtime object]).

    Args:
        config: the knobs, whole (its policies: ``layout``, ``sharding``, ``runtime``, ...).
        wrap_policy: stage 3's unit policy, or ``None`` for the default.
        ranks: ``() -> (world_size, global_rank)``, the door's (they are known once it launched).
        where: ``() -> str``, where the loop is, for a failure's message ("training step 3").
    """

    def __init__(
        self,
        config: ZeroConfig,
        wrap_policy: Optional[Callable[..., bool]],
        *,
        ranks: Callable[[], tuple[int, int]],
        where: Callable[[], str],
    ) -> None:
        self.config = config
        self.session = ZeroSession(config, wrap_policy)
        self._ranks = ranks
        self.where = where
        # every save from request to publish and link ([Note: checkpoint lifecycle] in runtime/checkpoints.py)
        self.checkpoints = CheckpointLifecycle(
            async_checkpoint=config.checkpointing.async_checkpoint, stall_s=config.runtime.collective_timeout,
            failed=lambda: self.session.failed, is_global_zero=lambda: self.is_global_zero,
            storage=storage_policy(config.checkpointing),
        )  # fmt: skip
        self.signals = SignalBoundary()  # [Note: signal boundaries] in runtime/signals.py
        self.monitor: Optional[Monitor] = Monitor() if config.runtime.monitor else None  # [Note: the monitor]
        self.device = torch.device("cpu")  # this rank's device and local ranks, from start()
        self.ranks_per_node = 1
        self._state_dict_hooks: list[Any] = []  # serve_state_dicts', removed at teardown
        self._names_before_split: dict[int, str] = {}  # parallelize's: the whole model's parameter names by id
        self._exit_hook = False  # [Note: nothing running at exit]
        self._restore: Optional["CheckpointRestore"] = None  # a load across the Trainer's three calls

    # -- views ------------------------------------------------------------------------------------
    @property
    def engine(self) -> Optional["ZeroEngine"]:
        return self.session.engine

    @property
    def failed(self) -> bool:
        """This rank failed, or knows another rank did: it issues no collective any more."""
        return self.session.failed

    @property
    def is_global_zero(self) -> bool:
        return self._ranks()[1] == 0

    @property
    def wants_host_buffers(self) -> bool:
        """Background saves whose host buffers are not made yet (:meth:`prepare_saves`)."""
        return self.config.checkpointing.async_checkpoint and not self.checkpoints.prepared and self.engine is not None

    @property
    def dims(self) -> Optional["ParallelDims"]:
        return self.session.dims

    # -- set up: layout, groups, the module, the engine ---------------------------------------------
    def plan_layout(self, *, num_nodes: int, num_processes: int, module: Any) -> "ParallelDims":
        """Before any process group: ``ParallelDims`` from ``config.layout`` and the cluster; raises on a bad one."""
        return self.session.plan_layout(num_nodes=num_nodes, num_processes=num_processes, module=module)

    def start(self, device: torch.device, *, ranks_per_node: int) -> None:
        """Once the door started the default process group: the failure channel, the groups."""
        self.device, self.ranks_per_node = device, ranks_per_node
        self.session.start(device.type)

    def push_layout(self, module: Any) -> None:
        """[Note: the parallelize registry]: the layout handed to a module that builds its model later
        (the Trainer's LightningModule, in ``configure_model``)."""
        from lightning_zero.runtime.parallelize import hand_over

        hand_over(module, self.session.parallel_plan())

    def parallelize(self, module: nn.Module) -> None:
        """[Note: the parallelize registry]: the layout's one check against a model that arrives
        built (Fabric's ``setup``), then each registered decoder inside it parallelized by its
        family's step (tp, ep, cp in that order), before anything is broadcast or sharded."""
        dims, groups = self.session.dims, self.session.groups
        if dims is None or groups is None:
            return
        from lightning_zero.runtime.parallelize import check_layout
        from lightning_zero.runtime.pipeline import pipeline_layout

        check_layout(dims, module)
        self.session.pipeline_layout = pipeline_layout(self.config, dims, module)  # pp > 1: the checked split
        self._names_before_split = {id(param): name for name, param in module.named_parameters()}
        self.session.parallel_plan().apply(module)

    def model_build(self) -> ContextManager:
        """Where a model built for the run goes: stage 3 on the meta device (the engine materializes
        it one unit at a time), else where it would go anyway. Under ``pp > 1`` the model is built
        whole, as ddp's (its initializers draw in ddp's order), then cut to this rank's stages
        ([Note: stage 3 under a pipeline] in ``zero/stage3/runtime.py``)."""
        meta = self.config.sharding.stage == 3 and self.session.pipeline_layout is None
        return torch.device("meta") if meta else nullcontext()

    def setup_module(self, module: nn.Module) -> None:
        """The module on this rank's device (meta tensors stay), dp rank 0's weights on every dp rank."""
        self.session.prepare_module(module, self.device, ranks_per_node=self.ranks_per_node)

    def serve_state_dicts(
        self, module: nn.Module, value_dtype: Callable[[nn.Parameter], torch.dtype], *, dense: bool = False
    ) -> None:
        """[Note: full state dicts]: ``module.state_dict()`` hands out ddp's values while the engine
        runs (once per set-up module; the hooks of an earlier call are removed first); ``dense``:
        tp-split parameters whole (a user's loop, whose ddp state dict is the dense model's)."""
        self.remove_state_dict_hooks()
        self._state_dict_hooks = self.session.serve_full_state_dicts(module, value_dtype, dense=dense)

    def remove_state_dict_hooks(self) -> None:
        for handle in self._state_dict_hooks:
            handle.remove()
        self._state_dict_hooks = []

    def build_engine(self, module: nn.Module, optimizers: list, precision: "PrecisionPolicy") -> "ZeroEngine":
        """A fresh engine over ``module`` and ``optimizers`` (an earlier one is closed first)."""
        return self.session.build_engine(module, optimizers, precision=precision, device=self.device,
                                         ranks_per_node=self.ranks_per_node)  # fmt: skip

    def on_host(self, optimizers: list) -> list:
        """Of ``optimizers``, those whose state may move to the device: state the engine put beside
        host masters (``offload_optimizer``) stays there, or the first step breaks."""
        engine = self.engine
        kept = {id(s.optimizer) for s in engine.optimizers if s.offload is not None} if engine else set()
        return [optimizer for optimizer in optimizers if id(optimizer) not in kept]

    # -- steps ------------------------------------------------------------------------------------
    def start_pipeline(self, module: nn.Module) -> None:
        """``pp > 1``: torch's schedules over this rank's stages ([Note: the pipelined step] in runtime/pipeline.py)."""
        self.session.start_pipeline(module, self.device)

    def rebind_optimizers(self, optimizers: list, module: nn.Module) -> None:
        """Under Fabric: optimizers built over the whole model before the parallelize step split it
        (tp, ep) or cut it (pp) step the parameters of the same names this rank holds, and only
        those ([Note: optimizers built before the split] in runtime/parallelize.py)."""
        if self._names_before_split:
            from lightning_zero.runtime.parallelize import rebind_optimizers

            rebind_optimizers(optimizers, module, self._names_before_split)

    def pipelined_backward(self) -> bool:
        """``pp > 1``: the gradients the step's schedule kept aside handed to the engine (``False``:
        not pipelined, the door runs its own backward)."""
        return self.session.pipelined_backward()

    def stepping(self, module: nn.Module, accumulate: int = 1) -> ContextManager:
        """Around a module's own step: under ``pp > 1`` its model runs as a pipeline ([Note: the
        pipelined step]); otherwise nothing."""
        return self.session.stepping(module, accumulate)

    @contextmanager
    def train_step(self) -> Generator[Optional["ZeroEngine"], None, None]:
        """One training step call ([Note: phases] in zero/stage3/runtime.py); its backward may still
        follow. A failure in it is posted ([Note: failure path])."""
        engine = self.engine
        if engine is None:
            yield None
            return
        engine.begin_step("train")
        try:
            yield engine
        except BaseException as exception:
            self.note_failure(exception)
            raise
        finally:
            engine.end_step_call()

    @contextmanager
    def eval_step(self, module: nn.Module) -> Generator[None, None, None]:
        """One evaluation step of ``module``; after a failure no ``end_eval_step`` (it gathers what
        the schedule expects). Under ``pp > 1`` the model runs as a pipeline while it is open."""
        engine = self.engine
        if engine is None:
            with self.session.stepping(module):
                yield
            return
        engine.begin_step("eval")
        try:
            with self.session.stepping(module):
                yield
        except BaseException as exception:
            self.note_failure(exception)
            raise
        engine.end_eval_step()

    def no_sync(self) -> ContextManager:
        """Gradients kept local for a non-final micro batch (stage 1; stages 2-3 with defer_grad_reduce)."""
        return nullcontext() if self.engine is None else self.engine.no_sync()

    def pre_backward(self) -> None:
        if self.engine is not None:
            self.engine.pre_backward()

    def post_backward(self) -> None:
        """The gradient sync ends here, whatever the loss reached ([Note: end of backward] in reducer.py)."""
        if self.engine is not None:
            self.engine.post_backward()

    def end_eval_loop(self) -> None:
        """Ranks with fewer evaluation batches serve the others' all-gathers until all are done."""
        if self.engine is not None:
            self.engine.end_eval_loop()

    def wait_param_gathers(self) -> None:
        """[Note: overlapped parameter gather] in zero/param_gather.py: parameters whole again."""
        if self.engine is not None:
            self.engine.wait_param_gathers()

    def serve_evaluating_peers(self, *, train_step_open: bool) -> None:
        """[Note: forwards on some ranks only] in runtime/forward_steps.py: at stage 3, before one of
        the door's own collectives, take part in the evaluation forwards other ranks still run."""
        engine = self.engine
        if engine is None or engine.stage != 3 or train_step_open or self.failed or in_backward():
            return
        with self.noting_failures():
            engine.end_eval_loop()

    # -- failures ([Note: failure path] in runtime/failure.py) --------------------------------------
    def note_failure(self, exception: BaseException, where: Optional[str] = None) -> None:
        """Post ``exception`` to the peers; an agreed stop is no failure ([Note: signal boundaries])."""
        if not isinstance(exception, AgreedStop):
            self.session.note_failure(exception, self.where() if where is None else where)

    @contextmanager
    def noting_failures(self) -> Generator[None, None, None]:
        try:
            yield
        except BaseException as exception:
            self.note_failure(exception)
            raise

    def excepthook(self, previous: Callable[..., Any]) -> Callable[..., Any]:
        """A ``sys.excepthook`` that posts the exception a script ends with, then calls ``previous``."""

        def hook(kind: type, exception: BaseException, trace: Any) -> None:
            self.session.note_failure(exception, self.where())
            previous(kind, exception, trace)

        return hook

    def refuse_when_failed(self, what: str) -> None:
        """A save or load that needs every rank raises on the failure path, naming the failure."""
        if not self.failed:
            return
        channel = self.session.failure_channel
        peer = channel.peer_failure if channel is not None else None
        cause = f"global rank {peer[0]} failed" if peer is not None else "this rank failed"
        raise RuntimeError(
            f"lightning_zero (global rank {self._ranks()[1]}): {cause}; {what} (it needs every rank). The last"
            " complete checkpoint is still the newest."
        )

    # -- checkpoints ([Note: checkpoint lifecycle] in runtime/checkpoints.py) -------------------------
    def layout(self, precision: str) -> "RankPlacement":
        """Where this rank sits, as a checkpoint records it (and a load reads into)."""
        world_size, global_rank = self._ranks()
        return self.session.checkpoint_layout(world_size=world_size, global_rank=global_rank, precision=precision)

    @staticmethod
    def check_storage_options(caller: str, path: Any, storage_options: Optional[Any], fix: str = "") -> None:
        """Per-save storage options are for object storage: with a local path they raise (before any collective)."""
        from lightning_zero.checkpoint.objstore import is_url

        if storage_options is not None and not is_url(path):
            raise TypeError(f"{caller}(storage_options={storage_options!r}): options for object storage, and"
                            f" {str(path)!r} is a local path; pass them with a URL (s3://...){fix}.")  # fmt: skip

    def save(self, path: Any, checkpoint: dict[str, Any], *, step: Any, module: nn.Module, optimizers: list,
             precision: str, storage_options: Optional[Any] = None) -> None:  # fmt: skip
        """The Trainer's save: every rank writes what it holds; on the failure path a warning, no save.
        After fit, validate, test or predict the optimizers' state is where fit's engine left it
        ([Note: optimizer state after the loop] in zero/flat.py): such a save holds what ddp's holds."""
        if self.failed:  # ModelCheckpoint(save_on_exception=True), or a save after the failure
            what = (f"the checkpoint {str(path)!r} was not saved (a sharded checkpoint needs every rank); the"
                    " last complete checkpoint is still the newest")  # fmt: skip
            self.session.warn_failed(self._ranks()[1], what)
            return
        self.wait_param_gathers()
        self.checkpoints.save(path, checkpoint, step=step, module=module, engine=self.engine, optimizers=optimizers,
                              layout=self.layout(precision), storage_options=storage_options,
                              optimizer_shards=self.session.optimizer_shards(optimizers))  # fmt: skip

    def prepare_saves(self, module: nn.Module, optimizers: list, precision: str, *, with_optimizer: bool) -> None:
        """[Note: host buffers before the first save] in checkpoint/background.py: once the optimizer
        state exists (a skipped first step, 16-mixed's overflow, has none yet: the next one then)."""
        from lightning_zero.checkpoint.background import live_tensors

        if not self.wants_host_buffers:
            return
        if with_optimizer and not any(optimizer.state for optimizer in optimizers):
            return
        self.wait_param_gathers()
        self.checkpoints.prepare(live_tensors(module=module, engine=self.engine, optimizers=optimizers,
                                              layout=self.layout(precision), with_optimizer=with_optimizer))  # fmt: skip

    def save_hf_pretrained(self, path: Any, module: nn.Module, precision: str, **options: Any) -> Any:
        """[Note: no-gather Hugging Face export] in checkpoint/hf_write.py; a collective."""
        from lightning_zero.checkpoint.hf_write import save_hf_pretrained

        self.wait_param_gathers()
        with self.noting_failures():
            return save_hf_pretrained(path, module=module, engine=self.engine, layout=self.layout(precision),
                                      storage=self.checkpoints.storage, **options)  # fmt: skip

    def before_load(self, path: Any, barrier: Callable[[], None]) -> None:
        """The save in flight published; a checkpoint a killed publish moved aside back before it is read."""
        self.checkpoints.before_load(path, barrier)

    def requeue(self) -> int:
        """A background save in flight published first (the scheduler may end the job right after),
        then global rank 0 runs ``scontrol requeue <job>`` (its exit code; 0 on the other ranks)."""
        from lightning_zero.runtime.signals import requeue_slurm_job

        self.checkpoints.wait()
        return requeue_slurm_job() if self.is_global_zero else 0

    def open_checkpoints(self, directories: list, barrier: Callable[[], None]) -> None:
        """At fit's setup: what killed saves left in ``directories`` cleaned; background saves from now on."""
        self.checkpoints.clean(directories, barrier)
        self.checkpoints.open()

    def begin_restore(self, path: Any, precision: str, barrier: Callable[[], None]) -> dict[str, Any]:
        """A sharded load across three calls (``runtime/restore.py``): Lightning's dict now, the
        module's tensors at :meth:`restore_model`, the optimizers' at :meth:`restore_optimizers`."""
        from lightning_zero.runtime.restore import CheckpointRestore

        self.before_load(path, barrier)
        self._restore = CheckpointRestore(path, self.layout(precision), self.checkpoints.storage)
        return self._restore.lightning_dict()

    def restore_model(self, module: nn.Module, optimizers: list, precision: str, *, strict: bool) -> bool:
        """The module's part of a load begun by :meth:`begin_restore` (``False``: none begun)."""
        if self._restore is None:
            return False
        self._restore.load_model(module, engine=self.engine, optimizers=optimizers, layout=self.layout(precision),
                                 strict=strict)  # fmt: skip
        return True

    def restore_optimizers(self, optimizers: list) -> bool:
        """The optimizers' part, which ends the load (``False``: none begun)."""
        if self._restore is None:
            return False
        self._restore.load_optimizers(optimizers)
        self._restore = None
        return True

    # -- teardown ---------------------------------------------------------------------------------
    def teardown(self) -> Optional[BaseException]:
        """`last` published or left as it was; the module usable outside the engine (full parameters,
        fp32 under bf16-mixed, as under ddp; on the failure path without the collectives); the
        failure channel's watcher stopped. Returns a failed background save's error, for the door
        to raise after its own teardown."""
        save_error = self.checkpoints.close()
        self.session.close_engine(self._ranks()[1])
        self.session.close()
        self.remove_state_dict_hooks()
        return save_error

    def quiesce(self) -> None:
        """[Note: nothing running at exit] Wait for the collectives this rank still has in flight (the
        stage 1-2 parameter all-gathers launched after the last step) and stop the failure channel's
        watcher thread (joined). Teardown does it; so does interpreter exit for a script that never
        tears down (LitGPT's scripts do not): :meth:`quiesce_at_exit`."""
        if self.engine is not None and not self.failed:
            try:
                self.engine.wait_param_gathers()
            except Exception:  # noqa: BLE001 - a peer is gone: nothing left to wait for
                pass
        channel = self.session.failure_channel
        if channel is not None:
            channel.stop_watching()

    def quiesce_at_exit(self) -> None:
        """Register :meth:`quiesce` at interpreter exit, once (after ``zero/waits.py``'s hook, so it runs first)."""
        if not self._exit_hook:
            self._exit_hook = True
            atexit.register(_quiesce_at_exit, weakref.ref(self))


def _quiesce_at_exit(run_ref: "weakref.ReferenceType[ZeroRun]") -> None:
    """[Note: nothing running at exit] An ``atexit`` hook: the run's collectives finished and its
    watcher joined before the interpreter finalizes. A thread that is inside a C++ call then (a gloo
    collective, a store read) is ended by the finalizing interpreter mid-call: "terminate called
    without an active exception"."""
    run = run_ref()
    if run is not None:
        run.quiesce()
