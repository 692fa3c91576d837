"""complete_cumsum as one Triton program that scans the lengths tile by tile."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _complete_cumsum_kernel(lengths_ptr, out_ptr, n, BLOCK: tl.constexpr):
    carry = tl.zeros([1], dtype=tl.int64)
    tl.store(out_ptr + tl.arange(0, 1), carry.to(out_ptr.dtype.element_ty))
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(lengths_ptr + offs, mask=mask, other=0).to(tl.int64)
        scanned = tl.cumsum(x, 0) + tl.sum(carry, 0)
        tl.store(out_ptr + 1 + offs, scanned.to(out_ptr.dtype.element_ty), mask=mask)
        carry += tl.sum(x, 0)


def complete_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    lengths = lengths.contiguous()
    out = torch.empty(lengths.numel() + 1, dtype=lengths.dtype, device=lengths.device)
    _complete_cumsum_kernel[(1,)](lengths, out, lengths.numel(), BLOCK=BLOCK)
    return out
