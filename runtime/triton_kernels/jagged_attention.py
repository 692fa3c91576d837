"""HSTU attention on jagged q, k, v as persistent Triton kernels, forward and backward.

Work items are (tile, head) pairs over every sequence's own tiles (none over padding): the host lists
each tile's sequence and start (int32, ``tiles``); a 1-D grid of ``num_programs`` programs loops over the items.
- scores ``s = alpha q k^T + rel[N - 1 + n - m] + time[bucket(ts_m - ts_n)]`` on the pairs HSTU's valid mask
  keeps (causal; ``num_targets`` last rows that see the history and themselves; a contextual prefix whose rows
  see every non-target row), recomputed wherever they are needed.
- forward and dq: an item is a query tile; it loops over the key tiles it can see (up to its
  diagonal when causal, every tile for a tile holding contextual rows).
- dk, dv and the bias gradients: an item is a key tile; it loops over the query tiles that
  see it (the contextual tiles, then from its diagonal on when causal) and accumulates ``dv = p^T g`` and
  ``dk = alpha ds^T q`` in registers, where ``p = silu(s) / N`` and ``ds = (g v^T) silu'(s) / N`` on the kept
  pairs; the relative bias gradient sums ``ds`` along each diagonal of the tile and adds the sums at
  ``N - 1 + n - m`` atomically (one add per diagonal), the time bias gradient adds ``ds`` at each pair's bucket.
- time buckets: HSTU's ``clamp(int(log(max(|gap|, 1)) / 0.301), 0, num_buckets)``; for integer timestamps by a
  binary search of the bucket edges (``recompile.runtime.jagged_attention.time_bucket_edges``: the formula exactly).
Index arithmetic is int32 (timestamps int64); tiles are ``BLOCK`` x head dim, well inside 192 KB.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import BLOCK, _work_item, tile_grid

NO_TIME, INT_TIME, FLOAT_TIME = 0, 1, 2


@triton.jit
def _load_rows(ptr, start, r, r_ok, heads, head, width, cols):
    """Rows ``r`` (``[BLOCK, BLOCK_W]``, zero past the sequence) of one head of a jagged [total, heads, width]."""
    return tl.load(ptr + ((start + r)[:, None] * heads + head) * width + cols[None, :],
                   mask=r_ok[:, None] & (cols[None, :] < width), other=0.0)


@triton.jit
def _load_pair(a_ptr, b_ptr, start, r, r_ok, heads, head, head_dim, value_dim, dd, dv):
    """Rows ``r`` of one head of a ``[total, heads, head_dim]`` tensor and of a ``[total, heads, value_dim]`` one
    (k and v, or q and the output gradient)."""
    return (_load_rows(a_ptr, start, r, r_ok, heads, head, head_dim, dd),
            _load_rows(b_ptr, start, r, r_ok, heads, head, value_dim, dv))


@triton.jit
def _store_rows(ptr, value, start, r, r_ok, heads, head, width, cols):
    tl.store(ptr + ((start + r)[:, None] * heads + head) * width + cols[None, :], value.to(ptr.dtype.element_ty),
             mask=r_ok[:, None] & (cols[None, :] < width))


@triton.jit
def _keep(m, n, m_ok, n_ok, length, targets, contextual, CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    """HSTU's valid mask on the pairs (m, n) of one tile (``recompile.runtime.jagged_attention.hstu_valid_mask``)."""
    keep = m_ok[:, None] & n_ok[None, :]
    if MASKED:
        shift = tl.maximum(contextual - 1, 0)
        max_ids = length - shift - targets
        row = tl.minimum(tl.maximum(m - shift, 0), max_ids)
        col = tl.minimum(tl.maximum(n - shift, 0), max_ids)
        dist = row[:, None] - col[None, :]
        if not CAUSAL:
            dist = tl.abs(dist)
        valid = (m[:, None] == n[None, :]) | (dist > 0)
        valid = valid | ((contextual > 0) & (row[:, None] == 0) & (col[None, :] < max_ids))
        keep = keep & valid
    elif CAUSAL:
        keep = keep & (n[None, :] <= m[:, None])
    return keep


