"""Attention over jagged sequences, with no work on padding: ``torch.ops.recompile.*``.

``q, k [total, H, D]``, ``v [total, H, Dv]``, ``offsets [B + 1]`` (int32 or int64); out ``[total, H, Dv]``.

- ``hstu_attention``: HSTU's pointwise attention (generative-recommenders ``pytorch_hstu_mha``):
  ``silu(alpha * q k^T + bias) / max_seq_len`` times HSTU's valid mask (causal including the
  diagonal; ``num_targets [B]`` last items that see the history and themselves only; a
  ``contextual_seq_len`` prefix that the first row attends to whole), then ``@ v``. The optional bias
  is relative-position ``rel_bias [2 * max_seq_len - 1]`` (``bias[i, j] = rel_bias[max_seq_len - 1 + j - i]``)
  plus relative-time ``time_bias [num_buckets + 1]`` at ``bucket(ts_i - ts_j)``, ``bucket(x) =
  clamp(int(log(float32(max(|x|, 1))) / 0.301), 0, num_buckets)`` (as generative-recommenders) over
  jagged ``timestamps [total]``.
- ``jagged_softmax_attention``: ``softmax(scale * q k^T)`` over the keys of the same sequence
  (causal optionally), ``@ v``: SASRec's attention with its key padding mask.

Kernels: ``reference`` pads every sequence to the longest (the padded formulation), ``cpu`` groups
sequences of similar length into buckets and runs each bucket as dense batched matmuls (work ~ the
jagged sizes; see ``recompile.runtime.jagged.length_buckets``), ``triton`` (HSTU with every feature, and softmax) runs one
program per core over (tile, head) work items of the sequences' own tiles. Backward recomputes the scores
bucket by bucket.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .jagged import BACKWARD_CHECK, BUCKET_RATIO, Bucket, check_offsets, checked_offsets, length_buckets
from .kernels import get_kernel, register_kernel, require

# HSTU's log bucketization of time differences.
TIME_BUCKET_BASE = 0.301


def hstu_valid_mask(lengths: torch.Tensor, n: int, causal: bool, num_targets: Optional[torch.Tensor],
                    contextual_seq_len: int) -> torch.Tensor:
    """HSTU's valid-attention mask ``[b, n, n]`` for sequences of ``lengths`` padded to ``n``."""
    ids = torch.arange(n, device=lengths.device).view(1, n)
    max_ids = lengths.view(-1, 1)
    if contextual_seq_len > 0:
        ids = (ids - contextual_seq_len + 1).clamp(min=0)
        max_ids = max_ids - contextual_seq_len + 1
    if num_targets is not None:
        max_ids = max_ids - num_targets.view(-1, 1)
        ids = torch.minimum(ids, max_ids)
    row, col = ids.unsqueeze(2), ids.unsqueeze(1)
    dist = row - col if causal else (row - col).abs()
    valid = torch.eye(n, dtype=torch.bool, device=lengths.device) | (dist > 0)
    if contextual_seq_len > 0:
        valid = valid | ((row == 0) & (col < max_ids.unsqueeze(2)))
    return valid


def relative_position_index(n: int, max_seq_len: int, device) -> torch.Tensor:
    """``[n, n]`` index into ``rel_bias``: ``max_seq_len - 1 + j - i``."""
    pos = torch.arange(n, device=device)
    return max_seq_len - 1 + pos.view(1, n) - pos.view(n, 1)


def relative_position_bias(rel_bias: torch.Tensor, n: int, max_seq_len: int) -> torch.Tensor:
    """``[n, n]`` ``rel_bias[max_seq_len - 1 + j - i]``: rows of sliding windows, no index tensor."""
    windows = rel_bias.unfold(0, n, 1)  # windows[s, j] = rel_bias[s + j]
    return windows[max_seq_len - n : max_seq_len].flip(0)


