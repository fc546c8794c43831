"""ZeRO stage 3: parameters live only as each rank's shard; units are gathered just in time.

What stage 3 does differently from stage 2 is all in this package:

- ``units.py`` -- **Units.** The module is cut into units (by default: every parameter-holding
  child of a block container -- a ``ModuleList``, or a ``ModuleDict``/``Sequential`` of repeated
  blocks --, every ``nn.Embedding``, and every module with parameters beside a block container --
  the final norm and the LM head); whatever is left belongs to the *root* unit, and so does every
  parameter shared by several units ([Note: shared parameters]).
- ``storage.py`` -- each unit's parameters form :class:`ShardedFlatParamGroup` s (one per
  optimizer param group, one per dtype for frozen parameters) with the same bucket layout as
  stages 1-2 ([Note: flat layout] in ``flat.py``), but only this rank's chunk of each bucket
  persists. Parameters are views into a full-size buffer whose *storage* is allocated (and
  all-gathered into) only while the unit runs, and resized to zero afterwards, so tensors
  autograd saved in forward see the re-gathered values in backward.
- ``runtime.py`` -- **Forward / backward.** A unit's forward pre-hook gathers it (prefetching
  the next ``prefetch_blocks`` along the recorded schedule), its post-hook frees it; a hook on its
  outputs gathers it again before its backward, and it is freed when its backward is done
  ([Note: freeing in backward]). The strategy names the phase ([Note: phases]).
- ``schedule.py`` -- recorded schedules and agreements keep every rank's all-gathers in step
  ([Note: gather schedule]), also when ranks run different modules ([Note: dynamic execution]);
  ``abort.py`` -- a rank that finds them out of step stops every rank ([Note: abort channel]).
  Gradients go through the same bucketed async reduce-scatter as stage 2
  (``reducer.ShardedGradStorage``). After the step nothing is gathered: the optimizer writes the
  updated chunk, and the next use gathers it.
- ``replicated_step.py`` -- optimizers that are not element-wise (Adafactor): full fp32 masters
  gathered and stepped one unit at a time ([Note: replicated step per unit]).
- ``init.py`` -- **Sharded init.** A meta-device model is materialized, initialized (buffers
  included, [Note: buffer init]) and sharded one unit at a time; ``deferred.py`` records the
  initializers of a model built under ``fabric.init_module(empty_init=True)`` and replays them
  there, so its values are eager construction's ([Note: deferred init]).
- ``gather_order.py`` -- a recorded order's held entries and the most it holds gathered at once
  ([Note: gathered working set]); plain Python, which the planner reads too.

Names are imported lazily (as ``lightning_zero``'s own), so ``gather_order`` is read without
importing torch.
"""

from __future__ import annotations

from lightning_zero._lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "lightning_zero.zero.stage3.units": (
            "SINGLE_UNIT_WARN_NUMEL Unit WrapPolicy assign_params default_wrap_policy find_units is_block_container"
        ),
        "lightning_zero.zero.stage3.schedule": "Schedule clone_dp_group",
        "lightning_zero.zero.stage3.storage": "ShardedFlatParamGroup",
        "lightning_zero.zero.stage3.runtime": "Stage3Runtime",
        "lightning_zero.zero.stage3.replicated_step": "UnitReplicatedOptimizer",
        "lightning_zero.zero.stage3.init": "build_units live_parameter_bytes",
    },
)
