"""Model-parallel embedding tables: ids travel to the ranks holding their rows, pooled bags travel back.

One lookup over T sharded tables on W ranks (TorchRec's table-wise / row-wise sharding):

1. per table, this rank orders its ids by owner rank (keeping each bag's ids together) and, with ``dedup``,
   sends each owner the distinct ids it needs plus, per id, its position among them (when that is fewer bytes
   than the ids themselves), with the number of ids each bag has on that owner (its ``lengths``);
2. ``all_to_all_single`` of the counts [W, T, 4], then of the ids (int64), then of the bags' structure
   (positions, lengths and per-sample weights, int32), all tables of the round at once, ordered (rank, table);
3. each owner pools, for every rank, the bags it received from that rank over the rows it holds: a
   table-wise owner the whole bags of every rank's batch slice, a row-wise owner the part of each bag in its
   row block. Its static tables are pooled in one call (``pool_local``: one ``F.embedding_bag`` per table,
   concatenated when the tables have the same number of bags, which the embedding pass groups into one
   ``recompile::grouped_embedding_bag`` when ``compile_lookups`` compiles it with rec_ascend);
4. ``all_to_all_single`` of the pooled [bags, D] results back (differentiable: the backward sends the pooled
   gradients to the owners, whose ``F.embedding_bag`` backward turns them into row gradients);
5. the requester sums the partial results of each bag over its owners (one owner for table-wise tables)
   and divides by the bag's length for mean pooling.

Unpooled tables (``nn.Embedding``, mode "none") ask each owner for their distinct ids as bags of one id and
expand the rows returned. A table called on its own makes one such round for itself. ``prefetch`` makes one
round for many tables (``distribute(model, features=...)`` runs it before the model's forward), and the
tables' calls then return their part of it: one set of collectives per step instead of one per table.

Gradients arriving at a shard are scaled by ``grad_scale`` (1 / world_size by default) so that, like DDP's
averaging of dense gradients, every parameter gets the gradient of the mean of the ranks' losses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from recompile.distributed.comm import all_to_all, all_to_all_rows, exchange_counts
from recompile.distributed.env import world
from recompile.distributed.sharding import Sharding

POOLING_MODES = ("sum", "mean", "none")
# Columns of the per-(rank, table) counts exchanged first.
KEYS, POSITIONS, BAGS, WEIGHTS = range(4)


def pool_local(weights: Sequence[torch.Tensor], ids: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor],
               per_sample_weights: Sequence[torch.Tensor | None], concat: bool):
    """The owner side of a lookup: every local shard's bags, summed; ``[K, sum(D)]`` when ``concat`` (all tables
    have K bags), else one ``[K_t, D_t]`` per table."""
    pooled = [F.embedding_bag(i, w, o, mode="sum", per_sample_weights=p)
              for w, i, o, p in zip(weights, ids, offsets, per_sample_weights)]
    return torch.cat(pooled, dim=1) if concat else pooled


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
        if sharding.rank + sharding.span(world_size) > world_size:
            raise ValueError(f"table {name!r}: sharding {sharding.describe()} needs ranks up to "
                             f"{sharding.rank + sharding.span(world_size) - 1}, the process group has {world_size}")
        self.name, self.num_embeddings, self.embedding_dim = name, num_embeddings, embedding_dim
        self.sharding, self.mode, self.include_last_offset, self.dedup = sharding, mode, include_last_offset, dedup
        self.grad_scale = 1.0 / world_size if grad_scale is None else grad_scale
        self.row_start, self.row_end = sharding.row_range(rank, num_embeddings, world_size)
        rows = weight[self.row_start:self.row_end].detach().clone() if weight is not None else \
            torch.empty(self.row_end - self.row_start, embedding_dim).normal_()
        self.weight = nn.Parameter(rows)
        self.lookup_fn: Callable = pool_local
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

    def holders(self, world_size: int) -> list[int]:
        return self.sharding.holders(self.num_embeddings, world_size)

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


@dataclass
class Request:
    """One table's part of a round, on the requesting rank: what goes to each owner, how answers come together."""

    table: nn.Module
    counts: torch.Tensor  # [W, 4]: keys, positions, bags, weights sent to each rank
    keys: torch.Tensor  # int64, ordered by owner
    structure: torch.Tensor  # int32, per owner: positions, bag lengths, weight bits
    slots: torch.Tensor  # where each returned row goes in the [size, D] result, ordered by owner
    size: int
    lengths: torch.Tensor | None  # ids per bag (mean pooling divides by it)
    inverse: torch.Tensor | None  # unpooled tables: the result row of each id
    shape: tuple