def time_bucket(gaps: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """HSTU's bucket of time gaps, as generative-recommenders writes it."""
    return (torch.log(gaps.abs().clamp(min=1).float()) / TIME_BUCKET_BASE).long().clamp(0, num_buckets)


@functools.cache
def time_bucket_edges(num_buckets: int, device: torch.device) -> torch.Tensor:
    """``edges[k]``: the smallest integer gap in bucket ``k + 1`` or above (a binary search of ``time_bucket``,
    which grows with the gap); the int64 maximum where no gap below 2**62 reaches it."""
    target = torch.arange(1, num_buckets + 1)
    lo, hi = torch.ones_like(target), torch.full_like(target, 2**62)
    while bool((lo < hi).any()):
        mid = (lo + hi) // 2
        up = time_bucket(mid, num_buckets) >= target
        hi, lo = torch.where(up, mid, hi), torch.where(up, lo, mid + 1)
    unreached = time_bucket(lo, num_buckets) < target
    return torch.where(unreached, torch.iinfo(torch.int64).max, lo).to(device)


def relative_time_index(timestamps: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``[b, n, n]`` index into ``time_bias`` from padded ``timestamps [b, n]``: ``time_bucket`` of the gaps,
    for integer timestamps by one search among the bucket edges instead of the log."""
    if timestamps.is_floating_point():
        return time_bucket(timestamps.unsqueeze(2) - timestamps.unsqueeze(1), num_buckets)
    ts = timestamps.long()
    gaps = (ts.unsqueeze(2) - ts.unsqueeze(1)).abs_()
    return torch.bucketize(gaps, time_bucket_edges(num_buckets, ts.device), right=True)


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)  # [b, n, H, D] <-> [b, H, n, D]


@dataclass(frozen=True)
class HSTUArgs:
    max_seq_len: int
    alpha: float
    causal: bool
    contextual_seq_len: int


@dataclass
class HSTUBucket:
    """One bucket of padded HSTU inputs: ``q, k [b, n, H, D]``, ``v [b, n, H, Dv]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor
    num_targets: Optional[torch.Tensor]
    timestamps: Optional[torch.Tensor]

    def scores(self, args: HSTUArgs, rel_bias, time_bias):
        """Pre-activation scores ``[b, H, n, n]`` and the time-bias index (None without time bias)."""
        n = self.q.shape[1]
        scores = torch.matmul(_heads_first(self.q), _heads_first(self.k).transpose(2, 3))
        if args.alpha != 1.0:
            scores.mul_(args.alpha)
        bias = time_index = None
        if rel_bias is not None:
            bias = relative_position_bias(rel_bias, n, args.max_seq_len)  # [n, n]
        if time_bias is not None:  # both biases summed first, then added over the heads once
            time_index = relative_time_index(self.timestamps, time_bias.numel() - 1)
            bias = time_bias[time_index] if bias is None else time_bias[time_index].add_(bias)  # [b, n, n]
        if bias is not None:
            scores += bias.to(scores.dtype).unsqueeze(-3)
        return scores, time_index

    def mask_(self, t: torch.Tensor, args: HSTUArgs) -> torch.Tensor:
        """``t [b, H, n, n]`` times HSTU's valid mask and ``1 / max_seq_len``, in place. Padded keys need no
        mask when nothing else limits attention: v is zero there."""
        if self.num_targets is not None or args.contextual_seq_len > 0:
            mask = hstu_valid_mask(self.lengths, t.shape[-1], args.causal, self.num_targets, args.contextual_seq_len)
            t.mul_(mask.unsqueeze(1))
        elif args.causal:
            t.tril_()
        return t.mul_(1.0 / args.max_seq_len)

    def forward(self, args: HSTUArgs, rel_bias, time_bias) -> torch.Tensor:
        scores, _ = self.scores(args, rel_bias, time_bias)
        weights = self.mask_(F.silu(scores, inplace=True), args)
        return _heads_first(torch.matmul(weights, _heads_first(self.v)))

    def backward(self, grad: torch.Tensor, args: HSTUArgs, rel_bias, time_bias):
        """``dq, dk, dv`` (padded) and the bias gradients of this bucket."""
        scores, time_index = self.scores(args, rel_bias, time_bias)
        sig = torch.sigmoid(scores)
        g, v = _heads_first(grad), _heads_first(self.v)
        dv = torch.matmul(self.mask_(scores * sig, args).transpose(2, 3), g)
        dscores = self.mask_(torch.matmul(g, v.transpose(2, 3)), args).mul_(sig * (1 + scores * (1 - sig)))
        dq = args.alpha * torch.matmul(dscores, _heads_first(self.k))
        dk = args.alpha * torch.matmul(dscores.transpose(2, 3), _heads_first(self.q))
        drel = dtime = None
        if rel_bias is not None:
            index = relative_position_index(scores.shape[-1], args.max_seq_len, scores.device)
            drel = torch.zeros_like(rel_bias).index_add_(0, index.flatten(), dscores.sum((0, 1)).flatten().to(rel_bias.dtype))
        if time_index is not None:
            dtime = torch.zeros_like(time_bias).index_add_(0, time_index.flatten(), dscores.sum(1).flatten().to(time_bias.dtype))
        return [_heads_first(t) for t in (dq, dk, dv)], [drel, dtime]


@dataclass
class SoftmaxBucket:
    """One bucket of padded softmax-attention inputs ``[b, n, H, D]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor

    def weights(self, scale: float, causal: bool) -> torch.Tensor:
        """Softmax weights ``[b, H, n, n]``. Causal: a valid row sees no padded key, so the mask is the
        ``[n, n]`` triangle; else the keys past each length are masked. Every row keeps a key (no NaN)."""
        n = self.q.shape[1]
        pos = torch.arange(n, device=self.q.device)
        if causal:
            drop = pos.view(n, 1) < pos.view(1, n)
        else:
            drop = (pos.view(1, n) >= self.lengths.view(-1, 1)).view(-1, 1, 1, n)
        scores = torch.matmul(_heads_first(self.q), _heads_first(self.k).transpose(2, 3)).mul_(scale)
        return torch.softmax(scores.masked_fill_(drop, float("-inf")), dim=-1)

    def forward(self, scale: float, causal: bool) -> torch.Tensor:
        return _heads_first(torch.matmul(self.weights(scale, causal), _heads_first(self.v)))

    def backward(self, grad: torch.Tensor, scale: float, causal: bool):
        p = self.weights(scale, causal)
        g = _heads_first(grad)
        dv = torch.matmul(p.transpose(2, 3), g)
        dp = torch.matmul(g, _heads_first(self.v).transpose(2, 3))
        dscores = scale * p * (dp - (dp * p).sum(-1, keepdim=True))
        dq = torch.matmul(dscores, _heads_first(self.k))
        dk = torch.matmul(dscores.transpose(2, 3), _heads_first(self.q))
        return [_heads_first(t) for t in (dq, dk, dv)]


# ---------------------------------------------------------------------------------------------
# Running attention bucket by bucket

# How each kernel forms buckets: the reference pads everything to the longest sequence.
BUCKET_RATIOS = {"reference": math.inf, "cpu": BUCKET_RATIO}


def _buckets(offsets: torch.Tensor, impl: str) -> list[Bucket]:
    return length_buckets(offsets, ratio=BUCKET_RATIOS[impl])


def _gather(bucket: Bucket, jagged: Sequence[Optional[torch.Tensor]], per_seq: Sequence[Optional[torch.Tensor]]):
    return ([None if t is None else bucket.gather(t) for t in jagged]
            + [None if t is None else t[bucket.seqs] for t in per_seq])


def _scatter_all(bucket: Bucket, outs: Sequence[torch.Tensor], padded: Sequence[torch.Tensor]) -> None:
    for out, part in zip(outs, padded):
        bucket.scatter(out, part)


# ---------------------------------------------------------------------------------------------
# hstu_attention


def _hstu_buckets(offsets, impl, q, k, v, num_targets, timestamps, grad=None):
    for bucket in _buckets(offsets, impl):
        qb, kb, vb, tb, gb, nt = _gather(bucket, [q, k, v, timestamps, grad], [num_targets])
        yield bucket, HSTUBucket(qb, kb, vb, bucket.lengths, nt, tb), gb


def _hstu_kernel(impl):
    def forward(q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual_seq_len, rel_bias,
                timestamps, time_bias):
        args = HSTUArgs(max_seq_len, alpha, causal, contextual_seq_len)
        out = v.new_zeros(v.shape)
        for bucket, padded, _ in _hstu_buckets(offsets, impl, q, k, v, num_targets, timestamps):
            bucket.scatter(out, padded.forward(args, rel_bias, time_bias))
        return out

    def backward(grad, q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual_seq_len, rel_bias,
                 timestamps, time_bias):
        args = HSTUArgs(max_seq_len, alpha, causal, contextual_seq_len)
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        bias_grads = [None if b is None else torch.zeros_like(b) for b in (rel_bias, time_bias)]
        for bucket, padded, g in _hstu_buckets(offsets, impl, q, k, v, num_targets, timestamps, grad):
            qkv_grads, part_bias_grads = padded.backward(g, args, rel_bias, time_bias)
            _scatter_all(bucket, grads, qkv_grads)
            for acc, part in zip(bias_grads, part_bias_grads):
                if acc is not None:
                    acc += part
        return grads, bias_grads

    return forward, backward


def _register_attention(op: str, bucketed, triton_kernels) -> None:
    """Kernels of ``op`` and ``<op>_backward``: ``bucketed(impl)``'s (forward, backward) for each of BUCKET_RATIOS,
    and ``triton``: the (forward, backward) ``triton_kernels()`` imports (Triton is imported at the first call)."""
    for impl in BUCKET_RATIOS:
        forward, backward = bucketed(impl)
        register_kernel(op, impl)(forward)
        register_kernel(f"{op}_backward", impl)(backward)
    register_kernel(op, "triton")(lambda *args: triton_kernels()[0](*args))
    register_kernel(f"{op}_backward", "triton")(lambda *args: triton_kernels()[1](*args))


def _hstu_triton():
    from .triton_kernels.jagged_attention import hstu_attention_backward, hstu_attention_forward

    def backward(*args):
        dq, dk, dv, drel, dtime = hstu_attention_backward(*args)
        return [dq, dk, dv], [drel, dtime]

    return hstu_attention_forward, backward


_register_attention("hstu_attention", _hstu_kernel, _hstu_triton)


def hstu_attention_reference(q, k, v, offsets, max_seq_len, alpha, causal=True, num_targets=None,
                             contextual_seq_len=0, rel_bias=None, timestamps=None, time_bias=None):
    return get_kernel("hstu_attention", "reference")(q, k, v, offsets, max_seq_len, alpha, causal, num_targets,
                                                     contextual_seq_len, rel_bias, timestamps, time_bias)


def _check_qkv(op: str, q, k, v, offsets, bounds_check: str) -> None:
    check_offsets(op, offsets, bounds_check)
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"recompile.{op}: q, k must be [total, heads, D] and v [total, heads, Dv] alike, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )


def _check_hstu(op, q, k, v, offsets, max_seq_len, rel_bias, timestamps, time_bias, bounds_check):
    _check_qkv(op, q, k, v, offsets, bounds_check)
    if (timestamps is None) != (time_bias is None):
        raise ValueError(f"recompile.{op}: timestamps and time_bias come together")
    if rel_bias is not None and rel_bias.numel() != 2 * max_seq_len - 1:
        raise ValueError(f"recompile.{op}: rel_bias must have 2 * max_seq_len - 1 = {2 * max_seq_len - 1} "
                         f"entries, got {rel_bias.numel()}")


def _checked_hstu(op, q, k, v, offsets, max_seq_len, rel_bias, timestamps, time_bias, bounds_check):
    """hstu_attention's arguments checked; its offsets by ``checked_offsets``, every sequence within max_seq_len."""
    _check_hstu(op, q, k, v, offsets, max_seq_len, rel_bias, timestamps, time_bias, bounds_check)
    return checked_offsets(op, offsets, q.shape[0], bounds_check, max_seq_len,
                           "a sequence has {longest} positions, longer than max_seq_len = {max_len}")


@torch.library.custom_op("recompile::hstu_attention", mutates_args=())
def hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, alpha: float,
    causal: bool = True, num_targets: Optional[torch.Tensor] = None, contextual_seq_len: int = 0,
    rel_bias: Optional[torch.Tensor] = None, timestamps: Optional[torch.Tensor] = None,
    time_bias: Optional[torch.Tensor] = None, impl: str = "reference", bounds_check: str = "fatal",
) -> torch.Tensor:
    offsets = _checked_hstu("hstu_attention", q, k, v, offsets, max_seq_len, rel_bias, timestamps, time_bias,
                            bounds_check)
    return get_kernel("hstu_attention", impl)(q, k, v, offsets, max_seq_len, alpha, causal, num_targets,
                                              contextual_seq_len, rel_bias, timestamps, time_bias)


@hstu_attention.register_fake
def _(q, k, v, offsets, max_seq_len, alpha, causal=True, num_targets=None, contextual_seq_len=0, rel_bias=None,
      timestamps=None, time_bias=None, impl="reference", bounds_check="fatal"):
    _check_hstu("hstu_attention", q, k, v, offsets, max_seq_len, rel_bias, timestamps, time_bias, bounds_check)
    return torch.empty_like(v)


@torch.library.custom_op("recompile::hstu_attention_backward", mutates_args=())
def hstu_attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_seq_len: int,
    alpha: float, causal: bool, num_targets: Optional[torch.Tensor], contextual_seq_len: int,
    rel_bias: Optional[torch.Tensor], timestamps: Optional[torch.Tensor], time_bias: Optional[torch.Tensor], impl: str,
    bounds_check: str = "fatal",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    offsets = _checked_hstu("hstu_attention_backward", q, k, v, offsets, max_seq_len, rel_bias, timestamps, time_bias,
                            bounds_check)
    (dq, dk, dv), (drel, dtime) = get_kernel("hstu_attention_backward", impl)(
        grad.contiguous(), q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual_seq_len, rel_bias,
        timestamps, time_bias)
    return dq, dk, dv, q.new_empty(0) if drel is None else drel, q.new_empty(0) if dtime is None else dtime


@hstu_attention_backward.register_fake
def _(grad, q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual_seq_len, rel_bias, timestamps,
      time_bias, impl, bounds_check="fatal"):
    _check_hstu("hstu_attention_backward", q, k, v, offsets, max_seq_len, rel_bias, timestamps, time_bias, bounds_check)

    def like(p):
        return q.new_empty(0) if p is None else torch.empty_like(p)

    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), like(rel_bias), like(time_bias)


