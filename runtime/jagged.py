"""Jagged tensor ops with FBGEMM's names and semantics: ``torch.ops.recompile.*``.

A jagged tensor is ``values [total, *inner]`` with ``offsets [B + 1]`` (int32 or int64): sequence
``b`` is ``values[offsets[b]:offsets[b + 1]]``. One jagged dimension, as every model here uses.

- ``jagged_to_padded_dense(values, offsets, max_length, padding_value)`` -> ``[B, max_length, *inner]``;
  positions past ``max_length`` are dropped.
- ``dense_to_jagged(dense, offsets, total_L)`` -> ``[total, *inner]``; positions past the dense
  length are 0.
- ``jagged_dense_elementwise_add(x, offsets, y)`` / ``jagged_dense_elementwise_mul`` -> jagged
  ``x + y`` / ``x * y`` at the jagged positions of dense ``y [B, N, *inner]``, ``y`` read as 0 past N
  (FBGEMM's ``jagged_dense_elementwise_add_jagged_output`` and ``jagged_dense_elementwise_mul``).
- ``jagged_softmax(values [total, D], offsets, max_L)``: softmax over each sequence's first ``max_L``
  positions, per column; positions past ``max_L`` are 0 (FBGEMM leaves them unwritten).
- ``jagged_jagged_bmm(x [total, M], y [total, N], offsets, max_L)`` -> ``[B, M, N]``, ``x_b^T y_b``
  over the first ``max_L`` positions.
- ``jagged_dense_bmm(x [total, K], offsets, y [B, K, N], max_L)`` -> ``[total, N]``, ``x_b y_b``;
  rows past ``max_L`` are 0.

Kernels: ``reference`` (a loop over sequences, the oracle), ``cpu`` (index arithmetic and
length-bucketed batched matmuls: no work on padding), ``fbgemm`` (``torch.ops.fbgemm.*``).

Every op (here and in ``recompile.runtime.jagged_attention``) runs ``checked_offsets`` on its offsets before any
kernel sees them: they must start at 0, never decrease and end at the values' length, and where an op
needs it (``hstu_attention``'s ``max_seq_len``, ``jagged_within``'s padded length) every sequence must fit
its maximum length. ``bounds_check`` (the embedding ops' modes) says what malformed offsets do: ``"fatal"``
raises naming the op and the argument (on an accelerator: a device-side assert, no host sync),
``"warning"`` repairs them (clamped into [0, total], made non-decreasing, closed at total) and warns,
``"ignore"`` repairs them silently (no host sync). Every kernel therefore sees the same offsets.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .fbgemm import fbgemm_op
from .kernels import get_kernel, register_kernel

OFFSET_DTYPES = (torch.int32, torch.int64)


BOUNDS_CHECK = ("fatal", "warning", "ignore")
TOO_LONG = "a sequence has {longest} positions, longer than max_len = {max_len}"


def check_offsets(op: str, offsets: torch.Tensor, bounds_check: str = "fatal", arg: str = "offsets") -> None:
    """What can be checked without reading the offsets (fake implementations run this)."""
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"recompile.{op}: {arg} must be 1-D with B + 1 entries, got shape {tuple(offsets.shape)}")
    if offsets.dtype not in OFFSET_DTYPES:
        raise ValueError(f"recompile.{op}: {arg} must be int32 or int64, got {offsets.dtype}")
    if bounds_check not in BOUNDS_CHECK:
        raise ValueError(f"recompile.{op}: bounds_check {bounds_check!r} is not one of {BOUNDS_CHECK}")


def _malformed(offsets: torch.Tensor) -> str:
    """Where well-formed offsets first fail (read on the host: only to word an error)."""
    values = offsets.tolist()
    if values[0] != 0:
        return f"[0] = {values[0]}"
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            return f"[{i}] = {values[i]} < [{i - 1}] = {values[i - 1]}"
    return f"[-1] = {values[-1]}"


def checked_offsets(op: str, offsets: torch.Tensor, total: int | None, bounds_check: str = "fatal",
                    max_len: int | None = None, too_long: str = TOO_LONG, arg: str = "offsets") -> torch.Tensor:
    """The offsets every kernel of a jagged op gets: checked, or repaired, per ``bounds_check`` (module docstring).

    ``total``: the values' length the offsets must end at (None: whatever the last offset says). ``max_len``:
    the longest sequence the op can take (None: any); a longer one is always an error, worded by ``too_long``.
    Runs in the op's body (never in traced code). On the CPU a check costs one host sync; on accelerators
    "fatal" and "ignore" none.
    """
    check_offsets(op, offsets, bounds_check, arg)
    host = offsets.device.type == "cpu"
    first, last = offsets[0], offsets[-1]
    ok = (first == 0) & (offsets.diff() >= 0).all()
    if total is not None:
        ok = ok & (last == total)
    end_rule = "" if total is None else f" and end at {total} (the values' length)"
    rule = f"start at 0, be non-decreasing{end_rule}"
    if bounds_check == "fatal":
        if not host:
            torch._assert_async(ok, f"recompile.{op}: {arg} must {rule}")
        elif not bool(ok):
            raise ValueError(f"recompile.{op}: {arg} must {rule}; {arg}{_malformed(offsets)}")
    elif bounds_check == "ignore" or not bool(ok):
        if bounds_check == "warning":
            warnings.warn(f"recompile.{op}: {arg} must {rule}; {arg}{_malformed(offsets)}: they are clamped "
                          f"into [0, total], made non-decreasing and closed at total", stacklevel=3)
        end = int(last.clamp(min=0)) if total is None else total
        repaired = offsets.clamp(0, end)
        repaired[0] = 0
        offsets = repaired.cummax(0).values
        offsets[-1] = end
    if max_len is not None and offsets.numel() > 1:
        longest = offsets.diff().max()
        if not host:
            message = f"recompile.{op}: " + too_long.format(longest="more", max_len=max_len)
            torch._assert_async(longest <= max_len, message)
        elif int(longest) > max_len:
            raise ValueError(f"recompile.{op}: " + too_long.format(longest=int(longest), max_len=max_len))
    return offsets


def _sequences(offsets: torch.Tensor, limit: int | None = None):
    """(b, start, length) per sequence, the length cut at ``limit``."""
    bounds = offsets.tolist()
    for b in range(len(bounds) - 1):
        length = bounds[b + 1] - bounds[b]
        yield b, bounds[b], length if limit is None else min(length, limit)


# ---------------------------------------------------------------------------------------------
# Positions and length buckets (the CPU kernels' way of skipping padding)


def jagged_positions(offsets: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the ``total`` jagged values: its sequence and its position in it (int64)."""
    offsets = offsets.long()
    lengths = offsets[1:] - offsets[:-1]
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=total)
    return rows, torch.arange(total, device=offsets.device) - offsets[rows]