def _lengths(table: nn.Module, ids: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """Ids per bag: one bag per row of a 2-D input, else from ``offsets``."""
    if ids.dim() == 2:
        if offsets is not None:
            raise ValueError(f"table {table.name!r}: offsets must be None for a 2-D input")
        return torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long, device=ids.device)
    if offsets is None:
        raise ValueError(f"table {table.name!r}: 1-D ids need offsets")
    ends = offsets[1:] if table.include_last_offset else torch.cat([offsets[1:], offsets.new_tensor([ids.numel()])])
    return (ends - offsets[:ends.numel()]).long()


def _request(table: nn.Module, feature: tuple, world_size: int) -> Request:
    ids, offsets, psw = (*feature, None)[:3]
    if psw is not None and (psw.requires_grad or table.mode != "sum"):
        raise ValueError(f"table {table.name!r}: per_sample_weights need mode 'sum' (the table's is {table.mode!r}) "
                         f"and no gradient when sharded")
    flat = ids.reshape(-1).long()
    if hasattr(table, "check_ids"):
        table.check_ids(flat)
    inverse = None
    if table.mode == "none":  # each distinct id is a bag of one, on its owner only
        if table.dedup:
            flat, inverse = torch.unique(flat, return_inverse=True)
        bag_lengths, psw = None, None
    else:
        bag_lengths = _lengths(table, ids, offsets)
        psw = psw.reshape(-1) if psw is not None else None
    owners = table.owner_of(flat, world_size)
    order = torch.argsort(owners, stable=True)  # by owner, each bag's ids still together and in bag order
    sent = torch.bincount(owners, minlength=world_size)
    # Unpooled ids are distinct already (with dedup).
    static_rows = table.num_embeddings if isinstance(table, ShardedEmbeddingBag) else None
    keys, positions, key_counts = _dedup(flat[order], owners[order], sent, table.dedup and bag_lengths is not None,
                                         static_rows)
    if bag_lengths is None:  # unpooled: the owner returns one row per id, in the order sent
        per_owner_lengths = [torch.ones(int(n), dtype=torch.long, device=flat.device) for n in sent]
        slots, size = order, flat.numel()
    else:
        bag_of = torch.repeat_interleave(torch.arange(bag_lengths.numel(), device=flat.device), bag_lengths)
        per_bag = torch.bincount(owners * bag_lengths.numel() + bag_of, minlength=world_size * bag_lengths.numel())
        per_owner = per_bag.view(world_size, -1)
        holders = table.holders(world_size)
        per_owner_lengths = [per_owner[r] if r in holders else per_owner[r, :0] for r in range(world_size)]
        size = bag_lengths.numel()
        slots = torch.arange(size, device=flat.device).repeat(len(holders))
    bags = torch.tensor([lengths.numel() for lengths in per_owner_lengths], device=flat.device)
    weights = psw[order] if psw is not None else None
    counts = torch.stack([key_counts, sent if positions is not None else torch.zeros_like(sent), bags,
                          sent if weights is not None else torch.zeros_like(sent)], dim=1)
    structure = torch.cat([piece.to(torch.int32) for r in range(world_size) for piece in (
        _slice(positions, sent, r, flat.device), per_owner_lengths[r], _slice(_bits(weights), sent, r, flat.device))])
    return Request(table, counts, keys, structure, slots, size, bag_lengths, inverse, tuple(ids.shape))


