"""Beam decode attention as a persistent Triton kernel: beams share one context KV, each adds its own keys.

A work item is (batch row, head, tile of ``BLOCK_W`` beams); a 1-D grid of ``num_programs`` programs loops
over the items. An item loads its beams' queries once, runs an online softmax over the row's context in
``BLOCK_N``-key tiles (``tl.dot`` of the beam tile against the key tile: the context is read once per beam
tile, not once per beam), then over the beams' own suffix keys one position at a time (a row-wise dot, each
beam against its own key), and writes ``acc / sum`` (zeros where a beam saw no key). fp32 accumulation,
int32 index arithmetic, tiles of at most ``BLOCK_N x BLOCK_D`` elements.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import num_programs

BLOCK_W = 16
BLOCK_N = 16


@triton.jit
def _beam_decode_kernel(
    q_ptr, ck_ptr, cv_ptr, clen_ptr, bk_ptr, bv_ptr, blen_ptr, out_ptr,
    num_items, beams, heads, context, suffix, head_dim, value_dim, scale,
    BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    dd = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_V)
    wi = tl.arange(0, BLOCK_W)
    ni = tl.arange(0, BLOCK_N)
    d_ok = dd < head_dim
    v_ok = dv < value_dim
    beam_tiles = (beams + BLOCK_W - 1) // BLOCK_W
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        b = item // (heads * beam_tiles)
        h = (item // beam_tiles) % heads
        w = (item % beam_tiles) * BLOCK_W + wi
        w_ok = w < beams
        row = (b * beams + w) * heads + h  # [BLOCK_W] rows of q / out
        q = tl.load(q_ptr + row[:, None] * head_dim + dd[None, :], mask=w_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32) * scale
        top = tl.full([BLOCK_W], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_W], dtype=tl.float32)
        acc = tl.zeros([BLOCK_W, BLOCK_V], dtype=tl.float32)
        context_len = tl.load(clen_ptr + b).to(tl.int32)
        for n0 in range(0, context_len, BLOCK_N):
            n = n0 + ni
            n_ok = n < context_len
            key_row = (b * context + n) * heads + h
            k = tl.load(ck_ptr + key_row[:, None] * head_dim + dd[None, :], mask=n_ok[:, None] & d_ok[None, :],
                        other=0.0).to(tl.float32)
            v = tl.load(cv_ptr + key_row[:, None] * value_dim + dv[None, :], mask=n_ok[:, None] & v_ok[None, :],
                        other=0.0).to(tl.float32)
            s = tl.where(n_ok[None, :], tl.dot(q, tl.trans(k)), float("-inf"))
            new_top = tl.maximum(top, tl.max(s, 1))
            p = tl.exp(s - new_top[:, None])
            rescale = tl.exp(top - new_top)
            total = total * rescale + tl.sum(p, 1)
            acc = acc * rescale[:, None] + tl.dot(p, v)
            top = new_top
        suffix_len = tl.load(blen_ptr + b).to(tl.int32)
        for j in range(0, suffix_len):
            own_row = ((b * beams + w) * suffix + j) * heads + h
            k = tl.load(bk_ptr + own_row[:, None] * head_dim + dd[None, :], mask=w_ok[:, None] & d_ok[None, :],
                        other=0.0).to(tl.float32)
            v = tl.load(bv_ptr + own_row[:, None] * value_dim + dv[None, :], mask=w_ok[:, None] & v_ok[None, :],
                        other=0.0).to(tl.float32)
            s = tl.sum(q * k, 1)
            new_top = tl.maximum(top, s)
            p = tl.exp(s - new_top)
            rescale = tl.exp(top - new_top)
            total = total * rescale + p
            acc = acc * rescale[:, None] + p[:, None] * v
            top = new_top
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + row[:, None] * value_dim + dv[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=w_ok[:, None] & v_ok[None, :])


def beam_decode_attention_forward(q, context_k, context_v, context_lengths, beam_k, beam_v, beam_lengths, scale):
    """``[B, W, H, Dv]``: see ``recompile.runtime.beam_decode_attention``."""
    batch, beams, heads, head_dim = q.shape
    context, suffix, value_dim = context_k.shape[1], beam_k.shape[2], context_v.shape[3]
    if max(t.numel() for t in (q, context_k, context_v, beam_k, beam_v)) >= 2**31:
        raise ValueError("recompile.beam_decode_attention (triton): tensors too large for int32 indexing")
    out = q.new_empty(batch, beams, heads, value_dim)
    num_items = batch * heads * triton.cdiv(beams, BLOCK_W)
    if num_items == 0:
        return out
    q, context_k, context_v, beam_k, beam_v = (t.contiguous() for t in (q, context_k, context_v, beam_k, beam_v))
    grid = (min(num_programs(q.device), num_items),)
    _beam_decode_kernel[grid](
        q, context_k, context_v, context_lengths.to(torch.int32), beam_k, beam_v, beam_lengths.to(torch.int32), out,
        num_items, beams, heads, context, suffix, head_dim, value_dim, scale,
        BLOCK_W=BLOCK_W, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_V=max(16, triton.next_power_of_2(value_dim)),
    )
    return out
