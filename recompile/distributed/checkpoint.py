"""Sharded checkpoints: N ranks save, M ranks load (resharding), static and dynamic tables.

A checkpoint is a directory:

- ``<table>.rank<r>.hkv``: rank r's rows of a table in hkv's checkpoint format (versioned, SHA-256 checked,
  written to a temp file, fsynced and renamed). Keys are global row ids for static tables and raw keys for
  dynamic ones; a value row is the embedding row followed by the optimizer's per-row state for it
  (momentum, Adagrad sums...), so the state reshards with its rows.
- ``dense.pt``: rank 0's dense parameters and their optimizer state, by parameter name (DDP keeps them equal).
- ``manifest.json``: world size, tables (rows, dim, sharding, files, optimizer state columns); written last.

Every rank writes into ``<path>.partial``; after a barrier rank 0 writes the manifest and swaps the directory
into place, so a crash mid-save leaves the previous checkpoint whole. ``load`` reads only the rows this
rank owns under the model's current plan, from every file, and checks that each of them was found.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil

import torch
import torch.distributed as dist
import torch.nn as nn
from hkv import HashTable
from hkv.checkpoint import CheckpointError, clean_stale_temps, parse, read, restore

from recompile.distributed.dynamic_embedding import ShardedDynamicEmbeddingBag
from recompile.distributed.env import world
from recompile.distributed.model_parallel import sharded_tables
from recompile.distributed.sharded_embedding import ShardedEmbeddingBag

MANIFEST = "manifest.json"
DENSE = "dense.pt"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _atomic(path: str, write) -> None:
    clean_stale_temps(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP and torch.compile wrappers."""
    while isinstance(model, nn.parallel.DistributedDataParallel) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model._orig_mod
    return model


def _row_state(optimizer, param: nn.Parameter) -> dict[str, torch.Tensor]:
    """The optimizer's per-row state of ``param`` (tensors of its shape), by state name."""
    state = optimizer.state.get(param, {}) if optimizer is not None else {}
    return {k: v for k, v in sorted(state.items()) if torch.is_tensor(v) and v.shape == param.shape}


def _scalar_state(optimizer, param: nn.Parameter) -> dict:
    state = optimizer.state.get(param, {}) if optimizer is not None else {}
    return {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.shape == param.shape)}


def _table_info(table) -> dict:
    rows = table.num_embeddings if isinstance(table, ShardedEmbeddingBag) else None
    return {"rows": rows, "dim": table.embedding_dim, "sharding": table.sharding.describe()}


def _static_store(table, optimizer) -> tuple[HashTable, dict]:
    """This rank's rows keyed by global row id, each followed by its optimizer state columns (``slots``)."""
    state = _row_state(optimizer, table.weight)
    values = torch.cat([table.weight.detach(), *state.values()], dim=1).cpu()
    keys = torch.arange(table.row_start, table.row_end)
    store = HashTable(values.shape[1], init_capacity=max(2 * len(keys), 128), max_capacity=max(8 * len(keys), 512),
                      dtype=values.dtype, name=f"checkpoint of table {table.name!r}")
    refused = store.insert_or_assign(keys, values)
    if refused.numel():
        raise RuntimeError(f"table {table.name!r}: the checkpoint store refused {refused.numel()} rows")
    return store, {"slots": list(state)}


def _dynamic_store(table, optimizer) -> tuple[HashTable, dict]:
    """The hkv table itself (its rows carry their optimizer state), and the optimizer's step."""
    return table.table, {"step": table.runtime.step}


def _restore_dynamic(table, shards, info: dict, optimizer) -> None:
    """The keys this rank owns under the current world size, from every saved shard, with their saved scores;
    all or nothing (hkv.checkpoint.restore: keys that do not fit are an error and the table is left as it was)."""
    rank, world_size = world()
    mine = [table.owner_of(keys, world_size) == rank for _, keys, _, _ in shards]
    keys, values, scores = (torch.cat([shard[i][m] for shard, m in zip(shards, mine)]) for i in (1, 2, 3))
    headers = [header for header, _, _, _ in shards]
    merged = headers[0] | {"clock": max(h["clock"] for h in headers),
                           "global_epoch": max(h["global_epoch"] for h in headers)}
    restore(table.table, merged, keys, values, scores)
    table.runtime.step = info["step"]