@dataclass
class Bucket:
    """Sequences padded together to length ``L``: ``n`` of them, ``flat`` values in ``slots`` of ``[n * L]``."""

    seqs: torch.Tensor  # [n] sequence ids
    lengths: torch.Tensor  # [n]
    width: int  # L
    flat: torch.Tensor  # value index of each valid position, in row-major order
    slots: torch.Tensor  # the valid positions' places in the flattened [n * L]

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """``[n, L, *inner]`` with zeros on padding."""
        out = values.new_zeros((self.seqs.numel() * self.width, *values.shape[1:]))
        out.index_copy_(0, self.slots, values.index_select(0, self.flat))
        return out.view(self.seqs.numel(), self.width, *values.shape[1:])

    def scatter(self, out: torch.Tensor, padded: torch.Tensor) -> None:
        """Write the valid rows of ``padded [n, L, *inner]`` to their places in ``out``."""
        out.index_copy_(0, self.flat, padded.flatten(0, 1).index_select(0, self.slots).to(out.dtype))


# Sequences whose padded lengths differ by at most this ratio share a bucket (max waste ~1/4).
BUCKET_RATIO = 1.25
# ... and so does a sequence whose padding to the bucket's length wastes at most this many score entries
# (top**2 - length**2): a bucket costs a dozen kernel launches, more than that much padding.
BUCKET_MIN_WASTE = 1024


def length_buckets(offsets: torch.Tensor, limit: int | None = None, ratio: float = BUCKET_RATIO) -> list[Bucket]:
    """Group non-empty sequences (lengths cut at ``limit``) so each group pads to little over its own lengths."""
    offsets = offsets.long()
    lengths = offsets[1:] - offsets[:-1]
    if limit is not None:
        lengths = lengths.clamp(max=limit)
    order = torch.argsort(lengths, descending=True, stable=True)
    sorted_lengths = lengths[order].tolist()
    buckets, start = [], 0
    while start < len(sorted_lengths) and sorted_lengths[start] > 0:
        top = sorted_lengths[start]
        end = start
        while end < len(sorted_lengths) and sorted_lengths[end] > 0 and (
            sorted_lengths[end] * ratio >= top or top**2 - sorted_lengths[end] ** 2 <= BUCKET_MIN_WASTE
        ):
            end += 1
        seqs = order[start:end]
        pos = torch.arange(top, device=offsets.device)
        valid = (pos[None, :] < lengths[seqs, None]).flatten()
        slots = valid.nonzero().squeeze(1)
        flat = (offsets[seqs, None] + pos[None, :]).flatten()[slots]
        buckets.append(Bucket(seqs, lengths[seqs], top, flat, slots))
        start = end
    return buckets


