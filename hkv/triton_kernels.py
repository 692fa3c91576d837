"""Triton kernels of hkv tables, in the subset triton-ascend compiles.

``claim`` stores new keys: the same probe, taking the first free slot by ``tl.atomic_cas``.
``find``: the probe, then each key's row read out in the same program: copied, or, for a table of row-wise quantized
rows (``hkv.rowwise``: int8 / int4 codes, then scale and bias), dequantized into fp32 (``code * scale + bias``, as
``hkv.rowwise.dequantize_rows``; scale and bias assembled from bytes, as a packed row's floats need not be aligned).
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
FIND_BLOCK, MAX_BLOCK_D = 64, 128  # find: keys per tile, and row columns per step (64 x 128 fp32: 32 KB)
ROW_FORMATS = {None: 0, "int8": 1, "int4": 2}  # as hkv.cpu.ROW_FORMATS
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
def _probe(table_keys_ptr, table_scores_ptr, keys, in_range, num_buckets, BUCKET: tl.constexpr, BLOCK: tl.constexpr,
           CLAIM: tl.constexpr):
    """The slot of each of ``keys`` (CLAIM False: holding it; CLAIM True: the free slot it took), -1 if none."""
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
    return slot


@triton.jit
def _probe_kernel(table_keys_ptr, table_scores_ptr, keys_ptr, scores_ptr, slots_ptr, n, num_buckets,
                  BUCKET: tl.constexpr, BLOCK: tl.constexpr, CLAIM: tl.constexpr):
    """Per key, the slot holding it (CLAIM False) or the free slot it took (CLAIM True); -1 if none."""
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_range = offs < n
        keys = tl.load(keys_ptr + offs, mask=in_range, other=0)
        slot = _probe(table_keys_ptr, table_scores_ptr, keys, in_range, num_buckets, BUCKET, BLOCK, CLAIM)
        if CLAIM:
            scores = tl.load(scores_ptr + offs, mask=in_range, other=0)
            tl.store(table_scores_ptr + slot, scores, mask=slot >= 0)
        tl.store(slots_ptr + offs, slot.to(tl.int64), mask=in_range)


@triton.jit
def _le_bytes(ptr, mask, N: tl.constexpr):
    """The ``N``-byte little-endian unsigned integers at byte pointers ``ptr`` (any alignment), as int32 bits."""
    value = tl.zeros(ptr.shape, dtype=tl.int32)
    for i in tl.static_range(N):
        value |= tl.load(ptr + i, mask=mask, other=0).to(tl.int32) << (8 * i)
    return value


@triton.jit
def _find_kernel(table_keys_ptr, values_ptr, keys_ptr, out_ptr, found_ptr, slots_ptr, n, num_buckets, dim, width,
                 BUCKET: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per key: probe, then its row read out into ``out`` (zero where absent): copied (ROW 0), or int8 (1) / int4
    (2) packed bytes of ``width`` per row dequantized into fp32 ``code * scale + bias``."""
    cols = tl.arange(0, BLOCK_D)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_range = offs < n
        keys = tl.load(keys_ptr + offs, mask=in_range, other=0)
        slot = _probe(table_keys_ptr, table_keys_ptr, keys, in_range, num_buckets, BUCKET, BLOCK, False)
        found = slot >= 0
        tl.store(slots_ptr + offs, slot.to(tl.int64), mask=in_range)
        tl.store(found_ptr + offs, found.to(tl.int8), mask=in_range)
        row = values_ptr + tl.where(found, slot, 0) * width
        if ROW == 1:  # fp32 scale and bias after the dim codes
            scale = _le_bytes(row + dim, found, 4).to(tl.float32, bitcast=True)
            bias = _le_bytes(row + dim + 4, found, 4).to(tl.float32, bitcast=True)
        elif ROW == 2:  # fp16 scale and bias after the dim / 2 bytes of codes
            scale = _le_bytes(row + dim // 2, found, 2).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            bias = _le_bytes(row + dim // 2 + 2, found, 2).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        for d0 in range(0, dim, BLOCK_D):
            d = d0 + cols
            load = found[:, None] & (d < dim)[None, :]
            if ROW == 0:
                value = tl.load(row[:, None] + d[None, :], mask=load, other=0.0)
            else:
                if ROW == 1:
                    codes = tl.load(row[:, None] + d[None, :], mask=load, other=0).to(tl.int32)
                else:
                    packed = tl.load(row[:, None] + d[None, :] // 2, mask=load, other=0).to(tl.int32)
                    codes = (packed >> ((d[None, :] & 1) * 4)) & 15
                value = codes.to(tl.float32) * scale[:, None] + bias[:, None]
            value = tl.where(load, value, 0.0)
            tl.store(out_ptr + offs[:, None] * dim + d[None, :], value.to(out_ptr.dtype.element_ty),
                     mask=in_range[:, None] & (d < dim)[None, :])


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


def find(table_keys: torch.Tensor, num_buckets: int, bucket_size: int, values: torch.Tensor, keys: torch.Tensor,
         qdtype: str | None = None, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, found, slots) of ``keys`` in one launch: rows as stored (``qdtype`` None) or, for ``values`` of packed
    ``qdtype`` rows of width ``dim``, dequantized into fp32; zero rows and slot -1 where absent."""
    if qdtype is None:
        dim = values.shape[1]
    if max(table_keys.numel(), values.numel()) >= 2**31:
        raise ValueError(f"hkv triton find: tables of {table_keys.numel()} slots / {values.numel()} value elements "
                         "exceed int32 offsets")
    keys = keys.contiguous()
    n = keys.numel()
    out = torch.empty(n, dim, dtype=torch.float32 if qdtype else values.dtype, device=values.device)
    found = torch.empty(n, dtype=torch.bool, device=keys.device)
    slots = torch.empty_like(keys)
    if n:
        grid = (max(1, min(num_programs(keys.device), triton.cdiv(n, FIND_BLOCK))),)
        _find_kernel[grid](table_keys, values, keys, out, found.view(torch.int8), slots, n, num_buckets, dim,
                           values.shape[1], BUCKET=bucket_size, ROW=ROW_FORMATS[qdtype], BLOCK=FIND_BLOCK,
                           BLOCK_D=min(MAX_BLOCK_D, triton.next_power_of_2(max(dim, 1))))
    return out, found, slots
