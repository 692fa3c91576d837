"""``recompile.hstu_paged_attention`` forward as a persistent Triton kernel (no time bias).

Work items are (query tile, head) pairs over each user's new rows; a 1-D grid of ``num_programs`` programs
loops over them. An item loops over the key tiles its rows can see, positions ``0 .. cached + its last row``:
a key position below the user's cached length is read from the page pools through the page table
(``page_table[user, n // page_size] * page_size + n % page_size``), one at or past it from the new rows.
Scores ``alpha q k^T + rel[N - 1 + n - m]``; kept pairs: a row sees itself and the earlier history rows (not
the candidates before it). Index arithmetic is int32; tiles are ``BLOCK`` x head dim.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .jagged_attention import _blocks, _check_size, _load_rows, _store_rows
from .tiles import tile_grid


@triton.jit
def _key_rows(new_ptr, pool_ptr, table_ptr, seq, start, cached, n, n_ok, table_width, page_size, heads, head, width,
              cols):
    """Key (or value) rows at positions ``n`` of one user: from the pool below ``cached``, else the new rows."""
    in_pool = n_ok & (n < cached)
    page = tl.load(table_ptr + seq * table_width + n // page_size, mask=in_pool, other=0)
    pool_row = page * page_size + n % page_size
    from_pool = tl.load(pool_ptr + (pool_row[:, None] * heads + head) * width + cols[None, :],
                        mask=in_pool[:, None] & (cols[None, :] < width), other=0.0)
    from_new = _load_rows(new_ptr, start - cached, n, n_ok & (n >= cached), heads, head, width, cols)
    return from_pool + from_new


@triton.jit
def _paged_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, out_ptr, offsets_ptr, cached_ptr, targets_ptr, table_ptr, tile_seq_ptr,
    tile_start_ptr, rel_ptr, num_items, heads, head_dim, value_dim, table_width, page_size, max_seq_len, alpha,
    inv_norm, HAS_TARGETS: tl.constexpr, HAS_REL: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    dd = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        tile = item // heads
        head = item % heads
        seq = tl.load(tile_seq_ptr + tile)
        start = tl.load(offsets_ptr + seq)
        new_len = tl.load(offsets_ptr + seq + 1) - start
        cached = tl.load(cached_ptr + seq)
        length = cached + new_len
        history_end = length
        if HAS_TARGETS:
            history_end = length - tl.load(targets_ptr + seq)
        local = tl.load(tile_start_ptr + tile) + rows
        m_ok = local < new_len
        m = cached + local
        q = _load_rows(q_ptr, start, local, m_ok, heads, head, head_dim, dd)
        acc = tl.zeros([BLOCK, BLOCK_V], dtype=tl.float32)
        hi = tl.where(tl.load(tile_start_ptr + tile) < new_len,  # a spare item (past the last tile) has no keys
                      tl.minimum(cached + tl.load(tile_start_ptr + tile) + BLOCK, length), 0)
        for n0 in range(0, hi, BLOCK):
            n = n0 + rows
            n_ok = n < length
            k = _key_rows(k_ptr, kc_ptr, table_ptr, seq, start, cached, n, n_ok, table_width, page_size, heads, head,
                          head_dim, dd)
            v = _key_rows(v_ptr, vc_ptr, table_ptr, seq, start, cached, n, n_ok, table_width, page_size, heads, head,
                          value_dim, dv)
            s = tl.dot(q, tl.trans(k)) * alpha
            keep = m_ok[:, None] & n_ok[None, :]
            if HAS_REL:
                s += tl.load(rel_ptr + max_seq_len - 1 + n[None, :] - m[:, None], mask=keep, other=0.0).to(tl.float32)
            keep = keep & ((n[None, :] == m[:, None]) | ((n[None, :] < m[:, None]) & (n[None, :] < history_end)))
            acc += tl.dot(tl.where(keep, s * tl.sigmoid(s) * inv_norm, 0.0).to(v.dtype), v)
        _store_rows(out_ptr, acc, start, local, m_ok, heads, head, value_dim, dv)


def hstu_paged_attention_forward(q, k, v, offsets, k_cache, v_cache, page_table, cached_lengths, max_seq_len, alpha,
                                 num_targets, rel_bias):
    """The new rows' HSTU attention over their cached prefix and themselves -> ``[total, H, Dv]``."""
    _check_size(q, v, max_seq_len)
    if k_cache.numel() >= 2**31 or v_cache.numel() >= 2**31:
        raise ValueError("recompile.hstu_paged_attention (triton): cache pools too large for int32 indexing")
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    launch = tile_grid(offsets, q.shape[0], q.shape[1])
    if launch is None:
        return out
    offsets, tile_seq, tile_start = launch.tiles
    table = page_table.to(torch.int32).contiguous()
    cached = cached_lengths.to(torch.int32)
    targets = cached if num_targets is None else num_targets.to(torch.int32)
    rel = rel_bias.contiguous() if rel_bias is not None else q.new_zeros(1)
    _paged_kernel[launch.grid](
        q.contiguous(), k.contiguous(), v.contiguous(), k_cache.contiguous(), v_cache.contiguous(), out, offsets,
        cached, targets, table, tile_seq, tile_start, rel, launch.num_items, q.shape[1], q.shape[2], v.shape[2],
        table.shape[1], k_cache.shape[1], max_seq_len, alpha, 1.0 / max_seq_len,
        HAS_TARGETS=num_targets is not None, HAS_REL=rel_bias is not None, **_blocks(q, v))
    return out
