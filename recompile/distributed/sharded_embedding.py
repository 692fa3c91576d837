"""Model-parallel embedding tables: ids travel to the rank owning their rows, rows travel back, pooled locally.

One lookup over T sharded tables on W ranks (Rec SDK's and DynamicEmb's flow):

1. per table, this rank deduplicates its ids (``torch.unique``) and orders the unique ids by owner rank;
2. ``all_to_all_single`` of the id counts [W, T], then of the ids themselves, ordered (rank, table);
3. each owner looks up the rows it received, all tables of the round in one call (``lookup_rows``, which
   ``compile_lookups`` compiles with rec_ascend; its lookups are unpooled and of different lengths per table,
   which the embedding pass's grouped op does not express, so they compile as plain gathers);
4. ``all_to_all_single`` of the rows back (differentiable: backward sends the row gradients to the owner,
   summed over the duplicate ids of each rank);
5. the requester pools its bags from the returned rows (``F.embedding_bag`` over the unique rows).

A table called on its own makes one such round for itself. ``prefetch`` makes one round for many tables
(``distribute(model, features=...)`` runs it before the model's forward), and the tables' calls then
return their part of it: one set of collectives per step instead of one per table.

Gradients arriving at a shard are scaled by ``grad_scale`` (1 / world_size by default) so that, like DDP's
averaging of dense gradients, every parameter gets the gradient of the mean of the ranks' losses.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from recompile.distributed.comm import all_to_all, all_to_all_rows, exchange_counts
from recompile.distributed.env import world
from recompile.distributed.sharding import Sharding

POOLING_MODES = ("sum", "mean", "none")


def lookup_rows(weights: Sequence[torch.Tensor], ids: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The owner side of a lookup: rows of every local shard, one ``F.embedding`` per table."""
    return [F.embedding(i, w) for w, i in zip(weights, ids)]


class ShardedEmbeddingBag(nn.Module):
    """A static table's local shard; called like ``nn.EmbeddingBag`` (or ``nn.Embedding`` with mode "none")."""

    def __init__(self, name: str, num_embeddings: int, embedding_dim: int, sharding: Sharding,
                 mode: str = "sum", include_last_offset: bool = False, weight: torch.Tensor | None = None,
                 dedup: bool = True, grad_scale: float | None = None):
        super().__init__()
        if mode not in POOLING_MODES:
            raise ValueError(f"table {name!r}: pooling mode {mode!r} is not supported when sharded; "
                             f"supported: {POOLING_MODES}")
        rank, world_size = world()
        self.name, self.num_embeddings, self.embedding_dim = name, num_embeddings, embedding_dim
        self.sharding, self.mode, self.include_last_offset, self.dedup = sharding, mode, include_last_offset, dedup
        self.grad_scale = 1.0 / world_size if grad_scale is None else grad_scale
        self.row_start, self.row_end = sharding.row_range(rank, num_embeddings, world_size)
        rows = weight[self.row_start:self.row_end].detach().clone() if weight is not None else \
            torch.empty(self.row_end - self.row_start, embedding_dim).normal_()
        self.weight = nn.Parameter(rows)
        self.lookup_fn: Callable = lookup_rows
        self.prefetched: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, result) of a ``prefetch``

    @classmethod
    def from_module(cls, name: str, module: nn.Module, sharding: Sharding, **kwargs) -> "ShardedEmbeddingBag":
        """Shard an ``nn.EmbeddingBag`` or ``nn.Embedding``; raises for options a shard cannot reproduce."""
        if getattr(module, "padding_idx", None) is not None or getattr(module, "max_norm", None) is not None \
                or getattr(module, "sparse", False):
            raise ValueError(f"table {name!r}: padding_idx, max_norm and sparse=True are not supported when sharded")
        mode = module.mode if isinstance(module, nn.EmbeddingBag) else "none"
        return cls(name, module.num_embeddings, module.embedding_dim, sharding, mode=mode,
                   include_last_offset=getattr(module, "include_last_offset", False), weight=module.weight, **kwargs)

    def extra_repr(self) -> str:
        return (f"{self.name!r}, {self.num_embeddings}, {self.embedding_dim}, {self.sharding.describe()}, "
                f"rows=[{self.row_start}, {self.row_end}), mode={self.mode!r}, dedup={self.dedup}")

    def owner_of(self, ids: torch.Tensor, world_size: int) -> torch.Tensor:
        return self.sharding.owner_of(ids, self.num_embeddings, world_size)

    def check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            bad = ids[(ids < 0) | (ids >= self.num_embeddings)][0]
            raise IndexError(f"table {self.name!r}: id {int(bad)} is outside [0, {self.num_embeddings})")

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        prefetched = take_prefetched(self, input)
        if prefetched is not None:
            return prefetched
        return sharded_lookup([self], [(input, offsets, per_sample_weights)])[0]


@torch._dynamo.disable
def prefetch(tables: Sequence[nn.Module], features: Sequence[tuple]) -> None:
    """Look ``features`` up in ``tables`` in one round of all-to-alls; each table's next call returns its result."""
    for table, feature, result in zip(tables, features, sharded_lookup(tables, features)):
        table.prefetched = (feature[0], result)


