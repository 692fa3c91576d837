"""HSTU attention on jagged q, k, v as persistent Triton kernels, forward and backward.

Work items are (tile, head) pairs over every sequence's own tiles (none over padding): the host lists
each tile's sequence and start (int32); a 1-D grid of ``num_programs`` programs loops over the items.
- forward and dq: an item is a query tile; it loops over the key tiles it can see (up to its
  diagonal when causal), recomputing the scores ``s = alpha q k^T + rel[N - 1 + n - m]``.
- dk, dv and the relative bias gradient: an item is a key tile; it loops over the query tiles that
  see it (from its diagonal on when causal) and accumulates ``dv = p^T g`` and ``dk = alpha ds^T q`` in
  registers, where ``p = silu(s) / N`` and ``ds = (g v^T) silu'(s) / N`` on the kept pairs; the bias
  gradient sums ``ds`` along each diagonal of the tile and adds the sums at ``N - 1 + n - m``
  atomically (fp32, one add per diagonal).
Index arithmetic is int32; tiles are ``BLOCK`` x head dim, well inside 192 KB.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.triton_kernels import num_programs

BLOCK = 16


@triton.jit
def _work_item(item, heads, offsets_ptr, tile_seq_ptr, tile_start_ptr):
    """Work item ``item``'s head, its sequence's first row and length, and its tile's first row."""
    tile = item // heads
    seq = tl.load(tile_seq_ptr + tile)
    start = tl.load(offsets_ptr + seq)
    return item % heads, start, tl.load(offsets_ptr + seq + 1) - start, tl.load(tile_start_ptr + tile)


@triton.jit
def _load_rows(ptr, start, r, r_ok, heads, head, width, cols):
    """Rows ``r`` (``[BLOCK, BLOCK_W]``, zero past the sequence) of one head of a jagged [total, heads, width]."""
    return tl.load(ptr + ((start + r)[:, None] * heads + head) * width + cols[None, :],
                   mask=r_ok[:, None] & (cols[None, :] < width), other=0.0)


@triton.jit
def _store_rows(ptr, value, start, r, r_ok, heads, head, width, cols):
    tl.store(ptr + ((start + r)[:, None] * heads + head) * width + cols[None, :], value.to(ptr.dtype.element_ty),
             mask=r_ok[:, None] & (cols[None, :] < width))


@triton.jit
def _scores(q, k, m, n, m_ok, n_ok, rel_ptr, max_seq_len, alpha, CAUSAL: tl.constexpr, HAS_REL: tl.constexpr):
    """Scores ``[BLOCK, BLOCK]`` of query rows m against key columns n, and which pairs are kept."""
    s = tl.dot(q, tl.trans(k)) * alpha
    if HAS_REL:
        s += tl.load(rel_ptr + max_seq_len - 1 + n[None, :] - m[:, None], mask=m_ok[:, None] & n_ok[None, :],
                     other=0.0).to(tl.float32)
    keep = m_ok[:, None] & n_ok[None, :]
    if CAUSAL:
        keep = keep & (n[None, :] <= m[:, None])
    return s, keep


@triton.jit
def _score_grads(s, keep, g, v, inv_norm):
    """``ds = (g v^T) silu'(s) / N`` on the kept pairs."""
    sig = tl.sigmoid(s)
    return tl.where(keep, tl.dot(g, tl.trans(v)) * sig * (1 + s * (1 - sig)) * inv_norm, 0.0)