# ---------------------------------------------------------------------------------------------
# jagged_to_padded_dense / dense_to_jagged


def jagged_to_padded_dense_reference(values, offsets, max_length, padding_value=0.0):
    out = values.new_full((offsets.numel() - 1, max_length, *values.shape[1:]), padding_value)
    for b, start, length in _sequences(offsets, max_length):
        out[b, :length] = values[start : start + length]
    return out


def dense_to_jagged_reference(dense, offsets, total_L=None):
    total = int(offsets[-1]) if total_L is None else total_L
    out = dense.new_zeros((total, *dense.shape[2:]))
    for b, start, length in _sequences(offsets, dense.shape[1]):
        out[start : start + length] = dense[b, :length]
    return out


def _padded_index(offsets, total, max_length):
    rows, pos = jagged_positions(offsets, total)
    keep = pos < max_length
    return rows, pos, keep


@register_kernel("jagged_to_padded_dense", "cpu")
def _jagged_to_padded_dense_cpu(values, offsets, max_length, padding_value=0.0):
    rows, pos, keep = _padded_index(offsets, values.shape[0], max_length)
    out = values.new_full((offsets.numel() - 1, max_length, *values.shape[1:]), padding_value)
    out[rows[keep], pos[keep]] = values[keep]
    return out


@register_kernel("dense_to_jagged", "cpu")
def _dense_to_jagged_cpu(dense, offsets, total_L=None):
    total = int(offsets[-1]) if total_L is None else total_L
    rows, pos, keep = _padded_index(offsets, total, dense.shape[1])
    out = dense.new_zeros((total, *dense.shape[2:]))
    out[keep] = dense[rows[keep], pos[keep]]
    return out


@register_kernel("jagged_to_padded_dense", "fbgemm")
def _jagged_to_padded_dense_fbgemm(values, offsets, max_length, padding_value=0.0):
    flat = values.flatten(1) if values.dim() > 2 else values
    out = fbgemm_op("jagged_to_padded_dense")(flat, [offsets], [max_length], padding_value)
    return out.reshape(offsets.numel() - 1, max_length, *values.shape[1:])


@register_kernel("dense_to_jagged", "fbgemm")
def _dense_to_jagged_fbgemm(dense, offsets, total_L=None):
    flat = dense.flatten(2) if dense.dim() > 3 else dense
    out = fbgemm_op("dense_to_jagged")(flat, [offsets], total_L)[0]
    return out.reshape(out.shape[0], *dense.shape[2:])


register_kernel("jagged_to_padded_dense", "reference")(jagged_to_padded_dense_reference)
register_kernel("dense_to_jagged", "reference")(dense_to_jagged_reference)


@register_kernel("jagged_to_padded_dense", "triton")
def _jagged_to_padded_dense_triton(values, offsets, max_length, padding_value=0.0):
    from .triton_kernels import jagged_dense

    return jagged_dense.jagged_to_padded_dense(values, offsets, max_length, padding_value)


@register_kernel("dense_to_jagged", "triton")
def _dense_to_jagged_triton(dense, offsets, total_L=None):
    from .triton_kernels import jagged_dense

    return jagged_dense.dense_to_jagged(dense, offsets, total_L)


@torch.library.custom_op("recompile::jagged_to_padded_dense", mutates_args=())
def jagged_to_padded_dense(
    values: torch.Tensor, offsets: torch.Tensor, max_length: int, padding_value: float = 0.0, impl: str = "reference",
    bounds_check: str = "fatal",
) -> torch.Tensor:
    offsets = checked_offsets("jagged_to_padded_dense", offsets, values.shape[0], bounds_check)
    return get_kernel("jagged_to_padded_dense", impl)(values, offsets, max_length, padding_value)


@jagged_to_padded_dense.register_fake
def _(values, offsets, max_length, padding_value=0.0, impl="reference", bounds_check="fatal"):
    check_offsets("jagged_to_padded_dense", offsets, bounds_check)
    return values.new_empty((offsets.shape[0] - 1, max_length, *values.shape[1:]))


