"""Sampled softmax loss over a positive and shared negatives: ``torch.ops.recompile.sampled_softmax_loss``.

``sampled_softmax_loss(pos, neg, neg_ids, target_ids, scale)`` with ``pos`` ``[N, 1]`` (each row's positive logit),
``neg`` ``[N, K]`` (its logits against K sampled items) and optionally the K items' ids and the N rows' target ids:
row n's loss is ``logsumexp(scale * [pos[n], neg[n, k] for k not a hit]) - scale * pos[n]``, a hit being a negative
whose id equals the row's target (an accidental hit, left out). It is
``F.cross_entropy(cat([pos, neg.masked_fill(hit, -inf)], 1) * scale, zeros, reduction="none")`` without the
``[N, K + 1]`` logits, the ``[N, K]`` mask or the slow int64 compare that builds it. Returns ``(loss, lse)``
(``lse`` [N], not differentiable, is what the backward reads).

Kernels: ``reference`` (torch, the spelling above, any device and dtype) and ``native`` (``csrc/sampled_softmax.h``,
the C++ ops ``torch.ops.recompile_native.sampled_softmax_fwd/bwd``, float32 on CPU: hits found by binary search in
the sorted negative ids, each row's passes in cache; the lowering chooses it where ``native_reads`` holds); the
backward op ``sampled_softmax_loss_backward`` has one of each. On the CPU the autograd is C++ (``csrc/ops.cpp``'s
``SampledSoftmax``, the AutogradCPU key) and the native kernels run below autograd in C++: a call runs no Python.
``register_autograd`` below is the same formula for the other devices.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from hkv.native import NativeLibrary
from .kernels import get_kernel, native_supports, register_kernel, require

OP = "sampled_softmax_loss"
NATIVE = NativeLibrary("recompile.runtime._C", frozenset({torch.float32}))  # the dtypes runtime/csrc/ops.cpp takes
available = NATIVE.available


if available():  # the C++ ops' fakes, so that torch.export and torch.compile can trace a direct call

    @torch.library.register_fake("recompile_native::sampled_softmax_fwd")
    def _(pos, neg, sorted_ids, order, targets, scale):
        return neg.new_empty(neg.shape[0]), neg.new_empty(neg.shape[0])

    @torch.library.register_fake("recompile_native::sampled_softmax_bwd")
    def _(grad, pos, neg, sorted_ids, order, targets, lse, scale):
        return pos.new_empty(pos.shape), neg.new_empty(neg.shape)


def native_reads(pos, neg, **_) -> bool | str:
    return native_supports(NATIVE, pos, neg)


def _logits(pos, neg, neg_ids, target_ids, scale):
    if neg_ids is not None:
        neg = neg.masked_fill(neg_ids.unsqueeze(0) == target_ids.unsqueeze(1), float("-inf"))
    return torch.cat([pos, neg], 1) * scale


def _reference(pos, neg, neg_ids, target_ids, scale):
    logits = _logits(pos, neg, neg_ids, target_ids, scale)
    lse = torch.logsumexp(logits, 1)
    return lse - logits[:, 0], lse


def _reference_backward(grad, pos, neg, neg_ids, target_ids, lse, scale):
    probs = torch.exp(_logits(pos, neg, neg_ids, target_ids, scale) - lse.unsqueeze(1)) * (grad * scale).unsqueeze(1)
    return probs[:, :1] - (grad * scale).unsqueeze(1), probs[:, 1:].contiguous()  # the strides the fake promises


register_kernel(OP, "reference")(_reference)
register_kernel(OP + "_backward", "reference")(_reference_backward)


def _problem(pos, neg, neg_ids, target_ids):
    """The kernels' arguments: pos and neg contiguous, and the negative ids sorted (with their order) and the
    targets as int64 (None without ids)."""
    if neg_ids is None:
        return pos.contiguous(), neg.contiguous(), None, None, None
    sorted_ids, order = torch.sort(neg_ids.to(torch.int64))
    return pos.contiguous(), neg.contiguous(), sorted_ids, order, target_ids.to(torch.int64).contiguous()


@register_kernel(OP, "native", supports=native_reads)
def _native(pos, neg, neg_ids, target_ids, scale):
    require(OP, "native", native_reads(pos, neg))
    return torch.ops.recompile_native.sampled_softmax_fwd(*_problem(pos, neg, neg_ids, target_ids), scale)


@register_kernel(OP + "_backward", "native", supports=native_reads)
def _native_backward(grad, pos, neg, neg_ids, target_ids, lse, scale):
    require(OP + "_backward", "native", native_supports(NATIVE, grad, pos, neg, lse))
    pos, neg, sorted_ids, order, targets = _problem(pos, neg, neg_ids, target_ids)
    return torch.ops.recompile_native.sampled_softmax_bwd(grad, pos, neg, sorted_ids, order, targets, lse, scale)


def _check(pos: Tensor, neg: Tensor, neg_ids: Optional[Tensor], target_ids: Optional[Tensor]) -> None:
    n = neg.shape[0] if neg.dim() == 2 else -1
    ok = neg.dim() == 2 and tuple(pos.shape) == (n, 1) and pos.dtype == neg.dtype and neg.is_floating_point()
    if (neg_ids is None) != (target_ids is None):
        ok = False
    elif neg_ids is not None:
        ok = ok and tuple(neg_ids.shape) == (neg.shape[1],) and tuple(target_ids.shape) == (n,)
        ok = ok and not neg_ids.is_floating_point() and not target_ids.is_floating_point()
    if not ok:
        raise ValueError(
            "recompile.sampled_softmax_loss: expected pos [N, 1] and neg [N, K] of one floating dtype, and neg_ids [K] "
            f"with target_ids [N] (integer, both or neither); got pos {tuple(pos.shape)} {pos.dtype}, neg "
            f"{tuple(neg.shape)} {neg.dtype}, neg_ids {None if neg_ids is None else tuple(neg_ids.shape)}, "
            f"target_ids {None if target_ids is None else tuple(target_ids.shape)}")


@torch.library.custom_op("recompile::sampled_softmax_loss", mutates_args=())
def sampled_softmax_loss(pos: Tensor, neg: Tensor, neg_ids: Optional[Tensor], target_ids: Optional[Tensor],
                         scale: float, impl: str) -> tuple[Tensor, Tensor]:
    """(loss [N], lse [N]): each row's sampled softmax cross entropy with its positive first."""
    _check(pos, neg, neg_ids, target_ids)
    return get_kernel(OP, impl)(pos, neg, neg_ids, target_ids, scale)


