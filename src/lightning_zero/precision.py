"""A precision as a statement about where each byte lives: one policy object per precision, and the
one validator of the knobs that shape it.

Both front doors turn what the user chose (``Trainer(precision=...)`` or a plugin, the same under
Fabric) and the strategy's ``ZeroConfig`` into a :class:`PrecisionPolicy` through
:func:`precision_policy`; the engine gets its dtypes from it, the ledger derives its bytes per
parameter from it (``planner.ledger.precision_bytes``, which the monitor and the planner read), and
``ZeroConfig``, the Hydra schema and the command line validate the knobs through
:func:`check_precision_knobs` and :func:`check_precision`. No ``lightning.pytorch`` here, and no
torch at import time: the command line's plan path validates through this module
([Note: light command line] in cli.py); torch is imported where a ``torch.dtype`` is built.

=============================== ========= ============ =============== ============== ======= ================
precision (knob)                compute   master       optimizer state grads/reduce   scaler  bytes/param
=============================== ========= ============ =============== ============== ======= ================
32-true                         fp32      (= params)   fp32            fp32           no      4 + 4 + 8
bf16-mixed                      bf16      fp32 shard   fp32            bf16           no      2 + 2 + 4 + 8
bf16-mixed, mixed_params=fp32   fp32 [a]  (= params)   fp32            fp32           no      4 + 4 + 8
16-mixed                        fp32 [a]  (= params)   fp32            fp32           dynamic 4 + 4 + 8
16-mixed, mixed_params=half     fp16      fp32 shard   fp32            fp16           dynamic 2 + 2 + 4 + 8
bf16-true                       bf16      (= params)   bf16            bf16           no      2 + 2 + 4
16-true                         fp16      (= params)   fp16            fp16           no      2 + 2 + 4
-true, master_weights=fp32      half      fp32 shard   fp32            half           no      2 + 2 + 4 + 8
=============================== ========= ============ =============== ============== ======= ================

[a] fp32 parameters and gradients; the forward runs under ``torch.autocast`` in the half dtype.

[Note: mixed_params] Under a ``-mixed`` precision the knob ``ZeroConfig.mixed_params`` says what
the engine holds between steps. ``"fp32"`` is Lightning's semantics (``ddp``'s ``MixedPrecision``):
fp32 parameters and gradients, the forward under autocast (which casts each weight to the half
dtype where an op runs in it), fp32 gradients reduced, the parameter chunk its own master. Its
numbers are ddp's: the same loss-scale decisions, losses equal to fp32 rounding. ``"half"`` is
DeepSpeed's and the ZeRO paper's: half-precision parameters and gradients at every stage, fp32
masters and optimizer state only in the shards (``2 + 2 + 12``). Per rank the two hold the same
bytes at stage 3 (``16 P / dp``); at stages 1-2 ``"half"`` holds less (the unsharded parameters,
and stage 1's gradients, in 2 bytes), and every collective sends half the bytes. Under fp16 the
half mode is not ddp's numbers: the gradients autograd hands back are fp16, and reductions over
tokens (a norm weight's gradient sums every token's contribution) round in fp16 and overflow
where ddp's fp32 ones do not, so the loss scale takes other steps (docs/precision.md has the
trajectories). ``"auto"`` (the default) is ``"fp32"`` under ``16-mixed`` (a user moving from ddp
expects ddp's numbers) and ``"half"`` under ``bf16-mixed`` (bf16 has fp32's exponent: no scale
to diverge, and the paper's bytes are the point of ZeRO). No effect under ``32-true`` and the
``-true`` precisions.

[Note: master_weights] Under ``bf16-true``/``16-true`` the knob ``ZeroConfig.master_weights``
says where the optimizer steps: ``"auto"`` (the default) steps the half-precision parameters
themselves, with optimizer state in the same dtype, exactly as Lightning's ``ddp`` holds a model
under ``bf16-true`` (``module.to(bfloat16)``, the optimizer built over it): the user who picks a
``-true`` precision asked for those bytes (LitGPT's fine-tuning recipes rely on them), and the
numbers are ddp's. ``"fp32"`` keeps fp32 master chunks and fp32 optimizer state in the shards
under the same half-precision compute (the bytes of ``bf16-mixed``, ``2 + 2 + 12``): updates too
small for bf16's 8-bit mantissa are no longer lost, which un-stalls fine-tunes whose bf16 state
stops moving. The masters start from the half-precision parameters the model was converted to.
Under ``32-true`` and the ``-mixed`` precisions the knob changes nothing (their masters are fp32
already).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
"""Every precision ZeroStrategy accepts (each has one policy, and so one row of bytes)."""

MASTER_WEIGHTS = ("auto", "fp32")  # values of ZeroConfig.master_weights ([Note: master_weights])
MIXED_PARAMS = ("auto", "fp32", "half")  # values of ZeroConfig.mixed_params ([Note: mixed_params])

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each dtype a policy names."""
_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_HALF = {"bf16": "bf16", "16": "fp16"}  # the precision string's prefix -> the half dtype's name

