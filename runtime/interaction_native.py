"""The native CPU kernels of the interaction ops (``csrc/interaction.c``), built on first use by ``hkv.native``.

Each function passes data pointers, sizes and ``torch.get_num_threads()`` to one C call per op (the whole
batch, every feature). ``available`` is False without a C compiler; the ops then keep their torch kernels.
"""
from __future__ import annotations

import functools
import os

import torch

from hkv.native import address, i32, i64, load, ptr, unit_stride_rows

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "interaction.c")
SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_ARGTYPES = {
    "dot_interaction_fwd": (ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i32),
    "dot_interaction_bwd": (ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, i32),
    "cross_epilogue_fwd": (ptr, ptr, ptr, ptr, ptr, i64, i64, i32),
    "cross_epilogue_bwd": (ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i32),
    "fm_second_order_fwd": (ptr, i64, i64, i64, i32, ptr, i32),
    "fm_second_order_bwd": (ptr, ptr, i64, i64, i64, i32, ptr, i32),
}
SIGNATURES = tuple((f"{name}_{s}", args) for name, args in _ARGTYPES.items() for s in SUFFIX.values())


def library():
    return load(SOURCE, SIGNATURES)


def available() -> bool:
    return library() is not None


def supports(*tensors: torch.Tensor | None) -> bool:
    """Every given tensor is a CPU tensor of a dtype the kernels are built for, and the library loads."""
    present = [t for t in tensors if t is not None]
    return all(t.device.type == "cpu" and t.dtype in SUFFIX for t in present) and available()


def _kernel(name: str, dtype: torch.dtype):
    if dtype not in SUFFIX:
        raise TypeError(f"recompile.{name.rsplit('_', 1)[0]}: the native kernel takes {sorted(map(str, SUFFIX))}, "
                        f"got {dtype}")
    return getattr(library(), f"{name}_{SUFFIX[dtype]}")


def feature_rows(items: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pointer of each feature's first row, row stride in elements) for items [B, D] or [B, n, D]."""
    pointers, strides = [], []
    for t in items:
        size = t.element_size()
        if t.dim() == 2:
            pointers.append(t.data_ptr())
            strides.append(t.stride(0))
        else:
            pointers.extend(t.data_ptr() + f * t.stride(1) * size for f in range(t.shape[1]))
            strides.extend([t.stride(0)] * t.shape[1])
    return torch.tensor(pointers, dtype=torch.int64), torch.tensor(strides, dtype=torch.int64)


@functools.lru_cache(maxsize=64)
def row_ranges(rows: torch.Tensor, cols: torch.Tensor, num_features: int) -> torch.Tensor:
    """[3, F] int32 (lo, hi, off): row r's pairs are the columns ``lo[r]:hi[r]``, written from ``off[r]`` on.
    The pairs must come row by row with consecutive columns, as in each of the four triangle orders."""
    rows, cols = rows.long(), cols.long()
    counts = torch.bincount(rows, minlength=num_features)
    off = torch.cumsum(counts, 0) - counts
    lo = torch.zeros_like(counts).scatter_reduce_(0, rows, cols, "amin", include_self=False)
    if not torch.equal(cols, lo[rows] + torch.arange(rows.numel()) - off[rows]):
        raise ValueError("recompile.dot_interaction: the native kernel takes pairs row by row with consecutive columns")
    return torch.stack([lo, lo + counts, off]).to(torch.int32)


def dot_interaction(items, prefix, rows, cols):
    items = [unit_stride_rows(t) for t in items]
    batch, dim = items[0].shape[0], items[0].shape[-1]
    pointers, strides = feature_rows(items)
    lo, hi, off = row_ranges(rows, cols, pointers.numel())
    k = 0 if prefix is None else prefix.shape[1]
    prefix = None if prefix is None else unit_stride_rows(prefix)
    out = items[0].new_empty(batch, k + rows.numel())
    _kernel("dot_interaction_fwd", out.dtype)(
        pointers.data_ptr(), strides.data_ptr(), pointers.numel(), batch, dim, address(prefix),
        0 if prefix is None else prefix.stride(0), k, lo.data_ptr(), hi.data_ptr(), off.data_ptr(), rows.numel(),
        out.data_ptr(), torch.get_num_threads())
    return out


def dot_interaction_backward(grad, items, k, rows, cols):
    """The gradients of the features, one contiguous tensor per item; ``grad`` is [B, k + P]."""
    items = [unit_stride_rows(t) for t in items]
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in items]
    pairs = unit_stride_rows(grad[:, k:])
    pointers, strides = feature_rows(items)
    out_pointers, out_strides = feature_rows(grads)
    lo, hi, off = row_ranges(rows, cols, pointers.numel())
    _kernel("dot_interaction_bwd", grad.dtype)(
        pairs.data_ptr(), pairs.stride(0), pointers.data_ptr(), strides.data_ptr(), out_pointers.data_ptr(),
        out_strides.data_ptr(), pointers.numel(), grad.shape[0], items[0].shape[-1], lo.data_ptr(), hi.data_ptr(),
        off.data_ptr(), torch.get_num_threads())
    return grads


def cross_epilogue(x0, x, h, bias):
    """``x0 * (h + bias) + x`` in one pass over [B, D]."""
    x0, x, h = x0.contiguous(), x.contiguous(), h.contiguous()
    out = torch.empty_like(x)
    _kernel("cross_epilogue_fwd", x.dtype)(
        x0.data_ptr(), x.data_ptr(), h.data_ptr(), address(None if bias is None else bias.contiguous()),
        out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return out


def cross_epilogue_backward(grad, x0, h, bias):
    """(grad_h, grad_x0, grad_bias) of ``x0 * (h + bias) + x`` in one pass."""
    grad, x0, h = grad.contiguous(), x0.contiguous(), h.contiguous()
    grad_h, grad_x0 = torch.empty_like(grad), torch.empty_like(grad)
    grad_bias = None if bias is None else torch.empty(grad.shape[1], dtype=torch.float32)
    _kernel("cross_epilogue_bwd", grad.dtype)(
        grad.data_ptr(), x0.data_ptr(), h.data_ptr(), address(None if bias is None else bias.contiguous()),
        grad_h.data_ptr(), grad_x0.data_ptr(), address(grad_bias), grad.shape[0], grad.shape[1],
        torch.get_num_threads())
    return grad_h, grad_x0, None if bias is None else grad_bias.to(bias.dtype)


def fm_second_order(v, reduce):
    v = v.contiguous()
    batch, num_fields, dim = v.shape
    out = v.new_empty(batch, 1 if reduce else dim)
    _kernel("fm_second_order_fwd", v.dtype)(v.data_ptr(), batch, num_fields, dim, int(reduce), out.data_ptr(),
                                            torch.get_num_threads())
    return out


def fm_second_order_backward(grad, v, reduce):
    v, grad = v.contiguous(), grad.contiguous()
    out = torch.empty_like(v)
    batch, num_fields, dim = v.shape
    _kernel("fm_second_order_bwd", v.dtype)(grad.data_ptr(), v.data_ptr(), batch, num_fields, dim, int(reduce),
                                            out.data_ptr(), torch.get_num_threads())
    return out
