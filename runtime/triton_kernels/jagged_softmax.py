"""jagged_softmax (softmax over each sequence's rows, column by column) as persistent Triton kernels.

Work items are (sequence, block of ``BLOCK_D`` columns); a 1-D grid of ``num_programs`` programs loops over them.
The forward walks its sequence's first ``min(length, max_L)`` rows twice in tiles of ``BLOCK_R``: an online max and
sum of exponentials per column in fp32, then ``exp(x - max) / sum``; the backward sums ``g * y`` per column, then
writes ``y (g - sum)``. Rows past ``max_L`` stay zero. Index arithmetic is int32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import num_programs

BLOCK_R = 16
MAX_BLOCK_D = 128


@triton.jit
def _softmax_kernel(
    x_ptr, g_ptr, out_ptr, offsets_ptr, num_items, col_blocks, dim, max_len,
    BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Forward: ``x_ptr`` the values. BACKWARD: ``x_ptr`` the forward's output ``y``, ``g_ptr`` its gradient."""
    rows = tl.arange(0, BLOCK_R)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        seq = item // col_blocks
        cols = (item % col_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < dim
        start = tl.load(offsets_ptr + seq)
        length = tl.minimum(tl.load(offsets_ptr + seq + 1) - start, max_len)
        if BACKWARD:
            total = tl.zeros([BLOCK_D], dtype=tl.float32)
        else:
            peak = tl.full([BLOCK_D], -1e30, dtype=tl.float32)
            total = tl.zeros([BLOCK_D], dtype=tl.float32)
        for r0 in range(0, length, BLOCK_R):
            at = (start + r0 + rows)[:, None] * dim + cols[None, :]
            ok = (r0 + rows < length)[:, None] & col_ok[None, :]
            if BACKWARD:
                y = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
                total += tl.sum(y * tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32), 0)
            else:
                x = tl.load(x_ptr + at, mask=ok, other=float("-inf")).to(tl.float32)
                new_peak = tl.maximum(peak, tl.max(x, 0))
                total = total * tl.exp(peak - new_peak) + tl.sum(tl.exp(x - new_peak[None, :]), 0)
                peak = new_peak
        for r0 in range(0, length, BLOCK_R):
            at = (start + r0 + rows)[:, None] * dim + cols[None, :]
            ok = (r0 + rows < length)[:, None] & col_ok[None, :]
            if BACKWARD:
                y = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
                g = tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32)
                value = y * (g - total[None, :])
            else:
                x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
                value = tl.exp(x - peak[None, :]) / total[None, :]
            tl.store(out_ptr + at, value.to(out_ptr.dtype.element_ty), mask=ok)


def _run(x, g, offsets, max_len, backward: bool) -> torch.Tensor:
    out = torch.zeros_like(x)  # rows past max_L stay zero
    if x.numel() >= 2**31:
        raise ValueError("recompile.jagged_softmax (triton): values too large for int32 indexing")
    batch, dim = offsets.numel() - 1, x.shape[1]
    block_d = min(triton.next_power_of_2(max(dim, 1)), MAX_BLOCK_D)
    col_blocks = triton.cdiv(dim, block_d)
    num_items = batch * col_blocks
    if num_items and x.shape[0]:
        _softmax_kernel[(min(num_programs(x.device), num_items),)](
            x, g, out, offsets.to(torch.int32), num_items, col_blocks, dim, max_len,
            BACKWARD=backward, BLOCK_R=BLOCK_R, BLOCK_D=block_d)
    return out


def jagged_softmax_forward(values, offsets, max_L):
    """Softmax over each sequence's first ``max_L`` rows, per column -> like ``values``."""
    values = values.contiguous()
    return _run(values, values, offsets, max_L, backward=False)


def jagged_softmax_backward(grad, output, offsets, max_L):
    """The gradient of :func:`jagged_softmax_forward` from its output."""
    return _run(output.contiguous(), grad.contiguous(), offsets, max_L, backward=True)
