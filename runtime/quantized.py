"""Row-wise quantized embedding tables and the grouped lookup over them:
``torch.ops.recompile.grouped_embedding_bag_quantized``.

Tables are stored in FBGEMM's fused row-wise layouts, "int8" (``D + 8`` bytes a row) and "int4" (``D / 2 + 4``):
uint8 ``[rows, width]``, each row its codes then its scale and bias, a value ``code * scale + bias``; the format,
and its quantize / dequantize helpers re-exported here, live in hkv/rowwise.py (hkv tables store it too).

The lookup takes ``grouped_embedding_bag``'s arguments (runtime/embedding.py: SUM / MEAN pooling into the
``"concat"`` or ``"stack"`` layout, NONE pooling into ``"sequence"``, fp32 per-sample weights, padding, bounds
checks, malformed offsets rejected naming the feature) with packed tables and their ``qdtype``; it returns fp32,
summed in fp32. It is for inference: it has no autograd.
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch
from torch import Tensor

from .embedding import (
    LOOKUP_SCHEMA, NONE, RAW_KERNELS, _assemble, _check_empty_offsets, _id_scale, _lookup_fake, _scaled, _validate,
    checked_lookup, feature_names, present,
)
from . import embedding_native as native
from .kernels import get_kernel, native_supports, register_kernel, require
# The packed format is hkv's (hkv/rowwise.py): hkv tables store rows in it too, and hkv sits below the runtime.
from hkv import rowwise
from hkv.rowwise import LEVELS, QDTYPES, SCALE_BIAS, dequantize_rows, packed_width, scale_bias  # noqa: F401

OP = "grouped_embedding_bag_quantized"


def unpacked_dim(packed: Tensor, qdtype: str, name: str = "table") -> int:
    """The dequantized width of a packed table, checking it is one (raises naming ``name``)."""
    where = f"recompile.{OP}: {name!r}"
    if qdtype not in QDTYPES:
        raise ValueError(f"recompile.{OP}: qdtype {qdtype!r} is not one of {QDTYPES}")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"{where}: a quantized table is a 2-D uint8 tensor, got {tuple(packed.shape)} {packed.dtype}")
    codes = packed.shape[1] - 2 * SCALE_BIAS[qdtype].itemsize
    if codes <= 0:
        raise ValueError(f"{where}: {packed.shape[1]} bytes per row leave no codes for {qdtype}")
    return codes if qdtype == "int8" else 2 * codes


def quantize_rows(weight: Tensor, qdtype: str, where: str = "recompile.quantize") -> Tensor:
    """hkv.rowwise's ``quantize_rows`` (FBGEMM's bytes exactly) into storage on huge pages (``on_huge_pages``): the
    packed tables a lookup reads at random."""
    return on_huge_pages(rowwise.quantize_rows(weight, qdtype, where, out=row_storage))


HUGE_PAGE = 2 << 20


def row_storage(rows: int, width: int) -> Tensor:
    """An uninitialised uint8 [rows, width] for a packed table; one of at least a huge page starts on a 2 MiB
    boundary and its storage runs to the end of its last 2 MiB page (up to two huge pages longer than its bytes), so
    that ``on_huge_pages`` can put it all there."""
    nbytes = rows * width
    if nbytes < HUGE_PAGE:
        return torch.empty(rows, width, dtype=torch.uint8)
    buffer = torch.empty(-(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE
    return buffer[start:start + nbytes].view(rows, width)


def on_huge_pages(table: Tensor) -> Tensor:
    """``table`` with its whole 2 MiB pages moved onto transparent huge pages where the machine has them
    (``recompile_native.advise_huge_pages``): the lookup reads rows at random, and on 4 KiB pages nearly every row
    costs a TLB miss (int8 at batch 2048, 26 tables of 100k rows, one id per bag: 1.6-1.7x faster, under load)."""
    if table.nbytes >= HUGE_PAGE and native.available():
        torch.ops.recompile_native.advise_huge_pages(table)
    return table


def _standins(weights: Sequence[Tensor], qdtype: str, names: Sequence[str]) -> list[Tensor]:
    """fp32 tables of the dequantized shapes, holding no memory: what the float op's checks and fake read."""
    return [w.new_empty((), dtype=torch.float32).expand(w.shape[0], unpacked_dim(w, qdtype, name))
            for w, name in zip(weights, names)]


