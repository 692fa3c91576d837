"""Row-wise quantized rows in FBGEMM's fused layouts: what hkv tables with ``dtype="int8" | "int4"`` store and what
``recompile.quantize`` packs float tables into (runtime/quantized.py re-exports these; hkv, below the runtime,
owns the format so that both read one definition).

A packed row is uint8: its codes, then its scale and bias; a value is ``code * scale + bias``.

- ``"int8"``: ``D`` codes, then fp32 scale and fp32 bias (``width = D + 8``), byte for byte
  ``torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized``: scale = (max - min) / 255, bias = min,
  code = round((x - min) * 255 / (max - min + 1e-8));
- ``"int4"``: ``D / 2`` bytes of two codes each (low nibble first), then fp16 scale and fp16 bias
  (``width = D / 2 + 4``), byte for byte ``torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(x, 4)``:
  bias = fp16(min), scale = fp16((max - bias) / 15) (1 where that is 0), code = clamp(round((x - bias) / scale), 0, 15).
"""
from __future__ import annotations

import torch
from torch import Tensor

QDTYPES = ("int8", "int4")
SCALE_BIAS = {"int8": torch.float32, "int4": torch.float16}  # the dtype of each row's scale and bias
LEVELS = {"int8": 255, "int4": 15}


def packed_width(dim: int, qdtype: str) -> int:
    """Bytes per packed row of a table of width ``dim``."""
    codes = dim if qdtype == "int8" else (dim + 1) // 2
    return codes + 2 * SCALE_BIAS[qdtype].itemsize


def check_qdtype(qdtype, dim: int, where: str) -> str:
    """``qdtype`` if it is one of QDTYPES that can pack rows of width ``dim``; else ValueError starting ``where``."""
    if qdtype not in QDTYPES:
        raise ValueError(f"{where}: dtype {qdtype!r} is not one of {QDTYPES}")
    if dim < 1:
        raise ValueError(f"{where}: a quantized row needs dim >= 1, got {dim}")
    if qdtype == "int4" and dim % 2:
        raise ValueError(f"{where}: int4 packs two columns per byte; the table's dim {dim} is odd")
    return qdtype


def quantize_rows(weight: Tensor, qdtype: str, where: str = "recompile.quantize", out=None) -> Tensor:
    """``weight`` [rows, D] (fp32 / fp16 / bf16) in the fused layout of ``qdtype`` (FBGEMM's bytes exactly); errors
    start with ``where``; ``out(rows, width)``, if given, allocates the packed uint8 rows."""
    check_qdtype(qdtype, weight.shape[1], where)
    x = weight.detach().float()
    low, high = x.aminmax(dim=1, keepdim=True) if x.numel() else (x[:, :1], x[:, :1])
    if qdtype == "int8":
        scale, bias = (high - low) / 255.0, low
        inverse = torch.div(255.0, high - low + 1e-8)  # a true division (Tensor.__rtruediv__ multiplies by 1 / x)
    else:
        bias = low.half().float()
        scale = torch.where(high == bias, 1.0, (high - bias) / 15.0).half().float()
        scale = torch.where(scale == 0, 1.0, scale)
        inverse = torch.div(1.0, scale)
        scale, inverse = (torch.where(inverse.isinf(), 1.0, v) for v in (scale, inverse))
    codes = torch.round((x - bias) * inverse).clamp_(0, LEVELS[qdtype]).to(torch.uint8)
    if qdtype == "int4":
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale_bias = torch.cat([scale, bias], 1).to(SCALE_BIAS[qdtype]).view(torch.uint8)
    if out is None:
        return torch.cat([codes, scale_bias], 1)
    return torch.cat([codes, scale_bias], 1, out=out(codes.shape[0], codes.shape[1] + scale_bias.shape[1]))


def scale_bias(packed: Tensor, qdtype: str) -> Tensor:
    """Each packed row's scale and bias, ``[rows, 2]`` in their stored dtype (fp32 for int8, fp16 for int4)."""
    tail = packed[:, packed.shape[1] - 2 * SCALE_BIAS[qdtype].itemsize:]
    return tail.clone(memory_format=torch.contiguous_format).view(SCALE_BIAS[qdtype])


def dequantize_rows(packed: Tensor, qdtype: str) -> Tensor:
    """The fp32 rows ``[rows, D]`` of packed rows (``code * scale + bias``)."""
    codes = packed[:, :packed.shape[1] - 2 * SCALE_BIAS[qdtype].itemsize]
    if qdtype == "int4":
        codes = torch.stack([codes & 15, codes >> 4], 2).reshape(packed.shape[0], 2 * codes.shape[1])
    scale, bias = scale_bias(packed, qdtype).float().unbind(1)
    return codes.float() * scale[:, None] + bias[:, None]


def stored_row(dim: int, dtype) -> tuple[int, torch.dtype]:
    """(width, dtype) of a table's stored rows: packed uint8 rows for a QDTYPES ``dtype``, else ``dim`` x ``dtype``."""
    return (packed_width(dim, dtype), torch.uint8) if dtype in QDTYPES else (dim, dtype)
