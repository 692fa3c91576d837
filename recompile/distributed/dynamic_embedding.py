"""Dynamic (hkv) embedding tables sharded row-wise by key hash.

``distribute`` replaces each ``hkv.DynamicEmbeddingBag`` / ``hkv.DynamicEmbedding`` with a
``ShardedDynamicEmbeddingBag`` that keeps its runtime (hash table, initialiser, row-resident optimizer):
on each rank the table holds exactly the keys with ``hash_owner(key) == rank``. ``sharded_lookup`` sends
every key to its owner, which looks the distinct keys it received up (inserting unseen ones in training; eval
never inserts) and pools them into the requesters' bags. Training stays fused as in hkv: the pooled gradients
come back to the owner, whose pooling backward gives each key's gradient summed over every bag of every rank
that asked for it, and the owner applies the table's optimizer to those rows in the backward.

New rows come from the table's initialiser on the owner; with a random initialiser a key's first value
depends on the order keys arrive, so only a deterministic one (constant) gives a table equal, key for key,
to the one a single process would build.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from hkv import DynamicEmbeddingBag
from recompile.distributed.env import world
from recompile.distributed.sharded_embedding import sharded_lookup, take_prefetched
from recompile.distributed.sharding import Sharding


class _OwnerRows(torch.autograd.Function):
    """Rows of the keys this rank received; backward runs the table's optimizer on them."""

    @staticmethod
    def forward(ctx, weight, keys, runtime, train):
        ctx.keys, ctx.runtime = keys, runtime
        return runtime.lookup(keys, train)

    @staticmethod
    def backward(ctx, grad):
        unique, inverse = torch.unique(ctx.keys, return_inverse=True)
        total = grad.new_zeros(unique.numel(), grad.shape[1]).index_add_(0, inverse, grad)
        ctx.runtime.update(unique, total)
        return None, None, None, None


class ShardedDynamicEmbeddingBag(nn.Module):
    """This rank's part of an hkv dynamic table; called like the module it replaces."""

    def __init__(self, name: str, module: DynamicEmbeddingBag, dedup: bool = True):
        super().__init__()
        self.name, self.dedup, self.mode = name, dedup, module.mode
        self.include_last_offset = False
        self.sharding = Sharding("hash_row_wise")
        self.runtime = module.runtime
        self.weight = module.weight  # empty: carries autograd to the fused update
        self.embedding_dim = module.runtime.dim
        self.prefetched = None  # (ids, result) of a ``prefetch``

    @property
    def table(self):
        return self.runtime.table

    @property
    def num_embeddings(self) -> int:
        return self.table.size()

    @property
    def grad_scale(self) -> float:
        return 1.0 / world()[1]

    def extra_repr(self) -> str:
        return f"{self.name!r}, dim={self.embedding_dim}, mode={self.mode!r}, keys here={self.table.size()}"

    def owner_of(self, keys: torch.Tensor, world_size: int) -> torch.Tensor:
        return self.sharding.owner_of(keys, 0, world_size)

    def holders(self, world_size: int) -> list[int]:
        return self.sharding.holders(0, world_size)

    def lookup_local(self, keys: torch.Tensor) -> torch.Tensor:
        return _OwnerRows.apply(self.weight, keys, self.runtime, self.training)

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        prefetched = take_prefetched(self, input)
        if prefetched is not None:
            return prefetched
        return sharded_lookup([self], [(input, offsets, None)])[0]
