"""Compressed collectives: ZeRO++'s qgZ (quantized gradient reduce-scatter) and qwZ (quantized
weight all-gather), on plain ``torch.distributed`` through :mod:`lightning_zero.comm.collectives`.

A ``comm_dtype`` says what travels on the wire:

- ``None``: no compression; the buffer's own dtype is sent by the plain collective.
- ``"fp32"``: the values are cast to fp32 (a bf16 buffer then sends twice its bytes; an fp32
  buffer runs exactly the plain collective).
- ``"bf16"``: the values are cast to bf16: half the bytes of fp32.
- ``"int8"``: block-wise symmetric int8 (see [Note: int8 blocks]): one byte per element plus one
  fp32 scale per :data:`BLOCK_SIZE` elements, i.e. ``1/4 + 4/(4 * BLOCK_SIZE)`` of fp32.

[Note: int8 blocks] A tensor (each destination chunk separately, so that a block never spans two
ranks' chunks) is cut into blocks of :data:`BLOCK_SIZE` consecutive elements (the last may be
shorter). Each block stores ``scale = absmax / 127`` (fp32) and ``q = round(x / scale)`` in
``[-127, 127]`` (int8); dequantization is ``q * scale``. Rounding to nearest bounds the error of
every element by ``scale / 2 = absmax(block) / 254``: :func:`int8_error_bound`. An all-zero block
has scale 0 and dequantizes to exact zeros. Non-finite values make their block's scale non-finite
(as they would make an uncompressed sum non-finite).

[Note: reduce-scatter without summing on the wire] A collective cannot sum int8 values with their
own scales, so a compressed reduce-scatter is an all-to-all: each rank quantizes the chunk meant
for each destination, the all-to-all delivers to every rank the ``n`` versions of its own chunk,
and the rank dequantizes and sums them in fp32. bf16 takes the same path (bf16 values, fp32 sum)
rather than the native bf16 reduce-scatter: a ring reduce-scatter in bf16 rounds every partial sum
to bf16 (``n - 1`` roundings, growing with the group), while the all-to-all rounds each input once
and sums exactly in fp32, for the same bytes on the wire. An all-to-all sends ``(n-1)/n`` of its
input from every rank, exactly what a ring reduce-scatter sends ([Note: logical bytes] in
``collectives.py``), so the bytes counted compare one to one. Both gloo (CPU, torch 2.13:
``all_to_all_single`` for int8/uint8/bf16/fp32, async, completing without ``wait``) and NCCL
support it.

[Note: one packed message] The int8 payload and its scales travel in one uint8 message per
destination (``chunk`` int8 bytes, then the chunk's scales as raw bytes), so one compressed
collective is one collective and one entry in the :class:`CommCounter`, whose ``bytes`` are the
exact wire bytes; for these the counter's ``elements`` are bytes too (uint8).

Error feedback (keeping each rank's quantization residual and adding it to the next step's
gradient) is not implemented: the residual is a full-size gradient bucket per rank, the memory
stage 2 exists to save, and the per-element error is already bounded by ``absmax / 254`` per
block and unbiased enough for training at the tolerance the tests state (docs/compression.md).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_zero.comm.collectives import (
    CommCounter,
    all_gather,
    all_reduce,
    all_to_all,
    finishing,
    local_only,
    reduce_scatter,
)

BLOCK_SIZE = 256
"""Elements per int8 quantization block; each block carries one fp32 scale (4 bytes), so scales
add ``4 / BLOCK_SIZE`` bytes per element (1.6% of the int8 payload)."""

SCALE_DTYPE = torch.float32
COMM_DTYPES = ("fp32", "bf16", "int8")
_TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_comm_dtype(comm_dtype: Optional[str], name: str = "comm_dtype") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``comm_dtype`` is ``None`` or one of :data:`COMM_DTYPES`."""
    if comm_dtype is not None and comm_dtype not in COMM_DTYPES:
        raise ValueError(
            f"{name}={comm_dtype!r}: give None (send the buffer's own dtype), 'fp32', 'bf16' or 'int8'"
            " (block-wise int8 with one fp32 scale per block)."
        )


def is_lossy(comm_dtype: Optional[str], dtype: torch.dtype) -> bool:
    """Whether sending values of ``dtype`` as ``comm_dtype`` can change them (bf16 -> fp32 cannot)."""
    if comm_dtype is None or comm_dtype == "fp32":
        return False
    if comm_dtype == "bf16":
        return dtype not in (torch.bfloat16,)
    return True


# -- block-wise int8 ---------------------------------------------------------------------------


def blocks_per_row(row_numel: int, block_size: int = BLOCK_SIZE) -> int:
    return math.ceil(row_numel / block_size)


