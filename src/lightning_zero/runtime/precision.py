"""A precision as a statement about where each byte lives: one policy object per precision.

Both front doors turn what the user chose (``Trainer(precision=...)`` or a plugin, the same under
Fabric) into a :class:`PrecisionPolicy`; the engine gets its dtypes from it, the monitor and the
planner read the ledger's bytes for it (``planner.ledger.precision_bytes``), and the strategy's
precision check is :func:`precision_policy` raising for the ones it does not know. No
``lightning.pytorch`` here.

========== ========= ========== =============== ============= ======= =========================
precision  compute   master     optimizer state grads/reduce  scaler  bytes/param (AdamW, dp=1)
========== ========= ========== =============== ============= ======= =========================
32-true    fp32      (= params) fp32            fp32          no      4 + 4 + 8
bf16-mixed bf16      fp32 shard fp32            bf16          no      2 + 2 + 4 + 8
16-mixed   fp16      fp32 shard fp32            fp16          dynamic 2 + 2 + 4 + 8
bf16-true  bf16      (= params) bf16            bf16          no      2 + 2 + 4
16-true    fp16      (= params) fp16            fp16          no      2 + 2 + 4
========== ========= ========== =============== ============= ======= =========================

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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that build dtypes: the command line checks
# ``trainer.precision`` with :func:`check_precision` on the plan path, which imports no torch
# ([Note: light command line] in cli.py).

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
"""Every precision ZeroStrategy accepts (the ledger has one row for each)."""

MASTER_WEIGHTS = ("auto", "fp32")  # values of ZeroConfig.master_weights ([Note: master_weights])

_HALF = {"bf16": "bfloat16", "16": "float16"}  # names of torch dtypes


@dataclass(frozen=True)
class PrecisionPolicy:
    """Where each byte of one precision lives.

    Attributes:
        name: the Lightning precision string (``"bf16-true"``, ...).
        compute_dtype: parameters and gradients in forward/backward.
        master_dtype: what the optimizer steps, and so its state's dtype: fp32 masters in the
            shards, or the compute parameters themselves when equal to ``compute_dtype``.
        autocast: forward runs under ``torch.autocast(compute_dtype)`` (the ``-mixed`` ones);
            then norm layers with running statistics keep fp32 parameters, as under ddp.
        loss_scaling: a dynamic loss scale guards fp16 gradients (``16-mixed``).
        master_weights: the knob as resolved (``"auto"`` or ``"fp32"``).
    """

    name: str
    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    autocast: bool
    loss_scaling: bool
    master_weights: str = "auto"

    @property
    def separate_masters(self) -> bool:
        """fp32 master chunks exist beside the compute parameters."""
        return self.master_dtype != self.compute_dtype

    @property
    def true_half(self) -> bool:
        """The whole module is converted to the half dtype (``-true`` precisions below 32 bits)."""
        return not self.autocast and self.compute_dtype != torch.float32

    def ledger_bytes(self) -> Any:
        """This precision's bytes per parameter (``planner.ledger.precision_bytes``)."""
        from lightning_zero.planner.ledger import precision_bytes

        return precision_bytes(self.name, self.master_weights)


def check_master_weights(master_weights: Any) -> None:
    if master_weights not in MASTER_WEIGHTS:
        raise ValueError(
            f"ZeroStrategy(master_weights={master_weights!r}): give 'auto' (under bf16-true/16-true the"
            " optimizer steps the half-precision parameters, as ddp does) or 'fp32' (fp32 master"
            " weights and optimizer state in the shards)."
        )


def check_precision(precision: str) -> None:
    """Raise, naming the supported precisions, unless ``precision`` is one ZeroStrategy accepts."""
    if str(precision) not in PRECISIONS:
        raise ValueError(
            f"ZeroStrategy does not support precision={str(precision)!r} (supported: {', '.join(PRECISIONS)})."
            " Use '32-true' (fp32 everywhere), 'bf16-mixed' / '16-mixed' (half compute, fp32 masters and"
            " optimizer state in the shards; 16-mixed with a dynamic loss scale) or 'bf16-true' /"
            " '16-true' (everything in the half dtype, as ddp holds it); see docs/precision.md."
        )


def precision_policy(precision: str, master_weights: str = "auto") -> PrecisionPolicy:
    """The policy of ``precision`` (a Lightning precision string); raises naming the supported ones."""
    import torch

    check_master_weights(master_weights)
    check_precision(precision)
    name = str(precision)
    if name == "32-true":
        return PrecisionPolicy(name, torch.float32, torch.float32, autocast=False, loss_scaling=False)
    half, _, kind = name.partition("-")
    dtype = getattr(torch, _HALF[half])
    if kind == "mixed":
        return PrecisionPolicy(name, dtype, torch.float32, autocast=True, loss_scaling=half == "16")
    master = torch.float32 if master_weights == "fp32" else dtype
    return PrecisionPolicy(name, dtype, master, autocast=False, loss_scaling=False, master_weights=master_weights)


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


def precision_label(compute_dtype: torch.dtype, master_dtype: torch.dtype) -> tuple[str, str]:
    """``(precision, master_weights)`` whose ledger row holds the bytes of an engine with these
    dtypes (the monitor's prediction): the bytes depend on the two dtypes only."""
    import torch

    if compute_dtype == torch.float32:
        return "32-true", "auto"
    half = "bf16" if compute_dtype == torch.bfloat16 else "16"
    if master_dtype == compute_dtype:
        return f"{half}-true", "auto"
    return f"{half}-mixed", "auto"
