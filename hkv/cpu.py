"""The CPU kernel of hkv tables (``csrc/probe.c``), built on first use by ``hkv.native``, called through ctypes.

Without a C compiler the kernel is simply unavailable and tables probe with the vectorised torch code.
"""
from __future__ import annotations

import ctypes
import os

import torch

from hkv.native import NativeLibrary, i32, i64, ptr

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "probe.c")
SIGNATURES = (
    ("hkv_locate", (ptr, i64, i64, ptr, i64, ptr, i32)),
    ("hkv_find", (ptr, i64, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, i32)),
    ("hkv_claim", (ptr, ptr, i64, i64, ptr, ptr, i64, ptr, i32)),
    ("hkv_upsert", (ptr, ptr, i64, i64, ptr, i64, ptr, i64, ptr, ptr, i32, i32, i64, i64, ptr, i32, ptr, ptr, ptr,
                    ptr, i32)),
    ("hkv_pool_backward", (ptr, ptr, i64, ptr, i64, i64, i32, ptr, i64)),
    ("hkv_unique", (ptr, i64, i64, ptr, ptr, ptr), i64),
)
# hkv_upsert's per-key outcome (csrc/probe.c UPSERT_*).
FOUND, INSERTED, FULL, ABSENT, FOUND_NEW, OUTCOMES = range(6)


NATIVE = NativeLibrary(SOURCE, SIGNATURES)
library, available = NATIVE.library, NATIVE.available  # the built kernel library (None without a C compiler)


def locate(table_keys: torch.Tensor, num_buckets: int, bucket_size: int, keys: torch.Tensor) -> torch.Tensor:
    keys = keys.contiguous()
    slots = torch.empty_like(keys)
    library().hkv_locate(table_keys.data_ptr(), num_buckets, bucket_size, keys.data_ptr(), keys.numel(),
                         slots.data_ptr(), torch.get_num_threads())
    return slots


def find(table_keys: torch.Tensor, num_buckets: int, bucket_size: int, values: torch.Tensor, keys: torch.Tensor):
    """(rows, found, slots): the value rows of ``keys`` (zero where absent), in one pass."""
    keys = keys.contiguous()
    n = keys.numel()
    out = values.new_empty(n, values.shape[1])
    found = torch.empty(n, dtype=torch.bool)
    slots = torch.empty_like(keys)
    library().hkv_find(table_keys.data_ptr(), num_buckets, bucket_size, values.data_ptr(),
                       values.shape[1] * values.element_size(), keys.data_ptr(), n, out.data_ptr(),
                       found.data_ptr(), slots.data_ptr(), torch.get_num_threads())
    return out, found, slots


def claim(table_keys: torch.Tensor, table_scores: torch.Tensor, num_buckets: int, bucket_size: int,
          keys: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Store new unique keys with their scores in free slots; the slot of each, -1 where the bucket is full."""
    keys, scores = keys.contiguous(), scores.contiguous()
    slots = torch.empty_like(keys)
    library().hkv_claim(table_keys.data_ptr(), table_scores.data_ptr(), num_buckets, bucket_size, keys.data_ptr(),
                        scores.data_ptr(), keys.numel(), slots.data_ptr(), torch.get_num_threads())
    return slots


def upsert(table_keys: torch.Tensor, table_scores: torch.Tensor, num_buckets: int, bucket_size: int,
           values: torch.Tensor, keys: torch.Tensor, new_values: torch.Tensor | None, given: torch.Tensor,
           strategy: int, insert: bool, clock_score: int, epoch: int, copy_out: bool, grouped: bool,
           fresh: torch.Tensor):
    """One pass of insert_or_assign / find_or_insert / assign over ``keys`` (see csrc/probe.c hkv_upsert).

    Returns (slots, status, counts, out): ``counts[c]`` the number of keys of status ``c``, ``out`` the
    stored rows of keys found (``copy_out``), else None.
    """
    keys, given = keys.contiguous(), given.contiguous()
    n = keys.numel()
    out = values.new_empty(n, values.shape[1]) if copy_out else None
    slots = torch.empty_like(keys)
    status = torch.empty(n, dtype=torch.int8)
    counts = (ctypes.c_int64 * OUTCOMES)()
    if new_values is not None:
        new_values = new_values.contiguous()
    library().hkv_upsert(
        table_keys.data_ptr(), table_scores.data_ptr(), num_buckets, bucket_size, values.data_ptr(),
        values.shape[1] * values.element_size(), keys.data_ptr(), n,
        None if new_values is None else new_values.data_ptr(), given.data_ptr(), strategy, int(insert),
        clock_score, epoch, None if out is None else out.data_ptr(), int(grouped), fresh.data_ptr(),
        slots.data_ptr(), status.data_ptr(), counts, torch.get_num_threads())
    return slots, status, list(counts), out


def unique(ids: torch.Tensor, num_buckets: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique ids, inverse) of CPU ``ids`` by hashing (O(n)): first-occurrence order, or grouped by
    table bucket (``h & (num_buckets - 1)``, ascending) when ``num_buckets`` > 0."""
    ids = ids.contiguous().to(torch.int64)
    n = ids.numel()
    uniq, inverse = torch.empty_like(ids), torch.empty_like(ids)
    work = torch.empty(6 * n + max(num_buckets, 0) + 3, dtype=torch.int64)  # a set of pow2(2n) <= 4n + 2 entries
    m = library().hkv_unique(ids.data_ptr(), n, num_buckets, uniq.data_ptr(), inverse.data_ptr(), work.data_ptr())
    return uniq[:m], inverse


def pool_backward(grad: torch.Tensor, offsets: torch.Tensor, inverse: torch.Tensor, mean: bool,
                  num_rows: int) -> torch.Tensor:
    """The gradient of sum / mean pooling with respect to the pooled unique rows (float32 CPU tensors)."""
    grad, offsets, inverse = grad.contiguous(), offsets.contiguous().to(torch.int64), inverse.contiguous()
    out = grad.new_empty(num_rows, grad.shape[1])
    library().hkv_pool_backward(grad.data_ptr(), offsets.data_ptr(), offsets.numel(), inverse.data_ptr(),
                                inverse.numel(), grad.shape[1], int(mean), out.data_ptr(), num_rows)
    return out