# ---------------------------------------------------------------------------------------------
# Kernels: (weights, qdtype, features, per_sample_weights, pooling, padding_idx, layout) -> fp32 output, or, in
# RAW_KERNELS (as runtime/embedding.py), the op's own arguments.


def _pool_reference(packed: Tensor, qdtype: str, f, psw, pooling: int, padding_idx: int) -> Tensor:
    rows = dequantize_rows(packed.index_select(0, f.ids), qdtype)  # each id's row, dequantized
    if pooling == NONE:
        return rows
    weighted = _scaled(rows, _id_scale(f, psw, pooling, padding_idx))
    return weighted.new_zeros(f.batch, rows.shape[1]).index_add_(0, f.bag_of_id(), weighted)


@register_kernel(OP, "reference")
def forward_reference(weights, qdtype, features, per_sample_weights, pooling, padding_idx, layout):
    """Dequantize the looked-up rows, then bag them in torch (the oracle for tests)."""
    outs = [_pool_reference(w, qdtype, *args) for w, args in zip(weights, zip(features, per_sample_weights, pooling,
                                                                               padding_idx))]
    return _assemble(outs, layout)


def checked_quantized_lookup(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset,
                             qdtype, layout, names, bounds_check):
    """The op's arguments checked as grouped_embedding_bag checks them (raising or warning naming the feature):
    its features and per-sample weights."""
    split = feature_names(names, len(weights))
    for name, psw in zip(split, per_sample_weights):
        if psw.numel() and psw.dtype != torch.float32:
            raise ValueError(f"recompile.{OP}: feature {name!r}: per_sample_weights must be float32, got {psw.dtype}")
    return checked_lookup(_standins(weights, qdtype, split), indices, offsets, per_sample_weights, pooling, padding_idx,
                          include_last_offset, layout, names, bounds_check)


def grouped_embedding_bag_quantized_reference(weights, indices, offsets, per_sample_weights, pooling, padding_idx,
                                              include_last_offset, qdtype, layout, names, bounds_check="fatal"):
    """The whole op in plain torch."""
    features, psws = checked_quantized_lookup(weights, indices, offsets, per_sample_weights, pooling, padding_idx,
                                              include_last_offset, qdtype, layout, names, bounds_check)
    return forward_reference(weights, qdtype, features, psws, pooling, padding_idx, layout)


# ---------------------------------------------------------------------------------------------
# The native kernel (csrc/quantized.h): embedding_native's plan over packed tables.


QDTYPE_CODES = {"int8": 3, "int4": 4}  # FLAGS >> DTYPE_SHIFT in csrc/quantized.h
_PLANS = threading.local()


def _plan(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, qdtype, layout,
          names, bounds_check):
    """The group's plan (cached by the tables' addresses and shapes and the static arguments; the arguments are
    validated when it is made), None where the kernel does not read the group (the "sequence" layout, tables not
    packed contiguous rows on the CPU)."""
    key = (qdtype, layout, tuple(pooling), tuple(padding_idx), tuple(include_last_offset),
           tuple(map(Tensor.data_ptr, weights)), tuple(w.shape for w in weights), tuple(map(Tensor.stride, weights)))
    plans = _PLANS.__dict__.setdefault("plans", {})
    plan = plans.get(key, False)
    if plan is False:
        readable = layout != "sequence" and all(
            w.is_cpu and w.dtype == torch.uint8 and w.dim() == 2 and w.stride(1) == 1 for w in weights)
        if len(plans) >= native.MAX_PLANS:
            plans.clear()
        split = feature_names(names, len(weights))
        _validate(_standins(weights, qdtype, split), indices, offsets, present(per_sample_weights), pooling,
                  padding_idx, include_last_offset, layout, split, bounds_check)
        plan = plans[key] = _quantized_plan(weights, qdtype, pooling, padding_idx, include_last_offset, layout) \
            if readable else None
    return plan


