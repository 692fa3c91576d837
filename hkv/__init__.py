"""hkv: HierarchicalKV embedding hash tables on torch tensors; usable on its own.

- ``hkv.HashTable``: HierarchicalKV's hash table API (insert_or_assign, find, find_or_insert,
  insert_and_evict, erase_if, export_batch, save/load, ...) with its eviction strategies.
- Storage tiers (device memory, host memory, a disk file) and admission filters.
"""
from hkv.admission import CBFFilter, CounterFilter
from hkv.checkpoint import CheckpointError
from hkv.table import EMPTY_KEY, LOCKED_KEY, RECLAIM_KEY, RESERVED_KEYS, EvictStrategy, HashTable

__all__ = [
    "CBFFilter", "CheckpointError", "CounterFilter", "EMPTY_KEY", "EvictStrategy", "HashTable", "LOCKED_KEY",
    "RECLAIM_KEY", "RESERVED_KEYS",
]