def _hstu_setup(ctx, inputs, output):
    q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias, timestamps, time_bias, impl, _ = inputs
    ctx.save_for_backward(q, k, v, offsets, num_targets, rel_bias, timestamps, time_bias)
    ctx.args = (max_seq_len, alpha, causal, contextual, impl)


def _hstu_backward(ctx, grad):
    q, k, v, offsets, num_targets, rel_bias, timestamps, time_bias = ctx.saved_tensors
    max_seq_len, alpha, causal, contextual, impl = ctx.args
    dq, dk, dv, drel, dtime = hstu_attention_backward(grad, q, k, v, offsets, max_seq_len, alpha, causal,
                                                      num_targets, contextual, rel_bias, timestamps, time_bias, impl,
                                                      BACKWARD_CHECK)
    return (dq, dk, dv, None, None, None, None, None, None, None if rel_bias is None else drel, None,
            None if time_bias is None else dtime, None, None)


hstu_attention.register_autograd(_hstu_backward, setup_context=_hstu_setup)


# ---------------------------------------------------------------------------------------------
# jagged_softmax_attention


def _softmax_kernel(impl):
    def forward(q, k, v, offsets, scale, causal):
        out = v.new_zeros(v.shape)
        for bucket in _buckets(offsets, impl):
            bucket.scatter(out, SoftmaxBucket(*_gather(bucket, [q, k, v], []), bucket.lengths).forward(scale, causal))
        return out

    def backward(grad, q, k, v, offsets, scale, causal):
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for bucket in _buckets(offsets, impl):
            qb, kb, vb, gb = _gather(bucket, [q, k, v, grad], [])
            _scatter_all(bucket, grads, SoftmaxBucket(qb, kb, vb, bucket.lengths).backward(gb, scale, causal))
        return grads

    return forward, backward