@torch.library.custom_op("recompile::dense_to_jagged", mutates_args=())
def dense_to_jagged(
    dense: torch.Tensor, offsets: torch.Tensor, total_L: int | None = None, impl: str = "reference",
    bounds_check: str = "fatal",
) -> torch.Tensor:
    check_offsets("dense_to_jagged", offsets, bounds_check)
    if dense.dim() < 2 or dense.shape[0] != offsets.numel() - 1:
        raise ValueError(
            f"recompile.dense_to_jagged: dense must be [B, N, ...] with B = len(offsets) - 1 = {offsets.numel() - 1}, "
            f"got shape {tuple(dense.shape)}"
        )
    offsets = checked_offsets("dense_to_jagged", offsets, total_L, bounds_check)
    return get_kernel("dense_to_jagged", impl)(dense, offsets, total_L)


@dense_to_jagged.register_fake
def _(dense, offsets, total_L=None, impl="reference", bounds_check="fatal"):
    check_offsets("dense_to_jagged", offsets, bounds_check)
    total = torch.library.get_ctx().new_dynamic_size() if total_L is None else total_L
    return dense.new_empty((total, *dense.shape[2:]))


# The backward of an op whose forward checked (or repaired) its offsets repairs the same offsets the same way,
# silently: "ignore" (a no-op on offsets the forward found well formed).
BACKWARD_CHECK = "ignore"


def _padded_setup(ctx, inputs, output):
    values, offsets, _, _, impl, _ = inputs
    ctx.save_for_backward(offsets)
    ctx.total, ctx.impl = values.shape[0], impl


def _padded_backward(ctx, grad):
    (offsets,) = ctx.saved_tensors
    return dense_to_jagged(grad.contiguous(), offsets, ctx.total, ctx.impl, BACKWARD_CHECK), None, None, None, None, None


def _jagged_setup(ctx, inputs, output):
    dense, offsets, _, impl, _ = inputs
    ctx.save_for_backward(offsets)
    ctx.max_length, ctx.impl = dense.shape[1], impl


def _jagged_backward(ctx, grad):
    (offsets,) = ctx.saved_tensors
    grad_dense = jagged_to_padded_dense(grad.contiguous(), offsets, ctx.max_length, 0.0, ctx.impl, BACKWARD_CHECK)
    return grad_dense, None, None, None, None


jagged_to_padded_dense.register_autograd(_padded_backward, setup_context=_padded_setup)
dense_to_jagged.register_autograd(_jagged_backward, setup_context=_jagged_setup)


# ---------------------------------------------------------------------------------------------
# jagged-dense elementwise add / mul (jagged output)


def jagged_dense_elementwise_add_reference(x_values, offsets, y):
    out = x_values.to(torch.result_type(x_values, y), copy=True)
    for b, start, length in _sequences(offsets, y.shape[1]):
        out[start : start + length] = x_values[start : start + length] + y[b, :length]
    return out


def jagged_dense_elementwise_mul_reference(x_values, offsets, y):
    out = torch.zeros_like(x_values, dtype=torch.result_type(x_values, y))
    for b, start, length in _sequences(offsets, y.shape[1]):
        out[start : start + length] = x_values[start : start + length] * y[b, :length]
    return out


@register_kernel("jagged_dense_elementwise_add", "cpu")
def _jagged_dense_add_cpu(x_values, offsets, y):
    rows, pos, keep = _padded_index(offsets, x_values.shape[0], y.shape[1])
    out = x_values.to(torch.result_type(x_values, y), copy=True)
    out[keep] += y[rows[keep], pos[keep]]
    return out


@register_kernel("jagged_dense_elementwise_mul", "cpu")
def _jagged_dense_mul_cpu(x_values, offsets, y):
    rows, pos, keep = _padded_index(offsets, x_values.shape[0], y.shape[1])
    out = torch.zeros_like(x_values, dtype=torch.result_type(x_values, y))
    out[keep] = x_values[keep] * y[rows[keep], pos[keep]]
    return out


@register_kernel("jagged_dense_elementwise_add", "fbgemm")
def _jagged_dense_add_fbgemm(x_values, offsets, y):
    return fbgemm_op("jagged_dense_elementwise_add_jagged_output")(x_values, [offsets], y)[0]


@register_kernel("jagged_dense_elementwise_mul", "fbgemm")
def _jagged_dense_mul_fbgemm(x_values, offsets, y):
    return fbgemm_op("jagged_dense_elementwise_mul")(x_values, [offsets], y)[0]


