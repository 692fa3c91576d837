"""Dynamic embedding tables as modules: ``hkv.DynamicEmbedding`` and ``hkv.DynamicEmbeddingBag``.

Ids are raw int64 values (feature hashes), not row numbers: each table is an ``hkv.HashTable`` whose
value row is ``[embedding | optimizer state]``. Training is fused as in DynamicEmb / FBGEMM TBE: the
forward inserts unseen ids (initialised by ``initializer_args``), the backward sums gradients per
unique id and applies the optimizer to the rows in place; the module's only parameter is an empty
``weight`` that carries autograd to that update. In eval mode lookups never insert: unseen ids get
``eval_initializer_args`` (zeros by default). Config names follow DynamicEmb's DynamicEmbTableOptions.

Inference tables may store their rows row-wise quantized: ``embedding_dtype="int8"`` or ``"int4"`` (FBGEMM's fused
layouts, ``hkv.rowwise``), or ``DynamicEmbeddingBag.quantize_(qdtype)`` on a trained table (``recompile.quantize``
calls it). Lookups return fp32 dequantized in the probe kernel; inserts (a training-mode lookup, ``prefetch``)
quantize the new rows; the optimizer step is refused (a quantized row holds no optimizer state).
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from hkv import checkpoint
from hkv.optim import SGD
from hkv.table import CLOCK_STRATEGIES, EvictStrategy, HashTable


class DynamicEmbInitializerMode(enum.Enum):
    NORMAL = "normal"
    TRUNCATED_NORMAL = "truncated_normal"
    UNIFORM = "uniform"
    CONSTANT = "constant"


@dataclass
class DynamicEmbInitializerArgs:
    mode: DynamicEmbInitializerMode = DynamicEmbInitializerMode.NORMAL
    mean: float = 0.0
    std_dev: float = 1.0
    lower: float | None = None  # uniform / truncated normal bounds; default (-1, 1) and mean -/+ 2 std_dev
    upper: float | None = None
    value: float = 0.0  # constant

    def make(self) -> Callable[[int, int, torch.dtype, torch.device], torch.Tensor]:
        mode = DynamicEmbInitializerMode(self.mode)

        def init(rows: int, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            out = torch.empty(rows, dim, dtype=torch.float32, device=device)
            if mode is DynamicEmbInitializerMode.NORMAL:
                out.normal_(self.mean, self.std_dev)
            elif mode is DynamicEmbInitializerMode.TRUNCATED_NORMAL:
                lo = self.mean - 2 * self.std_dev if self.lower is None else self.lower
                hi = self.mean + 2 * self.std_dev if self.upper is None else self.upper
                nn.init.trunc_normal_(out, self.mean, self.std_dev, lo, hi)
            elif mode is DynamicEmbInitializerMode.UNIFORM:
                out.uniform_(-1.0 if self.lower is None else self.lower, 1.0 if self.upper is None else self.upper)
            else:
                out.fill_(self.value)
            return out.to(dtype)

        return init


def _zeros() -> DynamicEmbInitializerArgs:
    return DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT, value=0.0)


@dataclass
class DynamicEmbTableOptions:
    dim: int
    max_capacity: int
    init_capacity: int | None = None  # default: max_capacity
    max_load_factor: float = 0.5
    bucket_capacity: int = 128
    evict_strategy: EvictStrategy = EvictStrategy.LRU
    embedding_dtype: torch.dtype | str = torch.float32  # or "int8" / "int4": rows stored quantized (inference)
    device: torch.device | str | None = None
    initializer_args: DynamicEmbInitializerArgs = field(default_factory=DynamicEmbInitializerArgs)
    eval_initializer_args: DynamicEmbInitializerArgs = field(default_factory=_zeros)
    global_hbm_for_values: int | None = None  # bytes of values on the device; the rest goes to host / disk
    host_memory_bytes: int | None = None
    disk_path: str | None = None
    admit_strategy: object | None = None  # hkv.CounterFilter / hkv.CBFFilter


# Live tables by id: the custom ops name a table by this integer (ops cannot take Python objects).
TABLES: "weakref.WeakValueDictionary[int, DynamicTable]" = weakref.WeakValueDictionary()
_table_ids = itertools.count()


class DynamicTable:
    """A table's runtime: the hash table, its initialisers and its row-wise optimizer."""

    def __init__(self, options: DynamicEmbTableOptions, optimizer=None, name: str = "dynamic_embedding"):
        self.options = options
        self.optimizer = optimizer if optimizer is not None else SGD()
        self.dim = options.dim
        self.name = name
        quantized = isinstance(options.embedding_dtype, str)  # rows hold the embedding only: no optimizer state
        self.table = HashTable(
            options.dim + (0 if quantized else self.optimizer.state_dim(options.dim)),
            options.init_capacity or options.max_capacity,
            options.max_capacity,
            max_load_factor=options.max_load_factor,
            bucket_size=options.bucket_capacity,
            evict_strategy=options.evict_strategy,
            dtype=options.embedding_dtype,
            device=options.device,
            device_memory_bytes=options.global_hbm_for_values,
            host_memory_bytes=options.host_memory_bytes,
            disk_path=options.disk_path,
            admission=options.admit_strategy,
            name=f"hkv table {name!r}",
        )
        self.initializer = options.initializer_args.make()
        self.eval_initializer = options.eval_initializer_args.make()
        self.step = 0
        self.id = next(_table_ids)
        TABLES[self.id] = self

    def __deepcopy__(self, memo) -> "DynamicTable":
        """A copy with its own table, registered under a new id (the copy's ops must not reach this table)."""
        new = copy.copy(self)
        memo[id(self)] = new
        new.table = copy.deepcopy(self.table, memo)
        new.id = next(_table_ids)
        TABLES[new.id] = new
        return new

    def _init_rows(self, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        emb = self.initializer(rows, self.dim, dtype, device)
        return torch.cat([emb, emb.new_zeros(rows, width - self.dim)], 1)

    def lookup(self, unique_ids: torch.Tensor, train: bool, grouping: int = 0) -> torch.Tensor:
        """Embeddings of unique ids; training inserts unseen ids, eval gives them the eval initialiser.
        ``grouping``: the ids are grouped by bucket of a table with that many buckets (0: not grouped)."""
        if train:
            return self.table.find_or_insert(unique_ids, init=self._init_rows, grouping=grouping)[:, :self.dim]
        values, found = self.table.find(unique_ids)
        emb = values[:, :self.dim]
        missing = (~found).nonzero().squeeze(1)
        if missing.numel():
            emb[missing] = self.eval_initializer(missing.numel(), self.dim, emb.dtype, emb.device)
        return emb

    def prefetch(self, unique_ids: torch.Tensor, grouping: int = 0) -> None:
        """Insert the unseen ids among ``unique_ids`` (initialised) ahead of the training lookup of the
        same batch, leaving the table as that lookup will: keys present are not touched, new keys are
        scored as never seen (an increment of 0; the lookup then counts them). Tables with admission
        insert nothing here (a prefetch is no sighting)."""
        table = self.table
        if table.admission is not None:
            return
        with table._lock:
            new = unique_ids[~table.contains(unique_ids)]
            if new.numel():
                scores = None if table.evict_strategy in CLOCK_STRATEGIES else torch.zeros_like(new)
                table.find_or_insert(new, init=self._init_rows, scores=scores, grouping=grouping)

    def quantize_(self, qdtype: str) -> None:
        """Store the table's embeddings row-wise quantized as ``qdtype`` from now on (their optimizer state is
        dropped): keys, scores and settings kept; a disk tier is not carried over."""
        self.table = self.table.quantized(qdtype, dim=self.dim)
        self.options = dataclasses.replace(self.options, embedding_dtype=qdtype, disk_path=None)

    def update(self, unique_ids: torch.Tensor, grad: torch.Tensor) -> None:
        """One optimizer step on the rows of ``unique_ids`` with their summed gradients (ids refused by
        admission or evicted since the lookup have no row and are skipped)."""
        if self.table.qdtype:
            raise RuntimeError(f"{self.table.name}: stores {self.table.qdtype} rows: a quantized table is for "
                               "inference and takes no optimizer step; train it in float, then quantize it")
        with self.table._lock:
            self.step += 1
            step = self.step

            def step_rows(rows: torch.Tensor, hit: torch.Tensor | None) -> torch.Tensor:
                g = grad if hit is None else grad[hit]
                return self.optimizer.update(rows.float(), g.float(), self.dim, step).to(rows.dtype)

            self.table.update_rows(unique_ids, step_rows)


def get_table(table_id: int) -> DynamicTable:
    try:
        return TABLES[table_id]
    except KeyError:
        raise KeyError(f"hkv: no live dynamic embedding table with id {table_id}") from None


POOLING_MODES = ("sum", "mean", "none")


class DynamicEmbeddingBag(nn.Module):
    """An EmbeddingBag over raw int64 ids: ``forward(ids, offsets)`` pools each bag (sum / mean),
    or returns one row per id (``mode="none"``)."""

    def __init__(self, options: DynamicEmbTableOptions, mode: str = "sum", optimizer=None, name: str | None = None):
        super().__init__()
        if mode not in POOLING_MODES:
            raise ValueError(f"hkv.{type(self).__name__}: mode must be one of {POOLING_MODES}, got {mode!r}")
        self.mode = mode
        # Whether loading a state dict with more entries than the table can hold keeps the highest-scoring ones
        # that fit (True) or raises CheckpointError naming how many would be dropped (False).
        self.restore_allows_eviction = False
        self.runtime = DynamicTable(options, optimizer, name or type(self).__name__)
        self.weight = nn.Parameter(torch.empty(0, device=options.device))  # carries autograd to the fused update

    @property
    def table(self) -> HashTable:
        return self.runtime.table

    @property
    def table_id(self) -> int:
        return self.runtime.id

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        if self.mode != "none" and offsets is None:
            raise ValueError(f"hkv {self.runtime.name!r}: mode {self.mode!r} needs offsets")
        if torch.compiler.is_compiling():
            return torch.ops.hkv.embedding_lookup(self.weight, ids, offsets, self.table_id, self.mode, self.training)
        from hkv.ops import EagerEmbeddingLookup

        return EagerEmbeddingLookup.apply(self.weight, ids, offsets, self.table_id, self.mode, self.training)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        with self.table._lock:
            data = checkpoint.dumps(self.table)
            destination[prefix + "table"] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            destination[prefix + "step"] = torch.tensor(self.runtime.step)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        data, step = state_dict.pop(prefix + "table", None), state_dict.pop(prefix + "step", None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if data is None:
            missing_keys.append(prefix + "table")
            return
        parsed = checkpoint.parse(data.numpy().tobytes(), source=f"state_dict[{prefix + 'table'!r}]")
        checkpoint.restore(self.table, *parsed, allow_eviction=self.restore_allows_eviction)
        self.runtime.step = int(step) if step is not None else 0

    def quantize_(self, qdtype: str) -> "DynamicEmbeddingBag":
        """Store the table's rows row-wise quantized (``DynamicTable.quantize_``); returns self."""
        self.runtime.quantize_(qdtype)
        return self

    def extra_repr(self) -> str:
        return f"dim={self.runtime.dim}, mode={self.mode!r}, table={self.table!r}"


class DynamicEmbedding(DynamicEmbeddingBag):
    """An Embedding over raw int64 ids: one row per id."""

    def __init__(self, options: DynamicEmbTableOptions, optimizer=None, name: str | None = None):
        super().__init__(options, "none", optimizer, name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids)
