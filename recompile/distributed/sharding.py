"""Where a table's rows live: table-wise (one rank), row-wise (contiguous row blocks over a group of ranks),
hash row-wise (by key hash).

A ``Sharding`` answers two questions every rank must agree on: which rank owns an id, and which global
rows a rank holds (static tables). A row-wise table is split into equal blocks over ``ranks`` consecutive
ranks starting at ``rank`` (every rank when ``ranks`` is None; a group of them is TorchRec's table-wise-
row-wise); table-wise is the one-rank case. Dynamic (hkv) tables have no row range: a key lives on
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
    rank: int = 0  # the first rank holding the table (its owner, table-wise)
    ranks: int | None = None  # row_wise: how many ranks from ``rank`` hold blocks of it (None: all of them)

    def __post_init__(self):
        if self.kind not in SHARDING_KINDS:
            raise ValueError(f"sharding kind {self.kind!r} is not one of {SHARDING_KINDS}")

    def span(self, world_size: int) -> int:
        """How many consecutive ranks from ``rank`` hold the table."""
        if self.kind == "table_wise":
            return 1
        return world_size if self.kind == "hash_row_wise" or self.ranks is None else self.ranks

    def describe(self) -> str:
        if self.kind == "table_wise":
            return f"table_wise@{self.rank}"
        if self.kind == "row_wise" and self.ranks is not None:
            return f"row_wise@{self.rank}-{self.rank + self.ranks - 1}"
        return self.kind

    def owner_of(self, ids: torch.Tensor, num_rows: int, world_size: int) -> torch.Tensor:
        if self.kind == "hash_row_wise":
            return hash_owner(ids, world_size)
        return torch.div(ids, block_rows(num_rows, self.span(world_size)), rounding_mode="floor") + self.rank

    def row_range(self, rank: int, num_rows: int, world_size: int) -> tuple[int, int]:
        """The global rows [start, end) that ``rank`` holds (static tables)."""
        if self.kind == "hash_row_wise":
            raise ValueError("hash_row_wise tables have no row range: keys live on hash(key) % world_size")
        span, local = self.span(world_size), rank - self.rank
        if not 0 <= local < span:
            return 0, 0
        block = block_rows(num_rows, span)
        return min(local * block, num_rows), min((local + 1) * block, num_rows)

    def holders(self, num_rows: int, world_size: int) -> list[int]:
        """The ranks holding rows of the table, ascending (every rank for hash row-wise)."""
        if self.kind == "hash_row_wise":
            return list(range(world_size))
        ranges = (self.row_range(r, num_rows, world_size) for r in range(world_size))
        return [r for r, (start, end) in enumerate(ranges) if end > start]


def block_rows(num_rows: int, world_size: int) -> int:
    return max(1, -(-num_rows // world_size))


def hash_owner(keys: torch.Tensor, world_size: int) -> torch.Tensor:
    """The rank owning each int64 key: a multiplicative hash mixed down, modulo the world size."""
    mixed = keys * _GOLDEN
    mixed = mixed ^ (mixed >> 31)
    return torch.remainder(mixed, world_size)
