"""Kernels that probe a table, by name: the op's ``impl`` argument picks one.

- ``reference``: the vectorised torch probing of ``hkv.table`` (any device).
"""
from __future__ import annotations

import contextlib

KERNEL_NAMES = ("reference",)


@contextlib.contextmanager
def using_kernel(table, impl: str):
    if impl not in KERNEL_NAMES:
        raise ValueError(f"hkv: unknown kernel {impl!r}; known: {KERNEL_NAMES}")
    with table._lock:
        previous, table.kernel = table.kernel, impl
        try:
            yield
        finally:
            table.kernel = previous
