"""jagged_dense_bmm and jagged_jagged_bmm as persistent Triton kernels (each other's backward).

- ``jagged_dense_bmm``: ``out[rows of b] = x[rows of b] @ y[b]`` for each sequence's first ``max_L`` rows (the rest
  zero). Work items are (row tile of a sequence, block of output columns), listed as every jagged kernel's
  (``tiles``: no host sync); each loops over K in blocks.
- ``jagged_jagged_bmm``: ``out[b] = x[rows of b]^T @ y[rows of b]`` over each sequence's first ``max_L`` rows.
  Work items are (sequence, block of M, block of N); each loops over its rows in tiles.
fp32 accumulation; int32 index arithmetic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import num_programs
from .tiles import BLOCK, _tile_item, tile_grid

BLOCK_K = 32
BLOCK_N = 32


@triton.jit
def _jagged_dense_kernel(
    x_ptr, y_ptr, out_ptr, offsets_ptr, tile_seq_ptr, tile_start_ptr, num_items, col_blocks, k_dim, n_dim, max_len,
    y_batch_stride, y_k_stride, y_n_stride,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    ks = tl.arange(0, BLOCK_K)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        col_block, seq, start, length, _, m = _tile_item(item, col_blocks, offsets_ptr, tile_seq_ptr, tile_start_ptr,
                                                         BLOCK)
        m_ok = m < tl.minimum(length, max_len)
        n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < n_dim
        acc = tl.zeros([BLOCK, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, tl.where(tl.max(m_ok.to(tl.int32), 0) > 0, k_dim, 0), BLOCK_K):
            k = k0 + ks
            x = tl.load(x_ptr + (start + m)[:, None] * k_dim + k[None, :], mask=m_ok[:, None] & (k[None, :] < k_dim),
                        other=0.0)
            y = tl.load(y_ptr + seq * y_batch_stride + k[:, None] * y_k_stride + n[None, :] * y_n_stride,
                        mask=(k[:, None] < k_dim) & n_ok[None, :], other=0.0)
            acc += tl.dot(x.to(tl.float32), y.to(tl.float32))
        tl.store(out_ptr + (start + m)[:, None] * n_dim + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _jagged_jagged_kernel(
    x_ptr, y_ptr, out_ptr, offsets_ptr, num_items, m_blocks, n_blocks, m_dim, n_dim, max_len,
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        seq = item // (m_blocks * n_blocks)
        ms = (item // n_blocks % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        ns = (item % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        start = tl.load(offsets_ptr + seq)
        limit = tl.minimum(tl.load(offsets_ptr + seq + 1) - start, max_len)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for r0 in range(0, limit, BLOCK):
            r = r0 + rows
            r_ok = r < limit
            x = tl.load(x_ptr + (start + r)[:, None] * m_dim + ms[None, :], mask=r_ok[:, None] & (ms[None, :] < m_dim),
                        other=0.0)
            y = tl.load(y_ptr + (start + r)[:, None] * n_dim + ns[None, :], mask=r_ok[:, None] & (ns[None, :] < n_dim),
                        other=0.0)
            acc += tl.dot(tl.trans(x.to(tl.float32)), y.to(tl.float32))
        tl.store(out_ptr + seq * m_dim * n_dim + ms[:, None] * n_dim + ns[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(ms[:, None] < m_dim) & (ns[None, :] < n_dim))


def _check_size(*tensors) -> None:
    if any(t.numel() >= 2**31 for t in tensors):
        raise ValueError("recompile.jagged bmm (triton): tensors too large for int32 indexing")


def jagged_dense_bmm(x_values, offsets, y, max_L):
    """``[total, N]``: each sequence's first ``max_L`` rows times its ``y[b]`` (``[K, N]``), zero past them."""
    x_values = x_values.contiguous()
    _check_size(x_values, y)
    out = x_values.new_zeros((x_values.shape[0], y.shape[2]))
    col_blocks = triton.cdiv(y.shape[2], BLOCK_N)
    launch = tile_grid(offsets, x_values.shape[0], col_blocks)
    if launch is not None:
        _jagged_dense_kernel[launch.grid](
            x_values, y, out, *launch.tiles, launch.num_items, col_blocks, x_values.shape[1], y.shape[2], max_L,
            *y.stride(), BLOCK=BLOCK, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N)
    return out


def jagged_jagged_bmm(x_values, y_values, offsets, max_L):
    """``[B, M, N]``: per sequence, ``x^T y`` over its first ``max_L`` rows."""
    x_values, y_values = x_values.contiguous(), y_values.contiguous()
    _check_size(x_values, y_values)
    batch, m_dim, n_dim = offsets.numel() - 1, x_values.shape[1], y_values.shape[1]
    out = x_values.new_zeros((batch, m_dim, n_dim))
    m_blocks, n_blocks = triton.cdiv(m_dim, BLOCK_N), triton.cdiv(n_dim, BLOCK_N)
    num_items = batch * m_blocks * n_blocks
    if num_items:
        _jagged_jagged_kernel[(min(num_programs(out.device), num_items),)](
            x_values, y_values, out, offsets.to(torch.int32), num_items, m_blocks, n_blocks, m_dim, n_dim, max_L,
            BLOCK=BLOCK, BLOCK_M=BLOCK_N, BLOCK_N=BLOCK_N)
    return out
