"""The CPU kernel of hkv tables (``csrc/probe.c``), built on first use by ``hkv.native``, called through ctypes.

Without a C compiler the kernel is simply unavailable and tables probe with the vectorised torch code.
"""
from __future__ import annotations

import os

import torch

from hkv.native import i32, i64, load, ptr

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "probe.c")
SIGNATURES = (
    ("hkv_locate", (ptr, i64, i64, ptr, i64, ptr, i32)),
    ("hkv_find", (ptr, i64, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, i32)),
    ("hkv_claim", (ptr, ptr, i64, i64, ptr, ptr, i64, ptr, i32)),
)


def library():
    """The built kernel library, or None when no C compiler is present."""
    return load(SOURCE, SIGNATURES)


def available() -> bool:
    return library() is not None


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
