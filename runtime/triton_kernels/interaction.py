"""Feature-interaction kernels: persistent 1-D grids, each program looping over its share of the work.

- dot interaction: one batch row per iteration; the [F, F] products ``T T^T`` are accumulated over D
  in chunks of ``BLOCK_D`` with ``tl.dot``, and only the wanted pairs are stored, each at its
  position in the output row (after the ``prefix`` columns, which are copied first).
- cross layer: tiles of ``x @ W^T`` with ``tl.dot``; the epilogue adds the bias and writes
  ``x0 * h + x`` from registers. The low-rank form runs the same kernel twice (``x V^T``, no epilogue).
- mixture of low-rank experts: each expert's matmuls through the same kernel (relu epilogue), then one pass
  per batch row: the gating softmax and ``x0 * sum_e g_e h_e + x``.
- FM second order: one batch row per iteration, the sum and the sum of squares over F accumulated in
  fp32 per D chunk, optionally summed over D.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting, num_programs


@triton.jit
def _pair_position(r, c, n, UPPER: tl.constexpr, SELF: tl.constexpr):
    """Index of pair (r, c) in row-major triu/tril order, and whether the pair is wanted."""
    if UPPER:
        if SELF:
            return r * (2 * n - r + 1) // 2 + (c - r), (c >= r) & (c < n)
        return r * (2 * n - r - 1) // 2 + (c - r - 1), (c > r) & (c < n)
    if SELF:
        return r * (r + 1) // 2 + c, (c <= r) & (r < n)
    return r * (r - 1) // 2 + c, (c < r) & (r < n)


@triton.jit
def _dot_interaction_kernel(
    t_ptr, prefix_ptr, out_ptr, batch, n, d, k, out_cols,
    UPPER: tl.constexpr, SELF: tl.constexpr, HAS_PREFIX: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    f = tl.arange(0, BLOCK_F)
    dd = tl.arange(0, BLOCK_D)
    r = f[:, None]
    c = f[None, :]
    pos, wanted = _pair_position(r, c, n, UPPER, SELF)
    for b in range(pid, batch, nprog):
        row = b * n * d
        acc = tl.zeros([BLOCK_F, BLOCK_F], dtype=tl.float32)
        for d0 in range(0, d, BLOCK_D):
            mask = (f[:, None] < n) & (d0 + dd[None, :] < d)
            tile = tl.load(t_ptr + row + f[:, None] * d + d0 + dd[None, :], mask=mask, other=0.0)
            if UPCAST:  # fp32 products in full precision (no tf32), as eager's bmm
                tile = tile.to(tl.float32)
                acc += tl.dot(tile, tl.trans(tile), input_precision="ieee")
            else:
                acc = tl.dot(tile, tl.trans(tile), acc)
        out_row = out_ptr + b * out_cols
        if HAS_PREFIX:
            for k0 in range(0, k, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                vals = tl.load(prefix_ptr + b * k + kk, mask=kk < k, other=0.0)
                tl.store(out_row + kk, vals, mask=kk < k)
        tl.store(out_row + k + pos, acc.to(out_ptr.dtype.element_ty), mask=wanted)


def dot_interaction(features, prefix, upper, self_interaction):
    features = features.contiguous()
    batch, n, d = features.shape
    k = 0 if prefix is None else prefix.shape[1]
    pairs = n * (n + (1 if self_interaction else -1)) // 2
    out = features.new_empty(batch, k + pairs)
    if batch == 0:
        return out
    prefix_arg = features if prefix is None else prefix.contiguous()
    grid = (min(batch, num_programs(features.device)),)
    # tl.dot tiles are at least 16 on a side; the interpreter's tl.dot takes fp32 only
    _dot_interaction_kernel[grid](
        features, prefix_arg, out, batch, n, d, k, k + pairs,
        UPPER=upper, SELF=self_interaction, HAS_PREFIX=prefix is not None,
        UPCAST=features.dtype == torch.float32 or interpreting(),
        BLOCK_F=max(triton.next_power_of_2(n), 16), BLOCK_D=max(min(triton.next_power_of_2(d), 64), 16), BLOCK_K=128,
    )
    return out


@triton.jit
def _linear_epilogue_kernel(
    a_ptr, w_ptr, bias_ptr, x0_ptr, x_ptr, out_ptr, hb_ptr, m, n, kdim,
    HAS_BIAS: tl.constexpr, CROSS: tl.constexpr, STORE_HB: tl.constexpr, RELU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out = a @ w^T (+ bias), then relu with RELU; with CROSS: out = x0 * (a @ w^T + bias) + x, and with
    STORE_HB also hb = a @ w^T + bias (what the cross stack's backward reads)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_n = tl.cdiv(n, BLOCK_N)
    tiles = tl.cdiv(m, BLOCK_M) * tiles_n
    rm0 = tl.arange(0, BLOCK_M)
    rn0 = tl.arange(0, BLOCK_N)
    rk0 = tl.arange(0, BLOCK_K)
    for tile in range(pid, tiles, nprog):
        rm = (tile // tiles_n) * BLOCK_M + rm0
        rn = (tile % tiles_n) * BLOCK_N + rn0
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, kdim, BLOCK_K):
            rk = k0 + rk0
            a = tl.load(a_ptr + rm[:, None] * kdim + rk[None, :], mask=(rm[:, None] < m) & (rk[None, :] < kdim), other=0.0)
            w = tl.load(w_ptr + rn[None, :] * kdim + rk[:, None], mask=(rn[None, :] < n) & (rk[:, None] < kdim), other=0.0)
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < n, other=0.0).to(tl.float32)[None, :]
        mask = (rm[:, None] < m) & (rn[None, :] < n)
        offs = rm[:, None] * n + rn[None, :]
        if STORE_HB:
            tl.store(hb_ptr + offs, acc.to(hb_ptr.dtype.element_ty), mask=mask)
        if RELU:
            acc = tl.maximum(acc, 0.0)
        if CROSS:
            x0 = tl.load(x0_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            acc = x0 * acc + x
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _linear(a, w, bias, x0=None, x=None, hb=None, relu=False):
    m, kdim = a.shape
    n = w.shape[0]
    out = a.new_empty(m, n)
    if m == 0:
        return out
    block_m, block_n, block_k = 32, 32, 32
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    _linear_epilogue_kernel[(min(tiles, num_programs(a.device)),)](
        a, w, a if bias is None else bias, a if x0 is None else x0, a if x is None else x, out,
        out if hb is None else hb, m, n, kdim,
        HAS_BIAS=bias is not None, CROSS=x0 is not None, STORE_HB=hb is not None, RELU=relu,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out


def cross_layer(x0, x, weight, bias, down):
    x0, x, weight = x0.contiguous(), x.contiguous(), weight.contiguous()
    z = x if down is None else _linear(x, down.contiguous(), None)
    return _linear(z, weight, None if bias is None else bias.contiguous(), x0, x)


def cross_stack(x0, x, weights, biases, downs, save):
    """The layers in turn, each one matmul kernel with the cross epilogue that also stores h + b when ``save``."""
    x0, x = x0.contiguous(), x.contiguous()
    hbs, inputs = [], []  # runtime.interaction.stack_saved's layout
    for layer, weight in enumerate(weights):
        z = x if not downs else _linear(x, downs[layer].contiguous(), None)
        bias = biases[layer].contiguous() if biases else None
        if save:
            hbs.append(torch.empty_like(x))
            inputs.append(x)
        x = _linear(z, weight.contiguous(), bias, x0, x, hb=hbs[-1] if save else None)
    return x, hbs + inputs[1:]



@triton.jit
def _mixture_combine_kernel(logits_ptr, h_ptr, x0_ptr, x_ptr, out_ptr, batch, d, experts,
                            BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[b] = x0[b] * sum_e softmax(logits[b])_e h[e, b] + x[b], one batch row per iteration."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ee = tl.arange(0, BLOCK_E)
    dd = tl.arange(0, BLOCK_D)
    for b in range(pid, batch, nprog):
        logit = tl.load(logits_ptr + b * experts + ee, mask=ee < experts, other=float("-inf")).to(tl.float32)
        p = tl.exp(logit - tl.max(logit, 0))
        g = p / tl.sum(p, 0)
        for d0 in range(0, d, BLOCK_D):
            dm = d0 + dd < d
            h = tl.load(h_ptr + ee[:, None] * batch * d + b * d + d0 + dd[None, :],
                        mask=(ee[:, None] < experts) & dm[None, :], other=0.0).to(tl.float32)
            y = tl.sum(g[:, None] * h, 0)
            x0 = tl.load(x0_ptr + b * d + d0 + dd, mask=dm, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + b * d + d0 + dd, mask=dm, other=0.0).to(tl.float32)
            tl.store(out_ptr + b * d + d0 + dd, (x0 * y + x).to(out_ptr.dtype.element_ty), mask=dm)


def cross_mixture(x0, x, gate, downs, mids, ups, biases, relu):
    """Each expert's matmuls with the activation (and U's bias) as their epilogue, then the gating softmax and
    the gate-weighted cross update in one pass."""
    x0, x = x0.contiguous(), x.contiguous()
    logits = _linear(x, gate.contiguous(), None)
    hs = []
    for e, (down, up) in enumerate(zip(downs, ups)):
        z = _linear(x, down.contiguous(), None, relu=relu)
        if mids:
            z = _linear(z, mids[e].contiguous(), None, relu=relu)
        hs.append(_linear(z, up.contiguous(), biases[e].contiguous() if biases else None))
    h = torch.stack(hs)
    batch, d = x.shape
    out = torch.empty_like(x)
    if batch == 0:
        return out
    _mixture_combine_kernel[(min(batch, num_programs(x.device)),)](
        logits, h, x0, x, out, batch, d, len(downs),
        BLOCK_E=max(triton.next_power_of_2(len(downs)), 2), BLOCK_D=min(max(triton.next_power_of_2(d), 16), 256),
    )
    return out

@triton.jit
def _fm_kernel(v_ptr, out_ptr, batch, n, d, REDUCE: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dd = tl.arange(0, BLOCK_D)
    for b in range(pid, batch, nprog):
        total = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, d, BLOCK_D):
            mask = d0 + dd < d
            s = tl.zeros([BLOCK_D], dtype=tl.float32)
            q = tl.zeros([BLOCK_D], dtype=tl.float32)
            for f in range(0, n):
                v = tl.load(v_ptr + (b * n + f) * d + d0 + dd, mask=mask, other=0.0).to(tl.float32)
                s += v
                q += v * v
            res = 0.5 * (s * s - q)
            if REDUCE:
                total += res
            else:
                tl.store(out_ptr + b * d + d0 + dd, res.to(out_ptr.dtype.element_ty), mask=mask)
        if REDUCE:
            tl.store(out_ptr + b + tl.arange(0, 1), tl.sum(total, 0).to(out_ptr.dtype.element_ty) + tl.zeros([1], dtype=out_ptr.dtype.element_ty))


def fm_second_order(v, reduce):
    v = v.contiguous()
    batch, n, d = v.shape
    out = v.new_empty(batch, 1 if reduce else d)
    if batch == 0:
        return out
    _fm_kernel[(min(batch, num_programs(v.device)),)](
        v, out, batch, n, d, REDUCE=reduce, BLOCK_D=min(max(triton.next_power_of_2(d), 16), 1024)
    )
    return out