@sampled_softmax_loss.register_fake
def _(pos, neg, neg_ids, target_ids, scale, impl):
    _check(pos, neg, neg_ids, target_ids)
    return neg.new_empty(neg.shape[0]), neg.new_empty(neg.shape[0])


@torch.library.custom_op("recompile::sampled_softmax_loss_backward", mutates_args=())
def sampled_softmax_loss_backward(grad: Tensor, pos: Tensor, neg: Tensor, neg_ids: Optional[Tensor],
                                  target_ids: Optional[Tensor], lse: Tensor, scale: float,
                                  impl: str) -> tuple[Tensor, Tensor]:
    """(grad_pos [N, 1], grad_neg [N, K])."""
    return get_kernel(OP + "_backward", impl)(grad, pos, neg, neg_ids, target_ids, lse, scale)


@sampled_softmax_loss_backward.register_fake
def _(grad, pos, neg, neg_ids, target_ids, lse, scale, impl):
    contiguous = torch.contiguous_format
    return torch.empty_like(pos, memory_format=contiguous), torch.empty_like(neg, memory_format=contiguous)


# The other devices' autograd (the CPU's is csrc/ops.cpp's SampledSoftmax, the same formula).
def _setup_context(ctx, inputs, output):
    pos, neg, neg_ids, target_ids, scale, impl = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(pos, neg, neg_ids, target_ids, output[1])
    ctx.scale, ctx.impl = scale, impl


def _backward(ctx, grad, _grad_lse):
    pos, neg, neg_ids, target_ids, lse = ctx.saved_tensors
    grad_pos, grad_neg = sampled_softmax_loss_backward(grad, pos, neg, neg_ids, target_ids, lse, ctx.scale, ctx.impl)
    return grad_pos, grad_neg, None, None, None, None


sampled_softmax_loss.register_autograd(_backward, setup_context=_setup_context)
