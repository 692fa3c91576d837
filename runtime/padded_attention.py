"""Softmax attention over padded histories with an additive mask: ``torch.ops.recompile.padded_softmax_attention``.

``q [B, H, Nq, D]``, ``k [B, H, N, D]``, ``v [B, H, N, Dv]``, ``mask`` additive, broadcastable to
``[B, H, Nq, N]`` (RecBole's ``where(item_seq != 0 [& causal], 0, -10000)``, a ``-inf`` key padding mask);
out ``[B, H, Nq, Dv]`` = ``softmax(q k^T * scale + mask, -1) @ v``, every row, padded ones included, exactly
the padded formula (so a model that reads the padded rows, as BERT4Rec's output does, sees the same numbers).

Kernels: ``reference`` is that formula. ``native`` (CPU; the lowering's first choice there:
``csrc/padded_attention.h``, registered below autograd in C++ so a compiled graph calls it without Python) fuses the
op per (sequence, head): the mask is read once for the keys each query row weighs (the same cut as below, per row)
and the read rows' query cuts, then the scores, the masked softmax and the product with v run on float buffers of
those keys only (two register-tiled GEMMs, the softmax in cache), over OpenMP threads; backward recomputes the
weights and forms dq, dk, dv the same way. With at most one AVX-512 vector (16) of query rows, keys and dims, as
RecBole's SASRec and BERT4Rec in the corpus, the query rows are the vector lanes instead (scores, softmax and
products without a reduction across lanes; docs/jagged.md). float32, float16 and bfloat16 storage, float arithmetic. ``cpu`` (ATen
ops; float64, or a build without the native library) first checks the mask at run time: the keys after the last
one any query attends to (mask above ``DROPPED``) are dropped for every query, so they add
``exp(-10000 + ...) = 0`` and are cut off (views, no copy): a batch whose longest history is shorter than the
padded length does the work of its longest history. A mask with a query row that attends to no key at all
(an empty history: the padded formula then spreads that row over every key) keeps all N keys, which is the
padded path. Backward recomputes the scores on the same cut.

``rows [B]`` (optional, self-attention only): the query row each sequence is read at downstream (RecBole's
``gather_indexes(output, item_seq_len - 1)``), when the jagged pass has proven that the output reaches the
graph's outputs only through row-wise ops, that gather, and the keys and values of attentions with the same mask
and rows. Then only the rows those read rows can depend on are computed, per sequence (jagged query rows): the
first ``Lq[b]`` rows of sequence b, ``Lq[b]`` the smallest length >= ``rows[b] + 1`` whose queries attend (through
the mask) to no key at or past it (a causal mask: ``rows[b] + 1``, the history read; bidirectional: the history).
Every row past ``Lq[b]`` is 0 in the output and gets no gradient, in every kernel. The check is of the mask itself,
at run time, so a mask with holes or an empty history widens ``Lq[b]`` (up to N: the padded path) and stays exact.
The CPU kernel runs the sequences in buckets of ``Lq`` rounded up to ``BUCKET``, each on its own width, where
that saves at least ``SPLIT_SAVING`` of the work; else all at once on the longest ``Lq`` (no gathers, no copies).

The CPU kernels' softmax over fewer than ``SHORT_ROWS`` keys is written out (``softmax_``: max, exp, sum, divide,
in place): ATen's CPU softmax vectorizes only rows of at least one AVX-512 vector and is 5x slower than those four
passes below it (480 vs 95 us for ``[128, 2, 12, 12]``, one thread; 35 us at 16 keys), which was most of a padded
attention's time at such lengths (RecBole's SASRec in the corpus: 12). Its exponent is clamped at ``EXP_FLOOR``
first: the vectorized exp leaves its fast path below -87.3 (8x slower on a masked row's -10000s); a key there
weighs ``exp(EXP_FLOOR)`` < 2e-38 of the row's largest instead of 0.
"""
from __future__ import annotations

from typing import Optional

import torch

from hkv.native import NativeLibrary
from .kernels import get_kernel, native_supports, register_kernel, require

OP = "padded_softmax_attention"
# A mask value at or below this drops its key: exp(DROPPED) is 0 in float32, float16 and bfloat16.
DROPPED = -1e4


def padded_softmax_attention_reference(q, k, v, mask, scale, rows=None):
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale + mask
    out = torch.matmul(torch.softmax(scores, dim=-1), v)
    return out if rows is None else _zero_rows_from(out, query_cuts(mask, rows, q.shape[2]))


register_kernel(OP, "reference")(padded_softmax_attention_reference)


