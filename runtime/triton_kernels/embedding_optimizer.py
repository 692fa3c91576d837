"""The fused embedding optimizers' step (``embedding_optimizer_step``) as one persistent Triton launch.

Every table's ids are keyed ``first row of the table in the group + id`` and sorted (stably) once, on the device
and without a host sync; each key's run in the sorted order is one touched row. Work items are blocks of
``BLOCK_R`` sorted positions: a position that starts a run owns the row, sums its ids' gradients (each id's
bag's output gradient times the id's factor: sample weight, padding, MEAN's 1/count) in fp32 in the order the
ids came, and applies the update in place (``recompile.runtime.embedding_optimizer``'s semantics):

- ``exact_sgd``: ``w -= lr g``;
- ``exact_adagrad``: ``s += g^2; w -= lr g / (sqrt(s) + eps)``;
- ``exact_rowwise_adagrad``: ``s += mean(g^2)`` (one per row), ``w -= lr g / (sqrt(s) + eps)``;
- ``adam``: ``m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; w -= step_size m / (sqrt(v) + eps)`` with the
  table's bias-corrected step size (counted on the host: no sync).
Rows are whole tiles (a row's D fits one ``BLOCK_D``); tables, their states and the output gradient are
addressed as in ``recompile.runtime.triton_kernels.embedding`` (element offsets from one base per kind).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import num_programs
from .embedding import _based, output_offsets

MAX_DIM = 1024
TILE_ELEMENTS = 4096
OPTIMIZERS = ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad", "adam")  # the kernel's OPT, in this order
# meta's columns (one row per table)
W_OFF, DIM, W_STRIDE, ROWS, ROW_BASE, OUT_OFF, S1_OFF, S2_OFF, META = (tl.constexpr(i) for i in range(9))


@triton.jit
def _step_kernel(
    meta_ptr, step_size_ptr, keys_ptr, order_ptr, run_end_ptr, table_ptr, bag_ptr, factor_ptr, grad_ptr, w_ptr,
    s1_ptr, s2_ptr, n, grad_stride, lr, eps, beta1, beta2,
    OPT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    lanes = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    for block in range(tl.program_id(0), tl.cdiv(n, BLOCK_R), tl.num_programs(0)):
        i = block * BLOCK_R + lanes
        key = tl.load(keys_ptr + i, mask=i < n, other=-1)
        owner = (i < n) & (key != tl.load(keys_ptr + i - 1, mask=(i > 0) & (i < n), other=-1))
        end = tl.load(run_end_ptr + i, mask=owner, other=0).to(tl.int32)
        t = tl.load(table_ptr + tl.load(order_ptr + i, mask=owner, other=0), mask=owner, other=0)
        row = meta_ptr + t * META
        dim = tl.load(row + DIM, mask=owner, other=0).to(tl.int32)
        at = (key - tl.load(row + ROW_BASE, mask=owner, other=0)).to(tl.int32)  # the row in its table
        owner = owner & (at >= 0) & (at < tl.load(row + ROWS, mask=owner, other=0))
        tile_ok = owner[:, None] & (cols[None, :] < dim[:, None])
        out_off = tl.load(row + OUT_OFF, mask=owner, other=0)
        g = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for j in range(0, tl.max(tl.where(owner, end - i, 0), 0)):
            take = owner & (i + j < end)
            p = tl.load(order_ptr + i + j, mask=take, other=0)
            bag = tl.load(bag_ptr + p, mask=take, other=0)
            factor = tl.load(factor_ptr + p, mask=take, other=0.0)
            g += tl.load(grad_ptr + out_off[:, None] + bag[:, None] * grad_stride + cols[None, :],
                         mask=take[:, None] & tile_ok, other=0.0).to(tl.float32) * factor[:, None]
        w_at = w_ptr + tl.load(row + W_OFF, mask=owner, other=0)[:, None] + at[:, None] * tl.load(
            row + W_STRIDE, mask=owner, other=0).to(tl.int32)[:, None] + cols[None, :]
        w = tl.load(w_at, mask=tile_ok, other=0.0)
        if OPT == 0:
            update = -lr * g
        elif OPT == 1:
            s_at = s1_ptr + tl.load(row + S1_OFF, mask=owner, other=0)[:, None] + at[:, None] * dim[:, None] + cols[None, :]
            s = tl.load(s_at, mask=tile_ok, other=0.0) + g * g
            tl.store(s_at, s, mask=tile_ok)
            update = -lr * g / (tl.sqrt(s) + eps)
        elif OPT == 2:
            s_at = s1_ptr + tl.load(row + S1_OFF, mask=owner, other=0) + at
            s = tl.load(s_at, mask=owner, other=0.0) + tl.sum(g * g, 1) / tl.maximum(dim, 1).to(tl.float32)
            tl.store(s_at, s, mask=owner)
            update = -lr * g / (tl.sqrt(s) + eps)[:, None]
        else:
            state = at[:, None] * dim[:, None] + cols[None, :]
            m_at = s1_ptr + tl.load(row + S1_OFF, mask=owner, other=0)[:, None] + state
            v_at = s2_ptr + tl.load(row + S2_OFF, mask=owner, other=0)[:, None] + state
            m = beta1 * tl.load(m_at, mask=tile_ok, other=0.0) + (1 - beta1) * g
            v = beta2 * tl.load(v_at, mask=tile_ok, other=0.0) + (1 - beta2) * g * g
            tl.store(m_at, m, mask=tile_ok)
            tl.store(v_at, v, mask=tile_ok)
            step_size = tl.load(step_size_ptr + t, mask=owner, other=0.0)
            update = -step_size[:, None] * m / (tl.sqrt(v) + eps)
        tl.store(w_at, (w + update.to(w.dtype)).to(w.dtype), mask=tile_ok)


def supports(weights, kind: str) -> bool:
    """Tables the kernel updates: unit column stride, rows of at most MAX_DIM, each table once in the group."""
    return (kind in OPTIMIZERS and all(w.stride(1) == 1 and w.shape[1] <= MAX_DIM for w in weights)
            and len({w.data_ptr() for w in weights}) == len(weights))


def optimizer_step(grad, weights, features, factors, states, step_sizes, layout, kind, params) -> None:
    """Update every table's touched rows in place: ``factors[t]`` each id's factor (None: 1), ``states[t]`` the
    table's state tensors (``recompile.runtime.embedding_optimizer.table_state``'s, in OPTIMIZERS' order of use),
    ``step_sizes[t]`` Adam's step size."""
    device = grad.device
    counts = [f.ids.numel() for f in features]
    n = sum(counts)
    if n == 0:
        return
    row_bases = [sum(w.shape[0] for w in weights[:t]) for t in range(len(weights))]
    keys = torch.cat([f.ids.long() + base for f, base in zip(features, row_bases)])
    keys, order = torch.sort(keys, stable=True)
    run_end = torch.searchsorted(keys, keys, right=True)
    tables = torch.cat([torch.full((c,), t, dtype=torch.int32, device=device) for t, c in enumerate(counts)])
    bags = torch.cat([torch.arange(c, device=device) if layout == "sequence" else f.bag_of_id()
                      for c, f in zip(counts, features)]).to(torch.int32)
    factors = torch.cat([torch.ones(c, device=device) if s is None else s.float() for c, s in zip(counts, factors)])
    w_base, w_offs, _ = _based(weights, weights[0].dtype, weights[0], contiguous=False)
    s1_base, s1_offs, _ = _based([s[0] if s else None for s in states], torch.float32, factors, contiguous=False)
    s2_base, s2_offs, _ = _based([s[1] if len(s) > 1 else None for s in states], torch.float32, factors,
                                 contiguous=False)
    _, out_offs, grad_stride = output_offsets(weights, features, layout)
    meta = torch.tensor([[w_offs[t], w.shape[1], w.stride(0), w.shape[0], row_bases[t], out_offs[t], max(s1_offs[t], 0),
                          max(s2_offs[t], 0)] for t, w in enumerate(weights)], dtype=torch.int64)
    steps = torch.tensor(step_sizes, dtype=torch.float32)
    if device.type != "cpu":
        meta, steps = (x.pin_memory().to(device, non_blocking=True) for x in (meta, steps))
    block_d = triton.next_power_of_2(max(w.shape[1] for w in weights))
    block_r = max(1, TILE_ELEMENTS // block_d)
    grid = (min(num_programs(device), triton.cdiv(n, block_r)),)
    _step_kernel[grid](
        meta, steps, keys, order, run_end, tables, bags, factors, grad.contiguous(), w_base, s1_base, s2_base, n,
        grad_stride, params["lr"], params["eps"], params["beta1"], params["beta2"],
        OPT=OPTIMIZERS.index(kind), BLOCK_R=block_r, BLOCK_D=block_d,
    )
