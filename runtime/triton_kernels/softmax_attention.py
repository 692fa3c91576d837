"""Softmax attention on jagged sequences (SASRec) as persistent Triton kernels, forward and backward.

The work items are those of the HSTU kernels (``tiles``): (tile, head) pairs over every sequence's own tiles, a
1-D grid looping over them.
- forward: an item is a query tile; it walks the key tiles it sees (up to its diagonal when causal) with an online
  softmax (running max and sum in fp32), and stores each row's log-sum-exp for the backward.
- backward: the forward is recomputed for the log-sum-exp ``lse`` and ``delta = rowsum(g * out)``; then dq per
  query tile (``ds = p (g v^T - delta)``, ``dq = scale ds k``) and dk, dv per key tile over the query tiles that
  see it (``dv = p^T g``, ``dk = scale ds^T q``), ``p = exp(scale q k^T - lse)`` recomputed per tile.
Index arithmetic is int32; tiles are ``BLOCK`` x head dim.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .jagged_attention import _blocks, _check_size, _load_pair, _load_rows, _store_rows
from .tiles import _tile_item, tile_grid


@triton.jit
def _masked_scores(q, k, m, n, m_ok, n_ok, scale, CAUSAL: tl.constexpr):
    keep = m_ok[:, None] & n_ok[None, :]
    if CAUSAL:
        keep = keep & (n[None, :] <= m[:, None])
    return tl.where(keep, tl.dot(q, tl.trans(k)) * scale, float("-inf"))


@triton.jit
def _row_values(ptr, start, m, m_ok, heads, head):
    """Per-row, per-head fp32 values (``[total, heads]``) of rows m."""
    return tl.load(ptr + (start + m) * heads + head, mask=m_ok, other=0.0)


@triton.jit
def _query_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, out_ptr, lse_ptr, delta_ptr, offsets_ptr, tile_seq_ptr, tile_start_ptr,
    num_items, heads, head_dim, value_dim, scale,
    CAUSAL: tl.constexpr, DQ: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per query tile: the forward (``out`` and ``lse``) or, with ``DQ``, ``dq`` into ``out_ptr``."""
    dd = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        head, _, start, length, q_start, m = _tile_item(item, heads, offsets_ptr, tile_seq_ptr, tile_start_ptr, BLOCK)
        m_ok = m < length
        q = _load_rows(q_ptr, start, m, m_ok, heads, head, head_dim, dd)
        if DQ:
            g = _load_rows(g_ptr, start, m, m_ok, heads, head, value_dim, dv)
            lse = _row_values(lse_ptr, start, m, m_ok, heads, head)
            delta = _row_values(delta_ptr, start, m, m_ok, heads, head)
            acc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK, BLOCK_V], dtype=tl.float32)
            row_max = tl.full([BLOCK], -1e30, dtype=tl.float32)
            row_sum = tl.zeros([BLOCK], dtype=tl.float32)
        hi = tl.minimum(q_start + BLOCK, length) if CAUSAL else length
        for n0 in range(0, hi, BLOCK):
            n = n0 + rows
            n_ok = n < length
            k, v = _load_pair(k_ptr, v_ptr, start, n, n_ok, heads, head, head_dim, value_dim, dd, dv)
            s = _masked_scores(q, k, m, n, m_ok, n_ok, scale, CAUSAL)
            if DQ:
                p = tl.exp(s - lse[:, None])
                ds = p * (tl.dot(g, tl.trans(v)) - delta[:, None])
                acc += tl.dot(ds.to(k.dtype), k)
            else:
                new_max = tl.maximum(row_max, tl.max(s, 1))
                p = tl.exp(s - new_max[:, None])
                rescale = tl.exp(row_max - new_max)
                row_sum = row_sum * rescale + tl.sum(p, 1)
                acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
                row_max = new_max
        if DQ:
            _store_rows(out_ptr, acc * scale, start, m, m_ok, heads, head, head_dim, dd)
        else:
            total = tl.maximum(row_sum, 1e-30)
            _store_rows(out_ptr, acc / total[:, None], start, m, m_ok, heads, head, value_dim, dv)
            tl.store(lse_ptr + (start + m) * heads + head, row_max + tl.log(total), mask=m_ok)


@triton.jit
def _key_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, offsets_ptr, tile_seq_ptr, tile_start_ptr,
    num_items, heads, head_dim, value_dim, scale,
    CAUSAL: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per key tile, over the query tiles that see it: dk and dv."""
    dd = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        head, _, start, length, k_start, n = _tile_item(item, heads, offsets_ptr, tile_seq_ptr, tile_start_ptr, BLOCK)
        n_ok = n < length
        k, v = _load_pair(k_ptr, v_ptr, start, n, n_ok, heads, head, head_dim, value_dim, dd, dv)
        dk = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        dvv = tl.zeros([BLOCK, BLOCK_V], dtype=tl.float32)
        for m0 in range(k_start if CAUSAL else 0, length, BLOCK):
            m = m0 + rows
            m_ok = m < length
            q, g = _load_pair(q_ptr, g_ptr, start, m, m_ok, heads, head, head_dim, value_dim, dd, dv)
            lse = _row_values(lse_ptr, start, m, m_ok, heads, head)
            delta = _row_values(delta_ptr, start, m, m_ok, heads, head)
            p = tl.exp(_masked_scores(q, k, m, n, m_ok, n_ok, scale, CAUSAL) - lse[:, None])
            dvv += tl.dot(tl.trans(p).to(g.dtype), g)
            ds = p * (tl.dot(g, tl.trans(v)) - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q)
        _store_rows(dk_ptr, dk * scale, start, n, n_ok, heads, head, head_dim, dd)
        _store_rows(dv_ptr, dvv, start, n, n_ok, heads, head, value_dim, dv)


def _launch(q, v, offsets):
    """The grid and the arguments after the tensors every kernel takes; None without work."""
    _check_size(q, v, 0)
    launch = tile_grid(offsets, q.shape[0], q.shape[1])
    if launch is None:
        return None
    return launch.grid, (*launch.tiles, launch.num_items, q.shape[1], q.shape[2], v.shape[2])


def _forward(q, k, v, offsets, scale, causal):
    out = torch.zeros_like(v)
    lse = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
    launch = _launch(q, v, offsets)
    if launch is not None:
        grid, common = launch
        _query_kernel[grid](q, k, v, v, out, lse, lse, *common, scale, CAUSAL=causal, DQ=False, **_blocks(q, v))
    return out, lse


def softmax_attention_forward(q, k, v, offsets, scale, causal):
    """``softmax(scale q k^T) v`` over each sequence's keys (causal: up to the row) -> ``[total, H, Dv]``."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _forward(q, k, v, offsets, scale, causal)[0]


def softmax_attention_backward(grad, q, k, v, offsets, scale, causal):
    """``[dq, dk, dv]`` of :func:`softmax_attention_forward`."""
    q, k, v, grad = q.contiguous(), k.contiguous(), v.contiguous(), grad.contiguous()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    out, lse = _forward(q, k, v, offsets, scale, causal)
    delta = (grad.float() * out.float()).sum(-1)
    launch = _launch(q, v, offsets)
    if launch is not None:
        grid, common = launch
        blocks = _blocks(q, v)
        _query_kernel[grid](q, k, v, grad, dq, lse, delta, *common, scale, CAUSAL=causal, DQ=True, **blocks)
        _key_kernel[grid](q, k, v, grad, dk, dv, lse, delta, *common, scale, CAUSAL=causal, **blocks)
    return [dq, dk, dv]