def _kept_rows(cuts: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, n, 1]``: 1 at the rows of sequence b before ``cuts[b]``, 0 past them."""
    keep = torch.arange(n, device=cuts.device) < cuts.view(-1, 1)
    return keep.view(keep.shape[0], 1, n, 1).to(dtype)


def _zero_rows_from(x: torch.Tensor, cuts: torch.Tensor) -> torch.Tensor:
    """``x [B, H, N, D]`` with the rows of sequence b at or past ``cuts[b]`` set to 0."""
    return x * _kept_rows(cuts, x.shape[2], x.dtype)


def query_cuts(mask: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """``Lq`` per sequence (module docstring): the query rows sequence b's read row ``rows[b]`` depends on
    through attentions on ``mask``: the smallest length past it whose queries attend to no key at or past it."""
    kept = (mask > DROPPED).expand(rows.shape[0], -1, n, -1)
    keys = kept.shape[-1]
    position = torch.arange(1, keys + 1, device=mask.device)
    # one past the last key each query row attends to (over the heads); a row attending to none: every key
    reach = torch.where(kept.any(-1), (kept * position).amax(-1), keys).amax(1).cummax(1).values.clamp(max=n)
    cuts = (rows.long() + 1).clamp(0, n)
    while True:
        wider = torch.maximum(cuts, reach.gather(1, (cuts - 1).clamp(min=0).view(-1, 1)).view(-1)) * (cuts > 0)
        if torch.equal(wider, cuts):
            return cuts
        cuts = wider


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


# Rows of fewer keys than this get the written-out softmax (module docstring).
SHORT_ROWS = 16
EXP_FLOOR = -87.0  # exp of it is float32's smallest normal magnitude, about (module docstring)


def softmax_(scores: torch.Tensor) -> torch.Tensor:
    """``torch.softmax(scores, -1)``, in place in ``scores`` for rows shorter than ``SHORT_ROWS`` (module
    docstring: why not ATen's there)."""
    if scores.shape[-1] >= SHORT_ROWS:
        return torch.softmax(scores, -1)
    scores.sub_(scores.amax(-1, keepdim=True)).clamp_(min=EXP_FLOOR).exp_()
    return scores.div_(scores.sum(-1, keepdim=True))


def _weights(q, k, mask, scale):
    scores = torch.matmul(q, k.transpose(-2, -1))
    return softmax_(scores.mul_(scale).add_(mask))


def _attention(q, k, v, mask, scale):
    """``padded_softmax_attention_reference`` without rows, in the CPU kernels' passes."""
    return torch.matmul(_weights(q, k, mask, scale), v)


# Sequences whose query cuts round up to the same multiple of this run together ...
BUCKET = 8
# ... when the buckets do at most this share of the work of running every sequence on the longest cut.
SPLIT_SAVING = 0.7


def _buckets(mask: torch.Tensor, rows: torch.Tensor, n: int):
    """``(cuts, [(width, sequences, their mask [.., width, width]), ...])``: the sequences by their cut rounded
    up to ``BUCKET`` (``sequences`` a slice of all when one bucket on the longest cut does nearly as little work);
    within a bucket a sequence's rows before its cut attend only to keys before it."""
    cuts = query_cuts(mask, rows, n)
    widths = ((cuts + BUCKET - 1) // BUCKET * BUCKET).clamp(max=n)
    longest = int(cuts.max()) if cuts.numel() else 0
    if float(widths.float().square().sum()) >= SPLIT_SAVING * cuts.numel() * longest ** 2:
        groups = [(longest, slice(None), mask)] if longest else []
    else:
        groups = [(width, (widths == width).nonzero().view(-1)) for width in widths.unique().tolist() if width]
        groups = [(width, seqs, mask if mask.shape[0] == 1 else mask[seqs]) for width, seqs in groups]
    buckets = [(width, seqs, part[..., :width, :width] if part.shape[-2] != 1 else part[..., :width])
               for width, seqs, part in groups]
    return cuts, buckets


@register_kernel(OP, "cpu")
def padded_softmax_attention_cpu(q, k, v, mask, scale, rows=None):
    if rows is None:
        return _attention(q, *_cut(cut_length(mask, k.shape[2]), k, v, mask), scale)
    n = q.shape[2]
    cuts, buckets = _buckets(mask, rows, n)
    if len(buckets) == 1 and buckets[0][0] == n:  # every row of every sequence: no copies, rows past the cuts zeroed
        return _attention(q, k, v, mask, scale).mul_(_kept_rows(cuts, n, q.dtype))
    out = q.new_zeros(*q.shape[:3], v.shape[-1])
    for width, seqs, part in buckets:
        out[seqs, :, :width] = _attention(q[seqs, :, :width], k[seqs, :, :width], v[seqs, :, :width], part, scale)
    return out.mul_(_kept_rows(cuts, n, q.dtype))


def _attention_backward(grad, q, k, v, mask, scale):
    """dq, dk, dv of ``padded_softmax_attention_reference`` (the weights recomputed)."""
    weights = _weights(q, k, mask, scale)
    dscores = torch.matmul(grad, v.transpose(-2, -1)).mul_(weights)
    dscores.addcmul_(weights, dscores.sum(-1, keepdim=True), value=-1).mul_(scale)
    dq, dk = torch.matmul(dscores, k), torch.matmul(dscores.transpose(-2, -1), q)
    return dq, dk, torch.matmul(weights.transpose(-2, -1), grad)


@register_kernel(f"{OP}_backward", "reference")
def padded_softmax_attention_backward_reference(grad, q, k, v, mask, scale, rows=None):
    if rows is not None:  # the rows past a sequence's cut are 0 whatever q, k, v: no gradient
        grad = _zero_rows_from(grad, query_cuts(mask, rows, q.shape[2]))
    return _attention_backward(grad, q, k, v, mask, scale)


@register_kernel(f"{OP}_backward", "cpu")
def padded_softmax_attention_backward_cpu(grad, q, k, v, mask, scale, rows=None):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if rows is None:
        cut = cut_length(mask, k.shape[2])
        dq, dk[:, :, :cut], dv[:, :, :cut] = _attention_backward(grad, q, *_cut(cut, k, v, mask), scale)
        return dq, dk, dv
    cuts, buckets = _buckets(mask, rows, q.shape[2])
    grad = _zero_rows_from(grad, cuts)
    if len(buckets) == 1 and buckets[0][0] == q.shape[2]:
        return _attention_backward(grad, q, k, v, mask, scale)
    for width, seqs, part in buckets:
        dq[seqs, :, :width], dk[seqs, :, :width], dv[seqs, :, :width] = _attention_backward(
            grad[seqs, :, :width], q[seqs, :, :width], k[seqs, :, :width], v[seqs, :, :width], part, scale)
    return dq, dk, dv


NATIVE = NativeLibrary("recompile.runtime._C", frozenset((torch.float32, torch.float16, torch.bfloat16)))
native_available = NATIVE.available


def supports_native(q, k, v, mask, **_) -> bool | str:
    """The C++ kernel (``csrc/padded_attention.h``): CPU q, k, v of one float dtype with one B and H, a float mask."""
    if not q.dtype == k.dtype == v.dtype:
        return f"q, k, v of dtypes {q.dtype}, {k.dtype}, {v.dtype}: the kernel takes one dtype"
    if q.dim() == k.dim() == v.dim() == 4 and not q.shape[:2] == k.shape[:2] == v.shape[:2]:
        return f"q, k, v of batch and heads {q.shape[:2]}, {k.shape[:2]}, {v.shape[:2]}: the kernel broadcasts none"
    return native_supports(NATIVE, q, k, v, mask)


@register_kernel(OP, "native", supports=supports_native)
def padded_softmax_attention_native(q, k, v, mask, scale, rows=None):
    require(OP, "native", supports_native(q, k, v, mask))
    return torch.ops.recompile_native.padded_attention_fwd(q, k, v, mask, scale, rows)


@register_kernel(f"{OP}_backward", "native", supports=supports_native)
def padded_softmax_attention_backward_native(grad, q, k, v, mask, scale, rows=None):
    require(f"{OP}_backward", "native", supports_native(q, k, v, mask))
    return torch.ops.recompile_native.padded_attention_bwd(grad.to(q.dtype), q, k, v, mask, scale, rows)


def _check(q, k, v, mask, rows=None):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"recompile.{OP}: q, k and v must be [B, H, N, D]; got {list(q.shape)}, {list(k.shape)}, "
                         f"{list(v.shape)}")
    if mask.dim() != 4 or not mask.is_floating_point():
        raise ValueError(f"recompile.{OP}: the mask must be an additive float [B|1, H|1, Nq|1, N] tensor without "
                         f"gradient; got {mask.dtype} {list(mask.shape)}")
    if rows is not None and (rows.dim() != 1 or rows.is_floating_point() or q.shape[2] != k.shape[2]):
        raise ValueError(f"recompile.{OP}: rows must be integer [B] read rows of a self-attention (Nq = N); got "
                         f"{rows.dtype} {list(rows.shape)} with Nq = {q.shape[2]}, N = {k.shape[2]}")


@torch.library.custom_op(f"recompile::{OP}", mutates_args=())
def padded_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, impl: str = "reference",
    rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    _check(q, k, v, mask, rows)
    return get_kernel(OP, impl)(q, k, v, mask, scale, rows)


@padded_softmax_attention.register_fake
def _(q, k, v, mask, scale, impl="reference", rows=None):
    _check(q, k, v, mask, rows)
    return q.new_empty(*q.shape[:3], v.shape[-1])


@torch.library.custom_op(f"recompile::{OP}_backward", mutates_args=())
def padded_softmax_attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, impl: str,
    rows: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = get_kernel(f"{OP}_backward", impl)(grad.contiguous(), q, k, v, mask, scale, rows)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@padded_softmax_attention_backward.register_fake
def _(grad, q, k, v, mask, scale, impl, rows=None):
    # contiguous whatever the strides of q, k, v (k is often a permuted view)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, mask, scale, impl, rows = inputs
    ctx.save_for_backward(q, k, v, mask, rows)
    ctx.args = (scale, impl)


def _backward_formula(ctx, grad):
    q, k, v, mask, rows = ctx.saved_tensors
    dq, dk, dv = padded_softmax_attention_backward(grad, q, k, v, mask, *ctx.args, rows)
    return dq, dk, dv, None, None, None, None


padded_softmax_attention.register_autograd(_backward_formula, setup_context=_setup)
