"""Decode attention of a beam search over one shared context: ``torch.ops.recompile.beam_decode_attention``.

Each of ``W`` beams of batch row ``b`` decodes one token; its query attends to the row's context keys (one
copy, shared by the beams: ContextKV) and to the keys of the tokens the beam decoded itself (BeamKV):

- ``q [B, W, H, D]``: one query per beam;
- ``context_k [B, N, H, D]``, ``context_v [B, N, H, Dv]``, ``context_lengths [B]`` (int32/int64): the first
  ``context_lengths[b]`` context keys of row ``b`` are valid;
- ``beam_k [B, W, S, H, D]``, ``beam_v [B, W, S, H, Dv]``, ``beam_lengths [B]``: the first ``beam_lengths[b]``
  suffix keys of each beam are valid (``S`` is the buffer; a fixed ``S`` keeps the decode step's shapes fixed);
- out ``[B, W, H, Dv]``: ``softmax(scale * q [ctx_k; beam_k]^T) [ctx_v; beam_v]`` over the valid keys; a query
  with no valid key gets zeros.

Kernels: ``reference`` materialises every beam's own copy of the context (the oracle, fp32 math), ``cpu``
scores all of a row's beams against the one context copy in a batched matmul and joins the two key sets
through their log-sum-exps (no copy), ``triton`` runs one program per core over (row, head, beam tile) items
with an online softmax over context tiles, then the beams' own keys. Inference only (no autograd).
"""
from __future__ import annotations

import torch

from .kernels import get_kernel, register_kernel

OP = "beam_decode_attention"


def _valid(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n]``: key ``j`` of row ``b`` is valid (``j < lengths[b]``)."""
    return torch.arange(n, device=lengths.device).view(1, n) < lengths.view(-1, 1)


def _masked_softmax_rows(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim where ``valid``; rows with no valid entry are all zeros."""
    if scores.shape[-1] == 0:
        return scores
    scores = scores.masked_fill(~valid, float("-inf"))
    top = scores.amax(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)
    weights = (scores - top).exp()
    return weights / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).tiny)


@register_kernel(OP, "reference")
def beam_decode_attention_reference(q, context_k, context_v, context_lengths, beam_k, beam_v, beam_lengths, scale):
    """Each beam's full key set, the shared context copied per beam: ``[B, W, N + S, H, D]``."""
    batch, beams = q.shape[:2]
    n, s = context_k.shape[1], beam_k.shape[2]
    keys = torch.cat([context_k.unsqueeze(1).expand(batch, beams, *context_k.shape[1:]), beam_k], 2).float()
    values = torch.cat([context_v.unsqueeze(1).expand(batch, beams, *context_v.shape[1:]), beam_v], 2).float()
    valid = torch.cat([_valid(context_lengths, n), _valid(beam_lengths, s)], 1)  # [B, N + S]
    scores = torch.einsum("bwhd,bwkhd->bwhk", q.float(), keys) * scale
    weights = _masked_softmax_rows(scores, valid.view(batch, 1, 1, n + s))
    return torch.einsum("bwhk,bwkhd->bwhd", weights, values).to(q.dtype)


@register_kernel(OP, "cpu")
def _beam_decode_attention_cpu(q, context_k, context_v, context_lengths, beam_k, beam_v, beam_lengths, scale):
    """All beams of a row scored against the one context copy in a batched matmul (``[B, H, W, N]``), each beam
    against its own suffix keys (``[B, W, H, S]``); one softmax over both, each part's values weighted apart."""
    batch, n, s = q.shape[0], context_k.shape[1], beam_k.shape[2]
    qf = q.float() * scale
    ctx = torch.matmul(qf.transpose(1, 2), context_k.float().permute(0, 2, 3, 1)).transpose(1, 2)  # [B, W, H, N]
    own = torch.einsum("bwhd,bwshd->bwhs", qf, beam_k.float())
    valid = torch.cat([_valid(context_lengths, n), _valid(beam_lengths, s)], 1).view(batch, 1, 1, n + s)
    weights = _masked_softmax_rows(torch.cat([ctx, own], -1), valid)
    out = torch.matmul(weights[..., :n].transpose(1, 2), context_v.float().transpose(1, 2)).transpose(1, 2)
    return (out + torch.einsum("bwhs,bwshd->bwhd", weights[..., n:], beam_v.float())).to(q.dtype)


@register_kernel(OP, "triton")
def _beam_decode_attention_triton(q, context_k, context_v, context_lengths, beam_k, beam_v, beam_lengths, scale):
    from .triton_kernels.beam_decode_attention import beam_decode_attention_forward

    return beam_decode_attention_forward(q, context_k, context_v, context_lengths, beam_k, beam_v, beam_lengths,
                                         scale)


def _check(q, context_k, context_v, context_lengths, beam_k, beam_v, beam_lengths) -> None:
    def fail(message: str):
        raise ValueError(f"recompile.beam_decode_attention: {message}")

    if q.dim() != 4:
        fail(f"q must be [batch, beams, heads, dim], got shape {tuple(q.shape)}")
    batch, beams, heads, dim = q.shape
    if context_k.dim() != 4 or context_k.shape[0] != batch or context_k.shape[2:] != (heads, dim):
        fail(f"context_k must be [{batch}, context, {heads}, {dim}], got {tuple(context_k.shape)}")
    if context_v.dim() != 4 or context_v.shape[:3] != context_k.shape[:3]:
        fail(f"context_v must be [{batch}, {context_k.shape[1]}, {heads}, value dim], got {tuple(context_v.shape)}")
    if beam_k.dim() != 5 or beam_k.shape[:2] != (batch, beams) or beam_k.shape[3:] != (heads, dim):
        fail(f"beam_k must be [{batch}, {beams}, suffix, {heads}, {dim}], got {tuple(beam_k.shape)}")
    if beam_v.shape != beam_k.shape[:4] + (context_v.shape[3],):
        fail(f"beam_v must be {tuple(beam_k.shape[:4]) + (context_v.shape[3],)}, got {tuple(beam_v.shape)}")
    for name, lengths in (("context_lengths", context_lengths), ("beam_lengths", beam_lengths)):
        if lengths.shape != (batch,) or lengths.dtype not in (torch.int32, torch.int64):
            fail(f"{name} must be int32/int64 of shape ({batch},), got {lengths.dtype} {tuple(lengths.shape)}")
    for name, t in (("context_k", context_k), ("context_v", context_v), ("beam_k", beam_k), ("beam_v", beam_v)):
        if t.dtype != q.dtype:
            fail(f"{name} is {t.dtype}, q is {q.dtype}")


@torch.library.custom_op("recompile::beam_decode_attention", mutates_args=())
def beam_decode_attention(
    q: torch.Tensor, context_k: torch.Tensor, context_v: torch.Tensor, context_lengths: torch.Tensor,
    beam_k: torch.Tensor, beam_v: torch.Tensor, beam_lengths: torch.Tensor, scale: float, impl: str = "reference",
) -> torch.Tensor:
    _check(q, context_k, context_v, context_lengths, beam_k, beam_v, beam_lengths)
    out = get_kernel(OP, impl)(q, context_k, context_v, context_lengths, beam_k, beam_v, beam_lengths, scale)
    return out.contiguous()  # the fake's layout, whatever strides the kernel's result has (q's may differ)


@beam_decode_attention.register_fake
def _(q, context_k, context_v, context_lengths, beam_k, beam_v, beam_lengths, scale, impl="reference"):
    _check(q, context_k, context_v, context_lengths, beam_k, beam_v, beam_lengths)
    return q.new_empty(q.shape[:3] + (context_v.shape[3],))
