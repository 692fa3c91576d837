"""grouped_embedding_bag as persistent Triton kernels (the triton-ascend subset): one launch for every table.

The tables stay the user's separate tensors: a device table ``meta [T, META]`` (int64) holds, per table, where
its rows, ids, offsets, per-sample weights and output slice start, as element offsets from one base tensor of
each kind (the lowest address: offsets are >= 0), with its sizes, pooling and padding id. Work items are
(table, block of ``BLOCK_B`` bags); a 1-D grid of ``num_programs`` programs loops over them and finds an item's
table among the tables' first blocks.

- forward: a block gathers ``BLOCK_L`` ids' rows of each of its bags at once, tile by tile along D, scales each
  by its factor (per-sample weight, 0 for the padding id, 1/count for MEAN), sums in fp32 and writes the
  table's slice of the grouped output (a column block of ``[B, sum(D)]``, a slot of ``[B, T, D]``, or the rows
  of the sequence layout).
- backward: the same walk adds each id's factor times its bag's output gradient to the id's row of the table's
  dense gradient (fp32 atomics; the gradients are addressed like the tables).
- bounds: the kernels check each id against its table and each bag's offsets, read row 0 for a bad id (what
  ``bounds_check="warning"/"ignore"`` return) and clamp bad offsets, and mark the table in an error flag
  tensor. Nothing waits for the flags: they are read when the device has passed them (polled at each lookup,
  or by :func:`check_lookup_errors`), and then the op's Python checks run on the saved inputs and raise or warn
  naming the feature, as the other kernels do before their lookup.
In-table index arithmetic is int32 (a table must hold fewer than 2**31 elements).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl

from . import num_programs

MAX_BLOCK_D = 256
# ids of each bag gathered at once, and the elements of a block's [BLOCK_B, BLOCK_L, BLOCK_D] gather
BLOCK_L = 4
TILE_ELEMENTS = 4096
# meta's columns (one row per table); a bag's ids come from offsets (MODE 0, or 1 with the last offset
# included) or are LENGTH consecutive ids (MODE 2: 2-D ids, or NONE pooling with LENGTH 1)
(W_OFF, ROWS, DIM, W_STRIDE, IDS_OFF, N_IDS, OFFS_OFF, N_OFFS, BAGS, MODE, LENGTH, PSW_OFF, POOLING, PAD, OUT_OFF,
 FIRST_BLOCK, META) = (tl.constexpr(i) for i in range(17))  # constexpr: the kernels read them
OFFSETS, LAST_OFFSET, FIXED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
ERR_IDS, ERR_OFFSETS = tl.constexpr(1), tl.constexpr(2)
MEAN = tl.constexpr(1)  # runtime.embedding.MEAN


@triton.jit
def _table_of(meta_ptr, item, num_tables, BLOCK_T: tl.constexpr):
    """The table of work item ``item``: the last table whose first block is at or before it."""
    t = tl.arange(0, BLOCK_T)
    first = tl.load(meta_ptr + t * META + FIRST_BLOCK, mask=t < num_tables, other=2**62)
    return tl.sum((first <= item).to(tl.int32), 0) - 1


@triton.jit
def _bags(meta_ptr, offs_ptr, err_ptr, t, item, lanes, BLOCK_B: tl.constexpr):
    """The block's bags of table t: (bag, bag_ok, first id, id count), offsets checked (a bad one is clamped into
    the ids and marks the table)."""
    row = meta_ptr + t * META
    n_ids = tl.load(row + N_IDS).to(tl.int32)
    bags = tl.load(row + BAGS).to(tl.int32)
    mode = tl.load(row + MODE).to(tl.int32)
    bag = (item - tl.load(row + FIRST_BLOCK).to(tl.int32)) * BLOCK_B + lanes
    bag_ok = bag < bags
    length = tl.load(row + LENGTH).to(tl.int32)
    offs = offs_ptr + tl.load(row + OFFS_OFF)
    given = bag_ok & (mode != FIXED)
    start = tl.where(given, tl.load(offs + bag, mask=given, other=0).to(tl.int32), length * bag)
    end = tl.where(given, tl.load(offs + bag + 1, mask=given & (bag + 1 < tl.load(row + N_OFFS)), other=n_ids).to(tl.int32),
                   length * bag + length)
    bad = given & ((start < 0) | (end < start) | (end > n_ids) | ((bag == 0) & (start != 0))
                   | ((mode == LAST_OFFSET) & (bag == bags - 1) & (end != n_ids)))
    if tl.sum(bad.to(tl.int32), 0) > 0:
        tl.atomic_or(err_ptr + t, ERR_OFFSETS)
    start = tl.minimum(tl.maximum(start, 0), n_ids)
    end = tl.minimum(tl.maximum(end, start), n_ids)
    return bag, bag_ok, start, tl.where(bag_ok, end - start, 0)


@triton.jit
def _ids(meta_ptr, ids_ptr, psw_ptr, t, at, take, HAS_PSW: tl.constexpr):
    """The rows of ids ``at`` (row 0 for a bad id), their factors (0 for the padding id, times the per-sample
    weight) and which of them are out of range."""
    row = meta_ptr + t * META
    raw = tl.load(ids_ptr + tl.load(row + IDS_OFF) + at, mask=take, other=0)
    bad = take & ((raw < 0) | (raw >= tl.load(row + ROWS)))
    ids = tl.where(bad, 0, raw)
    factor = tl.where(take & (ids != tl.load(row + PAD)), 1.0, 0.0)
    if HAS_PSW:
        psw_off = tl.load(row + PSW_OFF)
        factor *= tl.load(psw_ptr + tl.maximum(psw_off, 0) + at, mask=take & (psw_off >= 0), other=1.0).to(tl.float32)
    return ids.to(tl.int32), factor, bad


@triton.jit
def _mean_scale(meta_ptr, ids_ptr, t, start, length, longest, BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr):
    """``[BLOCK_B]`` 1 / (each bag's ids other than the padding id) for MEAN pooling, else 1."""
    row = meta_ptr + t * META
    scale = tl.full([BLOCK_B], 1.0, dtype=tl.float32)
    if tl.load(row + POOLING) == MEAN:
        count = tl.zeros([BLOCK_B], dtype=tl.float32)
        rows_in_table = tl.load(row + ROWS)
        pad = tl.load(row + PAD)
        for i0 in range(0, longest, BLOCK_L):
            at = start[:, None] + i0 + tl.arange(0, BLOCK_L)[None, :]
            take = i0 + tl.arange(0, BLOCK_L)[None, :] < length[:, None]
            raw = tl.load(ids_ptr + tl.load(row + IDS_OFF) + at, mask=take, other=0)
            ids = tl.where((raw < 0) | (raw >= rows_in_table), 0, raw)
            count += tl.sum((take & (ids != pad)).to(tl.float32), 1)
        scale = 1.0 / tl.maximum(count, 1.0)
    return scale


@triton.jit
def _grouped_kernel(
    meta_ptr, w_ptr, ids_ptr, offs_ptr, psw_ptr, out_ptr, err_ptr, num_items, num_tables, out_stride,
    BACKWARD: tl.constexpr, HAS_PSW: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Forward: ``out[bag] = sum factor * w[id]``. BACKWARD: ``w_ptr`` is the flat fp32 table gradient and
    ``out_ptr`` the output gradient: ``dw[id] += factor * dout[bag]``."""
    lanes = tl.arange(0, BLOCK_B)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        t = _table_of(meta_ptr, item, num_tables, BLOCK_T)
        row = meta_ptr + t * META
        w_off = tl.load(row + W_OFF)
        dim = tl.load(row + DIM).to(tl.int32)
        w_stride = tl.load(row + W_STRIDE).to(tl.int32)
        out_off = tl.load(row + OUT_OFF)
        bag, bag_ok, start, length = _bags(meta_ptr, offs_ptr, err_ptr, t, item, lanes, BLOCK_B)
        longest = tl.max(length, 0)
        scale = _mean_scale(meta_ptr, ids_ptr, t, start, length, longest, BLOCK_B, BLOCK_L)
        any_bad = tl.sum(tl.zeros([BLOCK_B], dtype=tl.int32), 0)
        for d0 in range(0, dim, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            col_ok = cols < dim
            out_at = out_ptr + out_off + bag[:, None] * out_stride + cols[None, :]
            out_ok = bag_ok[:, None] & col_ok[None, :]
            if BACKWARD:
                dout = tl.load(out_at, mask=out_ok, other=0.0).to(tl.float32) * scale[:, None]
            else:
                acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
            for i0 in range(0, longest, BLOCK_L):
                at = start[:, None] + i0 + tl.arange(0, BLOCK_L)[None, :]
                take = i0 + tl.arange(0, BLOCK_L)[None, :] < length[:, None]
                rows, factor, bad = _ids(meta_ptr, ids_ptr, psw_ptr, t, at, take, HAS_PSW)
                any_bad += tl.sum(tl.sum(bad.to(tl.int32), 1), 0)
                w_at = w_ptr + w_off + rows[:, :, None] * w_stride + cols[None, None, :]
                w_ok = take[:, :, None] & col_ok[None, None, :]
                if BACKWARD:
                    tl.atomic_add(w_at, dout[:, None, :] * factor[:, :, None], mask=w_ok)
                else:
                    vals = tl.load(w_at, mask=w_ok, other=0.0).to(tl.float32)
                    acc += tl.sum(vals * factor[:, :, None], 1)
            if not BACKWARD:
                tl.store(out_at, (acc * scale[:, None]).to(out_ptr.dtype.element_ty), mask=out_ok)
        if any_bad > 0:
            tl.atomic_or(err_ptr + t, ERR_IDS)


def _based(tensors: Sequence[Optional[torch.Tensor]], dtype: torch.dtype, fallback: torch.Tensor, contiguous=True):
    """One base tensor and each tensor's element offset from it (-1 for None), each of ``dtype`` and contiguous
    (cast or copied where it is not; ``contiguous=False``: as given); the base is the lowest address, so offsets
    are >= 0. Returns (base, offsets, the tensors the offsets point into)."""
    ts = [None if t is None else t.to(dtype) for t in tensors]
    ts = [t.contiguous() if contiguous and t is not None else t for t in ts]
    live = [t for t in ts if t is not None and t.numel()]
    if not live:
        return fallback, [-1 if t is None else 0 for t in ts], ts
    base = min(live, key=torch.Tensor.data_ptr)
    size, at = base.element_size(), base.data_ptr()
    offs = [-1 if t is None else (t.data_ptr() - at) // size if t.numel() else 0 for t in ts]
    return base, offs, ts


def _common_dtype(tensors) -> torch.dtype:
    dtypes = {t.dtype for t in tensors if t is not None}
    return dtypes.pop() if len(dtypes) == 1 else torch.int64


class Launch(NamedTuple):
    """A grouped launch: its meta, base tensors (the rest are kept alive through ``alive``) and sizes."""
    meta: torch.Tensor
    ids: torch.Tensor
    offsets: torch.Tensor
    psw: torch.Tensor
    has_psw: bool
    num_items: int
    num_tables: int
    block_b: int
    block_d: int
    alive: tuple


def _blocks(max_dim: int) -> tuple[int, int]:
    block_d = min(triton.next_power_of_2(max(max_dim, 1)), MAX_BLOCK_D)
    return max(1, TILE_ELEMENTS // (BLOCK_L * block_d)), block_d


def plan(weights, features, per_sample_weights, pooling, padding_idx, layout, w_offsets, w_strides, out_offsets) -> Launch:
    """The launch of a grouped walk over ``features`` (runtime.embedding.Feature) of ``weights``, with each table's
    rows at ``w_offsets[t]`` (elements from their base) ``w_strides[t]`` apart and its output slice at
    ``out_offsets[t]``."""
    device = weights[0].device
    block_b, block_d = _blocks(max(w.shape[1] for w in weights))
    ids_base, ids_offs, ids = _based([f.ids for f in features], _common_dtype([f.ids for f in features]),
                                     torch.zeros(1, dtype=torch.int32, device=device))
    given = [f.offsets for f in features]
    offs_base, offs_offs, offs = _based(given, _common_dtype(given), ids_base)
    psw_base, psw_offs, psws = _based(per_sample_weights, torch.float32, weights[0])
    rows, first = [], 0
    for t, (w, f, mode, pad) in enumerate(zip(weights, features, pooling, padding_idx)):
        sequence = layout == "sequence"  # a bag per id
        bags = f.ids.numel() if sequence else f.batch
        kind = FIXED if sequence or f.offsets is None else LAST_OFFSET if f.include_last_offset else OFFSETS
        row = [0] * int(META)
        row[W_OFF], row[ROWS], row[DIM], row[W_STRIDE] = w_offsets[t], w.shape[0], w.shape[1], w_strides[t]
        row[IDS_OFF], row[N_IDS], row[OFFS_OFF] = ids_offs[t], f.ids.numel(), max(offs_offs[t], 0)
        row[N_OFFS], row[BAGS], row[MODE] = 0 if f.offsets is None else f.offsets.numel(), bags, kind
        row[LENGTH] = 1 if sequence else f.length or 0
        row[PSW_OFF], row[POOLING], row[PAD] = psw_offs[t], mode, pad if mode != 2 else -1
        row[OUT_OFF], row[FIRST_BLOCK] = out_offsets[t], first
        first += triton.cdiv(bags, block_b)
        rows.append(row)
    meta = torch.tensor(rows, dtype=torch.int64)
    meta = meta if device.type == "cpu" else meta.pin_memory().to(device, non_blocking=True)
    return Launch(meta, ids_base, offs_base, psw_base, any(p is not None for p in per_sample_weights), first,
                  len(weights), block_b, block_d, (ids, offs, psws))


def _launch(launch: Launch, w_base, out_base, out_stride, err, backward: bool) -> None:
    if launch.num_items == 0:
        return
    grid = (min(num_programs(w_base.device), launch.num_items),)
    _grouped_kernel[grid](
        launch.meta, w_base, launch.ids, launch.offsets, launch.psw, out_base, err, launch.num_items,
        launch.num_tables, out_stride, BACKWARD=backward, HAS_PSW=launch.has_psw,
        BLOCK_T=triton.next_power_of_2(launch.num_tables + 1), BLOCK_B=launch.block_b, BLOCK_L=BLOCK_L,
        BLOCK_D=launch.block_d,
    )


def _check_size(weights) -> None:
    for w in weights:
        if w.numel() >= 2**31:
            raise ValueError(f"recompile.grouped_embedding_bag (triton): a table of {tuple(w.shape)} exceeds int32 "
                             "indexing")


def output_offsets(weights, features, layout: str) -> tuple[tuple[int, ...], list[int], int]:
    """The grouped output's shape, each table's first element in it and its row stride."""
    dim, num = weights[0].shape[1], len(weights)
    if layout == "sequence":
        counts = [f.ids.numel() for f in features]
        starts = [sum(counts[:t]) * dim for t in range(num)]
        return (sum(counts), dim), starts, dim
    batch = features[0].batch
    if layout == "stack":
        return (batch, num, dim), [t * dim for t in range(num)], num * dim
    widths = [w.shape[1] for w in weights]
    return (batch, sum(widths)), [sum(widths[:t]) for t in range(num)], sum(widths)


class _Pending(NamedTuple):
    flags: torch.Tensor  # on the host once the event has passed
    event: Optional[torch.Event]
    lookup: tuple  # the op's arguments, for its checks


_PENDING: list[_Pending] = []


def _report(block: bool) -> None:
    """Read the error flags the device has written (all of them when ``block``); for a lookup that marked an
    error, run the op's checks on its inputs: they raise or warn naming the feature."""
    from ..embedding import checked_lookup

    while _PENDING:
        entry = _PENDING[0]
        if entry.event is not None and not block and not entry.event.query():
            return
        _PENDING.pop(0)
        if entry.event is not None:
            entry.event.synchronize()
        flags = entry.flags.tolist()
        if any(flags):
            checked_lookup(*entry.lookup)
            if any(f & int(ERR_OFFSETS) for f in flags):
                raise RuntimeError("recompile.grouped_embedding_bag: the triton kernel rejected the offsets of tables "
                                   f"{[t for t, f in enumerate(flags) if f & int(ERR_OFFSETS)]} that the checks accept")


def check_lookup_errors() -> None:
    """Wait for every Triton lookup so far and raise (or warn) for the first one that met a bad id or offsets."""
    _report(block=True)


def _host_flags(err: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Event]]:
    """The flags on the host, and the event after which they are there (None: they are already)."""
    if err.device.type == "cpu":
        return err, None
    host = torch.empty(err.shape, dtype=err.dtype, pin_memory=True)
    host.copy_(err, non_blocking=True)
    event = torch.Event(device=err.device)
    event.record()
    return host, event


def _defer(err: torch.Tensor, lookup: tuple) -> None:
    _PENDING.append(_Pending(*_host_flags(err), lookup))
    _report(block=False)


def grouped_embedding_bag_forward(weights, indices, offsets, per_sample_weights, pooling, padding_idx,
                                  include_last_offset, layout, names, bounds_check) -> torch.Tensor:
    """The op's forward from its own arguments (a RAW kernel): one launch; ids and offsets checked in it."""
    from ..embedding import _validate, check_batches, feature_names, present, raw_features

    lookup = (weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout, names,
              bounds_check)
    psws = present(per_sample_weights)
    _validate(weights, indices, offsets, psws, pooling, padding_idx, include_last_offset, layout,
              feature_names(names, len(weights)), bounds_check)
    features = raw_features(indices, offsets, include_last_offset)
    check_batches(features, layout)
    _check_size(weights)
    weights = [w if w.stride(1) == 1 else w.contiguous() for w in weights]
    w_base, w_offs, _ = _based(weights, weights[0].dtype, weights[0], contiguous=False)
    shape, out_offs, out_stride = output_offsets(weights, features, layout)
    out = weights[0].new_empty(shape)
    err = torch.zeros(len(weights), dtype=torch.int32, device=out.device)
    launch = plan(weights, features, psws, pooling, padding_idx, layout, w_offs, [w.stride(0) for w in weights],
                  out_offs)
    _launch(launch, w_base, out, out_stride, err, backward=False)
    _defer(err, lookup)
    return out


def grouped_embedding_bag_backward(grad, weights, features, per_sample_weights, pooling, padding_idx, layout):
    """Every table's dense gradient in one launch (fp32 atomics, cast to the tables' dtype)."""
    _check_size(weights)
    tables = [torch.zeros(w.shape, dtype=torch.float32, device=grad.device) for w in weights]
    base, starts, _ = _based(tables, torch.float32, tables[0])
    shape, out_offs, out_stride = output_offsets(weights, features, layout)
    launch = plan(weights, features, per_sample_weights, pooling, padding_idx, layout, starts,
                  [w.shape[1] for w in weights], out_offs)
    err = torch.zeros(len(weights), dtype=torch.int32, device=grad.device)  # the forward reported them
    _launch(launch, base, grad.contiguous(), out_stride, err, backward=True)
    return [g.to(w.dtype) for g, w in zip(tables, weights)]
