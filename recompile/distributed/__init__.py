"""Distributed training on torch.distributed: data-parallel dense layers, model-parallel embedding tables.

- ``distribute(model, plan)``: shard the tables (table-wise, row-wise, hash row-wise) and wrap the rest in DDP;
- ``plan(specs, world_size, batch, hardware)``: the sharding planner and its cost model;
- ``save`` / ``load``: checkpoints written by N ranks and read by M;
- ``init_distributed()``: the process group for this device (gloo, nccl, hccl), from torchrun's environment;
- ``context_parallel_hstu_attention``: HSTU attention with each history split over a group (``context_parallel``).
"""
from recompile.distributed.comm import STATS, CollectiveError
from recompile.distributed.context_parallel import ContextParallelLayout, context_parallel_hstu_attention
from recompile.distributed.env import backend_for, init_distributed, world
from recompile.distributed.model_parallel import compile_lookups, distribute, embedding_tables, sharded_tables
from recompile.distributed.planner import Hardware, ShardingPlan, TableSpec, plan, table_specs
from recompile.distributed.sharded_embedding import ShardedEmbeddingBag
from recompile.distributed.sharding import Sharding

__all__ = [
    "STATS", "CollectiveError", "ContextParallelLayout", "Hardware", "ShardedEmbeddingBag", "Sharding",
    "ShardingPlan", "TableSpec", "backend_for", "compile_lookups", "context_parallel_hstu_attention", "distribute",
    "embedding_tables", "init_distributed", "plan", "sharded_tables", "table_specs", "world",
]