def _softmax_triton():
    from .triton_kernels.softmax_attention import softmax_attention_backward, softmax_attention_forward

    return softmax_attention_forward, softmax_attention_backward


_register_attention("jagged_softmax_attention", _softmax_kernel, _softmax_triton)


def jagged_softmax_attention_reference(q, k, v, offsets, scale, causal=True):
    return get_kernel("jagged_softmax_attention", "reference")(q, k, v, offsets, scale, causal)


@torch.library.custom_op("recompile::jagged_softmax_attention", mutates_args=())
def jagged_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, scale: float, causal: bool = True,
    impl: str = "reference", bounds_check: str = "fatal",
) -> torch.Tensor:
    offsets = _checked_qkv("jagged_softmax_attention", q, k, v, offsets, bounds_check)
    return get_kernel("jagged_softmax_attention", impl)(q, k, v, offsets, scale, causal)


def _checked_qkv(op, q, k, v, offsets, bounds_check):
    _check_qkv(op, q, k, v, offsets, bounds_check)
    return checked_offsets(op, offsets, q.shape[0], bounds_check)


@jagged_softmax_attention.register_fake
def _(q, k, v, offsets, scale, causal=True, impl="reference", bounds_check="fatal"):
    _check_qkv("jagged_softmax_attention", q, k, v, offsets, bounds_check)
    return torch.empty_like(v)