@triton.jit
def _time_buckets(ts_ptr, edges_ptr, start, m, n, m_ok, n_ok, num_buckets, steps, TIME: tl.constexpr):
    """``[BLOCK, BLOCK]`` time-bias index of the pairs (m, n)."""
    if TIME == 1:  # integer timestamps: the number of bucket edges <= |gap|, by binary search
        gap = tl.abs(tl.load(ts_ptr + start + m, mask=m_ok, other=0).to(tl.int64)[:, None]
                     - tl.load(ts_ptr + start + n, mask=n_ok, other=0).to(tl.int64)[None, :])
        lo = tl.zeros(gap.shape, dtype=tl.int32)
        hi = lo + num_buckets
        for _ in range(steps):
            open_ = lo < hi
            mid = (lo + hi) // 2
            up = tl.load(edges_ptr + mid, mask=open_, other=0) <= gap
            lo = tl.where(open_ & up, mid + 1, lo)
            hi = tl.where(open_ & ~up, mid, hi)
        return lo
    else:
        gap = (tl.load(ts_ptr + start + m, mask=m_ok, other=0)[:, None]
               - tl.load(ts_ptr + start + n, mask=n_ok, other=0)[None, :])
        gap = tl.maximum(tl.abs(gap), 1.0).to(tl.float32)
        return tl.minimum((tl.log(gap) / 0.301).to(tl.int32), num_buckets)  # 0.301: TIME_BUCKET_BASE


@triton.jit
def _scores(q, k, m, n, m_ok, n_ok, start, rel_ptr, ts_ptr, edges_ptr, time_ptr, max_seq_len, num_buckets, steps,
            alpha, HAS_REL: tl.constexpr, TIME: tl.constexpr):
    """Scores ``[BLOCK, BLOCK]`` of query rows m against key columns n, and the pairs' time buckets (0 without)."""
    s = tl.dot(q, tl.trans(k)) * alpha
    pair_ok = m_ok[:, None] & n_ok[None, :]
    if HAS_REL:
        s += tl.load(rel_ptr + max_seq_len - 1 + n[None, :] - m[:, None], mask=pair_ok, other=0.0).to(tl.float32)
    if TIME != 0:
        bucket = _time_buckets(ts_ptr, edges_ptr, start, m, n, m_ok, n_ok, num_buckets, steps, TIME)
        s += tl.load(time_ptr + bucket, mask=pair_ok, other=0.0).to(tl.float32)
    else:
        bucket = tl.zeros(s.shape, dtype=tl.int32)
    return s, bucket


@triton.jit
def _kept_scores(q, k, m, n, m_ok, n_ok, start, length, targets, contextual, rel_ptr, ts_ptr, edges_ptr, time_ptr,
                 max_seq_len, num_buckets, steps, alpha, CAUSAL: tl.constexpr, HAS_REL: tl.constexpr,
                 MASKED: tl.constexpr, TIME: tl.constexpr):
    """``_scores`` of the tile pair (m, n) and the pairs HSTU's mask keeps (``_keep``)."""
    s, bucket = _scores(q, k, m, n, m_ok, n_ok, start, rel_ptr, ts_ptr, edges_ptr, time_ptr, max_seq_len,
                        num_buckets, steps, alpha, HAS_REL, TIME)
    return s, bucket, _keep(m, n, m_ok, n_ok, length, targets, contextual, CAUSAL, MASKED)


@triton.jit
def _score_grads(s, keep, g, v, inv_norm):
    """``ds = (g v^T) silu'(s) / N`` on the kept pairs."""
    sig = tl.sigmoid(s)
    return tl.where(keep, tl.dot(g, tl.trans(v)) * sig * (1 + s * (1 - sig)) * inv_norm, 0.0)


