"""Rotary position tables, with the rope scalings of published Llama checkpoints.

[Note: rope scaling] A checkpoint's rope scaling is part of what its weights mean: the same
weights with a different ``inv_freq`` are a different model that still writes plausible text.
``LlamaConfig.rope_scaling`` holds it as a plain dict (``None``: the original rotary embedding of
Llama 2 and Llama 3.0), read from a Hugging Face ``config.json``'s ``rope_parameters``
(transformers 5) or ``rope_scaling`` (4.x), checked into one canonical dict by
``rope_scaling.normalize_rope_scaling`` (plain Python), and written back on export. The numbers follow
``transformers``' ``modeling_rope_utils`` (fp32 throughout, so logits agree to fp32 rounding):

=========  =====================================================  ==============================
rope_type  inv_freq (``base_i = theta^(-2i/d)``, ``d = head_dim``)  keys
=========  =====================================================  ==============================
linear     ``base_i / factor`` (positions stretched)              factor
llama3     Llama 3.1: wavelengths ``2 pi / base_i`` longer than    factor, low_freq_factor,
           ``L / low_freq_factor`` divided by ``factor``,          high_freq_factor,
           shorter than ``L / high_freq_factor`` kept, the band    original_max_position_embeddings
           between blended linearly in ``L / wavelength``          (``L``)
yarn       per-dimension blend of ``base_i`` (fast dims) and       factor, original_max_position_
           ``base_i / factor`` (slow dims) over a ramp set by      embeddings, optional beta_fast
           ``beta_fast``/``beta_slow`` rotations in ``L``; cos and (32), beta_slow (1), mscale,
           sin scaled by ``attention_factor``                      mscale_all_dim, attention_factor,
           (default ``0.1 ln(factor) + 1``)                        truncate (true)
dynamic    NTK: for a forward of ``T > L`` tokens, theta becomes   factor, original_max_position_
           ``theta (factor T / L - factor + 1)^(d / (d - 2))``;   embeddings (``L``: config.json's
           ``T <= L``: unscaled                                    ``max_position_embeddings``)
=========  =====================================================  ==============================

``dynamic`` depends on the length of the forward: :func:`rope_tables` gives the unscaled table
and ``Llama.forward`` recomputes it for a longer sequence. ``transformers`` caches the longest
length seen and keeps using it for shorter sequences above ``L`` until one at most ``L`` comes;
ours depends only on the current length (a training step is a pure function of its batch). The
two agree for any single forward, and for any sequence of forwards of non-decreasing length.
Other rope types (``longrope``, ...) are refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import torch

from lightning_zero.models.llama.rope_scaling import ROPE_TYPES


def _unscaled_inv_freq(head_dim: int, theta: Any, device: Optional[torch.device]) -> torch.Tensor:
    """``theta^(-2i / head_dim)`` for ``i < head_dim / 2``, fp32 ``(head_dim // 2,)``."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim
    return 1.0 / theta**exponents


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    slow = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)  # long waves: interpolated
    blend = (context / wavelength - low) / (high - low)  # 0 at the long end of the band, 1 at the short end
    blended = (1 - blend) * slow / factor + blend * slow
    in_band = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(in_band, blended, slow)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    head_dim: int, theta: float, scaling: Mapping[str, Any], device: Optional[torch.device]
) -> tuple[torch.Tensor, float]:
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def dim_of_rotations(rotations: float) -> float:
        """The (fractional) dimension pair whose wavelength fits ``rotations`` times in ``context``."""
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of_rotations(scaling.get("beta_fast", 32.0)), dim_of_rotations(scaling.get("beta_slow", 1.0))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    powers = theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    extrapolated, interpolated = 1.0 / powers, 1.0 / (factor * powers)
    keep = 1 - ramp  # 1: fast dims keep their frequency; 0: slow dims are interpolated
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: Optional[Mapping[str, Any]] = None,
    *,
    seq_len: Optional[int] = None,
    device: Optional[torch.device] = None,
) -> tuple[torch.Tensor, float]:
    """``(inv_freq (head_dim // 2,) fp32, attention scaling)`` of a rotary embedding.

    ``scaling``: a ``LlamaConfig.rope_scaling`` dict or ``None`` (see [Note: rope scaling]).
    ``seq_len``: the forward's length, which only ``dynamic`` reads (``None``: at most its
    ``original_max_position_embeddings``, i.e. unscaled).
    """
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type == "default":
        return _unscaled_inv_freq(head_dim, theta, device), 1.0
    if rope_type == "linear":
        return _unscaled_inv_freq(head_dim, theta, device) / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_unscaled_inv_freq(head_dim, theta, device), scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, device)
    if rope_type == "dynamic":
        factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
        if seq_len is None or seq_len <= context:
            return _unscaled_inv_freq(head_dim, theta, device), 1.0
        length = torch.tensor(seq_len, dtype=torch.int64)
        # fp32 tensor arithmetic, as transformers computes the new base from a tensor length
        base = theta * ((factor * length / context) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return _unscaled_inv_freq(head_dim, base.to(device), device), 1.0
    raise ValueError(f"rope_inv_freq: rope_type {rope_type!r} is not one of {ROPE_TYPES}")


def rope_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: Optional[torch.device] = None,
    scaling: Optional[Mapping[str, Any]] = None,
    *,
    seq_len: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each ``(max_seq_len, head_dim // 2)``, fp32, times the
    scaling's attention factor (yarn); ``seq_len`` as in :func:`rope_inv_freq`."""
    inv_freq, attention_scaling = rope_inv_freq(head_dim, theta, scaling, seq_len=seq_len, device=device)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos() * attention_scaling, angles.sin() * attention_scaling
