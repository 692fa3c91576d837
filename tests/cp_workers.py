"""Rank functions for tests/test_context_parallel.py: context-parallel HSTU attention on spawned gloo ranks."""
from __future__ import annotations

import torch

from recompile.distributed.context_parallel import ContextParallelLayout, context_parallel_hstu_attention
from recompile.runtime.jagged_attention import hstu_attention_reference

HEADS, DIM, DIM_V, TIME_BUCKETS = 2, 8, 6, 16


def problem(seed: int, lengths: list[int], max_seq_len: int, features: tuple[str, ...]) -> dict:
    """Random jagged inputs (the same on every rank for a seed); ``features`` among rel_bias, time_bias,
    num_targets, contextual, non_causal."""
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0] + lengths).cumsum(0)
    total = int(offsets[-1])
    p = {"offsets": offsets, "max_seq_len": max_seq_len, "alpha": 0.7, "causal": "non_causal" not in features,
         "q": torch.randn(total, HEADS, DIM, generator=gen), "k": torch.randn(total, HEADS, DIM, generator=gen),
         "v": torch.randn(total, HEADS, DIM_V, generator=gen), "rel_bias": None, "time_bias": None,
         "timestamps": None, "num_targets": None, "contextual_seq_len": 0}
    if "rel_bias" in features:
        p["rel_bias"] = torch.randn(2 * max_seq_len - 1, generator=gen)
    if "time_bias" in features:
        p["time_bias"] = torch.randn(TIME_BUCKETS + 1, generator=gen)
        gaps = torch.randint(0, 5000, (total,), generator=gen)
        p["timestamps"] = torch.cat([g.cumsum(0) for g in gaps.split(lengths)]) if total else gaps
    if "num_targets" in features:
        p["num_targets"] = torch.tensor([torch.randint(0, n // 2 + 1, (), generator=gen).item() for n in lengths])
    if "contextual" in features:
        p["contextual_seq_len"] = 2
    p["grad"] = torch.randn(total, HEADS, DIM_V, generator=gen)
    return p


DIFFERENTIABLE = ("q", "k", "v", "rel_bias", "time_bias")


def one_process(p: dict) -> dict:
    """Output and gradients of ``recompile.hstu_attention``'s reference on the whole batch."""
    leaves = {n: p[n].clone().requires_grad_() for n in DIFFERENTIABLE if p[n] is not None}
    out = hstu_attention_reference(leaves["q"], leaves["k"], leaves["v"], p["offsets"], p["max_seq_len"], p["alpha"],
                                   p["causal"], p["num_targets"], p["contextual_seq_len"], leaves.get("rel_bias"),
                                   p["timestamps"], leaves.get("time_bias"))
    out.backward(p["grad"])
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def context_parallel(rank: int, world_size: int, p: dict, exchange: str = "ring", block_size: int = 256,
                     group=None) -> dict:
    """This rank's output rows and the gradients of its rows (biases: its part of their gradients)."""
    layout = ContextParallelLayout(p["offsets"], world_size)
    local = {n: layout.shard(p[n], rank).requires_grad_() for n in ("q", "k", "v")}
    biases = {n: p[n].clone().requires_grad_() for n in ("rel_bias", "time_bias") if p[n] is not None}
    ts = None if p["timestamps"] is None else layout.shard(p["timestamps"], rank)
    out = context_parallel_hstu_attention(
        local["q"], local["k"], local["v"], layout, p["max_seq_len"], p["alpha"], p["causal"], p["num_targets"],
        p["contextual_seq_len"], biases.get("rel_bias"), ts, biases.get("time_bias"), group=group,
        exchange=exchange, block_size=block_size)
    out.backward(layout.shard(p["grad"], rank))
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in {**local, **biases}.items()}}


def cases(rank: int, world_size: int, problems: list[dict], exchange: str, block_size: int) -> list[dict]:
    return [context_parallel(rank, world_size, p, exchange, block_size) for p in problems]


def data_and_context_parallel(rank: int, world_size: int, problems: list[dict], cp_size: int) -> dict:
    """A dp x cp grid: replica ``rank // cp_size`` attends ``problems[replica]`` on its group of ``cp_size`` ranks."""
    import torch.distributed as dist

    groups = [dist.new_group(list(range(first, first + cp_size))) for first in range(0, world_size, cp_size)]
    replica = rank // cp_size
    return context_parallel(rank % cp_size, cp_size, problems[replica], "ring", 4, groups[replica])
