"""The kernel table: every custom op's implementations, by name.

A `torch.ops.recompile.*` op takes an ``impl`` string naming the implementation to run
(chosen at compile time by ``recompile.lowering``); the op looks it up here. Names in use:

- ``reference``: plain torch, the oracle for tests; runs on every device.
- ``cpu``: our CPU kernel.
- ``fbgemm``: the library op (``torch.ops.fbgemm.*`` from fbgemm-gpu, fbgemm-gpu-cpu or fbgemm-ascend).
- ``triton``: a Triton kernel (CUDA through triton, Ascend through triton-ascend; tested on CPU
  under ``TRITON_INTERPRET=1``).
- ``aten``: eager ATen ops, where an op's best choice is no custom kernel at all.
"""
from __future__ import annotations

from typing import Callable

KERNELS: dict[str, dict[str, Callable]] = {}


def register_kernel(op: str, impl: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as implementation ``impl`` of op ``op`` (the name without namespace)."""

    def wrap(fn: Callable) -> Callable:
        table = KERNELS.setdefault(op, {})
        if impl in table:
            raise ValueError(f"kernel {impl!r} of op {op!r} is registered twice")
        table[impl] = fn
        return fn

    return wrap


def get_kernel(op: str, impl: str) -> Callable:
    table = KERNELS.get(op)
    if table is None:
        raise KeyError(f"op {op!r} has no kernels; known ops: {sorted(KERNELS)}")
    try:
        return table[impl]
    except KeyError:
        raise ValueError(
            f"op {op!r} has no implementation {impl!r}; it has {sorted(table)}"
        ) from None