_KNOB_FIXES = {
    "master_weights": (
        MASTER_WEIGHTS,
        'give "auto" (under bf16-true/16-true the optimizer steps the half-precision parameters, as ddp does)'
        ' or "fp32" (fp32 master weights and optimizer state in the shards); see docs/precision.md.',
    ),
    "mixed_params": (
        MIXED_PARAMS,
        'give "auto" (16-mixed: "fp32"; bf16-mixed: "half"), "fp32" (fp32 parameters and gradients under'
        ' autocast, as ddp holds them) or "half" (half-precision parameters and gradients, fp32 masters and'
        " optimizer state in the shards, as DeepSpeed holds them); see docs/precision.md.",
    ),
}


def check_precision_knobs(**knobs: Any) -> None:
    """The one validator of the precision knobs of ``ZeroConfig`` (``master_weights``,
    ``mixed_params``): raises ``ValueError("ZeroStrategy(<knob>=<value>): <fix>")``, the form
    ``ZeroConfig`` and the Hydra schema report."""
    for name, value in knobs.items():
        allowed, fix = _KNOB_FIXES[name]
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"ZeroStrategy({name}={value!r}): {fix}")


def check_precision(precision: Any) -> None:
    """Raise, naming the supported precisions, unless ``precision`` is one ZeroStrategy accepts."""
    if str(precision) not in PRECISIONS:
        raise ValueError(
            f"ZeroStrategy does not support precision={str(precision)!r} (supported: {', '.join(PRECISIONS)})."
            " Use '32-true' (fp32 everywhere), 'bf16-mixed' / '16-mixed' (half-precision autocast; 16-mixed"
            " with a dynamic loss scale) or 'bf16-true' / '16-true' (everything in the half dtype, as ddp"
            " holds it); see docs/precision.md."
        )


def _torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, _TORCH_NAMES[name])


