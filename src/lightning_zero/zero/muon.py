"""Muon's arithmetic, split where sharding cuts it, and ``GroupedMuon`` for stacked expert matrices.

[Note: Muon's update, split] ``torch.optim.Muon`` steps a 2-D parameter ``W`` with gradient ``g``:

1. ``buf.lerp_(g, 1 - momentum)``; ``u = g.lerp(buf, momentum)`` (Nesterov) or ``u = buf``:
   element-wise, but the owner holds ``buf`` whole ([Note: matrix owners]);
2. ``O = NS(u)``: Newton-Schulz in bf16 on the *whole* matrix (the only non-element-wise part);
3. ``W.mul_(1 - lr * weight_decay)``; ``W.add_(O, alpha=-adjust_lr(lr, shape))``: element-wise.

The owner runs 1 and 2 (:func:`momentum_update`, :func:`newton_schulz`) and sends ``O`` (bf16:
what NS returns, so the return trip is exact at 2 bytes an element); each rank runs 3 on its own
master slices (:func:`apply_update`). Element-wise ops on a slice give the bits they give on the
whole tensor, so the result is torch's bit for bit (``tests/test_muon.py`` checks each function
against ``torch.optim.Muon``). The functions mirror torch 2.13's ``torch/optim/_muon.py`` line by
line rather than import its private ones (the device check runs torch 2.11).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

MATRIX_OPTIMIZERS = ("Muon", "GroupedMuon")
"""Optimizers the engine steps through matrix owners (``zero/matrix_optimizer.py``)."""

WHOLE_MATRIX_OPTIMIZERS = ("Shampoo", "DistributedShampoo", "SOAP", "Dion", "DionMixedPrecision")
"""Optimizers that need whole matrices the owner mechanism does not serve (yet): refused by name."""


def momentum_update(grad: Tensor, buf: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Step 1 of [Note: Muon's update, split]: advances ``buf`` in place, returns what NS takes."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def newton_schulz(update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Tensor:
    """Step 2: the orthogonalized ``update`` (bf16, same shape), as ``torch.optim.Muon`` computes it."""
    if steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(update.shape) != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    if len(coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = coefficients
    ortho = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape: tuple[int, ...]) -> float:
    """Muon's learning rate for a matrix of ``shape`` (rows, cols: the whole matrix's)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def scalar_lr(lr: Any) -> float:
    """A param group's ``lr`` as a Python float (torch accepts a 1-element tensor)."""
    return lr.item() if torch.is_tensor(lr) else lr


def apply_update(param: Tensor, ortho: Tensor, lr: float, weight_decay: float, matrix_lr: float) -> None:
    """Step 3 on ``param`` (the whole matrix or any slice of it, ``ortho`` the matching slice)."""
    param.mul_(1 - lr * weight_decay)
    param.add_(ortho, alpha=-matrix_lr)


def step_matrix(param: Tensor, grad: Tensor, buf: Tensor, group: dict, shape: Optional[tuple] = None) -> None:
    """One whole matrix's Muon step with ``group``'s hyperparameters (``shape``: the matrix's,
    default ``param``'s): what ``torch.optim.Muon`` does to one 2-D parameter."""
    lr = scalar_lr(group["lr"])
    update = momentum_update(grad, buf, group["momentum"], group["nesterov"])
    ortho = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
    matrix_lr = adjusted_lr(lr, group["adjust_lr_fn"], tuple(shape or param.shape))
    apply_update(param, ortho, lr, group["weight_decay"], matrix_lr)


class GroupedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` that also takes 3-D parameters: stacks of matrices (a mixture of
    experts' ``(n_experts, rows, cols)`` weights), each matrix ``p[e]`` stepped on its own exactly
    as ``torch.optim.Muon`` steps a 2-D parameter of that shape (its own momentum, NS and
    ``adjust_lr`` from ``(rows, cols)``), as torchtitan's ``GroupedMuon`` does. 2-D parameters are
    stepped as ``torch.optim.Muon`` steps them; any other rank is refused as torch refuses it.
    Same arguments as ``torch.optim.Muon``; under ZeRO each matrix gets an owner ([Note: matrix
    owners]) within the expert-data-parallel group for expert stacks."""

    def __init__(self, params: Any, lr: float = 1e-3, **kwargs: Any) -> None:
        # torch.optim.Muon validates the hyperparameters and fills the defaults (its errors, its words)
        defaults = torch.optim.Muon([torch.zeros(1, 1)], lr=lr, **kwargs).defaults
        torch.optim.Optimizer.__init__(self, params, defaults)
        for group in self.param_groups:
            for param in group["params"]:
                if param.ndim not in (2, 3):
                    raise ValueError(
                        "GroupedMuon only supports 2D parameters and 3D stacks of 2D matrices whereas we"
                        f" found a parameter with size: {param.size()}"
                    )

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                if param.ndim == 2:
                    step_matrix(param, param.grad, buf, group)
                    continue
                for index in range(param.shape[0]):
                    step_matrix(param[index], param.grad[index], buf[index], group)
        return loss