def _restore_static(table, shards, info: dict, optimizer) -> None:
    """Copy the rows this rank holds (and their optimizer state) out of every saved shard."""
    slots = info["slots"]
    n, dim = table.row_end - table.row_start, table.embedding_dim
    rows = torch.empty(n, dim * (1 + len(slots)))
    found = torch.zeros(n, dtype=torch.bool)
    for _, keys, values, _ in shards:
        mine = (keys >= table.row_start) & (keys < table.row_end)
        local = keys[mine] - table.row_start
        rows[local] = values[mine].to(rows.dtype)
        found[local] = True
    if not bool(found.all()):
        missing = int(torch.nonzero(~found)[0]) + table.row_start
        raise ValueError(f"table {table.name!r}: the checkpoint has no row {missing}")
    columns = rows.split(dim, dim=1)
    with torch.no_grad():
        table.weight.copy_(columns[0])
    if optimizer is not None and slots:
        optimizer.state[table.weight].update({slot: c.clone().to(table.weight) for slot, c in zip(slots, columns[1:])})


SAVE = {ShardedEmbeddingBag: _static_store, ShardedDynamicEmbeddingBag: _dynamic_store}
RESTORE = {ShardedEmbeddingBag: _restore_static, ShardedDynamicEmbeddingBag: _restore_dynamic}


def save(model: nn.Module, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write a checkpoint of the sharded ``model`` (and ``optimizer``) from every rank; collective."""
    rank, world_size = world()
    model = _unwrap(model)
    partial = f"{path}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()
    tables = {}
    for name, table in sharded_tables(model):
        store, extra = SAVE[type(table)](table, optimizer)
        store.save(os.path.join(partial, f"{name}.rank{rank}.hkv"))
        tables[name] = _table_info(table) | extra
    if rank == 0:
        table_names = {name for name, _ in sharded_tables(model)}
        dense = {n: p for n, p in model.named_parameters() if n.rpartition(".")[0] not in table_names}
        state = {"params": {n: p.detach().cpu() for n, p in dense.items()},
                 "optimizer": {n: optimizer.state[p] for n, p in dense.items() if p in optimizer.state}
                 if optimizer is not None else {},
                 "table_scalars": {n: _scalar_state(optimizer, t.weight) for n, t in sharded_tables(model)}}
        _atomic(os.path.join(partial, DENSE), lambda f: torch.save(state, f))
    _barrier()
    if rank == 0:
        manifest = {"world_size": world_size, "tables": tables}
        _atomic(os.path.join(partial, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        old = f"{path}.old"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def _load_dense(file: str) -> dict:
    """``dense.pt`` as tensors, numbers and containers only: ``weights_only=True`` refuses any pickle that
    would import or call something, so a crafted checkpoint cannot run code on ``load``."""
    try:
        return torch.load(file, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise CheckpointError(f"checkpoint file {file!r} is not plain dense state (tensors, numbers, dicts); "
                              f"refused to unpickle it: {str(exc).splitlines()[0]}") from None


def load(model: nn.Module, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Fill the sharded ``model`` (and ``optimizer``) from a checkpoint written by any number of ranks."""
    model = _unwrap(model)
    if not os.path.exists(os.path.join(path, MANIFEST)) and os.path.exists(os.path.join(f"{path}.old", MANIFEST)):
        path = f"{path}.old"  # a save died between moving the previous checkpoint aside and putting the new one
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        raise FileNotFoundError(f"{path!r} is not a complete recompile checkpoint: it has no {MANIFEST}")
    with open(manifest_path) as f:
        manifest = json.load(f)
    dense = _load_dense(os.path.join(path, DENSE))
    for name, table in sharded_tables(model):
        if name not in manifest["tables"]:
            raise KeyError(f"checkpoint {path!r} has no table {name!r} (it has {sorted(manifest['tables'])})")
        info = manifest["tables"][name]
        if any(info[k] != v for k, v in _table_info(table).items() if k != "sharding"):
            raise ValueError(f"table {name!r}: checkpoint has {info}, the model has {_table_info(table)}")
        shards = []
        for rank in range(manifest["world_size"]):
            file = os.path.join(path, f"{name}.rank{rank}.hkv")
            shards.append(parse(read(file), source=f"checkpoint file {file!r}"))
        RESTORE[type(table)](table, shards, info, optimizer)
        if optimizer is not None:
            optimizer.state[table.weight].update(dense["table_scalars"].get(name, {}))
    params = dict(model.named_parameters())
    for name, value in dense["params"].items():
        if name not in params:
            raise KeyError(f"checkpoint {path!r} has dense parameter {name!r}, the model has none of that name")
        with torch.no_grad():
            params[name].copy_(value)
        if optimizer is not None and name in dense["optimizer"]:
            optimizer.state[params[name]] = dense["optimizer"][name]
