"""Triton kernels, written in the subset triton-ascend compiles.

The subset: a 1-D grid sized to the core count with a loop over work items inside each program,
int32 index arithmetic, no ``tl.dot`` on int64, tiles that fit in 192 KB of on-chip buffer.
One source serves CUDA (triton) and Ascend (triton-ascend); on a machine without either the
kernels run under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import os

import torch

# Programs a 1-D grid launches when the device cannot be asked (the interpreter on CPU).
INTERPRETER_PROGRAMS = 4


def num_programs(device: torch.device) -> int:
    """Programs for a persistent 1-D grid: one per core (SM on CUDA, vector core on Ascend)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "npu":
        props = torch.npu.get_device_properties(device)  # type: ignore[attr-defined]
        return int(getattr(props, "vector_core_num", 0) or getattr(props, "multi_processor_count", 1))
    return INTERPRETER_PROGRAMS


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