register_kernel("jagged_dense_elementwise_add", "reference")(jagged_dense_elementwise_add_reference)
register_kernel("jagged_dense_elementwise_mul", "reference")(jagged_dense_elementwise_mul_reference)


def _elementwise_triton(mode: str, cpu_kernel):
    """The Triton kernel for floating results; integer ones run ``cpu_kernel`` (torch ops, on any device)."""

    def kernel(x_values, offsets, y):
        if not torch.result_type(x_values, y).is_floating_point:
            return cpu_kernel(x_values, offsets, y)
        from .triton_kernels import jagged_dense

        return jagged_dense.jagged_dense_elementwise(getattr(jagged_dense, mode), x_values, offsets, y)

    return kernel


register_kernel("jagged_dense_elementwise_add", "triton")(_elementwise_triton("ADD", _jagged_dense_add_cpu))
register_kernel("jagged_dense_elementwise_mul", "triton")(_elementwise_triton("MUL", _jagged_dense_mul_cpu))


def _check_jagged_dense(op, x_values, offsets, y, bounds_check):
    check_offsets(op, offsets, bounds_check)
    if y.dim() != x_values.dim() + 1 or y.shape[0] != offsets.numel() - 1 or y.shape[2:] != x_values.shape[1:]:
        raise ValueError(
            f"recompile.{op}: y must be [B, N, *inner] matching x_values {tuple(x_values.shape)} and "
            f"{offsets.numel() - 1} sequences, got {tuple(y.shape)}"
        )


def _elementwise_op(name: str):
    """Define ``recompile::<name>(x_values, offsets, y, impl, bounds_check)`` (jagged output) with its fake impl."""

    @torch.library.custom_op(f"recompile::{name}", mutates_args=())
    def op(x_values: torch.Tensor, offsets: torch.Tensor, y: torch.Tensor, impl: str = "reference",
           bounds_check: str = "fatal") -> torch.Tensor:
        _check_jagged_dense(name, x_values, offsets, y, bounds_check)
        offsets = checked_offsets(name, offsets, x_values.shape[0], bounds_check)
        return get_kernel(name, impl)(x_values, offsets, y)

    @op.register_fake
    def _(x_values, offsets, y, impl="reference", bounds_check="fatal"):
        _check_jagged_dense(name, x_values, offsets, y, bounds_check)
        return x_values.new_empty(x_values.shape, dtype=torch.result_type(x_values, y))

    return op


jagged_dense_elementwise_add = _elementwise_op("jagged_dense_elementwise_add")
jagged_dense_elementwise_mul = _elementwise_op("jagged_dense_elementwise_mul")


def _elementwise_setup(ctx, inputs, output):
    x_values, offsets, y, impl, _ = inputs
    ctx.save_for_backward(x_values, offsets, y)
    ctx.impl = impl


def _add_backward(ctx, grad):
    x_values, offsets, y = ctx.saved_tensors
    grad = grad.contiguous()
    grad_y = jagged_to_padded_dense(grad, offsets, y.shape[1], 0.0, ctx.impl, BACKWARD_CHECK)
    return grad.to(x_values.dtype), None, grad_y.to(y.dtype), None, None


def _mul_backward(ctx, grad):
    x_values, offsets, y = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = jagged_dense_elementwise_mul(grad, offsets, y, ctx.impl, BACKWARD_CHECK)
    grad_y = jagged_to_padded_dense(grad * x_values, offsets, y.shape[1], 0.0, ctx.impl, BACKWARD_CHECK)
    return grad_x.to(x_values.dtype), None, grad_y.to(y.dtype), None, None


jagged_dense_elementwise_add.register_autograd(_add_backward, setup_context=_elementwise_setup)
jagged_dense_elementwise_mul.register_autograd(_mul_backward, setup_context=_elementwise_setup)


# ---------------------------------------------------------------------------------------------
# jagged_softmax


def jagged_softmax_reference(values, offsets, max_L):
    out = torch.zeros_like(values)
    for _, start, length in _sequences(offsets, max_L):
        out[start : start + length] = torch.softmax(values[start : start + length], dim=0)
    return out


def jagged_softmax_backward_reference(grad, output, offsets, max_L):
    out = torch.zeros_like(grad)
    for _, start, length in _sequences(offsets, max_L):
        y, g = output[start : start + length], grad[start : start + length]
        out[start : start + length] = y * (g - (g * y).sum(0, keepdim=True))
    return out


