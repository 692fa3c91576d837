"""The native CPU kernel of ``recompile.hstu_attention`` (``csrc/jagged_attention.h``, the C++ ops
``torch.ops.recompile_native.hstu_attention_fwd/bwd``): forward and backward over tiles of each sequence, no
padding, scores never leave the cache.

One call per direction for the whole batch, every head, with ``torch.get_num_threads()`` OpenMP threads.
q, k, v and the gradient are read in place (any row and head strides, as the views of a fused projection
have); f32, f16 and bf16 storage, float arithmetic. It runs integer timestamps (the time buckets by HSTU's
bucket bounds, exactly); ``supports`` says which inputs it takes (the lowering chooses the ``cpu`` kernel for float
timestamps, other dtypes or devices, or a package built without its native kernels).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from hkv.native import NativeLibrary, unit_stride_rows
from .jagged_attention import time_bucket_edges
from .kernels import native_supports, register_kernel, require

DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the dtypes runtime/csrc/ops.cpp hstu_attention takes
VECTOR = 16  # the kernel's vector width in floats: rel_bias and timestamps carry this much zero padding

NATIVE = NativeLibrary("recompile.runtime._C", frozenset(DTYPES))
available = NATIVE.available


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, timestamps: Optional[torch.Tensor] = None,
             **_) -> bool | str:
    """CPU tensors of one dtype the kernel is built for, integer timestamps if any, and the library loads."""
    if not q.dtype == k.dtype == v.dtype:
        return f"q, k, v of dtypes {q.dtype}, {k.dtype}, {v.dtype}: the kernel takes one dtype"
    if timestamps is not None and timestamps.is_floating_point():
        return f"{timestamps.dtype} timestamps: the kernel takes integer timestamps"
    return native_supports(NATIVE, q, k, v)


@functools.cache
def bucket_bounds(num_buckets: int) -> torch.Tensor:
    """Where each time bucket starts, as float gaps (HSTU buckets the float of the gap, so a gap is in bucket k
    or above exactly when its float reaches the float of the first integer gap there), framed by -inf and inf."""
    edges = time_bucket_edges(num_buckets, torch.device("cpu"))
    bounds = torch.where(edges == torch.iinfo(torch.int64).max, math.inf, edges.float())
    return torch.cat([torch.tensor([-math.inf]), bounds, torch.tensor([math.inf])])


def _arguments(q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias, timestamps,
               time_bias) -> tuple:
    """The ops' arguments after q, k, v: int64 offsets and targets, float biases, rel_bias and timestamps
    zero-padded by the vector width (the kernel reads whole vectors)."""
    total = q.shape[0]
    if timestamps is not None and timestamps.numel() != total:
        raise ValueError(f"recompile.hstu_attention: timestamps must have one entry per item ({total}), "
                         f"got {timestamps.numel()}")
    rel = None if rel_bias is None else F.pad(rel_bias.detach().float().contiguous(), (0, VECTOR))
    ts = None if timestamps is None else F.pad(timestamps.to(torch.int64), (0, VECTOR))
    tb = None if time_bias is None else time_bias.detach().float().contiguous()
    bounds = None if time_bias is None else bucket_bounds(time_bias.numel() - 1)
    return (offsets.to(torch.int64).contiguous(), max_seq_len, alpha, causal,
            None if num_targets is None else num_targets.to(torch.int64).contiguous(), contextual, rel, ts, tb, bounds)


def hstu_attention(q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias, timestamps,
                   time_bias):
    q, k, v = unit_stride_rows(q), unit_stride_rows(k), unit_stride_rows(v)
    return torch.ops.recompile_native.hstu_attention_fwd(q, k, v, *_arguments(
        q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias, timestamps, time_bias))


def hstu_attention_backward(grad, q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias,
                            timestamps, time_bias):
    """``[dq, dk, dv], [drel, dtime]`` (None for an absent bias), as the other kernels return them."""
    q, k, v, grad = (unit_stride_rows(t) for t in (q, k, v, grad.to(v.dtype)))
    dq, dk, dv, drel, dtime = torch.ops.recompile_native.hstu_attention_bwd(grad, q, k, v, *_arguments(
        q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias, timestamps, time_bias))
    return [dq, dk, dv], [None if b is None else g.to(b.dtype) for g, b in ((drel, rel_bias), (dtime, time_bias))]


@register_kernel("hstu_attention", "native", supports=supports)
def _hstu_attention_native(q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias,
                           timestamps, time_bias):
    require("hstu_attention", "native", supports(q, k, v, timestamps))
    return hstu_attention(q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias, timestamps,
                          time_bias)


@register_kernel("hstu_attention_backward", "native", supports=supports)
def _hstu_attention_backward_native(grad, q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual,
                                    rel_bias, timestamps, time_bias):
    require("hstu_attention_backward", "native", supports(q, k, v, timestamps))
    return hstu_attention_backward(grad, q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual,
                                   rel_bias, timestamps, time_bias)
