"""Triton kernels, written in the subset triton-ascend compiles.

The subset: a 1-D grid sized to the core count with a loop over work items inside each program,
int32 index arithmetic, no ``tl.dot`` on int64, tiles that fit in 192 KB of on-chip buffer.
One source serves CUDA (triton) and Ascend (triton-ascend); on a machine without either the
kernels run under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import os

from hkv.triton_kernels import num_programs  # noqa: F401  (one grid size for the hkv and runtime kernels)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