def quantize_int8(rows: torch.Tensor, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``rows`` (``(R, C)``) block-wise: returns ``(payload, scales)`` with
    ``payload`` int8 ``(R, C)`` and ``scales`` fp32 ``(R, ceil(C / block_size))`` ([Note: int8 blocks])."""
    num_rows, row_numel = rows.shape
    num_blocks = blocks_per_row(row_numel, block_size)
    padded = F.pad(rows.float(), (0, num_blocks * block_size - row_numel))
    blocks = padded.view(num_rows, num_blocks, block_size)  # (R, blocks, block_size)
    absmax = blocks.abs().amax(dim=-1)  # (R, blocks)
    scales = (absmax / 127).to(SCALE_DTYPE)
    inverse = torch.where(absmax > 0, 127 / absmax, torch.zeros_like(absmax))
    quantized = (blocks * inverse.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    payload = quantized.view(num_rows, num_blocks * block_size)[:, :row_numel].contiguous()
    return payload, scales


def dequantize_int8(payload: torch.Tensor, scales: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """fp32 ``(R, C)`` values of ``payload`` (int8 ``(R, C)``) with their block ``scales`` (``(R, blocks)``)."""
    num_rows, row_numel = payload.shape
    num_blocks = scales.shape[1]
    padded = F.pad(payload.float(), (0, num_blocks * block_size - row_numel))
    values = padded.view(num_rows, num_blocks, block_size) * scales.float().unsqueeze(-1)
    return values.view(num_rows, num_blocks * block_size)[:, :row_numel]


def int8_error_bound(rows: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Per-element bound on ``|dequantize(quantize(x)) - x|``: ``absmax(block) / 254`` (``(R, C)``)."""
    num_rows, row_numel = rows.shape
    num_blocks = blocks_per_row(row_numel, block_size)
    padded = F.pad(rows.float().abs(), (0, num_blocks * block_size - row_numel))
    absmax = padded.view(num_rows, num_blocks, block_size).amax(dim=-1, keepdim=True)
    bound = (absmax / 254).expand(num_rows, num_blocks, block_size).reshape(num_rows, -1)
    return bound[:, :row_numel]


def pack_int8(rows: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Quantize each row and lay out ``[payload bytes | scale bytes]`` per row: uint8
    ``(R, C + 4 * blocks)`` ([Note: one packed message])."""
    payload, scales = quantize_int8(rows, block_size)
    return torch.cat([payload.view(torch.uint8), scales.view(torch.uint8)], dim=1)


def unpack_int8(packed: torch.Tensor, row_numel: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """fp32 ``(R, row_numel)`` values of rows packed by :func:`pack_int8`."""
    payload = packed[:, :row_numel].contiguous().view(torch.int8)
    # A fresh copy with standard strides: 4-byte aligned, whatever rows of ``packed`` this is.
    scales = packed[:, row_numel:].clone(memory_format=torch.contiguous_format).view(SCALE_DTYPE)
    return dequantize_int8(payload, scales, block_size)


def packed_row_bytes(row_numel: int, block_size: int = BLOCK_SIZE) -> int:
    """Wire bytes of one int8 row of ``row_numel`` elements: payload + one fp32 scale per block."""
    return row_numel + blocks_per_row(row_numel, block_size) * torch.empty((), dtype=SCALE_DTYPE).element_size()


# -- collectives ---------------------------------------------------------------------------------


def reduce_scatter_compressed(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    comm_dtype: Optional[str],
    *,
    async_op: bool = False,
    counter: Optional[CommCounter] = None,
    label: str = "reduce_scatter",
):
    """Sum ``input`` over the group and leave chunk ``rank`` of the sum in ``output``, sending
    ``comm_dtype`` values (see the module docstring). ``output`` may be a view of ``input`` (it is
    written only when the collective finishes). ``comm_dtype=None`` (and ``"fp32"`` on an fp32
    buffer) runs exactly :func:`lightning_zero.comm.collectives.reduce_scatter`. With ``async_op`` the
    returned handle's ``wait()`` finishes the dequantize-and-sum."""
    check_comm_dtype(comm_dtype)
    size = dist.get_world_size(group)
    if comm_dtype is None or local_only(size) or (comm_dtype == "fp32" and input.dtype == torch.float32):
        return reduce_scatter(output, input, group, async_op=async_op, counter=counter, label=label)
    if input.numel() != size * output.numel():
        raise ValueError(
            f"reduce_scatter_compressed: input.numel()={input.numel()} must be group size ({size}) x"
            f" output.numel()={output.numel()}"
        )
    if comm_dtype == "fp32":  # a non-fp32 buffer summed in fp32 on the wire
        summed = torch.empty(output.shape, dtype=torch.float32, device=output.device)
        send = input.float()
        work = reduce_scatter(summed, send, group, async_op=True, counter=counter, label=label)
        return finishing(work, lambda: output.copy_(summed), async_op, (send,))
    chunk_numel = output.numel()
    rows = input.reshape(size, chunk_numel)  # row r: the chunk rank r receives
    if comm_dtype == "bf16":
        send = rows.to(torch.bfloat16).contiguous()
        received = torch.empty_like(send)

        def dequantized(source: int) -> torch.Tensor:
            return received[source].float()

    else:
        send = pack_int8(rows)
        received = torch.empty_like(send)

        def dequantized(source: int) -> torch.Tensor:
            return unpack_int8(received[source : source + 1], chunk_numel)[0]

    def finish() -> None:
        # Sum the n versions of this rank's chunk in fp32, one source at a time (transient
        # memory: two chunks of fp32, not the whole bucket), in rank order on every rank.
        summed = dequantized(0).clone()
        for source in range(1, size):
            summed += dequantized(source)
        output.copy_(summed.view_as(output))

    work = all_to_all(received, send, group, async_op=True, counter=counter, label=label)
    return finishing(work, finish, async_op, (send,))


def all_gather_compressed(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    comm_dtype: Optional[str],
    *,
    async_op: bool = False,
    counter: Optional[CommCounter] = None,
    label: str = "all_gather",
):
    """Concatenate every rank's ``input`` into ``output`` (``size * input.numel()`` elements),
    sending ``comm_dtype`` values. ``comm_dtype=None``, a group of one rank, or a ``comm_dtype``
    equal to the buffer's dtype run exactly :func:`lightning_zero.comm.collectives.all_gather`. With a lossy ``comm_dtype`` *every* chunk of ``output``, this
    rank's own included, holds the dequantized values, so all ranks hold identical results.
    ``input`` may be a view of ``output`` (the result is written only when the collective finishes)."""
    check_comm_dtype(comm_dtype)
    size = dist.get_world_size(group)
    if comm_dtype is None or local_only(size) or _TORCH_DTYPE.get(comm_dtype) == input.dtype:
        return all_gather(output, input, group, async_op=async_op, counter=counter, label=label)
    if output.numel() != size * input.numel():
        raise ValueError(
            f"all_gather_compressed: output.numel()={output.numel()} must be group size ({size}) x"
            f" input.numel()={input.numel()}"
        )
    shard_numel = input.numel()
    if comm_dtype in _TORCH_DTYPE:
        wire_dtype = _TORCH_DTYPE[comm_dtype]
        send = input.reshape(-1).to(wire_dtype)
        gathered = torch.empty(size * shard_numel, dtype=wire_dtype, device=output.device)

        def finish() -> None:
            output.copy_(gathered.view_as(output))

    else:
        send = pack_int8(input.reshape(1, shard_numel)).view(-1)
        gathered = torch.empty(size * send.numel(), dtype=torch.uint8, device=output.device)

        def finish() -> None:
            values = unpack_int8(gathered.view(size, -1), shard_numel)  # (size, shard)
            output.copy_(values.reshape(output.shape))

    work = all_gather(gathered, send, group, async_op=True, counter=counter, label=label)
    return finishing(work, finish, async_op, (send,))


def all_reduce_compressed(
    tensor: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    comm_dtype: Optional[str],
    *,
    counter: Optional[CommCounter] = None,
    label: str = "all_reduce",
) -> None:
    """In-place sum of ``tensor`` over the group as a compressed reduce-scatter followed by a
    compressed all-gather (``tensor`` is padded to a multiple of the group size on the way).
    Every rank ends with identical values. Synchronous: the all-gather can only start once the
    reduce-scatter finished, and launching it later from a ``wait()`` could order it after other
    collectives on some ranks only."""
    check_comm_dtype(comm_dtype)
    size = dist.get_world_size(group)
    if comm_dtype is None or local_only(size):
        all_reduce(tensor, group, counter=counter, label=label)
        return
    flat = tensor.reshape(-1).float()
    chunk_numel = math.ceil(flat.numel() / size)
    padded = F.pad(flat, (0, size * chunk_numel - flat.numel()))
    summed_chunk = torch.empty(chunk_numel, dtype=torch.float32, device=tensor.device)
    reduce_scatter_compressed(summed_chunk, padded, group, comm_dtype, counter=counter, label=label)
    all_gather_compressed(padded, summed_chunk, group, comm_dtype, counter=counter, label=label)
    tensor.copy_(padded[: flat.numel()].view_as(tensor))