@torch._dynamo.disable
def take_prefetched(table: nn.Module, input: torch.Tensor) -> torch.Tensor | None:
    ready, table.prefetched = table.prefetched, None
    if ready is None:
        return None
    if ready[0] is not input:
        raise RuntimeError(f"table {table.name!r} was called with other ids than the ones prefetched for it: the "
                           f"features function given to distribute must return the tensors the model passes it")
    return ready[1]


def _bags(table: nn.Module, ids: torch.Tensor, offsets: torch.Tensor | None, psw: torch.Tensor | None):
    """1-D ids and offsets (2-D input: one bag per row), ids as int64."""
    if ids.dim() == 2:
        if offsets is not None:
            raise ValueError(f"table {table.name!r}: offsets must be None for a 2-D input")
        offsets = torch.arange(0, ids.numel(), ids.shape[1], device=ids.device)
        ids = ids.reshape(-1)
        psw = psw.reshape(-1) if psw is not None else None
    return ids.long(), offsets, psw


@torch._dynamo.disable  # the collectives run between compiled graphs; their splits depend on the data
def sharded_lookup(tables: Sequence[nn.Module], features: Sequence[tuple]) -> list[torch.Tensor]:
    """Look up ``features[t] = (ids, offsets, per_sample_weights)`` in sharded ``tables[t]`` (see module doc)."""
    rank, world_size = world()
    send_ids, send_counts, positions = [], [], []
    for table, (ids, _, _) in zip(tables, features):
        ids = ids.reshape(-1).long()
        if hasattr(table, "check_ids"):
            table.check_ids(ids)
        unique, inverse = torch.unique(ids, return_inverse=True) if table.dedup else \
            (ids, torch.arange(ids.numel(), device=ids.device))
        owners = table.owner_of(unique, world_size)
        order = torch.argsort(owners, stable=True)
        send_ids.append(unique[order])
        send_counts.append(torch.bincount(owners, minlength=world_size))
        positions.append(torch.argsort(order)[inverse])  # where each id's row comes back
    counts = torch.stack(send_counts, dim=1)  # [W, T]: ids this rank sends to each rank, per table
    # [W, T]: ids each rank sends here, per table; the split arithmetic below runs on the host.
    counts, recv_counts = counts.cpu(), exchange_counts(counts).cpu()
    received = all_to_all(_by_rank_then_table(send_ids, counts), counts.sum(1).tolist(),
                          recv_counts.sum(1).tolist(), "ids")
    local_ids = _per_table(received, recv_counts, [1] * len(tables))
    rows = _local_rows(tables, [table_ids.view(-1) for table_ids in local_ids])
    dims = [table.embedding_dim for table in tables]
    recv_values, send_values = recv_counts * torch.tensor(dims), counts * torch.tensor(dims)
    back = _by_rank_then_table([r.reshape(-1) for r in rows], recv_values)
    got = all_to_all_rows(back, recv_values.sum(1).tolist(), send_values.sum(1).tolist(), tables[0].grad_scale)
    table_rows = _per_table(got, counts, dims)
    return [_pool(table, r, pos, feature) for table, r, pos, feature in zip(tables, table_rows, positions, features)]


def _by_rank_then_table(per_table: Sequence[torch.Tensor], counts: torch.Tensor) -> torch.Tensor:
    """Concatenate ``per_table[t]`` (already ordered by destination rank, ``counts[:, t]`` each) as (rank, table)."""
    pieces = [torch.split(t, counts[:, i].tolist()) for i, t in enumerate(per_table)]
    return torch.cat([pieces[t][r] for r in range(counts.shape[0]) for t in range(counts.shape[1])])


def _per_table(flat: torch.Tensor, counts: torch.Tensor, dims: Sequence[int]) -> list[torch.Tensor]:
    """Inverse of ``_by_rank_then_table`` for received data: per table, [sum_r counts[r, t], dims[t]]."""
    world_size, num_tables = counts.shape
    sizes = [int(counts[r, t]) * dims[t] for r in range(world_size) for t in range(num_tables)]
    pieces = torch.split(flat, sizes)
    return [torch.cat([pieces[r * num_tables + t] for r in range(world_size)]).view(-1, dims[t])
            for t in range(num_tables)]


def _local_rows(tables: Sequence[nn.Module], ids: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rows for the ids received by this rank: static tables in one grouped call, dynamic tables on their own."""
    static = [i for i, t in enumerate(tables) if isinstance(t, ShardedEmbeddingBag)]
    rows: list = [None] * len(tables)
    if static:
        local = [ids[i] - tables[i].row_start for i in static]
        # Views, not the Parameters: Dynamo specialises parameter shapes, and shards differ in size.
        weights = [tables[i].weight.view_as(tables[i].weight) for i in static]
        for i, r in zip(static, tables[static[0]].lookup_fn(weights, local)):
            rows[i] = r
    for i, table in enumerate(tables):
        if rows[i] is None:
            rows[i] = table.lookup_local(ids[i])
    return rows


def _pool(table: nn.Module, rows: torch.Tensor, positions: torch.Tensor, feature: tuple) -> torch.Tensor:
    ids, offsets, psw = _bags(table, *feature)
    if table.mode == "none":
        return F.embedding(positions, rows).view(*feature[0].shape, table.embedding_dim)
    return F.embedding_bag(positions, rows, offsets, mode=table.mode, per_sample_weights=psw,
                           include_last_offset=table.include_last_offset)
