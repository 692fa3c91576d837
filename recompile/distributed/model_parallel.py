"""``distribute(model, plan)``: embedding tables model-parallel, everything else data-parallel (DDP).

Every ``nn.EmbeddingBag`` / ``nn.Embedding`` of the model is replaced, in place, by a ``ShardedEmbeddingBag``
holding this rank's rows under the plan, and every ``hkv.DynamicEmbeddingBag`` by a
``ShardedDynamicEmbeddingBag`` holding the keys this rank owns; the rest of the model is wrapped in
``torch.nn.parallel.DistributedDataParallel`` with the shards in its ignore list, so DDP all-reduces only
the dense gradients. ``torch.compile(distributed_model, backend="rec_ascend")`` then compiles the dense
graphs (Dynamo's DDP optimizer splits them at DDP's bucket boundaries) and the table lookups run between
them (see ``sharded_embedding``); ``compile_lookups`` compiles the owners' pooling too, grouped by the
embedding pass.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from hkv import DynamicEmbeddingBag

from recompile.distributed.dynamic_embedding import ShardedDynamicEmbeddingBag
from recompile.distributed.env import world
from recompile.distributed.planner import ShardingPlan, plan as make_plan, table_specs
from recompile.distributed.sharded_embedding import ShardedEmbeddingBag, pool_local, prefetch

STATIC_TABLES = (nn.EmbeddingBag, nn.Embedding)
SHARDED_TABLES = (ShardedEmbeddingBag, ShardedDynamicEmbeddingBag)


def embedding_tables(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(module path, module) of every embedding table of ``model``, sharded or not."""
    for name, module in model.named_modules():
        if isinstance(module, STATIC_TABLES + SHARDED_TABLES + (DynamicEmbeddingBag,)):
            yield name, module


def sharded_tables(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(module path, module) of every sharded table: static shards and dynamic (hkv) tables."""
    for name, module in model.named_modules():
        if isinstance(module, SHARDED_TABLES):
            yield name, module


def distribute(model: nn.Module, plan: ShardingPlan | None = None, *, batch: int = 1024,
               pooling: Mapping[str, float] | float = 1.0, dedup: bool = True,
               features: Callable[..., Mapping[str, tuple]] | None = None,
               device: torch.device | str | None = None, **ddp_kwargs: Any) -> nn.Module:
    """Shard ``model``'s tables by ``plan`` (when None, planned here for ``batch`` bags per rank of ``pooling`` ids
    each, by table or for all, and printed by rank 0) and make the rest data-parallel.

    Every rank must call this with the same model (same seed or weights): each keeps only its rows.
    ``features(*forward_args, **forward_kwargs) -> {table path: (ids, offsets)}``, when given, names the ids
    each table will be called with, so that one round of all-to-alls serves them all (see ``prefetch``).
    Returns the DDP-wrapped model, or the model itself when no process group is initialised.
    """
    rank, world_size = world()
    if plan is None:  # planned here: printed once, as TorchRec's planner logs its plan
        plan = make_plan(table_specs(model, pooling), world_size, batch, dedup=dedup)
        if rank == 0 and world_size > 1:
            print(plan)
    elif plan.world_size != world_size:
        raise ValueError(f"the sharding plan is for {plan.world_size} ranks, this process group has {world_size}")
    tables = [(n, m) for n, m in embedding_tables(model) if isinstance(m, STATIC_TABLES)]
    missing = [n for n, _ in tables if n not in plan.shardings]  # dynamic tables are always hash row-wise
    if missing:
        raise ValueError(f"tables {missing} have no sharding in the plan (it has {sorted(plan.shardings)})")
    for name, module in tables:
        _replace(model, name, ShardedEmbeddingBag.from_module(name, module, plan[name], dedup=dedup))
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, DynamicEmbeddingBag)]:
        _replace(model, name, ShardedDynamicEmbeddingBag(name, module, dedup=dedup))
    if features is not None:
        model.register_forward_pre_hook(_prefetch_hook(features), with_kwargs=True)
    if device is not None:
        model.to(device)
    if not torch.distributed.is_initialized():
        return model
    ignored = [f"{name}.{p}" for name, m in sharded_tables(model) for p, _ in m.named_parameters()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return DistributedDataParallel(model, **ddp_kwargs)


def compile_lookups(model: nn.Module, backend: str | Callable = "rec_ascend",
                    options: Mapping[str, Any] | None = None) -> None:
    """Compile the owner side of the sharded lookups (``pool_local``: every local table's bags of a round)
    with ``backend``; rec_ascend's embedding pass groups them into one ``recompile::grouped_embedding_bag``."""
    compiled = torch.compile(pool_local, backend=backend, options=options, dynamic=True)
    for _, table in sharded_tables(model):
        if isinstance(table, ShardedEmbeddingBag):
            table.lookup_fn = compiled


def _prefetch_hook(features: Callable[..., Mapping[str, tuple]]):
    def hook(model: nn.Module, args: tuple, kwargs: dict) -> None:
        named = features(*args, **kwargs)
        prefetch([model.get_submodule(name) for name in named], [(*f, None)[:3] for f in named.values()])

    return hook


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)
