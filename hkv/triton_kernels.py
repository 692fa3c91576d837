"""Triton kernels of hkv tables, in the subset triton-ascend compiles.

``claim`` stores new keys: the same probe, taking the first free slot by ``tl.atomic_cas``.
``locate``: a persistent 1-D grid (one program per core) loops over tiles of keys; each tile hashes
its keys (fmix64, as ``hkv.table.mix64``), then probes linearly from each key's home position until
every lane has found its key or hit an EMPTY slot (at most ``bucket_size`` rounds). Slot offsets are
int32 (tables below 2**31 slots); the hash itself needs 64-bit integer multiplies.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hkv import table

BLOCK = 256
# hkv.table's reserved keys; globals a kernel reads must be constexpr. A compare-and-swap expecting
# LOCKED_KEY (never stored) never writes.
EMPTY_KEY, RECLAIM_KEY, LOCKED_KEY = (tl.constexpr(key) for key in (table.EMPTY_KEY, table.RECLAIM_KEY, table.LOCKED_KEY))


@triton.jit
def _mix64(k):
    k = k ^ (k >> 33)
    k = k * 0xFF51AFD7ED558CCD
    k = k ^ (k >> 33)
    k = k * 0xC4CEB9FE1A85EC53
    return k ^ (k >> 33)


@triton.jit
def _probe_kernel(table_keys_ptr, table_scores_ptr, keys_ptr, scores_ptr, slots_ptr, n, num_buckets,
                  BUCKET: tl.constexpr, BLOCK: tl.constexpr, CLAIM: tl.constexpr):
    """Per key, the slot holding it (CLAIM False) or the free slot it took (CLAIM True); -1 if none."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    for start in range(pid * BLOCK, n, programs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_range = offs < n
        keys = tl.load(keys_ptr + offs, mask=in_range, other=0)
        h = _mix64(keys.to(tl.uint64, bitcast=True))
        base = (h & (num_buckets - 1).to(tl.uint64)).to(tl.int32) * BUCKET
        pos = ((h >> 40) & (BUCKET - 1)).to(tl.int32)
        slot = tl.full([BLOCK], -1, tl.int32)
        active = in_range
        r = 0
        while (r < BUCKET) & (tl.max(active.to(tl.int32), 0) > 0):
            s = tl.where(active, base + ((pos + r) & (BUCKET - 1)), 0)
            k = tl.load(table_keys_ptr + s, mask=active, other=LOCKED_KEY)
            if CLAIM:
                free = active & ((k == EMPTY_KEY) | (k == RECLAIM_KEY))
                old = tl.atomic_cas(table_keys_ptr + s, tl.where(free, k, LOCKED_KEY), keys)
                done = free & (old == k)
            else:
                done = active & (k == keys)
                active = active & (k != EMPTY_KEY)
            slot = tl.where(done, s, slot)
            active = active & ~done
            r += 1
        if CLAIM:
            scores = tl.load(scores_ptr + offs, mask=in_range, other=0)
            tl.store(table_scores_ptr + slot, scores, mask=slot >= 0)
        tl.store(slots_ptr + offs, slot.to(tl.int64), mask=in_range)


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


def locate(table_keys: torch.Tensor, num_buckets: int, bucket_size: int, keys: torch.Tensor) -> torch.Tensor:
    """The slot holding each key, -1 where absent (as ``HashTable._probe``)."""
    return _launch(table_keys, table_keys, num_buckets, bucket_size, keys, keys, claim=False)


def claim(table_keys: torch.Tensor, table_scores: torch.Tensor, num_buckets: int, bucket_size: int,
          keys: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Store new unique keys with their scores in free slots (compare-and-swap); -1 where the bucket is full."""
    return _launch(table_keys, table_scores, num_buckets, bucket_size, keys, scores, claim=True)


def _launch(table_keys, table_scores, num_buckets, bucket_size, keys, scores, claim: bool) -> torch.Tensor:
    if table_keys.numel() >= 2**31:
        raise ValueError(f"hkv triton kernels: tables of {table_keys.numel()} slots exceed int32 offsets")
    keys, scores = keys.contiguous(), scores.contiguous()
    slots = torch.empty_like(keys)
    if keys.numel():
        grid = (max(1, min(num_programs(keys.device), triton.cdiv(keys.numel(), BLOCK))),)
        _probe_kernel[grid](table_keys, table_scores, keys, scores, slots, keys.numel(), num_buckets,
                            BUCKET=bucket_size, BLOCK=BLOCK, CLAIM=claim)
    return slots