def _segments(offsets, values, max_L):
    rows, pos, keep = _padded_index(offsets, values.shape[0], max_L)
    return rows, keep


def _segment_sum(x, rows, num_rows):
    return x.new_zeros((num_rows, *x.shape[1:])).index_add_(0, rows, x)


@register_kernel("jagged_softmax", "cpu")
def _jagged_softmax_cpu(values, offsets, max_L):
    rows, keep = _segments(offsets, values, max_L)
    num_rows = offsets.numel() - 1
    masked = values.masked_fill(~keep[:, None], float("-inf"))
    peak = masked.new_full((num_rows, values.shape[1]), float("-inf"))
    peak = peak.scatter_reduce(0, rows[:, None].expand_as(values), masked, "amax")
    e = torch.exp(masked - peak[rows]).masked_fill(~keep[:, None], 0)
    return e / _segment_sum(e, rows, num_rows)[rows].clamp(min=torch.finfo(e.dtype).tiny)


@register_kernel("jagged_softmax_backward", "cpu")
def _jagged_softmax_backward_cpu(grad, output, offsets, max_L):
    rows, keep = _segments(offsets, output, max_L)
    gy = grad * output
    return (gy - output * _segment_sum(gy, rows, offsets.numel() - 1)[rows]) * keep[:, None]


@register_kernel("jagged_softmax", "fbgemm")
def _jagged_softmax_fbgemm(values, offsets, max_L):
    _, keep = _segments(offsets, values, max_L)
    return torch.where(keep[:, None], fbgemm_op("jagged_softmax")(values, offsets, max_L)[0], 0)  # rest unwritten


@register_kernel("jagged_softmax_backward", "fbgemm")
def _jagged_softmax_backward_fbgemm(grad, output, offsets, max_L):
    _, keep = _segments(offsets, output, max_L)
    return torch.where(keep[:, None], fbgemm_op("jagged_softmax_backward")(grad, output, offsets, max_L), 0)


register_kernel("jagged_softmax", "reference")(jagged_softmax_reference)
register_kernel("jagged_softmax_backward", "reference")(jagged_softmax_backward_reference)


@register_kernel("jagged_softmax", "triton")
def _jagged_softmax_triton(values, offsets, max_L):
    from .triton_kernels.jagged_softmax import jagged_softmax_forward

    return jagged_softmax_forward(values, offsets, max_L)


@register_kernel("jagged_softmax_backward", "triton")
def _jagged_softmax_backward_triton(grad, output, offsets, max_L):
    from .triton_kernels.jagged_softmax import jagged_softmax_backward

    return jagged_softmax_backward(grad, output, offsets, max_L)


def _check_2d(op, offsets, bounds_check, *tensors):
    check_offsets(op, offsets, bounds_check)
    for t in tensors:
        if t.dim() != 2:
            raise ValueError(f"recompile.{op}: jagged values must be [total, D], got shape {tuple(t.shape)}")


def _checked_2d(op, offsets, bounds_check, *tensors) -> torch.Tensor:
    """The offsets of an op over jagged ``[total, D]`` values, checked by ``checked_offsets``."""
    _check_2d(op, offsets, bounds_check, *tensors)
    return checked_offsets(op, offsets, tensors[0].shape[0], bounds_check)


@torch.library.custom_op("recompile::jagged_softmax", mutates_args=())
def jagged_softmax(values: torch.Tensor, offsets: torch.Tensor, max_L: int, impl: str = "reference",
                   bounds_check: str = "fatal") -> torch.Tensor:
    offsets = _checked_2d("jagged_softmax", offsets, bounds_check, values)
    return get_kernel("jagged_softmax", impl)(values.contiguous(), offsets, max_L)


@torch.library.custom_op("recompile::jagged_softmax_backward", mutates_args=())
def jagged_softmax_backward(
    grad: torch.Tensor, output: torch.Tensor, offsets: torch.Tensor, max_L: int, impl: str = "reference",
    bounds_check: str = "fatal",
) -> torch.Tensor:
    offsets = _checked_2d("jagged_softmax_backward", offsets, bounds_check, output, grad)
    return get_kernel("jagged_softmax_backward", impl)(grad.contiguous(), output, offsets, max_L)


@jagged_softmax.register_fake
def _(values, offsets, max_L, impl="reference", bounds_check="fatal"):
    _check_2d("jagged_softmax", offsets, bounds_check, values)
    return torch.empty_like(values)


