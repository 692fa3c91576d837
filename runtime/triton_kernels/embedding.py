"""grouped_embedding_bag forward as a persistent Triton kernel (the triton-ascend subset).

One launch per table, each a 1-D grid of ``num_programs`` programs looping over blocks of ``BLOCK_B``
bags. A block gathers ``BLOCK_L`` ids' rows of each of its bags at once (``BLOCK_B * BLOCK_L`` rows in
flight, not one bag's ids one after another), tile by tile along D, scaled by each id's factor (per-sample weight,
padding mask, 1/count for MEAN), summed in fp32 and written straight into the table's slice of the
grouped output (a column block of ``[B, sum(D)]``, a slot of ``[B, T, D]``, or a row block of the
sequence layout). Index arithmetic is int32: a table must hold fewer than 2**31 elements.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.triton_kernels import num_programs

MAX_BLOCK_D = 256
# ids of each bag gathered at once, and the elements of a block's [BLOCK_B, BLOCK_L, BLOCK_D] gather
BLOCK_L = 4
TILE_ELEMENTS = 4096


@triton.jit
def _pooled_rows_kernel(
    weight_ptr, ids_ptr, bounds_ptr, scale_ptr, out_ptr,
    num_bags, dim, weight_stride, out_stride,
    HAS_SCALE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK_B)
    for block in range(pid, tl.cdiv(num_bags, BLOCK_B), programs):
        bag = block * BLOCK_B + lanes
        bag_ok = bag < num_bags
        start = tl.load(bounds_ptr + bag, mask=bag_ok, other=0).to(tl.int32)
        length = tl.load(bounds_ptr + bag + 1, mask=bag_ok, other=0).to(tl.int32) - start
        longest = tl.max(length, 0)
        for d0 in range(0, dim, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            col_ok = cols < dim
            acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
            for i0 in range(0, longest, BLOCK_L):
                at = start[:, None] + i0 + tl.arange(0, BLOCK_L)[None, :]
                take = i0 + tl.arange(0, BLOCK_L)[None, :] < length[:, None]
                row = tl.load(ids_ptr + at, mask=take, other=0).to(tl.int32)
                vals = tl.load(weight_ptr + row[:, :, None] * weight_stride + cols[None, None, :],
                               mask=take[:, :, None] & col_ok[None, None, :], other=0.0).to(tl.float32)
                if HAS_SCALE:
                    vals *= tl.load(scale_ptr + at, mask=take, other=0.0)[:, :, None]
                acc += tl.sum(vals, 1)
            tl.store(out_ptr + bag[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=bag_ok[:, None] & col_ok[None, :])


def _check_size(weight: torch.Tensor) -> None:
    if weight.numel() >= 2**31:
        raise ValueError(f"recompile.grouped_embedding_bag (triton): a table of {tuple(weight.shape)} exceeds int32 indexing")


def grouped_embedding_bag_forward(weights, features, scales, layout: str) -> torch.Tensor:
    """The grouped output; ``scales[t]`` is table t's factor per id (None: all 1; NONE pooling: one id per row)."""
    w0 = weights[0]
    if layout == "sequence":
        out = w0.new_empty(sum(f.ids.numel() for f in features), w0.shape[1])
    elif layout == "stack":
        out = w0.new_empty(features[0].batch, len(weights), w0.shape[1])
    else:
        out = w0.new_empty(features[0].batch, sum(w.shape[1] for w in weights))
    grid = (num_programs(w0.device),)
    column = row = 0
    for t, (w, f, scale) in enumerate(zip(weights, features, scales)):
        _check_size(w)
        w = w.contiguous()
        dim, n = w.shape[1], f.ids.numel()
        if layout == "sequence":
            target, bounds = out[row:row + n], torch.arange(n + 1, device=w.device, dtype=torch.int32)
            row += n
        else:
            target, bounds = (out[:, t] if layout == "stack" else out[:, column:column + dim]), f.bounds
            column += dim
        if target.shape[0] == 0 or dim == 0:
            continue
        block = min(triton.next_power_of_2(dim), MAX_BLOCK_D)
        _pooled_rows_kernel[grid](
            w, f.ids, bounds, f.ids if scale is None else scale.contiguous(), target, target.shape[0], dim, w.stride(0),
            target.stride(0), HAS_SCALE=scale is not None, BLOCK_B=TILE_ELEMENTS // (BLOCK_L * block), BLOCK_L=BLOCK_L, BLOCK_D=block,
        )
    return out
