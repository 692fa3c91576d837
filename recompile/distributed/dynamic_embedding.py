"""Dynamic (hkv) embedding tables sharded row-wise by key hash, trained with an exact SGD in the backward.

``DynamicEmbeddingBag`` is called like ``nn.EmbeddingBag`` with raw int64 keys. Each rank's rows live in
an ``hkv.HashTable`` holding exactly the keys with ``hash_owner(key) == rank``; ``sharded_lookup`` sends
every key to its owner, which looks it up (inserting it on first sight in training; eval never inserts).
As in DynamicEmb and TBE, the optimizer runs in the backward: the owner sums the gradients of each key
over every rank that asked for it and applies ``row -= lr * grad`` to its table, so these rows are not
parameters of any torch optimizer. A new key's row is a function of the key alone (uniform in
``[-init_scale, init_scale]``), so it is the same whichever rank inserts it, in one process or on many.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from hkv import HashTable
from hkv.table import mix64
from recompile.distributed.env import world
from recompile.distributed.sharded_embedding import POOLING_MODES, sharded_lookup
from recompile.distributed.sharding import Sharding

_MANTISSA = float(1 << 53)


def key_init(keys: torch.Tensor, dim: int, scale: float) -> torch.Tensor:
    """Rows uniform in [-scale, scale), a deterministic function of each key."""
    cells = keys.unsqueeze(1) * dim + torch.arange(dim, device=keys.device)
    bits = (mix64(cells) >> 11) & ((1 << 53) - 1)
    return (bits.to(torch.float64) / _MANTISSA * 2 - 1).mul(scale).to(torch.float32)


class _TableRows(torch.autograd.Function):
    """Rows of ``keys`` from ``module``'s table; backward applies the SGD step to the table itself."""

    @staticmethod
    def forward(ctx, anchor, keys, module):
        ctx.keys, ctx.module = keys, module
        return module.find_rows(keys)

    @staticmethod
    def backward(ctx, grad):
        ctx.module.apply_gradients(ctx.keys, grad)
        return None, None, None


class DynamicEmbeddingBag(nn.Module):
    def __init__(self, name: str, embedding_dim: int, mode: str = "sum", lr: float = 0.01,
                 init_scale: float = 0.05, capacity: int = 1 << 12, max_capacity: int = 1 << 24,
                 dedup: bool = True, include_last_offset: bool = False):
        super().__init__()
        if mode not in POOLING_MODES:
            raise ValueError(f"table {name!r}: pooling mode {mode!r} is not one of {POOLING_MODES}")
        self.name, self.embedding_dim, self.mode, self.lr = name, embedding_dim, mode, lr
        self.init_scale, self.dedup, self.include_last_offset = init_scale, dedup, include_last_offset
        self.sharding = Sharding("hash_row_wise")
        self.table = HashTable(embedding_dim, capacity, max_capacity, name=f"table {name!r}")

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

    def find_rows(self, keys: torch.Tensor) -> torch.Tensor:
        if self.training:
            return self.table.find_or_insert(keys, init=key_init(keys, self.embedding_dim, self.init_scale))
        return self.table.find(keys)[0]

    def apply_gradients(self, keys: torch.Tensor, grad: torch.Tensor) -> None:
        unique, inverse = torch.unique(keys, return_inverse=True)
        total = torch.zeros(unique.numel(), self.embedding_dim, dtype=grad.dtype).index_add_(0, inverse, grad)
        rows, found = self.table.find(unique)
        if not bool(found.all()):
            raise RuntimeError(f"table {self.name!r}: key {int(unique[~found][0])} was evicted between its lookup "
                               f"and its gradient; raise max_capacity")
        self.table.assign(unique, rows - self.lr * total)

    def lookup_local(self, keys: torch.Tensor) -> torch.Tensor:
        anchor = torch.empty(0, requires_grad=torch.is_grad_enabled() and self.training)
        return _TableRows.apply(anchor, keys, self)

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        return sharded_lookup([self], [(input, offsets, per_sample_weights)])[0]
