"""Jagged <-> padded dense conversions and jagged-dense elementwise add / mul as one persistent Triton kernel.

Work items are (row tile of a sequence, block of ``BLOCK_D`` inner columns), listed as every jagged kernel's
(``tiles``: no host sync). Row ``m`` of sequence ``b`` pairs the jagged row
``offsets[b] + m`` with the padded row ``[b, m]`` when ``m < N`` (the padded length):

- ``TO_PADDED``: padded ``[b, m] = jagged[offsets[b] + m]`` (the rest keeps the padding value);
- ``TO_JAGGED``: jagged ``[offsets[b] + m] = padded[b, m]``, zero for ``m >= N``;
- ``ADD`` / ``MUL``: jagged ``x + y[b, m]`` (``x`` for ``m >= N``) / ``x * y[b, m]`` (zero for ``m >= N``).
Inner dimensions are flattened; index arithmetic is int32.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .tiles import BLOCK, _tile_item, tile_grid

TO_PADDED, TO_JAGGED, ADD, MUL = 0, 1, 2, 3
MAX_BLOCK_D = 128


@triton.jit
def _jagged_dense_kernel(
    x_ptr, y_ptr, out_ptr, offsets_ptr, tile_seq_ptr, tile_start_ptr, num_items, col_blocks, dim, padded_len,
    MODE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``x_ptr`` the jagged values (TO_PADDED, ADD, MUL), ``y_ptr`` the padded ones (TO_JAGGED, ADD, MUL)."""
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        col_block, seq, start, length, _, m = _tile_item(item, col_blocks, offsets_ptr, tile_seq_ptr, tile_start_ptr,
                                                         BLOCK)
        m_ok = m < length
        paired = m_ok & (m < padded_len)
        cols = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols[None, :] < dim
        jagged_at = (start + m)[:, None] * dim + cols[None, :]
        padded_at = (seq * padded_len + m)[:, None] * dim + cols[None, :]
        if MODE == 0:
            tl.store(out_ptr + padded_at, tl.load(x_ptr + jagged_at, mask=paired[:, None] & col_ok),
                     mask=paired[:, None] & col_ok)
        else:
            y = tl.load(y_ptr + padded_at, mask=paired[:, None] & col_ok, other=0.0).to(tl.float32)
            if MODE == 1:
                value = y
            else:
                x = tl.load(x_ptr + jagged_at, mask=m_ok[:, None] & col_ok, other=0.0).to(tl.float32)
                value = x + y if MODE == 2 else x * y
            tl.store(out_ptr + jagged_at, value.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & col_ok)


def _run(mode: int, x, y, out, offsets, rows: int, dim: int, padded_len: int) -> torch.Tensor:
    """Launch ``mode`` over ``rows`` jagged rows of ``dim`` inner columns."""
    if max(t.numel() for t in (x, y, out)) >= 2**31:
        raise ValueError("recompile.jagged (triton): tensors too large for int32 indexing")
    block_d = min(triton.next_power_of_2(max(dim, 1)), MAX_BLOCK_D)
    col_blocks = triton.cdiv(dim, block_d)
    launch = tile_grid(offsets, rows, col_blocks)
    if launch is not None:
        _jagged_dense_kernel[launch.grid](x, y, out, *launch.tiles, launch.num_items, col_blocks, dim, padded_len,
                                          MODE=mode, BLOCK=BLOCK, BLOCK_D=block_d)
    return out


def jagged_to_padded_dense(values, offsets, max_length, padding_value=0.0):
    values = values.contiguous()
    out = values.new_full((offsets.numel() - 1, max_length, *values.shape[1:]), padding_value)
    return _run(TO_PADDED, values, values, out, offsets, values.shape[0], math.prod(values.shape[1:]), max_length)


def dense_to_jagged(dense, offsets, total_L=None):
    dense = dense.contiguous()
    total = int(offsets[-1]) if total_L is None else total_L
    out = dense.new_zeros((total, *dense.shape[2:]))
    return _run(TO_JAGGED, dense, dense, out, offsets, total, math.prod(dense.shape[2:]), dense.shape[1])


def jagged_dense_elementwise(mode: int, x_values, offsets, y):
    """``ADD`` or ``MUL`` of jagged ``x_values`` and padded ``y`` -> jagged, of their result dtype (floating)."""
    x_values, y = x_values.contiguous(), y.contiguous()
    out = torch.empty_like(x_values, dtype=torch.result_type(x_values, y))
    return _run(mode, x_values, y, out, offsets, x_values.shape[0], math.prod(x_values.shape[1:]), y.shape[1])
