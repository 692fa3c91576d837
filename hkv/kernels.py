"""Kernels that probe a table, by name; a table's ``kernel`` (or an op's ``impl`` argument) picks one.

- ``reference``: the vectorised torch probing of ``hkv.table`` (any device).
- ``cpu``: the C kernel of ``hkv.cpu`` (CPU tables; one pass per key: hash, probe, copy the row, dequantizing a
  quantized table's packed row into fp32 on the way).
- ``triton``: the Triton kernels of ``hkv.triton_kernels`` (CUDA, Ascend; the interpreter on CPU; ``find`` probes and
  reads the row out in one launch, dequantizing a quantized table's packed row into fp32).

``LOCATE[name](table, keys) -> slots``, ``FIND[name](table, keys) -> (values, found)`` and
``CLAIM[name](table, new_keys, scores) -> slots`` (stores the keys; -1 where the bucket is full).
"""
from __future__ import annotations

import contextlib
import os

import torch

from hkv import cpu
from hkv.storage import DenseValues


def _locate_cpu(table, keys):
    return cpu.locate(table._keys, table._num_buckets, table.bucket_size, keys)


def _find_cpu(table, keys):
    if not isinstance(table._values, DenseValues):  # tiers: locate here, gather from each tier
        return _find_by_locate(table, keys)
    values, found, _ = cpu.find(table._keys, table._num_buckets, table.bucket_size, table._values.data, keys,
                                table._row_format, table.dim)
    return values, found


def _locate_triton(table, keys):
    from hkv.triton_kernels import locate

    return locate(table._keys, table._num_buckets, table.bucket_size, keys)


def _find_triton(table, keys):
    if not isinstance(table._values, DenseValues):  # tiers: locate here, gather from each tier
        return _find_by_locate(table, keys)
    from hkv.triton_kernels import find

    values, found, _ = find(table._keys, table._num_buckets, table.bucket_size, table._values.data, keys,
                            table.qdtype, table.dim)
    return values, found


def _claim_cpu(table, keys, scores):
    return cpu.claim(table._keys, table._scores, table._num_buckets, table.bucket_size, keys, scores)


def _claim_triton(table, keys, scores):
    from hkv.triton_kernels import claim

    return claim(table._keys, table._scores, table._num_buckets, table.bucket_size, keys, scores)


def _find_by_locate(table, keys):
    slot = table._locate(keys)
    found = slot >= 0
    return table._gather(slot, found), found


LOCATE = {
    "reference": lambda table, keys: table._probe(keys),
    "cpu": _locate_cpu,
    "triton": _locate_triton,
}
FIND = {"reference": _find_by_locate, "cpu": _find_cpu, "triton": _find_triton}
CLAIM = {
    "reference": lambda table, keys, scores: table._claim_rounds(keys, scores),
    "cpu": _claim_cpu,
    "triton": _claim_triton,
}
KERNEL_NAMES = tuple(LOCATE)


def runs_on(name: str, device: torch.device) -> bool:
    """Whether kernel ``name`` can probe a table on ``device`` here."""
    if name == "cpu":
        return device.type == "cpu" and cpu.available()
    if name == "triton":
        return device.type in ("cuda", "npu") or os.environ.get("TRITON_INTERPRET") == "1"
    return name == "reference"


def supports(name: str, table) -> bool | str:
    """True when kernel ``name`` probes ``table`` here, else why not (the Triton kernels index with int32)."""
    if not runs_on(name, table.device):
        return f"hkv kernel {name!r} does not run on {table.device} here"
    if name == "triton" and max(table._keys.numel(), getattr(table._values, "data", table._keys).numel()) >= 2**31:
        return f"{table.name}: over 2**31 slots or value elements; the Triton kernels index with int32"
    return True


def default_kernel(device: torch.device) -> str:
    return "cpu" if runs_on("cpu", device) else "reference"


def check_kernel(name: str, device: torch.device) -> str:
    if name not in LOCATE:
        raise ValueError(f"hkv: unknown kernel {name!r}; known: {KERNEL_NAMES}")
    if not runs_on(name, device):
        raise ValueError(f"hkv: kernel {name!r} cannot run on {device} here")
    return name


@contextlib.contextmanager
def using_kernel(table, impl: str):
    """Probe ``table`` with kernel ``impl`` inside the block (the table's lock is held); "auto": its own."""
    if impl == "auto":
        impl = table.kernel
    check_kernel(impl, table.device)
    with table._lock:
        previous, table.kernel = table.kernel, impl
        try:
            yield
        finally:
            table.kernel = previous