@jagged_softmax_backward.register_fake
def _(grad, output, offsets, max_L, impl="reference", bounds_check="fatal"):
    _check_2d("jagged_softmax_backward", offsets, bounds_check, output, grad)
    return torch.empty_like(grad)


def _softmax_setup(ctx, inputs, output):
    _, offsets, max_L, impl, _ = inputs
    ctx.save_for_backward(output, offsets)
    ctx.max_L, ctx.impl = max_L, impl


def _softmax_backward(ctx, grad):
    output, offsets = ctx.saved_tensors
    return jagged_softmax_backward(grad, output, offsets, ctx.max_L, ctx.impl, BACKWARD_CHECK), None, None, None, None


jagged_softmax.register_autograd(_softmax_backward, setup_context=_softmax_setup)


# ---------------------------------------------------------------------------------------------
# jagged_jagged_bmm / jagged_dense_bmm


def jagged_jagged_bmm_reference(x_values, y_values, offsets, max_L):
    out = x_values.new_zeros((offsets.numel() - 1, x_values.shape[1], y_values.shape[1]))
    for b, start, length in _sequences(offsets, max_L):
        out[b] = x_values[start : start + length].T @ y_values[start : start + length]
    return out


def jagged_dense_bmm_reference(x_values, offsets, y, max_L):
    out = x_values.new_zeros((x_values.shape[0], y.shape[2]))
    for b, start, length in _sequences(offsets, max_L):
        out[start : start + length] = x_values[start : start + length] @ y[b]
    return out


@register_kernel("jagged_jagged_bmm", "cpu")
def _jagged_jagged_bmm_cpu(x_values, y_values, offsets, max_L):
    out = x_values.new_zeros((offsets.numel() - 1, x_values.shape[1], y_values.shape[1]))
    for bucket in length_buckets(offsets, max_L):
        out[bucket.seqs] = torch.bmm(bucket.gather(x_values).transpose(1, 2), bucket.gather(y_values))
    return out


@register_kernel("jagged_dense_bmm", "cpu")
def _jagged_dense_bmm_cpu(x_values, offsets, y, max_L):
    out = x_values.new_zeros((x_values.shape[0], y.shape[2]))
    for bucket in length_buckets(offsets, max_L):
        bucket.scatter(out, torch.bmm(bucket.gather(x_values), y[bucket.seqs]))
    return out


@register_kernel("jagged_jagged_bmm", "fbgemm")
def _jagged_jagged_bmm_fbgemm(x_values, y_values, offsets, max_L):
    return fbgemm_op("jagged_jagged_bmm")(x_values, y_values, offsets, max_L)


@register_kernel("jagged_dense_bmm", "fbgemm")
def _jagged_dense_bmm_fbgemm(x_values, offsets, y, max_L):
    return fbgemm_op("jagged_dense_bmm")(x_values, offsets, y, max_L)[0]


register_kernel("jagged_jagged_bmm", "reference")(jagged_jagged_bmm_reference)
register_kernel("jagged_dense_bmm", "reference")(jagged_dense_bmm_reference)


@register_kernel("jagged_jagged_bmm", "triton")
def _jagged_jagged_bmm_triton(x_values, y_values, offsets, max_L):
    from .triton_kernels.jagged_bmm import jagged_jagged_bmm

    return jagged_jagged_bmm(x_values, y_values, offsets, max_L)


@register_kernel("jagged_dense_bmm", "triton")
def _jagged_dense_bmm_triton(x_values, offsets, y, max_L):
    from .triton_kernels.jagged_bmm import jagged_dense_bmm

    return jagged_dense_bmm(x_values, offsets, y, max_L)


def _check_same_total(op, x_values, y_values):
    if x_values.shape[0] != y_values.shape[0]:
        raise ValueError(f"recompile.{op}: x_values and y_values must have the same length, got "
                         f"{x_values.shape[0]} and {y_values.shape[0]}")


@torch.library.custom_op("recompile::jagged_jagged_bmm", mutates_args=())
def jagged_jagged_bmm(
    x_values: torch.Tensor, y_values: torch.Tensor, offsets: torch.Tensor, max_L: int, impl: str = "reference",
    bounds_check: str = "fatal",
) -> torch.Tensor:
    _check_same_total("jagged_jagged_bmm", x_values, y_values)
    offsets = _checked_2d("jagged_jagged_bmm", offsets, bounds_check, x_values, y_values)
    return get_kernel("jagged_jagged_bmm", impl)(x_values.contiguous(), y_values.contiguous(), offsets, max_L)


