"""The native CPU kernel of ``recompile.hstu_attention`` (``csrc/jagged_attention.c``), built on first use by
``hkv.native``: forward and backward over tiles of each sequence, no padding, scores never leave the cache.

One C call per direction for the whole batch, every head, with ``torch.get_num_threads()`` OpenMP threads.
q, k, v and the gradient are read in place (any row and head strides, as the views of a fused projection
have); f32, f16 and bf16 storage, float arithmetic. It runs integer timestamps (the time buckets by HSTU's
bucket bounds, exactly); float timestamps, other dtypes or devices, or a machine without a C compiler take
the ``cpu`` kernel.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F

from hkv.native import NativeLibrary, address, i64, ptr, unit_stride_rows
from runtime.jagged_attention import time_bucket_edges
from runtime.kernels import get_kernel, register_kernel

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "jagged_attention.c")
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
VECTOR = 16  # the kernel's vector width in floats: rel_bias and timestamps carry this much zero padding
ERRORS = {
    -1: (MemoryError, "out of memory for the per-thread tiles"),
    -2: (ValueError, "offsets must be non-decreasing within [0, total]"),
    -3: (ValueError, "a sequence is longer than max_seq_len, beyond the relative position bias"),
}


class Problem(ctypes.Structure):
    """``hstu_problem`` of csrc/jagged_attention.c, field for field."""

    _fields_ = [
        ("q", ptr), ("k", ptr), ("v", ptr), ("grad", ptr),
        ("q_stride", i64 * 2), ("k_stride", i64 * 2), ("v_stride", i64 * 2), ("grad_stride", i64 * 2),
        ("offsets", ptr), ("total", i64), ("batch", i64), ("heads", i64), ("dim", i64), ("dim_v", i64),
        ("max_seq_len", i64), ("alpha", ctypes.c_float), ("causal", ctypes.c_int32), ("contextual", i64),
        ("num_targets", ptr), ("rel_bias", ptr), ("timestamps", ptr), ("time_bias", ptr),
        ("bucket_bounds", ptr), ("num_buckets", i64), ("dtype", ctypes.c_int32), ("threads", ctypes.c_int32),
        ("out", ptr), ("dq", ptr), ("dk", ptr), ("dv", ptr), ("drel", ptr), ("dtime", ptr),
    ]


SIGNATURES = tuple((name, (ctypes.POINTER(Problem),), ctypes.c_int) for name in ("hstu_attention_fwd",
                                                                                    "hstu_attention_bwd"))


NATIVE = NativeLibrary(SOURCE, SIGNATURES)
library, available = NATIVE.library, NATIVE.available


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, timestamps: Optional[torch.Tensor]) -> bool:
    """CPU tensors of one dtype the kernel is built for, integer timestamps if any, and the library loads."""
    return (all(t.device.type == "cpu" and t.dtype == q.dtype for t in (q, k, v)) and q.dtype in DTYPES
            and (timestamps is None or not timestamps.is_floating_point()) and available())


@functools.cache
def bucket_bounds(num_buckets: int) -> torch.Tensor:
    """Where each time bucket starts, as float gaps (HSTU buckets the float of the gap, so a gap is in bucket k
    or above exactly when its float reaches the float of the first integer gap there), framed by -inf and inf."""
    edges = time_bucket_edges(num_buckets, torch.device("cpu"))
    bounds = torch.where(edges == torch.iinfo(torch.int64).max, math.inf, edges.float())
    return torch.cat([torch.tensor([-math.inf]), bounds, torch.tensor([math.inf])])


def _problem(q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias, timestamps,
             time_bias, keep: list) -> Problem:
    """The C problem; ``keep`` holds the converted tensors it points into for the duration of the call."""
    total, heads, dim = q.shape
    if timestamps is not None and timestamps.numel() != total:
        raise ValueError(f"recompile.hstu_attention: timestamps must have one entry per item ({total}), "
                         f"got {timestamps.numel()}")
    offsets = offsets.to(torch.int64).contiguous()
    num_targets = None if num_targets is None else num_targets.to(torch.int64).contiguous()
    rel = None if rel_bias is None else F.pad(rel_bias.detach().float().contiguous(), (0, VECTOR))
    ts = None if timestamps is None else F.pad(timestamps.to(torch.int64), (0, VECTOR))
    tb = None if time_bias is None else time_bias.detach().float().contiguous()
    bounds = None if time_bias is None else bucket_bounds(time_bias.numel() - 1)
    keep += [offsets, num_targets, rel, ts, tb, bounds]
    return Problem(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), grad=None,
        q_stride=(i64 * 2)(*q.stride()[:2]), k_stride=(i64 * 2)(*k.stride()[:2]),
        v_stride=(i64 * 2)(*v.stride()[:2]), grad_stride=(i64 * 2)(0, 0),
        offsets=offsets.data_ptr(), total=total, batch=offsets.numel() - 1, heads=heads, dim=dim,
        dim_v=v.shape[2], max_seq_len=max_seq_len, alpha=alpha, causal=int(causal), contextual=contextual,
        num_targets=address(num_targets), rel_bias=address(rel), timestamps=address(ts), time_bias=address(tb),
        bucket_bounds=address(bounds), num_buckets=0 if tb is None else tb.numel() - 1, dtype=DTYPES[q.dtype],
        threads=torch.get_num_threads(),
    )


def _call(name: str, problem: Problem) -> None:
    status = getattr(library(), name)(ctypes.byref(problem))
    if status:
        error, why = ERRORS[status]
        raise error(f"recompile.hstu_attention ({name}): {why}")


def hstu_attention(q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias, timestamps,
                   time_bias):
    q, k, v, keep = unit_stride_rows(q), unit_stride_rows(k), unit_stride_rows(v), []
    problem = _problem(q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias, timestamps,
                       time_bias, keep)
    out = torch.empty(v.shape, dtype=v.dtype)
    problem.out = out.data_ptr()
    _call("hstu_attention_fwd", problem)
    return out


def hstu_attention_backward(grad, q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias,
                            timestamps, time_bias):
    """``[dq, dk, dv], [drel, dtime]`` (None for an absent bias), as the other kernels return them."""
    q, k, v, grad = (unit_stride_rows(t) for t in (q, k, v, grad.to(v.dtype)))
    keep = []
    problem = _problem(q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias, timestamps,
                       time_bias, keep)
    grads = [torch.empty(t.shape, dtype=q.dtype) for t in (q, k, v)]
    bias_grads = [None if b is None else torch.zeros(b.shape, dtype=torch.float32) for b in (rel_bias, time_bias)]
    problem.grad, problem.grad_stride = grad.data_ptr(), (i64 * 2)(*grad.stride()[:2])
    problem.dq, problem.dk, problem.dv = (t.data_ptr() for t in grads)
    problem.drel, problem.dtime = (address(b) for b in bias_grads)
    _call("hstu_attention_bwd", problem)
    return grads, [None if g is None else g.to(b.dtype) for g, b in zip(bias_grads, (rel_bias, time_bias))]


@register_kernel("hstu_attention", "native")
def _hstu_attention_native(q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias,
                           timestamps, time_bias):
    kernel = hstu_attention if supports(q, k, v, timestamps) else get_kernel("hstu_attention", "cpu")
    return kernel(q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias, timestamps,
                  time_bias)


@register_kernel("hstu_attention_backward", "native")
def _hstu_attention_backward_native(grad, q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual,
                                    rel_bias, timestamps, time_bias):
    kernel = hstu_attention_backward if supports(q, k, v, timestamps) else get_kernel("hstu_attention_backward", "cpu")
    return kernel(grad, q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias, timestamps,
                  time_bias)
