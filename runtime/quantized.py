"""Row-wise quantized embedding tables and the grouped lookup over them:
``torch.ops.recompile.grouped_embedding_bag_quantized``.

Tables are stored in FBGEMM's fused row-wise layouts (uint8 ``[rows, width]``, each row its codes then its scale and
bias; a value is ``code * scale + bias``):

- ``"int8"``: ``D`` codes, then fp32 scale and fp32 bias (``width = D + 8``), byte for byte
  ``torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized``: scale = (max - min) / 255, bias = min,
  code = round((x - min) * 255 / (max - min + 1e-8));
- ``"int4"``: ``D / 2`` bytes of two codes each (low nibble first), then fp16 scale and fp16 bias
  (``width = D / 2 + 4``), byte for byte ``torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(x, 4)``:
  bias = fp16(min), scale = fp16((max - bias) / 15) (1 where that is 0), code = clamp(round((x - bias) / scale), 0, 15).

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

OP = "grouped_embedding_bag_quantized"
QDTYPES = ("int8", "int4")
SCALE_BIAS = {"int8": torch.float32, "int4": torch.float16}  # the dtype of each row's scale and bias
LEVELS = {"int8": 255, "int4": 15}


def packed_width(dim: int, qdtype: str) -> int:
    """Bytes per packed row of a table of width ``dim``."""
    codes = dim if qdtype == "int8" else (dim + 1) // 2
    return codes + 2 * SCALE_BIAS[qdtype].itemsize


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


def quantize_rows(weight: Tensor, qdtype: str) -> Tensor:
    """``weight`` [rows, D] (fp32 / fp16 / bf16) in the fused layout of ``qdtype`` (FBGEMM's bytes exactly)."""
    if qdtype not in QDTYPES:
        raise ValueError(f"recompile.quantize: dtype {qdtype!r} is not one of {QDTYPES}")
    x = weight.detach().float()
    if qdtype == "int4" and x.shape[1] % 2:
        raise ValueError(f"recompile.quantize: int4 packs two columns per byte; the table's dim {x.shape[1]} is odd")
    low, high = x.aminmax(dim=1, keepdim=True) if x.numel() else (x[:, :1], x[:, :1])
    if qdtype == "int8":
        scale, bias = (high - low) / 255.0, low
        inverse = torch.div(255.0, high - low + 1e-8)  # a true division (Tensor.__rtruediv__ multiplies by 1 / x)
    else:
        bias = low.half().float()
        scale = torch.where(high == bias, 1.0, (high - bias) / 15.0).half().float()
        scale = torch.where(scale == 0, 1.0, scale)
        inverse = torch.div(1.0, scale)
        scale, inverse = (torch.where(inverse.isinf(), 1.0, v) for v in (scale, inverse))
    codes = torch.round((x - bias) * inverse).clamp_(0, LEVELS[qdtype]).to(torch.uint8)
    if qdtype == "int4":
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale_bias = torch.cat([scale, bias], 1).to(SCALE_BIAS[qdtype]).view(torch.uint8)
    return torch.cat([codes, scale_bias], 1)


def scale_bias(packed: Tensor, qdtype: str) -> Tensor:
    """Each packed row's scale and bias, ``[rows, 2]`` in their stored dtype (fp32 for int8, fp16 for int4)."""
    tail = packed[:, packed.shape[1] - 2 * SCALE_BIAS[qdtype].itemsize:]
    return tail.clone(memory_format=torch.contiguous_format).view(SCALE_BIAS[qdtype])


def dequantize_rows(packed: Tensor, qdtype: str) -> Tensor:
    """The fp32 rows ``[rows, D]`` of packed rows (``code * scale + bias``)."""
    dim = unpacked_dim(packed, qdtype)
    codes = packed[:, :packed.shape[1] - 2 * SCALE_BIAS[qdtype].itemsize]
    if qdtype == "int4":
        codes = torch.stack([codes & 15, codes >> 4], 2).reshape(packed.shape[0], dim)
    scale, bias = scale_bias(packed, qdtype).float().unbind(1)
    return codes.float() * scale[:, None] + bias[:, None]


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
