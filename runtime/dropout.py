"""Dropout with a counter-based mask: ``torch.ops.recompile.dropout``.

``dropout(x, p, seed)`` keeps element ``i`` of ``x`` (row-major order) when ``h(i) >= p * 2**32`` and scales it by
``1 / (1 - p)``, zeroing the others (``x * 0``: NaN stays NaN), where ``h`` hashes the index with the two 31-bit
seeds ``seed = [s0, s1]`` (``csrc/dropout.h`` says how). The mask is a function of the seed and the index alone:
the backward is the same op on the gradient with the same seed (nothing is stored), every kernel draws the same
mask, and the seed comes from ``torch.randint`` on the default generator, so ``torch.manual_seed`` repeats a run.
The masks are not eager's ``bernoulli_`` draws (nor are Inductor's own).

Kernels: ``reference`` (torch integer ops, any device and dtype) and ``native`` (``csrc/dropout.h``, the C++ op
``torch.ops.recompile_native.dropout``: float32 on CPU, one OpenMP pass; the lowering chooses it where ``native_reads`` holds).
"""
from __future__ import annotations

import torch

from hkv.native import NativeLibrary
from .kernels import get_kernel, native_supports, register_kernel, require

OP = "dropout"
M32 = 0xFFFFFFFF
SEED_BOUND = 2**31 - 1  # each of the two seeds is drawn from [0, SEED_BOUND)


def threshold(p: float) -> int:
    """Hashes below this are dropped: ``p * 2**32`` (an element is kept with probability ``1 - p`` to 2**-32)."""
    return min(int(p * 2**32), M32)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``x`` in [0, 2**32) without leaving int64: the 16-bit halves of ``c`` one by one."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def keep_mask(shape: torch.Size, p: float, seed: torch.Tensor) -> torch.Tensor:
    """Which elements of a tensor of ``shape`` dropout keeps with ``seed`` (bool, on the seed's device)."""
    index = torch.arange(shape.numel(), device=seed.device, dtype=torch.int64)
    s0, s1 = seed.to(torch.int64).unbind()
    hashed = _mix32(_mix32((index & M32) ^ s0) ^ (((index >> 32) + s1) & M32))
    return (hashed >= threshold(p)).view(shape)


def dropout_reference(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    factor = torch.where(keep_mask(x.shape, p, seed.to(x.device)), 1.0 / (1.0 - p), 0.0).to(x.dtype)
    return x.contiguous() * factor


register_kernel(OP, "reference")(dropout_reference)


NATIVE = NativeLibrary("recompile.runtime._C", frozenset({torch.float32}))  # the dtypes runtime/csrc/ops.cpp dropout takes
available = NATIVE.available
if available():  # the C++ op's fake, so that torch.export and torch.compile can trace a direct call

    @torch.library.register_fake("recompile_native::dropout")
    def _(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)


def native_reads(x: torch.Tensor, **_) -> bool | str:
    return native_supports(NATIVE, x)


@register_kernel(OP, "native", supports=native_reads)
def _dropout_native(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    require(OP, "native", native_reads(x))
    return torch.ops.recompile_native.dropout(x, seed, p)


def _check(x: torch.Tensor, p: float, seed: torch.Tensor) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"recompile.dropout: p must be in [0, 1), got {p}")
    if not x.is_floating_point():
        raise TypeError(f"recompile.dropout: x must be a floating-point tensor, got {x.dtype}")
    if seed.shape != (2,) or seed.dtype != torch.int64:
        raise ValueError(f"recompile.dropout: seed must be an int64 tensor of 2 values, got {seed.dtype} "
                         f"{tuple(seed.shape)}")


@torch.library.custom_op("recompile::dropout", mutates_args=())
def dropout(x: torch.Tensor, p: float, seed: torch.Tensor, impl: str) -> torch.Tensor:
    """``x`` with each element kept (scaled by ``1 / (1 - p)``) or zeroed as the mask of ``seed`` says."""
    _check(x, p, seed)
    return get_kernel(OP, impl)(x, p, seed)


@dropout.register_fake
def _(x, p, seed, impl):
    _check(x, p, seed)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, p, seed, impl = inputs
    ctx.save_for_backward(seed)
    ctx.p, ctx.impl = p, impl


def _backward(ctx, grad):
    (seed,) = ctx.saved_tensors
    return dropout(grad, ctx.p, seed, ctx.impl), None, None, None


dropout.register_autograd(_backward, setup_context=_setup_context)