@triton.jit
def _query_tiles_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, out_ptr, offsets_ptr, tile_seq_ptr, tile_start_ptr, rel_ptr,
    num_items, heads, head_dim, value_dim, max_seq_len, alpha, inv_norm,
    CAUSAL: tl.constexpr, HAS_REL: tl.constexpr, DQ: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Per query tile, over the key tiles it sees: the forward ``out = p v`` or, with ``DQ``, ``dq = alpha ds k``."""
    dd = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        head, start, length, q_start = _work_item(item, heads, offsets_ptr, tile_seq_ptr, tile_start_ptr)
        m = q_start + rows
        m_ok = m < length
        q = _load_rows(q_ptr, start, m, m_ok, heads, head, head_dim, dd)
        if DQ:
            g = _load_rows(g_ptr, start, m, m_ok, heads, head, value_dim, dv)
        acc = tl.zeros([BLOCK, BLOCK_D if DQ else BLOCK_V], dtype=tl.float32)
        hi = tl.minimum(q_start + BLOCK, length) if CAUSAL else length
        for n0 in range(0, hi, BLOCK):
            n = n0 + rows
            n_ok = n < length
            k = _load_rows(k_ptr, start, n, n_ok, heads, head, head_dim, dd)
            v = _load_rows(v_ptr, start, n, n_ok, heads, head, value_dim, dv)
            s, keep = _scores(q, k, m, n, m_ok, n_ok, rel_ptr, max_seq_len, alpha, CAUSAL, HAS_REL)
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
def _hstu_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, dk_ptr, dv_ptr, drel_ptr, offsets_ptr, tile_seq_ptr, tile_start_ptr, rel_ptr,
    num_items, heads, head_dim, value_dim, max_seq_len, alpha, inv_norm,
    CAUSAL: tl.constexpr, HAS_REL: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    dd = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK)
    diagonals = tl.arange(0, 2 * BLOCK)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        head, start, length, k_start = _work_item(item, heads, offsets_ptr, tile_seq_ptr, tile_start_ptr)
        n = k_start + rows
        n_ok = n < length
        k = _load_rows(k_ptr, start, n, n_ok, heads, head, head_dim, dd)
        v = _load_rows(v_ptr, start, n, n_ok, heads, head, value_dim, dv)
        dk = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        dvv = tl.zeros([BLOCK, BLOCK_V], dtype=tl.float32)
        lo = k_start if CAUSAL else 0
        for m0 in range(lo, length, BLOCK):
            m = m0 + rows
            m_ok = m < length
            q = _load_rows(q_ptr, start, m, m_ok, heads, head, head_dim, dd)
            g = _load_rows(g_ptr, start, m, m_ok, heads, head, value_dim, dv)
            s, keep = _scores(q, k, m, n, m_ok, n_ok, rel_ptr, max_seq_len, alpha, CAUSAL, HAS_REL)
            p = tl.where(keep, s * tl.sigmoid(s) * inv_norm, 0.0)
            dvv += tl.dot(tl.trans(p).to(g.dtype), g)
            ds = _score_grads(s, keep, g, v, inv_norm)
            dk += tl.dot(tl.trans(ds).to(q.dtype), q)
            if HAS_REL:  # one atomic add per diagonal of the tile, not per pair
                at = max_seq_len - 1 + k_start - m0 - (BLOCK - 1) + diagonals
                tl.atomic_add(drel_ptr + at, _diagonal_sums(ds, BLOCK),
                              mask=(diagonals < 2 * BLOCK - 1) & (at >= 0) & (at < 2 * max_seq_len - 1))
        _store_rows(dk_ptr, dk * alpha, start, n, n_ok, heads, head, head_dim, dd)
        _store_rows(dv_ptr, dvv, start, n, n_ok, heads, head, value_dim, dv)


def _tiles(offsets: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each BLOCK-row tile's sequence and first row (int32), over every sequence's own tiles."""
    lengths = offsets[1:] - offsets[:-1]
    tiles = (lengths + BLOCK - 1) // BLOCK
    tile_seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=device, dtype=torch.int32), tiles)
    first = torch.cumsum(tiles, 0) - tiles
    tile_start = ((torch.arange(tile_seq.numel(), device=device) - first[tile_seq.long()]) * BLOCK).to(torch.int32)
    return tile_seq, tile_start


def _check_size(q, v, max_seq_len) -> None:
    total, heads, head_dim = q.shape
    if max(total * heads * max(head_dim, v.shape[2]), 2 * max_seq_len) >= 2**31:
        raise ValueError("recompile.hstu_attention (triton): tensors too large for int32 indexing")


def _blocks(q, v) -> dict:
    return dict(BLOCK=BLOCK, BLOCK_D=max(16, triton.next_power_of_2(q.shape[2])),
                BLOCK_V=max(16, triton.next_power_of_2(v.shape[2])))


def _launch(q, v, offsets, max_seq_len, alpha, causal, rel_bias):
    """The grid, the arguments every kernel takes after its tensors, and the constexprs; None without work."""
    _check_size(q, v, max_seq_len)
    offsets = offsets.to(torch.int32)
    tile_seq, tile_start = _tiles(offsets, q.device)
    num_items = tile_seq.numel() * q.shape[1]
    if num_items == 0:
        return None
    rel = rel_bias.contiguous() if rel_bias is not None else q.new_zeros(1)
    grid = (min(num_programs(q.device), num_items),)
    common = (offsets, tile_seq, tile_start, rel, num_items, q.shape[1], q.shape[2], v.shape[2], max_seq_len, alpha,
              1.0 / max_seq_len)
    return grid, common, dict(CAUSAL=causal, HAS_REL=rel_bias is not None, **_blocks(q, v))


def hstu_attention_forward(q, k, v, offsets, max_seq_len, alpha, causal, rel_bias):
    """Jagged HSTU attention (no targets, contextual prefix or time bias) -> ``[total, H, Dv]``."""
    out = torch.empty_like(v)
    launch = _launch(q, v, offsets, max_seq_len, alpha, causal, rel_bias)
    if launch is not None:
        grid, common, flags = launch
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        _query_tiles_kernel[grid](q, k, v, v, out, *common, DQ=False, **flags)
    return out


def hstu_attention_backward(grad, q, k, v, offsets, max_seq_len, alpha, causal, rel_bias):
    """``(dq, dk, dv, drel)`` of :func:`hstu_attention_forward` (drel None without a relative bias)."""
    q, k, v, grad = q.contiguous(), k.contiguous(), v.contiguous(), grad.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    drel = None if rel_bias is None else torch.zeros(rel_bias.shape, dtype=torch.float32, device=q.device)
    launch = _launch(q, v, offsets, max_seq_len, alpha, causal, rel_bias)
    if launch is not None:
        grid, common, flags = launch
        _query_tiles_kernel[grid](q, k, v, grad, dq, *common, DQ=True, **flags)
        # without a bias the kernel never reads its drel pointer
        _hstu_dkdv_kernel[grid](q, k, v, grad, dk, dv, dq if drel is None else drel, *common, **flags)
    return dq, dk, dv, None if drel is None else drel.to(rel_bias.dtype)