@triton.jit
def _query_tiles_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, out_ptr, offsets_ptr, tile_seq_ptr, tile_start_ptr, targets_ptr, rel_ptr, ts_ptr,
    edges_ptr, time_ptr, num_items, heads, head_dim, value_dim, max_seq_len, contextual, num_buckets, steps, alpha,
    inv_norm, CAUSAL: tl.constexpr, HAS_REL: tl.constexpr, HAS_TARGETS: tl.constexpr, MASKED: tl.constexpr,
    TIME: tl.constexpr, DQ: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per query tile, over the key tiles it sees: the forward ``out = p v`` or, with ``DQ``, ``dq = alpha ds k``."""
    dd = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        head, start, length, targets, q_start = _work_item(item, heads, offsets_ptr, tile_seq_ptr, tile_start_ptr,
                                                           targets_ptr, HAS_TARGETS)
        m = q_start + rows
        m_ok = m < length
        q = _load_rows(q_ptr, start, m, m_ok, heads, head, head_dim, dd)
        if DQ:
            g = _load_rows(g_ptr, start, m, m_ok, heads, head, value_dim, dv)
        acc = tl.zeros([BLOCK, BLOCK_D if DQ else BLOCK_V], dtype=tl.float32)
        hi = length
        if CAUSAL:  # contextual rows see past their diagonal
            hi = tl.where(q_start < contextual, length, tl.minimum(q_start + BLOCK, length))
        for n0 in range(0, hi, BLOCK):
            n = n0 + rows
            n_ok = n < length
            k, v = _load_pair(k_ptr, v_ptr, start, n, n_ok, heads, head, head_dim, value_dim, dd, dv)
            s, _, keep = _kept_scores(q, k, m, n, m_ok, n_ok, start, length, targets, contextual, rel_ptr, ts_ptr,
                                      edges_ptr, time_ptr, max_seq_len, num_buckets, steps, alpha, CAUSAL, HAS_REL,
                                      MASKED, TIME)
            if DQ:
                acc += tl.dot(_score_grads(s, keep, g, v, inv_norm).to(k.dtype), k)
            else:
                acc += tl.dot(tl.where(keep, s * tl.sigmoid(s) * inv_norm, 0.0).to(v.dtype), v)
        if DQ:
            _store_rows(out_ptr, acc * alpha, start, m, m_ok, heads, head, head_dim, dd)
        else:
            _store_rows(out_ptr, acc, start, m, m_ok, heads, head, value_dim, dv)


@triton.jit
def _diagonal_sums(t, BLOCK: tl.constexpr):
    """``[2 BLOCK]`` sums of ``t [BLOCK (m), BLOCK (n)]`` along its diagonals: entry ``BLOCK - 1 + n - m``."""
    i = tl.arange(0, BLOCK)
    on = (i[None, :] - i[:, None] + BLOCK - 1)[None, :, :] == tl.arange(0, 2 * BLOCK)[:, None, None]
    return tl.sum(tl.sum(tl.where(on, t[None, :, :], 0.0), 2), 1)


@triton.jit
def _dkdv_step(dk, dvv, m0, k, v, n, n_ok, k_start, head, start, length, targets, q_ptr, g_ptr, drel_ptr, dtime_ptr,
               rel_ptr, ts_ptr, edges_ptr, time_ptr, heads, head_dim, value_dim, max_seq_len, contextual, num_buckets,
               steps, alpha, inv_norm, dd, dv, CAUSAL: tl.constexpr, HAS_REL: tl.constexpr, MASKED: tl.constexpr,
               TIME: tl.constexpr, BLOCK: tl.constexpr):
    """One query tile's share of a key tile's dk and dv; its bias gradients added atomically."""
    m = m0 + tl.arange(0, BLOCK)
    m_ok = m < length
    q, g = _load_pair(q_ptr, g_ptr, start, m, m_ok, heads, head, head_dim, value_dim, dd, dv)
    s, bucket, keep = _kept_scores(q, k, m, n, m_ok, n_ok, start, length, targets, contextual, rel_ptr, ts_ptr,
                                   edges_ptr, time_ptr, max_seq_len, num_buckets, steps, alpha, CAUSAL, HAS_REL,
                                   MASKED, TIME)
    p = tl.where(keep, s * tl.sigmoid(s) * inv_norm, 0.0)
    dvv += tl.dot(tl.trans(p).to(g.dtype), g)
    ds = _score_grads(s, keep, g, v, inv_norm)
    dk += tl.dot(tl.trans(ds).to(q.dtype), q)
    if HAS_REL:  # one atomic add per diagonal of the tile, not per pair
        diagonals = tl.arange(0, 2 * BLOCK)
        at = max_seq_len - 1 + k_start - m0 - (BLOCK - 1) + diagonals
        tl.atomic_add(drel_ptr + at, _diagonal_sums(ds, BLOCK),
                      mask=(diagonals < 2 * BLOCK - 1) & (at >= 0) & (at < 2 * max_seq_len - 1))
    if TIME != 0:
        tl.atomic_add(dtime_ptr + bucket, ds, mask=keep)
    return dk, dvv


@triton.jit
def _hstu_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, dk_ptr, dv_ptr, drel_ptr, dtime_ptr, offsets_ptr, tile_seq_ptr, tile_start_ptr,
    targets_ptr, rel_ptr, ts_ptr, edges_ptr, time_ptr, num_items, heads, head_dim, value_dim, max_seq_len, contextual,
    num_buckets, steps, alpha, inv_norm, CAUSAL: tl.constexpr, HAS_REL: tl.constexpr, HAS_TARGETS: tl.constexpr,
    MASKED: tl.constexpr, TIME: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    dd = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_V)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        head, start, length, targets, k_start = _work_item(item, heads, offsets_ptr, tile_seq_ptr, tile_start_ptr,
                                                           targets_ptr, HAS_TARGETS)
        n = k_start + tl.arange(0, BLOCK)
        n_ok = n < length
        k, v = _load_pair(k_ptr, v_ptr, start, n, n_ok, heads, head, head_dim, value_dim, dd, dv)
        dk = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        dvv = tl.zeros([BLOCK, BLOCK_V], dtype=tl.float32)
        lo = 0
        if CAUSAL:  # the query tiles holding contextual rows before the diagonal, then from the diagonal on
            lo = k_start
            for m0 in range(0, tl.minimum(tl.cdiv(contextual, BLOCK) * BLOCK, k_start), BLOCK):
                dk, dvv = _dkdv_step(dk, dvv, m0, k, v, n, n_ok, k_start, head, start, length, targets, q_ptr, g_ptr,
                                     drel_ptr, dtime_ptr, rel_ptr, ts_ptr, edges_ptr, time_ptr, heads, head_dim,
                                     value_dim, max_seq_len, contextual, num_buckets, steps, alpha, inv_norm, dd, dv,
                                     CAUSAL, HAS_REL, MASKED, TIME, BLOCK)
        for m0 in range(lo, length, BLOCK):
            dk, dvv = _dkdv_step(dk, dvv, m0, k, v, n, n_ok, k_start, head, start, length, targets, q_ptr, g_ptr,
                                 drel_ptr, dtime_ptr, rel_ptr, ts_ptr, edges_ptr, time_ptr, heads, head_dim,
                                 value_dim, max_seq_len, contextual, num_buckets, steps, alpha, inv_norm, dd, dv,
                                 CAUSAL, HAS_REL, MASKED, TIME, BLOCK)
        _store_rows(dk_ptr, dk * alpha, start, n, n_ok, heads, head, head_dim, dd)
        _store_rows(dv_ptr, dvv, start, n, n_ok, heads, head, value_dim, dv)


def _check_size(q, v, max_seq_len) -> None:
    total, heads, head_dim = q.shape
    if max(total * heads * max(head_dim, v.shape[2]), 2 * max_seq_len) >= 2**31:
        raise ValueError("recompile.hstu_attention (triton): tensors too large for int32 indexing")


def _blocks(q, v) -> dict:
    return dict(BLOCK=BLOCK, BLOCK_D=max(16, triton.next_power_of_2(q.shape[2])),
                BLOCK_V=max(16, triton.next_power_of_2(v.shape[2])))


def _launch(q, v, offsets, max_seq_len, alpha, causal, num_targets, contextual_seq_len, rel_bias, timestamps,
            time_bias):
    """The grid, the arguments every kernel takes after its tensors, and the constexprs; None without work."""
    from ..jagged_attention import time_bucket_edges

    _check_size(q, v, max_seq_len)
    launch = tile_grid(offsets, q.shape[0], q.shape[1])
    if launch is None:
        return None
    unused = launch.tiles[0]  # a pointer the kernel never reads (its constexpr flag is off)
    time = NO_TIME if time_bias is None else FLOAT_TIME if timestamps.is_floating_point() else INT_TIME
    num_buckets = 0 if time_bias is None else time_bias.numel() - 1
    edges = time_bucket_edges(num_buckets, q.device) if time == INT_TIME else unused
    common = (*launch.tiles, unused if num_targets is None else num_targets,
              unused if rel_bias is None else rel_bias.contiguous(), unused if timestamps is None else timestamps,
              edges, unused if time_bias is None else time_bias.contiguous(), launch.num_items, q.shape[1], q.shape[2],
              v.shape[2], max_seq_len, contextual_seq_len, num_buckets, num_buckets.bit_length(), alpha,
              1.0 / max_seq_len)
    flags = dict(CAUSAL=causal, HAS_REL=rel_bias is not None, HAS_TARGETS=num_targets is not None,
                 MASKED=num_targets is not None or contextual_seq_len > 0, TIME=time, **_blocks(q, v))
    return launch.grid, common, flags


def hstu_attention_forward(q, k, v, offsets, max_seq_len, alpha, causal, num_targets=None, contextual_seq_len=0,
                           rel_bias=None, timestamps=None, time_bias=None):
    """Jagged HSTU attention -> ``[total, H, Dv]`` (arguments as ``torch.ops.recompile.hstu_attention``)."""
    out = torch.empty_like(v)
    launch = _launch(q, v, offsets, max_seq_len, alpha, causal, num_targets, contextual_seq_len, rel_bias, timestamps,
                     time_bias)
    if launch is not None:
        grid, common, flags = launch
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        _query_tiles_kernel[grid](q, k, v, v, out, *common, DQ=False, **flags)
    return out


def hstu_attention_backward(grad, q, k, v, offsets, max_seq_len, alpha, causal, num_targets=None,
                            contextual_seq_len=0, rel_bias=None, timestamps=None, time_bias=None):
    """``(dq, dk, dv, drel, dtime)`` of :func:`hstu_attention_forward` (a bias gradient is None without the bias)."""
    q, k, v, grad = q.contiguous(), k.contiguous(), v.contiguous(), grad.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    drel, dtime = (None if b is None else torch.zeros(b.shape, dtype=torch.float32, device=q.device)
                   for b in (rel_bias, time_bias))
    launch = _launch(q, v, offsets, max_seq_len, alpha, causal, num_targets, contextual_seq_len, rel_bias, timestamps,
                     time_bias)
    if launch is not None:
        grid, common, flags = launch
        _query_tiles_kernel[grid](q, k, v, grad, dq, *common, DQ=True, **flags)
        # without a bias the kernel never reads its gradient's pointer
        _hstu_dkdv_kernel[grid](q, k, v, grad, dk, dv, dq if drel is None else drel, dq if dtime is None else dtime,
                                *common, **flags)
    return (dq, dk, dv, *(None if g is None else g.to(b.dtype) for g, b in ((drel, rel_bias), (dtime, time_bias))))
