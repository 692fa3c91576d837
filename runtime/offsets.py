"""Lengths -> offsets: ``torch.ops.recompile.complete_cumsum``.

``complete_cumsum(lengths)`` is ``[0, l0, l0+l1, ...]`` (``len(lengths) + 1`` values), the offsets
of a jagged tensor from its lengths; FBGEMM calls it ``asynchronous_complete_cumsum``.
"""
from __future__ import annotations

import torch

from .fbgemm import fbgemm_op
from .kernels import get_kernel, register_kernel

OP = "complete_cumsum"


def complete_cumsum_reference(lengths: torch.Tensor) -> torch.Tensor:
    out = lengths.new_zeros(lengths.numel() + 1)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


register_kernel(OP, "reference")(complete_cumsum_reference)


@register_kernel(OP, "cpu")
def _complete_cumsum_cpu(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=lengths.dtype), (1, 0))


@register_kernel(OP, "fbgemm")
def _complete_cumsum_fbgemm(lengths: torch.Tensor) -> torch.Tensor:
    return fbgemm_op("asynchronous_complete_cumsum")(lengths)


@register_kernel(OP, "triton")
def _complete_cumsum_triton(lengths: torch.Tensor) -> torch.Tensor:
    from .triton_kernels.offsets import complete_cumsum

    return complete_cumsum(lengths)


@torch.library.custom_op("recompile::complete_cumsum", mutates_args=())
def complete_cumsum(lengths: torch.Tensor, impl: str = "reference") -> torch.Tensor:
    if lengths.dim() != 1:
        raise ValueError(
            f"recompile.complete_cumsum: lengths must be 1-D, got shape {tuple(lengths.shape)}"
        )
    if lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"recompile.complete_cumsum: lengths must be int32 or int64, got {lengths.dtype}")
    return get_kernel(OP, impl)(lengths)


@complete_cumsum.register_fake
def _(lengths: torch.Tensor, impl: str = "reference") -> torch.Tensor:
    return lengths.new_empty(lengths.shape[0] + 1)