def _dedup(ids: torch.Tensor, owners: torch.Tensor, sent: torch.Tensor, dedup: bool, rows: int | None):
    """(keys, positions of the ids among them or None, keys per owner) for ids ordered by owner (``sent`` per
    owner). With ``dedup``, the distinct ids of each owner go, with each id's position among them, when that is
    fewer bytes (8 per key, 4 per position) than the ids alone (8 per id). ``rows``: a static table's rows (its
    owners are row blocks, so sorted ids are in owner order); None for a dynamic table's hashed keys."""
    if not dedup or ids.numel() == 0:
        return ids, None, sent
    unique, inverse = _unique(ids, rows)
    if 2 * unique.numel() >= ids.numel():
        return ids, None, sent
    unique_owners = owners.new_empty(unique.numel()).scatter_(0, inverse, owners)
    if rows is None:  # hashed keys: order the distinct keys by owner
        order = torch.argsort(unique_owners, stable=True)
        unique, unique_owners, inverse = unique[order], unique_owners[order], torch.argsort(order)[inverse]
    key_counts = torch.bincount(unique_owners, minlength=sent.numel())
    starts = torch.cumsum(key_counts, 0) - key_counts
    return unique, inverse - starts[owners], key_counts


def _unique(ids: torch.Tensor, rows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted distinct ids and each id's index among them: through a presence table over the rows when that is
    not much larger than the ids (3x faster than sorting on CPU), else ``torch.unique``."""
    if rows is None or rows > 8 * ids.numel():
        return torch.unique(ids, return_inverse=True)
    present = torch.zeros(rows, dtype=torch.bool, device=ids.device)
    present[ids] = True
    unique = present.nonzero().squeeze(1)
    index = torch.empty(rows, dtype=torch.long, device=ids.device)
    index[unique] = torch.arange(unique.numel(), device=ids.device)
    return unique, index[ids]


def _bits(weights: torch.Tensor | None) -> torch.Tensor | None:
    return weights.to(torch.float32).view(torch.int32) if weights is not None else None


def _slice(t: torch.Tensor | None, counts: torch.Tensor, rank: int, device: torch.device) -> torch.Tensor:
    if t is None:
        return torch.empty(0, dtype=torch.int32, device=device)
    start = int(counts[:rank].sum())
    return t[start:start + int(counts[rank])]


@torch._dynamo.disable  # the collectives run between compiled graphs; their splits depend on the data
def sharded_lookup(tables: Sequence[nn.Module], features: Sequence[tuple]) -> list[torch.Tensor]:
    """Look up ``features[t] = (ids, offsets, per_sample_weights)`` in sharded ``tables[t]`` (see module doc)."""
    _, world_size = world()
    requests = [_request(table, feature, world_size) for table, feature in zip(tables, features)]
    sent = torch.stack([r.counts for r in requests], dim=1)  # [W, T, 4], what this rank sends each rank
    # [W, T, 4]: what each rank sends here; the split arithmetic runs on the host.
    tag = f"tables {[t.name for t in tables]}"
    received = exchange_counts(sent.reshape(world_size, -1), tag).view(world_size, len(tables), 4).cpu()
    sent = sent.cpu()
    key_sizes, recv_key_sizes = sent[..., KEYS], received[..., KEYS]
    keys = all_to_all(_by_rank_then_table([r.keys for r in requests], key_sizes), key_sizes.sum(1).tolist(),
                      recv_key_sizes.sum(1).tolist(), "ids")
    struct_sizes, recv_struct_sizes = sent[..., 1:].sum(-1), received[..., 1:].sum(-1)
    structure = all_to_all(_by_rank_then_table([r.structure for r in requests], struct_sizes),
                           struct_sizes.sum(1).tolist(), recv_struct_sizes.sum(1).tolist(), "bags")
    pooled = _pool_received(tables, _split(keys, recv_key_sizes), _split(structure, recv_struct_sizes), received)
    dims = torch.tensor([t.embedding_dim for t in tables])
    send_values, recv_values = received[..., BAGS] * dims, sent[..., BAGS] * dims
    back = _by_rank_then_table([p.reshape(-1) for p in pooled], send_values)
    got = all_to_all_rows(back, send_values.sum(1).tolist(), recv_values.sum(1).tolist(), tables[0].grad_scale)
    answers = _split(got, recv_values)
    return [_assemble(request, [answers[r][t] for r in range(world_size)])
            for t, request in enumerate(requests)]


def _by_rank_then_table(per_table: Sequence[torch.Tensor], counts: torch.Tensor) -> torch.Tensor:
    """Concatenate ``per_table[t]`` (already ordered by destination rank, ``counts[:, t]`` each) as (rank, table)."""
    pieces = [torch.split(t, counts[:, i].tolist()) for i, t in enumerate(per_table)]
    return torch.cat([pieces[t][r] for r in range(counts.shape[0]) for t in range(counts.shape[1])])


def _split(flat: torch.Tensor, counts: torch.Tensor) -> list[list[torch.Tensor]]:
    """Inverse of ``_by_rank_then_table`` for received data: ``out[rank][table]``."""
    pieces = torch.split(flat, counts.reshape(-1).tolist())
    return [list(pieces[r * counts.shape[1]:(r + 1) * counts.shape[1]]) for r in range(counts.shape[0])]


@dataclass
class Bags:
    """The bags one owner pools for one table, from every rank: ``keys[positions]`` are the ids, in bag order."""

    keys: torch.Tensor
    positions: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None

    @property
    def count(self) -> int:
        return self.offsets.numel()


def _received_bags(keys: list[torch.Tensor], structure: list[torch.Tensor], counts: torch.Tensor) -> Bags:
    """One table's bags from every rank (``counts`` [W, 4]), with positions into the concatenated keys."""
    positions, lengths, weights, start = [], [], [], 0
    for k, s, (n_keys, n_positions, n_bags, n_weights) in zip(keys, structure, counts.tolist()):
        pos, bag_lengths, bits = torch.split(s, [n_positions, n_bags, n_weights])
        positions.append((pos.long() if n_positions else torch.arange(n_keys, device=s.device)) + start)
        lengths.append(bag_lengths.long())
        weights.append(bits.view(torch.float32) if n_weights else torch.ones(int(bag_lengths.sum()), device=s.device))
        start += n_keys
    lengths = torch.cat(lengths)
    has_weights = bool(counts[:, WEIGHTS].any())
    return Bags(torch.cat(keys), torch.cat(positions), torch.cumsum(lengths, 0) - lengths,
                torch.cat(weights) if has_weights else None)


def _pool_received(tables: Sequence[nn.Module], keys: list[list[torch.Tensor]], structure: list[list[torch.Tensor]],
                   counts: torch.Tensor) -> list[torch.Tensor]:
    """The pooled [bags, D] of every table, for the bags every rank sent here: static tables in one call."""
    world_size = counts.shape[0]
    bags = [_received_bags([keys[r][t] for r in range(world_size)], [structure[r][t] for r in range(world_size)],
                           counts[:, t]) for t in range(len(tables))]
    pooled: list = [None] * len(tables)
    static = [t for t, table in enumerate(tables) if isinstance(table, ShardedEmbeddingBag) and bags[t].count]
    if static:
        ids = [bags[t].keys[bags[t].positions] - tables[t].row_start for t in static]
        # Views, not the Parameters: Dynamo specialises parameter shapes, and shards differ in size.
        weights = [tables[t].weight.view_as(tables[t].weight) for t in static]
        concat = len({bags[t].count for t in static}) == 1
        out = tables[static[0]].lookup_fn(weights, ids, [bags[t].offsets for t in static],
                                          [bags[t].weights for t in static], concat)
        for t, p in zip(static, torch.split(out, [tables[t].embedding_dim for t in static], 1) if concat else out):
            pooled[t] = p
    for t, table in enumerate(tables):
        if pooled[t] is None:  # no bags: still tied to the weight, so every rank takes part in the backward
            pooled[t] = _pool_dynamic(table, bags[t]) if bags[t].count else \
                table.weight[:0].reshape(0, table.embedding_dim)
    return pooled


def _pool_dynamic(table: nn.Module, bags: Bags) -> torch.Tensor:
    """A dynamic table's bags: its rows for the distinct keys received (inserted in training), then pooled."""
    keys, inverse = torch.unique(bags.keys, return_inverse=True)
    return F.embedding_bag(inverse[bags.positions], table.lookup_local(keys), bags.offsets, mode="sum",
                           per_sample_weights=bags.weights)


def _assemble(request: Request, answers: list[torch.Tensor]) -> torch.Tensor:
    """Sum the owners' partial bags (or place the rows of unpooled ids) into this rank's result."""
    table = request.table
    rows = torch.cat(answers).view(-1, table.embedding_dim)
    out = rows.new_zeros(request.size, table.embedding_dim).index_add(0, request.slots, rows)
    if table.mode == "mean":
        return out / request.lengths.clamp(min=1).unsqueeze(1).to(out.dtype)
    if table.mode == "none":
        return (out[request.inverse] if request.inverse is not None else out).view(*request.shape, -1)
    return out
