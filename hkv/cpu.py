"""The CPU kernels of hkv tables (``csrc/probe.h``), the C++ ops ``torch.ops.hkv_native.*`` built at install.

A package built without them has ``available()`` False, and tables probe with the vectorised torch code.
"""
from __future__ import annotations

import torch

from hkv.native import NativeLibrary

# hkv_upsert's per-key outcome (csrc/probe.h UPSERT_*).
FOUND, INSERTED, FULL, ABSENT, FOUND_NEW, OUTCOMES = range(6)
# How the kernels read a table's stored rows out, by its qdtype (csrc/probe.h ROW_*): copied, or dequantized to fp32.
ROW_FORMATS = {None: 0, "int8": 1, "int4": 2}

NATIVE = NativeLibrary("hkv._C")
available = NATIVE.available
ops = torch.ops.hkv_native


def locate(table_keys: torch.Tensor, num_buckets: int, bucket_size: int, keys: torch.Tensor) -> torch.Tensor:
    return ops.locate(table_keys, num_buckets, bucket_size, keys)


def find(table_keys: torch.Tensor, num_buckets: int, bucket_size: int, values: torch.Tensor, keys: torch.Tensor,
         row_format: int = 0, dim: int = 0):
    """(rows, found, slots): the value rows of ``keys`` (zero where absent), in one pass; ``row_format``
    (ROW_FORMATS) 1 or 2: ``values`` holds int8 / int4 packed rows of width ``dim``, read out as fp32."""
    return ops.find(table_keys, num_buckets, bucket_size, values, keys, row_format, dim)


def claim(table_keys: torch.Tensor, table_scores: torch.Tensor, num_buckets: int, bucket_size: int,
          keys: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Store new unique keys with their scores in free slots; the slot of each, -1 where the bucket is full."""
    return ops.claim(table_keys, table_scores, num_buckets, bucket_size, keys, scores)


def upsert(table_keys: torch.Tensor, table_scores: torch.Tensor, num_buckets: int, bucket_size: int,
           values: torch.Tensor, keys: torch.Tensor, new_values: torch.Tensor | None, given: torch.Tensor,
           strategy: int, insert: bool, clock_score: int, epoch: int, copy_out: bool, grouped: bool,
           fresh: torch.Tensor, row_format: int = 0, dim: int = 0):
    """One pass of insert_or_assign / find_or_insert / assign over ``keys`` (see csrc/probe.h hkv_upsert).

    Returns (slots, status, counts, out): ``counts[c]`` the number of keys of status ``c``, ``out`` the
    stored rows of keys found (``copy_out``; dequantized as ``find`` reads them), else None. ``new_values``
    are rows as stored.
    """
    slots, status, counts, out = ops.upsert(table_keys, table_scores, num_buckets, bucket_size, values, keys,
                                            new_values, given, strategy, insert, clock_score, epoch, copy_out,
                                            grouped, fresh, row_format, dim)
    return slots, status, counts.tolist(), out if copy_out else None


def unique(ids: torch.Tensor, num_buckets: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique ids, inverse) of CPU ``ids`` by hashing (O(n)): first-occurrence order, or grouped by
    table bucket (``h & (num_buckets - 1)``, ascending) when ``num_buckets`` > 0."""
    return ops.unique(ids, num_buckets)


def pool_backward(grad: torch.Tensor, offsets: torch.Tensor, inverse: torch.Tensor, mean: bool,
                  num_rows: int) -> torch.Tensor:
    """The gradient of sum / mean pooling with respect to the pooled unique rows (float32 CPU tensors)."""
    return ops.pool_backward(grad, offsets, inverse, mean, num_rows)