def _quantized_plan(weights, qdtype, pooling, padding_idx, include_last_offset, layout):
    """embedding_native's plan of the fp32 tables the packed ones stand for (DIM, OUT_AT, fp32 output and sample
    weights), reading the packed rows: W_PTR and W_STRIDE (bytes) theirs, the packed format's code in FLAGS."""
    plan = native._Plan(_standins(weights, qdtype, [""] * len(weights)), pooling, padding_idx, include_last_offset,
                        layout)
    plan.type_flags = QDTYPE_CODES[qdtype] << native.DTYPE_SHIFT
    for t, w in enumerate(weights):
        plan.meta[t * native.META + native.W_PTR] = w.data_ptr()
        plan.meta[t * native.META + native.W_STRIDE] = w.stride(0)
    return plan


def native_reads(weights=(), layout="concat", **_) -> bool | str:
    """``supports`` of the native kernel: packed tables (uint8 rows, unit stride) on the CPU, pooled layouts, and
    the library built."""
    if layout == "sequence":
        return "the sequence layout: the quantized kernel pools"
    if not all(w.device.type == "cpu" and w.dtype == torch.uint8 and w.dim() == 2 and w.stride(1) == 1
               for w in weights):
        return "tables that are not packed uint8 rows of unit stride on the CPU"
    return native_supports(native.NATIVE)  # the library is built


@register_kernel(OP, "native", supports=native_reads)
def forward_native(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, qdtype,
                   layout, names, bounds_check):
    """Every table in one call; the Python checks run only when the kernel marked an error, or the ids and offsets
    are not what it reads as given (then the reference runs)."""
    lookup = (weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, qdtype, layout,
              names, bounds_check)
    plan = _plan(*lookup)  # validates the arguments, naming the table at fault
    if plan is None:
        require(OP, "native", native_reads(weights, layout))
    filled = plan.fill(indices, offsets, per_sample_weights) if plan is not None else None
    if filled is None:
        features, psws = checked_quantized_lookup(*lookup)
        return forward_reference(weights, qdtype, features, psws, pooling, padding_idx, layout)
    rows, looked_up = filled
    out = plan.output(rows)
    stream = out.nbytes > native.STREAM_BYTES
    native.ops.qeb_forward_pooled(plan.num, plan.meta_t, rows, out, plan.stride(), plan.err_t, stream,
                                  native._threads(looked_up))
    if any(plan.err):
        checked_quantized_lookup(*lookup)
        native._reject_offsets(plan.err, "the checks accept them")
    return out


RAW_KERNELS.add("native")  # (already there for grouped_embedding_bag: the set names kernels, not ops)


# ---------------------------------------------------------------------------------------------
# The op.


@torch.library.custom_op(
    f"recompile::{OP}", mutates_args=(),
    schema=f"({LOOKUP_SCHEMA}, str qdtype, str layout, str names, str bounds_check, str impl) -> Tensor",
)
def grouped_embedding_bag_quantized(weights, indices, offsets, per_sample_weights, pooling, padding_idx,
                                    include_last_offset, qdtype, layout, names, bounds_check, impl) -> Tensor:
    lookup = (weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset)
    if impl in RAW_KERNELS:
        for args in zip(feature_names(names, len(weights)), indices, offsets, include_last_offset):
            _check_empty_offsets(*args)
        return get_kernel(OP, impl)(*lookup, qdtype, layout, names, bounds_check)
    features, psws = checked_quantized_lookup(*lookup, qdtype, layout, names, bounds_check)
    return get_kernel(OP, impl)(weights, qdtype, features, psws, pooling, padding_idx, layout)


@grouped_embedding_bag_quantized.register_fake
def _(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, qdtype, layout, names,
      bounds_check, impl):
    standins = _standins(weights, qdtype, feature_names(names, len(weights)))
    return _lookup_fake(standins, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset,
                        layout, names, bounds_check)
