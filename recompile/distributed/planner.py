"""The sharding planner: table sizes, dims, pooling factors and a per-rank memory budget -> a sharding plan.

Cost model (per training step, per rank; ``W`` ranks, ``B`` bags per rank and table, ``p`` ids per bag,
rows of ``d`` values of ``b`` bytes; a table sharded over a group of ``s`` ranks: 1 table-wise, ``W`` row-wise
over every rank, a divisor of ``W`` row-wise over a group; see ``sharded_embedding`` for the exchange):

- a rank's ``n = B * p`` ids of a table of ``R`` rows hold ``u = R * (1 - exp(-n / R))`` distinct ids (the
  expected distinct count of ``n`` uniform draws; skewed real ids deduplicate further, so this is an upper
  bound); each holder gets ``n / s`` of them, ``u / s`` distinct.
- one requester-holder pair moves ``X = ids + 4 B + 2 B d b`` bytes: the ids (``8 n/s``, or with dedup
  ``min(8 u/s + 4 n/s, 8 n/s)``: distinct ids and each id's position among them when that is smaller), the bags'
  lengths, the pooled ``[B, d]`` result coming back and its gradient going to the holder.
- a holder moves ``(W - 1 + s - 1) * X`` bytes (every other rank's requests and its own to the other holders),
  any other rank ``s * X`` (sent and received: what crosses its link).
- a holder pools ``W n / s`` ids, each costing ``3 d b`` bytes of memory traffic (read forward, read and write
  in the update); it holds ``ceil(R / s)`` rows of ``d b (1 + optimizer_slots)`` bytes.
- time = bytes moved / ``network_gbps`` + lookup bytes / ``memory_gbps``.

Table-wise keeps a table's traffic off all but one rank but loads that rank with every rank's bags;
row-wise spreads rows and lookups but every rank exchanges ``[B, d]`` partial sums with every holder, so
it pays off for tables too large (or too hot) for one rank. The planner places tables largest first; for
each it takes, among table-wise on the least loaded rank and row-wise over the least loaded group of each
size (powers of two dividing ``W``, and ``W``), the placement that fits every rank's budget with the smallest
maximum per-rank time, then total time, then maximum memory. Dynamic (hkv) tables are hash row-wise over every
rank. ``fixed`` shardings are taken as given. A table that fits nowhere is an error naming it. This is
TorchRec's planner in miniature: enumerate shardings, estimate, place greedily.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch.nn as nn

from recompile.distributed.sharding import Sharding

ID_BYTES = 8
POSITION_BYTES = LENGTH_BYTES = 4  # int32


@dataclass(frozen=True)
class TableSpec:
    name: str
    rows: int
    dim: int
    pooling: float = 1.0  # mean ids per bag
    dynamic: bool = False  # an hkv table: hash row-wise only, ``rows`` is its expected number of keys
    value_bytes: int = 4
    optimizer_slots: float = 0.0  # optimizer state per value (Adagrad 1, Adam 2, row-wise Adagrad 1 / dim)

    def unique_ids(self, ids: float, dedup: bool) -> float:
        return self.rows * -math.expm1(-ids / self.rows) if dedup and self.rows else ids

    def bytes_per_row(self) -> float:
        return self.dim * self.value_bytes * (1 + self.optimizer_slots)


@dataclass(frozen=True)
class Hardware:
    """One rank; the defaults are an accelerator's (200 Gb/s between ranks, HBM), recompile's target."""

    memory_bytes: float = float("inf")  # per-rank budget for tables and their optimizer state
    network_gbps: float = 25.0  # all-to-all bandwidth per rank, GB/s
    memory_gbps: float = 1500.0  # embedding gather/update bandwidth per rank, GB/s


@dataclass
class RankLoad:
    memory: float = 0.0
    comm_bytes: float = 0.0
    lookup_bytes: float = 0.0

    def time_ms(self, hw: Hardware) -> float:
        return (self.comm_bytes / hw.network_gbps + self.lookup_bytes / hw.memory_gbps) / 1e6

    def plus(self, other: "RankLoad") -> "RankLoad":
        return RankLoad(self.memory + other.memory, self.comm_bytes + other.comm_bytes,
                        self.lookup_bytes + other.lookup_bytes)


@dataclass
class Placement:
    sharding: Sharding
    per_rank: list[RankLoad]


def placement(spec: TableSpec, sharding: Sharding, world_size: int, batch: int, dedup: bool) -> Placement:
    """Per-rank memory, bytes moved and bytes of memory traffic per step for ``spec`` under ``sharding``."""
    span = sharding.span(world_size)
    holders = range(sharding.rank, sharding.rank + span)
    n = batch * spec.pooling
    ids = ID_BYTES * n / span
    if dedup:
        ids = min(ids, (ID_BYTES * spec.unique_ids(n, dedup) + POSITION_BYTES * n) / span)
    pair = ids + LENGTH_BYTES * batch + 2 * batch * spec.dim * spec.value_bytes
    per_rank = []
    for r in range(world_size):
        if r in holders:
            per_rank.append(RankLoad(math.ceil(spec.rows / span) * spec.bytes_per_row(),
                                     (world_size - 1 + span - 1) * pair,
                                     world_size * n / span * 3 * spec.dim * spec.value_bytes))
        else:
            per_rank.append(RankLoad(0.0, span * pair, 0.0))
    return Placement(sharding, per_rank)


@dataclass
class ShardingPlan:
    """Table name -> Sharding, with the cost model's per-rank estimate."""

    shardings: dict[str, Sharding]
    specs: dict[str, TableSpec] = field(default_factory=dict)
    world_size: int = 1
    batch: int = 0
    dedup: bool = True
    hardware: Hardware = field(default_factory=Hardware)

    def __getitem__(self, name: str) -> Sharding:
        if name not in self.shardings:
            raise KeyError(f"sharding plan has no table {name!r}; it plans {sorted(self.shardings)}")
        return self.shardings[name]

    def loads(self) -> list[RankLoad]:
        loads = [RankLoad() for _ in range(self.world_size)]
        for name, spec in self.specs.items():
            p = placement(spec, self.shardings[name], self.world_size, self.batch, self.dedup)
            loads = [a.plus(b) for a, b in zip(loads, p.per_rank)]
        return loads

    def __str__(self) -> str:
        lines = [f"sharding plan: {len(self.shardings)} tables on {self.world_size} ranks, batch {self.batch} per "
                 f"rank, dedup {'on' if self.dedup else 'off'}",
                 f"  {'table':<24}{'rows':>14}{'dim':>6}{'pool':>6}  sharding"]
        for name, sharding in self.shardings.items():
            spec = self.specs.get(name)
            size = f"{spec.rows:>14}{spec.dim:>6}{spec.pooling:>6.1f}" if spec else " " * 26
            lines.append(f"  {name:<24}{size}  {sharding.describe()}")
        if self.specs:
            lines.append(f"  {'rank':<6}{'memory GB':>12}{'all-to-all MB/step':>20}{'est. ms/step':>14}")
            for r, load in enumerate(self.loads()):
                lines.append(f"  {r:<6}{load.memory / 1e9:>12.3f}{load.comm_bytes / 1e6:>20.3f}"
                             f"{load.time_ms(self.hardware):>14.3f}")
        return "\n".join(lines)


