"""The sharding planner: table sizes, dims, pooling factors and a per-rank memory budget -> a sharding plan.

Cost model (per training step, per rank; ``B`` ids-bags per rank, ``W`` ranks, fp32 rows of ``d`` values,
``b`` bytes per value, ``p`` ids per bag):

- ids per rank per table ``n = B * p``; after deduplication ``u = R * (1 - exp(-n / R))`` for a table of
  ``R`` rows (the expected distinct count of ``n`` uniform draws; skewed real ids deduplicate further, so
  this is an upper bound). Without dedup ``u = n``.
- each unique id costs ``8`` bytes (int64) sent to its owner, ``d * b`` bytes of row coming back and
  ``d * b`` bytes of gradient going to the owner again: ``c = 8 + 2 * d * b`` bytes.
- table-wise on rank ``o``: the owner moves ``(W - 1) * u * c`` bytes, every other rank ``u * c``;
  its lookups touch ``W * u`` rows on the owner.
- row-wise (and hash row-wise): every rank moves ``2 * (W - 1) / W * u * c`` bytes (sent and received
  ``(W - 1) / W`` of its ids' traffic) and touches ``u`` rows.
- time = bytes moved / ``network_gbps`` + rows touched * ``3 * d * b`` (read forward, read and write in
  the update) / ``memory_gbps``; memory = rows held * ``d * b * (1 + optimizer_slots)``.

The planner places tables largest first; for each it takes the placement (row-wise, or table-wise on the
least loaded rank) that fits every rank's budget and gives the smallest maximum per-rank time so far, ties
broken by the smallest maximum memory. Dynamic (hkv) tables are always hash row-wise. A table that fits nowhere is
an error naming it. This is TorchRec's planner in miniature: enumerate shardings, estimate, place greedily.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch.nn as nn

from recompile.distributed.sharding import Sharding

ID_BYTES = 8


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

    def bytes_per_id(self) -> int:
        return ID_BYTES + 2 * self.dim * self.value_bytes

    def bytes_per_row(self) -> float:
        return self.dim * self.value_bytes * (1 + self.optimizer_slots)


@dataclass(frozen=True)
class Hardware:
    memory_bytes: float = float("inf")  # per-rank budget for tables and their optimizer state
    network_gbps: float = 25.0  # all-to-all bandwidth per rank, GB/s
    memory_gbps: float = 100.0  # embedding gather/update bandwidth per rank, GB/s


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
    """Per-rank memory, bytes moved and bytes of rows touched per step for ``spec`` under ``sharding``."""
    u = spec.unique_ids(batch * spec.pooling, dedup)
    per_id = spec.bytes_per_id()
    if sharding.kind == "table_wise":
        owner = sharding.rank
        memory = [spec.rows * spec.bytes_per_row() if r == owner else 0.0 for r in range(world_size)]
        comm = [(world_size - 1) * u * per_id if r == owner else u * per_id for r in range(world_size)]
        touched = [world_size * u if r == owner else 0.0 for r in range(world_size)]
    else:
        memory = [math.ceil(spec.rows / world_size) * spec.bytes_per_row()] * world_size
        comm = [2 * (world_size - 1) / world_size * u * per_id] * world_size
        touched = [u] * world_size
    row_traffic = 3 * spec.dim * spec.value_bytes
    return Placement(sharding, [RankLoad(m, c, t * row_traffic) for m, c, t in zip(memory, comm, touched)])


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
         dedup: bool = True, kinds: Iterable[str] = ("table_wise", "row_wise")) -> ShardingPlan:
    """Greedy placement, largest tables first (see the module docstring for the cost model)."""
    kinds = tuple(kinds)
    loads = [RankLoad() for _ in range(world_size)]
    chosen: dict[str, Sharding] = {}
    for spec in sorted(specs, key=lambda s: s.rows * s.bytes_per_row(), reverse=True):
        best = None
        for sharding in _candidates(spec, world_size, kinds, loads, hardware):
            after = [a.plus(b) for a, b in zip(loads, placement(spec, sharding, world_size, batch, dedup).per_rank)]
            if max(load.memory for load in after) > hardware.memory_bytes:
                continue
            key = (max(load.time_ms(hardware) for load in after), max(load.memory for load in after))
            if best is None or key < best[0]:
                best = (key, sharding, after)
        if best is None:
            need = spec.rows * spec.bytes_per_row() / (world_size if "row_wise" in kinds else 1)
            raise ValueError(f"table {spec.name!r} ({spec.rows} rows x {spec.dim}) fits no rank: it needs at least "
                             f"{need / 1e9:.3f} GB on a rank beside the tables placed before it, the budget is "
                             f"{hardware.memory_bytes / 1e9:.3f} GB per rank")
        _, chosen[spec.name], loads = best
    ordered = {s.name: chosen[s.name] for s in specs}
    return ShardingPlan(ordered, {s.name: s for s in specs}, world_size, batch, dedup, hardware)


def _candidates(spec: TableSpec, world_size: int, kinds: tuple[str, ...], loads: list[RankLoad],
                hardware: Hardware) -> list[Sharding]:
    """Row-wise, and table-wise on the least loaded rank (a table-wise table adds the same cost to every other
    rank and more to its owner, so no other owner gives a smaller maximum)."""
    if spec.dynamic:
        return [Sharding("hash_row_wise")]
    out = [Sharding("row_wise")] if "row_wise" in kinds else []
    fits = [r for r in range(world_size) if loads[r].memory + spec.rows * spec.bytes_per_row() <= hardware.memory_bytes]
    if "table_wise" in kinds and fits:
        owner = min(fits, key=lambda r: (loads[r].time_ms(hardware), loads[r].memory, r))
        out.append(Sharding("table_wise", owner))
    return out


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
