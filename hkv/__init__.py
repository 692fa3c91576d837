"""hkv: HierarchicalKV embedding hash tables on torch tensors; usable on its own.

- ``hkv.HashTable``: HierarchicalKV's hash table API (insert_or_assign, find, find_or_insert,
  insert_and_evict, erase_if, export_batch, save/load, ...) with its eviction strategies.
- Storage tiers (device memory, host memory, a disk file) and admission filters; rows stored as a float dtype
  or row-wise quantized (``dtype="int8" | "int4"``, ``hkv.rowwise``: FBGEMM's fused layouts).
- ``hkv.DynamicEmbedding`` / ``hkv.DynamicEmbeddingBag``: modules over raw int64 ids with fused
  row-wise optimizers, calling ``torch.ops.hkv.*`` (``hkv.ops``); ``hkv.Prefetcher`` overlaps the
  next batch's table inserts with the current step.
"""
from hkv import ops  # noqa: F401  (defines torch.ops.hkv.*)
from hkv.admission import CBFFilter, CounterFilter
from hkv.checkpoint import CheckpointError
from hkv.embedding import (
    DynamicEmbedding, DynamicEmbeddingBag, DynamicEmbInitializerArgs, DynamicEmbInitializerMode,
    DynamicEmbTableOptions,
)
from hkv.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from hkv.prefetch import Prefetcher
from hkv.table import EMPTY_KEY, LOCKED_KEY, RECLAIM_KEY, RESERVED_KEYS, EvictStrategy, HashTable

__all__ = [
    "Adagrad", "Adam", "CBFFilter", "CheckpointError", "CounterFilter", "DynamicEmbInitializerArgs",
    "DynamicEmbInitializerMode", "DynamicEmbTableOptions", "DynamicEmbedding", "DynamicEmbeddingBag", "EMPTY_KEY",
    "EvictStrategy", "HashTable", "LOCKED_KEY", "Prefetcher", "RECLAIM_KEY", "RESERVED_KEYS", "RowWiseAdagrad", "SGD",
]