def plan(specs: Sequence[TableSpec], world_size: int, batch: int, hardware: Hardware = Hardware(),
         dedup: bool = True, kinds: Iterable[str] = ("table_wise", "row_wise"),
         fixed: Mapping[str, Sharding] | None = None) -> ShardingPlan:
    """Greedy placement, largest tables first (see the module docstring for the cost model); ``fixed`` forces
    the sharding of the tables it names."""
    kinds, fixed = tuple(kinds), dict(fixed or {})
    unknown = sorted(set(fixed) - {s.name for s in specs})
    if unknown:
        raise ValueError(f"fixed shardings for tables {unknown} that are not planned; "
                         f"tables: {[s.name for s in specs]}")
    loads = [RankLoad() for _ in range(world_size)]
    chosen: dict[str, Sharding] = {}
    ordered = sorted(specs, key=lambda s: (s.name not in fixed, -s.rows * s.bytes_per_row()))
    for spec in ordered:
        candidates = [fixed[spec.name]] if spec.name in fixed else _candidates(spec, world_size, kinds, loads, hardware)
        best = None
        for sharding in candidates:
            after = [a.plus(b) for a, b in zip(loads, placement(spec, sharding, world_size, batch, dedup).per_rank)]
            if max(load.memory for load in after) > hardware.memory_bytes:
                continue
            times = [load.time_ms(hardware) for load in after]
            key = (max(times), sum(times), max(load.memory for load in after))
            if best is None or key < best[0]:
                best = (key, sharding, after)
        if best is None:
            need = spec.rows * spec.bytes_per_row() / (world_size if "row_wise" in kinds else 1)
            raise ValueError(f"table {spec.name!r} ({spec.rows} rows x {spec.dim}) fits no rank: it needs at least "
                             f"{need / 1e9:.3f} GB on a rank beside the tables placed before it, the budget is "
                             f"{hardware.memory_bytes / 1e9:.3f} GB per rank")
        _, chosen[spec.name], loads = best
    return ShardingPlan({s.name: chosen[s.name] for s in specs}, {s.name: s for s in specs}, world_size, batch, dedup,
                        hardware)


def _candidates(spec: TableSpec, world_size: int, kinds: tuple[str, ...], loads: list[RankLoad],
                hardware: Hardware) -> list[Sharding]:
    """Table-wise on the least loaded rank and row-wise over the least loaded group of each size (a placement adds
    the same cost to every rank outside its group, so no other group of that size gives a smaller maximum)."""
    if spec.dynamic:
        return [Sharding("hash_row_wise")]
    sizes = ([1] if "table_wise" in kinds else []) + \
        ([s for s in _powers_of_two(world_size) if world_size % s == 0] + [world_size] if "row_wise" in kinds else [])
    out = []
    for size in dict.fromkeys(sizes):
        group = min(range(0, world_size, size), key=lambda start: _group_load(loads[start:start + size], hardware))
        out.append(Sharding("table_wise", group) if size == 1 else
                   Sharding("row_wise", group, None if size == world_size else size))
    return out


def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(1, limit.bit_length()) if 1 << k < limit]


def _group_load(loads: list[RankLoad], hardware: Hardware) -> tuple[float, float]:
    return max(load.time_ms(hardware) for load in loads), max(load.memory for load in loads)


def table_specs(model: nn.Module, pooling: Mapping[str, float] | float = 1.0) -> list[TableSpec]:
    """A TableSpec for every embedding table of ``model``, named by its module path."""
    from recompile.distributed.model_parallel import embedding_tables

    specs = []
    for name, module in embedding_tables(model):
        p = pooling.get(name, 1.0) if isinstance(pooling, Mapping) else pooling
        if is_dynamic(module):  # rows: the keys it holds now (the planner only needs them for estimates)
            specs.append(TableSpec(name, module.table.size(), module.table.dim, p, dynamic=True))
        else:
            specs.append(TableSpec(name, module.num_embeddings, module.embedding_dim, p))
    return specs


def is_dynamic(module: nn.Module) -> bool:
    return not isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and not hasattr(module, "row_start")
