"""Stages 1-2: the parameter all-gather after the optimizer step, overlapped with the next forward.

[Note: overlapped parameter gather] After ``optimizer.step()`` every dp rank holds only its own
updated chunk of each bucket; the all-gather that makes the parameters whole again (one per
bucket, ``(dp-1)/dp`` of the bucket's bytes per rank) is not needed until the next forward reads
those parameters. As Megatron-Core's ``overlap_param_gather`` does, :class:`ParamGatherer`
launches every bucket's all-gather asynchronously at the end of the step (buckets of the
earliest-registered parameters first: the order forward needs them) and leaves them in flight;
a forward pre-hook on each module that owns parameters waits only for the buckets holding that
module's own parameters. The first block's forward then waits for its bucket while the later
buckets are still being gathered behind it.

Everything else that reads parameters waits for *all* pending gathers first (``wait_all``):

- the strategy's safe points: an evaluation step (validate/test/predict), the start of an
  evaluation loop, checkpoint save, the end of fit (``release_module``), and ``pre_backward``
  (backward reads the parameters saved by forward);
- the optimizer step, right after its closure ran (its update writes the chunks the gathers read;
  a second optimizer stepping before any forward, as in a GAN's manual optimization, waits here);
- ``module.state_dict()`` (a pre-hook on every hooked module and the root), a forward of the root
  module outside a training step, ``engine.managed_parameters()``, a synchronous re-gather
  (``refresh_params_from_masters``).

Parameters a training step reads without calling their module's forward (``F.linear(x,
self.head.weight)``, a parameter of the LightningModule itself) would miss their pre-hook. The
first training-step call therefore runs without overlap (each gather waited at once) and records
which modules' forwards ran; from then on, buckets holding a parameter none of whose owning
modules ran in that step are waited when a training step begins (``begin_train_step``). What
stays out of reach: a step that reads a parameter directly *before* calling its owning module
in the same step (it sees parameters still being gathered: ``ZeroStrategy(overlap_param_gather=False)``
waits for every gather inside the step, as before). User hooks between the optimizer step and the
next training step (a callback's ``on_train_batch_end``, e.g. an EMA of the weights) are guarded
by the strategy's barrier callback ([Note: parameter reads between steps] in ``gather_barrier.py``).

Ranks launch the same all-gathers in the same order (per optimizer, per flat group, buckets in
reverse layout order), whatever their forward does; waits are local and may come in any order.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from lightning_zero.comm.collectives import CommCounter
from lightning_zero.comm.compression import all_gather_compressed
from lightning_zero.zero.domains import shard_group
from lightning_zero.zero.flat import FlatParamGroup
from lightning_zero.zero.waits import Waiter

GatherKey = tuple[int, int]  # (id(flat group), bucket index)


class PendingGather(NamedTuple):
    """A launched parameter all-gather: the handle and what it gathers (for timeout messages)."""

    work: Any
    what: str


class ParamGatherer:
    """Launches the stage 1-2 parameter all-gathers after a step and waits for them on use.

    Args:
        module: the trained module; forward pre-hooks go on every submodule that owns a
            parameter of ``groups`` and on ``module`` itself.
        groups: the flat groups whose buckets are gathered after a step.
        dp_group: the data-parallel group the parameters are sharded over.
        counter: logical bytes sent are counted here (``all_gather_params``).
        waiter: how a gather is waited on (time limit, polling, the failure channel:
            ``zero/waits.py``).

    Attributes:
        waits: how many bucket gathers were waited where: ``"forward_hook"`` (inside a module's
            forward pre-hook: overlapped with the forward before it), ``"safe_point"`` (by
            ``wait_all``/``begin_train_step``), ``"at_launch"`` (the first training step, which
            runs without overlap).
        launched: bucket all-gathers launched so far.
    """

    def __init__(
        self,
        module: nn.Module,
        groups: list[FlatParamGroup],
        *,
        dp_group: Optional[dist.ProcessGroup],
        counter: CommCounter,
        waiter: Optional[Waiter] = None,
    ) -> None:
        self.module = module
        self.dp_group = dp_group
        self.counter = counter
        self.waiter = waiter if waiter is not None else Waiter()
        self.waits = {"forward_hook": 0, "safe_point": 0, "at_launch": 0}
        self.launched = 0
        self._pending: dict[GatherKey, PendingGather] = {}  # insertion order = launch order
        self._in_train_step = False
        self._learning = True  # until the first training-step call ended (see the Note)
        self._forward_seen: set[int] = set()  # ids of modules whose forward ran while learning
        self._early_keys: set[GatherKey] = set()  # buckets waited when a training step begins
        key_of_param: dict[int, GatherKey] = {}
        for group in groups:
            for slot in group.layout.slots:
                key_of_param[id(slot.param)] = (id(group), slot.bucket_index)
        self._key_of_param = key_of_param
        self._keys_of_module: dict[int, list[GatherKey]] = {}
        self._owners_of_param: dict[int, set[int]] = {}  # param id -> ids of modules owning it
        for submodule in module.modules():
            keys = []
            for param in submodule._parameters.values():
                key = key_of_param.get(id(param)) if param is not None else None
                if key is None:
                    continue
                self._owners_of_param.setdefault(id(param), set()).add(id(submodule))
                if key not in keys:
                    keys.append(key)
            if keys or submodule is module:
                self._keys_of_module[id(submodule)] = keys
        self._handles = []
        for submodule in module.modules():
            if id(submodule) in self._keys_of_module:
                # [Note: hooks under torch.compile] in zero/stage3/runtime.py
                self._handles.append(submodule.register_forward_pre_hook(torch.compiler.disable(self._before_forward)))
                self._handles.append(submodule.register_state_dict_pre_hook(self._before_state_dict))

    # -- launch --------------------------------------------------------------------------------
    def launch(self, groups: Iterable[FlatParamGroup], what: Callable[[int], str]) -> None:
        """Start the all-gather of every bucket of ``groups`` (after their chunks were updated).

        ``what(bucket_index)`` names a gather in timeout messages. During the first training
        step (and before any) each gather is waited at once: no overlap until the engine has
        seen which modules a training step runs ([Note: overlapped parameter gather]).
        """
        with record_function("lightning_zero::launch_param_gather"):
            for group in groups:
                for bucket in reversed(group.layout.buckets):  # earliest-registered parameters first
                    key = (id(group), bucket.index)
                    if key in self._pending:  # its previous gather still runs into the same buffer
                        self._wait(key, "safe_point")
                    work = all_gather_compressed(  # ``param_comm_dtype=None``: the plain all-gather
                        group.param_bucket(bucket),
                        group.param_shard(bucket),
                        shard_group(group, self.dp_group),  # [Note: expert domain]
                        group.param_comm_dtype,
                        async_op=True,
                        counter=self.counter,
                        label="all_gather_params",
                    )
                    self.launched += 1
                    self._pending[key] = PendingGather(work, what(bucket.index))
                    if self._learning:
                        self._wait(key, "at_launch")

    # -- waits ---------------------------------------------------------------------------------
    def pending_count(self) -> int:
        """Bucket all-gathers launched and not waited for yet."""
        return len(self._pending)

    def _wait(self, key: GatherKey, where: str) -> None:
        pending = self._pending.pop(key, None)
        if pending is None:
            return
        self.waiter.wait(pending.work, lambda: pending.what)
        self.waits[where] += 1

    def wait_all(self) -> None:
        """Wait for every pending gather, in launch order (a safe point: parameters are whole after)."""
        if not self._pending:
            return
        with record_function("lightning_zero::wait_param_gather"):
            for key in list(self._pending):
                self._wait(key, "safe_point")

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if self._learning and self._in_train_step:
            self._forward_seen.add(id(module))
        if not self._pending:
            return
        if module is self.module and not self._in_train_step:
            self.wait_all()  # a whole-model forward outside the training step
            return
        keys = [key for key in self._keys_of_module.get(id(module), ()) if key in self._pending]
        if keys:
            with record_function("lightning_zero::wait_param_gather"):
                for key in keys:
                    self._wait(key, "forward_hook")

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self.wait_all()

    # -- training-step boundaries (the strategy drives them through the engine) -----------------
    def begin_train_step(self) -> None:
        """A training step starts: wait for buckets no module forward of a training step covers."""
        self._in_train_step = True
        if self._early_keys and self._pending:
            with record_function("lightning_zero::wait_param_gather"):
                for key in [key for key in self._pending if key in self._early_keys]:
                    self._wait(key, "safe_point")

    def end_train_step(self) -> None:
        """The training-step call returned; the first one ends learning (see the Note)."""
        self._in_train_step = False
        if self._learning:
            self._learning = False
            # A bucket is waited early if one of its parameters has no owning module whose
            # forward ran (a parameter outside ``module``'s tree has no owner at all).
            self._early_keys = {
                key
                for param_id, key in self._key_of_param.items()
                if not (self._owners_of_param.get(param_id, set()) & self._forward_seen)
            }

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def closure_then(closure: Callable[[], Any], after: Callable[[], None]) -> Callable[[], Any]:
    """``closure`` followed by ``after``: an optimizer step's pre-hook wraps its closure with it,
    so ``after`` runs once the forward/backward inside the closure are done, before the update."""

    def wrapped() -> Any:
        result = closure()
        after()
        return result

    return wrapped