@torch.library.custom_op("recompile::jagged_softmax_attention_backward", mutates_args=())
def jagged_softmax_attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, scale: float,
    causal: bool, impl: str, bounds_check: str = "fatal",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    offsets = _checked_qkv("jagged_softmax_attention_backward", q, k, v, offsets, bounds_check)
    dq, dk, dv = get_kernel("jagged_softmax_attention_backward", impl)(grad.contiguous(), q, k, v, offsets, scale,
                                                                       causal)
    return dq, dk, dv


@jagged_softmax_attention_backward.register_fake
def _(grad, q, k, v, offsets, scale, causal, impl, bounds_check="fatal"):
    _check_qkv("jagged_softmax_attention_backward", q, k, v, offsets, bounds_check)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _softmax_setup(ctx, inputs, output):
    q, k, v, offsets, scale, causal, impl, _ = inputs
    ctx.save_for_backward(q, k, v, offsets)
    ctx.args = (scale, causal, impl)


def _softmax_backward(ctx, grad):
    q, k, v, offsets = ctx.saved_tensors
    dq, dk, dv = jagged_softmax_attention_backward(grad, q, k, v, offsets, *ctx.args, BACKWARD_CHECK)
    return dq, dk, dv, None, None, None, None, None


jagged_softmax_attention.register_autograd(_softmax_backward, setup_context=_softmax_setup)
