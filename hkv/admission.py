"""Admission (DeepRec-style feature filters): a key is stored only after it was seen ``threshold`` times.

Until a key is admitted, ``find_or_insert`` does not store it and returns its initial value.
- ``CounterFilter``: exact counts kept in an hkv table of their own (LFU scores are the counts).
- ``CBFFilter``: a counting Bloom filter, ``num_hashes`` counters per key in a fixed array; the count
  is the smallest of them (may overcount on collisions, never undercounts).
"""
from __future__ import annotations

import torch

from hkv.table import EvictStrategy, HashTable, mix64

# Per-hash seeds (odd 64-bit constants) of the counting Bloom filter.
BLOOM_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
               0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x27D4EB2F165667C5, 0x85EBCA77C2B2AE63)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


class CounterFilter:
    """Admit a key once it has been seen ``threshold`` times (counted exactly, up to ``max_keys`` candidates)."""

    def __init__(self, threshold: int, max_keys: int = 1 << 20, device=None):
        if threshold < 1:
            raise ValueError(f"CounterFilter: threshold must be >= 1, got {threshold}")
        self.threshold = threshold
        self.counts = HashTable(0, min(max_keys, 1 << 14), max_keys, max_load_factor=0.75,
                                evict_strategy=EvictStrategy.LFU, device=device, name="hkv.CounterFilter")

    def admit(self, keys: torch.Tensor) -> torch.Tensor:
        """Count one sighting of each (unique) key; True where the key has now been seen often enough."""
        empty = keys.new_empty(keys.numel(), 0, dtype=torch.float32)
        self.counts.insert_or_assign(keys, empty)
        _, _, seen = self.counts.find(keys, return_scores=True)
        admitted = seen >= self.threshold
        self.counts.erase(keys[admitted])
        return admitted

    def count(self, keys: torch.Tensor) -> torch.Tensor:
        return self.counts.find(keys, return_scores=True)[2]


class CBFFilter:
    """Admit a key once a counting Bloom filter has counted it ``threshold`` times."""

    def __init__(self, threshold: int, num_counters: int = 1 << 22, num_hashes: int = 3, device=None):
        if threshold < 1:
            raise ValueError(f"CBFFilter: threshold must be >= 1, got {threshold}")
        if not 1 <= num_hashes <= len(BLOOM_SEEDS):
            raise ValueError(f"CBFFilter: num_hashes must be in [1, {len(BLOOM_SEEDS)}], got {num_hashes}")
        self.threshold = threshold
        self.counters = torch.zeros(num_counters, dtype=torch.int32, device=device)
        self.seeds = [_signed(c) for c in BLOOM_SEEDS[:num_hashes]]

    def _positions(self, keys: torch.Tensor) -> torch.Tensor:
        m = self.counters.numel()
        return torch.stack([torch.remainder(mix64(keys.to(self.counters.device) * s), m) for s in self.seeds])

    def count(self, keys: torch.Tensor) -> torch.Tensor:
        return self.counters[self._positions(keys)].amin(0).to(torch.int64)

    def admit(self, keys: torch.Tensor) -> torch.Tensor:
        pos = self._positions(keys)
        self.counters.index_add_(0, pos.flatten(), torch.ones(pos.numel(), dtype=torch.int32, device=pos.device))
        return self.counters[pos].amin(0) >= self.threshold