def _check_dense_bmm(x_values, offsets, y, bounds_check):
    _check_2d("jagged_dense_bmm", offsets, bounds_check, x_values)
    if y.dim() != 3 or y.shape[0] != offsets.numel() - 1 or y.shape[1] != x_values.shape[1]:
        raise ValueError(
            f"recompile.jagged_dense_bmm: y must be [B, K, N] with B = {offsets.numel() - 1} and "
            f"K = {x_values.shape[1]}, got {tuple(y.shape)}"
        )


@torch.library.custom_op("recompile::jagged_dense_bmm", mutates_args=())
def jagged_dense_bmm(
    x_values: torch.Tensor, offsets: torch.Tensor, y: torch.Tensor, max_L: int, impl: str = "reference",
    bounds_check: str = "fatal",
) -> torch.Tensor:
    _check_dense_bmm(x_values, offsets, y, bounds_check)
    offsets = checked_offsets("jagged_dense_bmm", offsets, x_values.shape[0], bounds_check)
    return get_kernel("jagged_dense_bmm", impl)(x_values.contiguous(), offsets, y.contiguous(), max_L)


@jagged_jagged_bmm.register_fake
def _(x_values, y_values, offsets, max_L, impl="reference", bounds_check="fatal"):
    _check_same_total("jagged_jagged_bmm", x_values, y_values)
    _check_2d("jagged_jagged_bmm", offsets, bounds_check, x_values, y_values)
    return x_values.new_empty((offsets.shape[0] - 1, x_values.shape[1], y_values.shape[1]))


@jagged_dense_bmm.register_fake
def _(x_values, offsets, y, max_L, impl="reference", bounds_check="fatal"):
    _check_dense_bmm(x_values, offsets, y, bounds_check)
    return x_values.new_empty((x_values.shape[0], y.shape[2]))


def _bmm_setup(ctx, inputs, output):
    *tensors, max_L, impl, _ = inputs
    ctx.save_for_backward(*tensors)
    ctx.max_L, ctx.impl = max_L, impl


def _jagged_jagged_bmm_backward(ctx, grad):
    x_values, y_values, offsets = ctx.saved_tensors
    grad_x = jagged_dense_bmm(y_values, offsets, grad.transpose(1, 2), ctx.max_L, ctx.impl, BACKWARD_CHECK)
    grad_y = jagged_dense_bmm(x_values, offsets, grad, ctx.max_L, ctx.impl, BACKWARD_CHECK)
    return grad_x, grad_y, None, None, None, None


def _jagged_dense_bmm_backward(ctx, grad):
    x_values, offsets, y = ctx.saved_tensors
    grad_x = jagged_dense_bmm(grad, offsets, y.transpose(1, 2), ctx.max_L, ctx.impl, BACKWARD_CHECK)
    grad_y = jagged_jagged_bmm(x_values, grad, offsets, ctx.max_L, ctx.impl, BACKWARD_CHECK)
    return grad_x, None, grad_y, None, None, None


jagged_jagged_bmm.register_autograd(_jagged_jagged_bmm_backward, setup_context=_bmm_setup)
jagged_dense_bmm.register_autograd(_jagged_dense_bmm_backward, setup_context=_bmm_setup)


# ---------------------------------------------------------------------------------------------
# jagged_within: the guard of a padded region rewritten to jagged


def jagged_within_reference(values, offsets, max_length):
    return values.clone()


register_kernel("jagged_within", "reference")(jagged_within_reference)

PADDED_TOO_LONG = ("a padded region was compiled for sequences of at most {max_len} positions (its padded length), "
                   "but a sequence has {longest}; pad to a larger length or disable the jagged pass")


@torch.library.custom_op("recompile::jagged_within", mutates_args=())
def jagged_within(values: torch.Tensor, offsets: torch.Tensor, max_length: int, impl: str = "reference",
                  bounds_check: str = "fatal") -> torch.Tensor:
    """``values`` (a copy) once the offsets are checked to cover them and every sequence to fit ``max_length``
    positions (raises otherwise)."""
    offsets = checked_offsets("jagged_within", offsets, values.shape[0], bounds_check, max_length, PADDED_TOO_LONG)
    return get_kernel("jagged_within", impl)(values, offsets, max_length)


@jagged_within.register_fake
def _(values, offsets, max_length, impl="reference", bounds_check="fatal"):
    check_offsets("jagged_within", offsets, bounds_check)
    return torch.empty_like(values)


jagged_within.register_autograd(lambda ctx, grad: (grad, None, None, None, None),
                                setup_context=lambda ctx, inputs, output: None)