@dataclass(frozen=True)
class PrecisionPolicy:
    """Where each byte of one precision lives (built by :func:`precision_policy`).

    Attributes:
        name: the Lightning precision string (``"bf16-true"``, ...).
        params: the dtype (``"fp32"``, ``"bf16"``, ``"fp16"``) of the parameters and gradients the
            engine holds and computes with (:attr:`compute_dtype`).
        masters: what the optimizer steps, and so its state's dtype: fp32 master chunks in the
            shards, or the parameter chunks themselves when equal to ``params``
            (:attr:`master_dtype`).
        autocast: the dtype the forward runs in under ``torch.autocast`` (the ``-mixed`` ones), or
            None. Half-precision parameters under autocast keep the parameters of norm layers with
            running statistics in fp32, as under ddp.
        loss_scaling: a dynamic loss scale guards fp16 gradients (``16-mixed``).
        master_weights, mixed_params: the knobs as given (``ZeroConfig``).
    """

    name: str
    params: str
    masters: str
    autocast: Optional[str]
    loss_scaling: bool
    master_weights: str = "auto"
    mixed_params: str = "auto"

    @property
    def compute_dtype(self) -> "torch.dtype":
        return _torch_dtype(self.params)

    @property
    def master_dtype(self) -> "torch.dtype":
        return _torch_dtype(self.masters)

    @property
    def separate_masters(self) -> bool:
        """fp32 master chunks exist beside the compute parameters."""
        return self.masters != self.params

    @property
    def half_params_under_autocast(self) -> bool:
        """Half-precision parameters under autocast: norm layers with running statistics keep fp32
        ones, as ddp's autocast leaves them (the engine's ``norms_in_fp32``)."""
        return self.autocast is not None and self.params != "fp32"

    def ddp_dtype(self, param: "torch.Tensor") -> "torch.dtype":
        """The dtype ddp holds ``param`` in ([Note: full state dicts] in ``checkpoint/full.py``): the
        module's own dtype, fp32 for floating parameters under the ``-mixed`` precisions (where ours
        may be the compute copies: bf16 under ``bf16-mixed``, ``16-mixed`` with ``mixed_params="half"``)."""
        import torch

        if self.autocast is not None and param.is_floating_point():
            return torch.float32
        return param.dtype

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter element, and per gradient element (before ``reduce_dtype``)."""
        return DTYPE_BYTES[self.params]

    @property
    def state_bytes(self) -> int:
        """Bytes per element of the masters and the optimizer state."""
        return DTYPE_BYTES[self.masters]


def precision_policy(precision: Any, master_weights: str = "auto", mixed_params: str = "auto") -> PrecisionPolicy:
    """The policy of ``precision`` (a Lightning precision string) under the knobs
    ``ZeroConfig.master_weights`` and ``ZeroConfig.mixed_params``; raises naming the supported
    precisions, or the knob and its values."""
    check_precision_knobs(master_weights=master_weights, mixed_params=mixed_params)
    check_precision(precision)
    name = str(precision)
    knobs = dict(master_weights=master_weights, mixed_params=mixed_params)
    if name == "32-true":
        return PrecisionPolicy(name, "fp32", "fp32", autocast=None, loss_scaling=False, **knobs)
    prefix, _, kind = name.partition("-")
    half = _HALF[prefix]
    if kind == "mixed":
        scaled = half == "fp16"
        fp32_params = mixed_params == "fp32" or (mixed_params == "auto" and scaled)
        params = "fp32" if fp32_params else half
        return PrecisionPolicy(name, params, "fp32", autocast=half, loss_scaling=scaled, **knobs)
    masters = "fp32" if master_weights == "fp32" else half
    return PrecisionPolicy(name, half, masters, autocast=None, loss_scaling=False, **knobs)


def unscale_and_agree(scaler: Any, optimizer: Any, sharded: Any) -> tuple[bool, bool]:
    """``scaler.unscale_(optimizer)`` on this rank's fp32 gradient shards, then the ranks' global
    overflow decision written into the scaler's record, so that ``scaler.step`` skips (or takes)
    the step on every rank alike and ``scaler.update`` backs off (or grows) as GradScaler does
    ([Note: global overflow] in ``zero/optimizer.py``). ``sharded``: the engine's
    ``ShardedOptimizer`` for ``optimizer``. Returns ``(this rank's shard overflowed, any rank's)``.
    Both front doors call it between the backward and the clipping."""
    import torch

    sharded.flush_offloaded_grads()  # offload: the shards on the host before the unscale reads them
    scaler.unscale_(optimizer)
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    local = any(bool(value.item()) for value in found.values())
    anywhere = sharded.agree_overflow(local)
    if not found:  # no gradient on this rank: record the agreed answer for scaler.step/update
        found[scaler._scale.device] = torch.zeros(1, device=scaler._scale.device)
    for value in found.values():
        value.fill_(float(anywhere))
    return local, anywhere


def engine_policy(compute_dtype: "torch.dtype", master_dtype: "torch.dtype") -> PrecisionPolicy:
    """A policy holding the bytes of an engine built with these dtypes (the monitor's prediction,
    which sees the engine only): the bytes depend on the two dtypes alone."""
    import torch

    if compute_dtype == torch.float32:
        return precision_policy("32-true")
    prefix = "bf16" if compute_dtype == torch.bfloat16 else "16"
    if master_dtype == compute_dtype:
        return precision_policy(f"{prefix}-true")
    return precision_policy(f"{prefix}-mixed", mixed_params="half")
