"""Softmax attention over padded histories with an additive mask: ``torch.ops.recompile.padded_softmax_attention``.

``q [B, H, Nq, D]``, ``k [B, H, N, D]``, ``v [B, H, N, Dv]``, ``mask`` additive, broadcastable to
``[B, H, Nq, N]`` (RecBole's ``where(item_seq != 0 [& causal], 0, -10000)``, a ``-inf`` key padding mask);
out ``[B, H, Nq, Dv]`` = ``softmax(q k^T * scale + mask, -1) @ v``, every row, padded ones included, exactly
the padded formula (so a model that reads the padded rows, as BERT4Rec's output does, sees the same numbers).

Kernels: ``reference`` is that formula. ``cpu`` first checks the mask at run time: the keys after the last
one any query attends to (mask above ``DROPPED``) are dropped for every query, so they add
``exp(-10000 + ...) = 0`` and are cut off (views, no copy): a batch whose longest history is shorter than the
padded length does the work of its longest history. A mask with a query row that attends to no key at all
(an empty history: the padded formula then spreads that row over every key) keeps all N keys, which is the
padded path. Backward recomputes the scores on the same cut.
"""
from __future__ import annotations

import torch

from runtime.kernels import get_kernel, register_kernel

OP = "padded_softmax_attention"
# A mask value at or below this drops its key: exp(DROPPED) is 0 in float32, float16 and bfloat16.
DROPPED = -1e4


def padded_softmax_attention_reference(q, k, v, mask, scale):
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale + mask
    return torch.matmul(torch.softmax(scores, dim=-1), v)


register_kernel(OP, "reference")(padded_softmax_attention_reference)


def cut_length(mask: torch.Tensor, n: int) -> int:
    """How many leading keys can matter: one past the last key some query attends to (mask above ``DROPPED``),
    or all ``n`` where a query attends to none (the padded formula spreads that row over every key)."""
    kept = mask > DROPPED
    if not bool(kept.any(-1).all()):
        return n
    attended = kept.reshape(-1, kept.shape[-1]).any(0)
    return int(torch.nonzero(attended)[-1]) + 1 if attended.shape[0] == n else n


def _cut(cut, k, v, mask):
    return k[:, :, :cut], v[:, :, :cut], mask[..., :cut]


@register_kernel(OP, "cpu")
def padded_softmax_attention_cpu(q, k, v, mask, scale):
    return padded_softmax_attention_reference(q, *_cut(cut_length(mask, k.shape[2]), k, v, mask), scale)


def _attention_backward(grad, q, k, v, mask, scale):
    """dq, dk, dv of ``padded_softmax_attention_reference`` (the weights recomputed)."""
    weights = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * scale + mask, dim=-1)
    dweights = torch.matmul(grad, v.transpose(-2, -1))
    dscores = weights * (dweights - (dweights * weights).sum(-1, keepdim=True)) * scale
    dq, dk = torch.matmul(dscores, k), torch.matmul(dscores.transpose(-2, -1), q)
    return dq, dk, torch.matmul(weights.transpose(-2, -1), grad)


@register_kernel(f"{OP}_backward", "cpu")
def padded_softmax_attention_backward_cpu(grad, q, k, v, mask, scale):
    cut = cut_length(mask, k.shape[2])
    dq, dk_cut, dv_cut = _attention_backward(grad, q, *_cut(cut, k, v, mask), scale)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dk[:, :, :cut], dv[:, :, :cut] = dk_cut, dv_cut
    return dq, dk, dv


register_kernel(f"{OP}_backward", "reference")(_attention_backward)


def _check(q, k, v, mask):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"recompile.{OP}: q, k and v must be [B, H, N, D]; got {list(q.shape)}, {list(k.shape)}, "
                         f"{list(v.shape)}")
    if mask.dim() != 4 or not mask.is_floating_point():
        raise ValueError(f"recompile.{OP}: the mask must be an additive float [B|1, H|1, Nq|1, N] tensor without "
                         f"gradient; got {mask.dtype} {list(mask.shape)}")


@torch.library.custom_op(f"recompile::{OP}", mutates_args=())
def padded_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, impl: str = "reference",
) -> torch.Tensor:
    _check(q, k, v, mask)
    return get_kernel(OP, impl)(q, k, v, mask, scale)


@padded_softmax_attention.register_fake
def _(q, k, v, mask, scale, impl="reference"):
    return q.new_empty(*q.shape[:3], v.shape[-1])


@torch.library.custom_op(f"recompile::{OP}_backward", mutates_args=())
def padded_softmax_attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = get_kernel(f"{OP}_backward", impl)(grad.contiguous(), q, k, v, mask, scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@padded_softmax_attention_backward.register_fake
def _(grad, q, k, v, mask, scale, impl):
    # contiguous whatever the strides of q, k, v (k is often a permuted view)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, mask, scale, impl = inputs
    ctx.save_for_backward(q, k, v, mask)
    ctx.args = (scale, impl)


def _backward_formula(ctx, grad):
    q, k, v, mask = ctx.saved_tensors
    dq, dk, dv = padded_softmax_attention_backward(grad, q, k, v, mask, *ctx.args)
    return dq, dk, dv, None, None, None


padded_softmax_attention.register_autograd(_backward_formula, setup_context=_setup)
