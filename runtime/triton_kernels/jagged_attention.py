"""HSTU attention forward on jagged q, k, v as one persistent Triton kernel.

Work items are (query tile, head) pairs over every sequence's own tiles (none over padding): the
host lists each tile's sequence and start (int32); a 1-D grid of ``num_programs`` programs loops
over the items, and each item loops over the key tiles it can see (up to its diagonal when causal).
Index arithmetic is int32; tiles are ``BLOCK`` x head dim, well inside 192 KB.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.triton_kernels import num_programs

BLOCK = 16


@triton.jit
def _hstu_forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, offsets_ptr, tile_seq_ptr, tile_start_ptr, rel_ptr,
    num_items, heads, head_dim, value_dim, max_seq_len, alpha, inv_norm,
    CAUSAL: tl.constexpr, HAS_REL: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    dd = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        head = item % heads
        tile = item // heads
        seq = tl.load(tile_seq_ptr + tile)
        q_start = tl.load(tile_start_ptr + tile)
        start = tl.load(offsets_ptr + seq)
        length = tl.load(offsets_ptr + seq + 1) - start
        m = q_start + rows
        m_ok = m < length
        q = tl.load(q_ptr + ((start + m)[:, None] * heads + head) * head_dim + dd[None, :],
                    mask=m_ok[:, None] & (dd[None, :] < head_dim), other=0.0)
        acc = tl.zeros([BLOCK, BLOCK_V], dtype=tl.float32)
        hi = tl.minimum(q_start + BLOCK, length) if CAUSAL else length
        for n0 in range(0, hi, BLOCK):
            n = n0 + rows
            n_ok = n < length
            k = tl.load(k_ptr + ((start + n)[:, None] * heads + head) * head_dim + dd[None, :],
                        mask=n_ok[:, None] & (dd[None, :] < head_dim), other=0.0)
            s = tl.dot(q, tl.trans(k)) * alpha
            if HAS_REL:
                s += tl.load(rel_ptr + max_seq_len - 1 + n[None, :] - m[:, None],
                             mask=m_ok[:, None] & n_ok[None, :], other=0.0)
            keep = m_ok[:, None] & n_ok[None, :]
            if CAUSAL:
                keep = keep & (n[None, :] <= m[:, None])
            p = tl.where(keep, s * tl.sigmoid(s) * inv_norm, 0.0)
            v = tl.load(v_ptr + ((start + n)[:, None] * heads + head) * value_dim + dv[None, :],
                        mask=n_ok[:, None] & (dv[None, :] < value_dim), other=0.0)
            acc += tl.dot(p.to(v.dtype), v)
        tl.store(out_ptr + ((start + m)[:, None] * heads + head) * value_dim + dv[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (dv[None, :] < value_dim))


def hstu_attention_forward(q, k, v, offsets, max_seq_len, alpha, causal, rel_bias):
    """Jagged HSTU attention (no targets, contextual prefix or time bias) -> ``[total, H, Dv]``."""
    total, heads, head_dim = q.shape
    value_dim = v.shape[2]
    if max(total * heads * max(head_dim, value_dim), 2 * max_seq_len) >= 2**31:
        raise ValueError("recompile.hstu_attention (triton): tensors too large for int32 indexing")
    offsets = offsets.to(torch.int32)
    lengths = offsets[1:] - offsets[:-1]
    tiles = (lengths + BLOCK - 1) // BLOCK
    tile_seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=q.device, dtype=torch.int32), tiles)
    first = torch.cumsum(tiles, 0) - tiles
    tile_start = ((torch.arange(tile_seq.numel(), device=q.device) - first[tile_seq.long()]) * BLOCK).to(torch.int32)
    out = torch.empty_like(v)
    num_items = tile_seq.numel() * heads
    if num_items == 0:
        return out
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    rel = rel_bias.contiguous() if rel_bias is not None else q.new_zeros(1)
    grid = (min(num_programs(q.device), num_items),)
    _hstu_forward_kernel[grid](
        q, k, v, out, offsets, tile_seq, tile_start, rel, num_items, heads, head_dim, value_dim, max_seq_len,
        alpha, 1.0 / max_seq_len, CAUSAL=causal, HAS_REL=rel_bias is not None, BLOCK=BLOCK,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_V=max(16, triton.next_power_of_2(value_dim)),
    )
    return out
