"""Where a table's rows live: table-wise (one rank), row-wise (contiguous row blocks), hash row-wise (by key hash).

A ``Sharding`` answers two questions every rank must agree on: which rank owns an id, and which global
rows a rank holds (static tables). Dynamic (hkv) tables have no row range: a key lives on
``hash(key) % world_size``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SHARDING_KINDS = ("table_wise", "row_wise", "hash_row_wise")
# Odd 64-bit constant (2^64 / golden ratio, as a signed int64) of Fibonacci hashing.
_GOLDEN = -7046029254386353131


@dataclass(frozen=True)
class Sharding:
    kind: str
    rank: int = 0  # the owner of a table_wise table

    def __post_init__(self):
        if self.kind not in SHARDING_KINDS:
            raise ValueError(f"sharding kind {self.kind!r} is not one of {SHARDING_KINDS}")

    def describe(self) -> str:
        return f"table_wise@{self.rank}" if self.kind == "table_wise" else self.kind

    def owner_of(self, ids: torch.Tensor, num_rows: int, world_size: int) -> torch.Tensor:
        if self.kind == "table_wise":
            return torch.full_like(ids, self.rank)
        if self.kind == "row_wise":
            return torch.div(ids, block_rows(num_rows, world_size), rounding_mode="floor")
        return hash_owner(ids, world_size)

    def row_range(self, rank: int, num_rows: int, world_size: int) -> tuple[int, int]:
        """The global rows [start, end) that ``rank`` holds (static tables)."""
        if self.kind == "table_wise":
            return (0, num_rows) if rank == self.rank else (0, 0)
        if self.kind == "row_wise":
            block = block_rows(num_rows, world_size)
            return min(rank * block, num_rows), min((rank + 1) * block, num_rows)
        raise ValueError("hash_row_wise tables have no row range: keys live on hash(key) % world_size")


def block_rows(num_rows: int, world_size: int) -> int:
    return -(-num_rows // world_size)


def hash_owner(keys: torch.Tensor, world_size: int) -> torch.Tensor:
    """The rank owning each int64 key: a multiplicative hash mixed down, modulo the world size."""
    mixed = keys * _GOLDEN
    mixed = mixed ^ (mixed >> 31)
    return torch.remainder(mixed, world_size)
