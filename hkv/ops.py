"""``torch.ops.hkv.*``: dynamic embedding lookups as custom ops, so torch.compile can capture them.

- ``embedding_lookup(weight, ids, offsets, table_id, mode, train)``: what the modules call; one op for
  dedup, lookup (insert when training) and pooling. Its backward is ``embedding_lookup_backward``.
- The lowered form (``recompile/passes/dynamic_embedding.py`` rewrites the former into it):
  ``unique(ids, on_host, table_id) -> (unique_ids, inverse, num_unique, grouping)``; ``lookup(weight,
  unique_ids, num_unique, grouping, table_id, train)`` -> rows, whose backward ``update`` applies the
  optimizer; then an ATen ``embedding_bag`` / ``embedding`` over ``inverse`` expands and pools the rows.
  With ``on_host`` (partial offload) ``unique`` hashes, deduplicates and buckets the ids on the host:
  the unique ids come grouped by the table's bucket (``grouping``: the bucket count used), which the
  CPU kernel then splits over threads by bucket without scanning the batch.
A table is named by its integer id (``hkv.embedding.TABLES``); ``weight`` is the module's empty
parameter, through which autograd reaches the fused optimizer update. The table is state no argument holds:
``lookup`` (which inserts when training), ``update`` and the module-level ops say so by an ordered effect
(``EFFECTFUL``), so that a compiler keeps each call, once, in program order, even when its result is unused. ``impl`` names the kernel
probing the table (``hkv.kernels``); ``"auto"`` keeps the table's own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._library.effects import EffectType

from hkv import cpu
from hkv.embedding import get_table
from hkv.kernels import using_kernel

LIB = "hkv"


def unique_ids(ids: torch.Tensor, on_host: bool, num_buckets: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Dedup ids once per batch; ``on_host``: on the CPU (Rec SDK's partial offload), results moved back.

    CPU ids are hashed by the C kernel (``hkv.cpu.unique``; grouped by bucket when ``num_buckets`` > 0),
    others sorted by ``torch.unique``.
    """
    where = ids.cpu() if on_host else ids
    if where.device.type == "cpu" and cpu.available():
        uniq, inverse = cpu.unique(where, num_buckets)
    else:
        uniq, inverse = torch.unique(where.to(torch.int64), return_inverse=True)
    return uniq.to(ids.device), inverse.to(ids.device)


def host_unique(ids: torch.Tensor, table) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Partial offload's host side: (unique ids, inverse, grouping), the unique ids grouped by bucket of
    ``table`` (a DynamicTable) and ``grouping`` its bucket count (0 where no CPU kernel groups them)."""
    num_buckets = table.table.num_buckets() if cpu.available() else 0
    return *unique_ids(ids, True, num_buckets), num_buckets


def pool(rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor | None, mode: str) -> torch.Tensor:
    """Expand unique rows back to the ids and pool them per bag."""
    if mode == "none":
        return F.embedding(inverse, rows)
    return F.embedding_bag(inverse, rows, offsets, mode=mode)


def pool_backward(grad: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor | None, mode: str,
                  num_rows: int) -> torch.Tensor:
    """The gradient of ``pool`` with respect to ``rows``: output gradients summed per unique row."""
    if mode != "none" and grad.device.type == "cpu" and grad.dtype == torch.float32 and cpu.available():
        return cpu.pool_backward(grad, offsets, inverse, mode == "mean", num_rows)
    if mode != "none":
        lengths = torch.diff(offsets, append=offsets.new_tensor([inverse.numel()]))
        bag = torch.repeat_interleave(torch.arange(offsets.numel(), device=grad.device), lengths)
        grad = grad[bag] if mode == "sum" else grad[bag] / lengths[bag, None].to(grad.dtype)
    return grad.new_zeros(num_rows, grad.shape[1]).index_put_((inverse,), grad, accumulate=True)


@torch.library.custom_op("hkv::unique", mutates_args=())
def unique(ids: torch.Tensor, on_host: bool, table_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                      torch.Tensor]:
    """(unique ids padded to len(ids), inverse, number of unique ids, grouping), the last two 1-element tensors.

    ``on_host``: the unique ids are grouped by bucket of table ``table_id`` and ``grouping`` holds its
    bucket count (0 otherwise). Padding keeps every shape a function of the input's, so graphs need
    no data-dependent sizes.
    """
    uniq, inverse, num_buckets = host_unique(ids, get_table(table_id)) if on_host else (*unique_ids(ids, False), 0)
    padded = torch.zeros_like(inverse)
    padded[:uniq.numel()] = uniq
    return padded, inverse, inverse.new_full((1,), uniq.numel()), inverse.new_full((1,), num_buckets)


@unique.register_fake
def _(ids, on_host, table_id):
    flat = ids.new_empty(ids.shape, dtype=torch.int64)
    return flat, torch.empty_like(flat), ids.new_empty(1, dtype=torch.int64), ids.new_empty(1, dtype=torch.int64)


@torch.library.custom_op("hkv::lookup", mutates_args=())
def lookup(weight: torch.Tensor, unique_ids: torch.Tensor, num_unique: torch.Tensor, grouping: torch.Tensor,
           table_id: int, train: bool, impl: str = "reference") -> torch.Tensor:
    """Rows of the first ``num_unique`` ids (found, or inserted when training); padding rows are zero.
    ``grouping``: the bucket count the ids are grouped by (``unique``), 0 when not grouped."""
    table = get_table(table_id)
    n = int(num_unique)
    rows = unique_ids.new_zeros(unique_ids.shape[0], table.dim, dtype=table.table.dtype)
    with using_kernel(table.table, impl):
        rows[:n] = table.lookup(unique_ids[:n], train, int(grouping))
    return rows


@lookup.register_fake
def _(weight, unique_ids, num_unique, grouping, table_id, train, impl="reference"):
    table = get_table(table_id)
    return unique_ids.new_empty(unique_ids.shape[0], table.dim, dtype=table.table.dtype)


@torch.library.custom_op("hkv::update", mutates_args=())
def update(grad: torch.Tensor, unique_ids: torch.Tensor, num_unique: torch.Tensor, table_id: int,
           impl: str = "reference") -> torch.Tensor:
    """Apply the table's optimizer to the rows of the first ``num_unique`` ids; returns the (empty) grad of weight."""
    table = get_table(table_id)
    n = int(num_unique)
    with using_kernel(table.table, impl):
        table.update(unique_ids[:n], grad[:n])
    return grad.new_zeros(0)


@update.register_fake
def _(grad, unique_ids, num_unique, table_id, impl="reference"):
    return grad.new_empty(0)


def _lookup_setup(ctx, inputs, output):
    _, ctx.unique_ids, ctx.num_unique, _, ctx.table_id, _, ctx.impl = inputs


def _lookup_backward(ctx, grad):
    weight_grad = torch.ops.hkv.update(grad, ctx.unique_ids, ctx.num_unique, ctx.table_id, ctx.impl)
    return weight_grad, None, None, None, None, None, None


lookup.register_autograd(_lookup_backward, setup_context=_lookup_setup)


def _pooled_lookup(ids, offsets, table_id: int, mode: str, train: bool, impl: str):
    """(pooled output, unique ids, inverse): dedup, look up (insert when training) and pool."""
    uniq, inverse = unique_ids(ids, on_host=False)
    table = get_table(table_id)
    with using_kernel(table.table, impl):
        rows = table.lookup(uniq, train)
    return pool(rows, inverse, offsets, mode), uniq, inverse


def _apply_gradient(grad, uniq, inverse, offsets, table_id: int, mode: str, impl: str) -> None:
    """Sum the output gradient per unique id (the pooling's backward) and apply the table's optimizer."""
    table = get_table(table_id)
    with using_kernel(table.table, impl):
        table.update(uniq, pool_backward(grad, inverse, offsets, mode, uniq.numel()))


@torch.library.custom_op("hkv::embedding_lookup", mutates_args=())
def embedding_lookup(weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None, table_id: int,
                     mode: str, train: bool, impl: str = "auto") -> torch.Tensor:
    return _pooled_lookup(ids, offsets, table_id, mode, train, impl)[0]


@embedding_lookup.register_fake
def _(weight, ids, offsets, table_id, mode, train, impl="auto"):
    table = get_table(table_id)
    rows = ids.shape[0] if mode == "none" else offsets.shape[0]
    return ids.new_empty(rows, table.dim, dtype=table.table.dtype)


@torch.library.custom_op("hkv::embedding_lookup_backward", mutates_args=())
def embedding_lookup_backward(grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None, table_id: int,
                              mode: str, impl: str = "auto") -> torch.Tensor:
    """Dedup the ids again, sum the output gradient per unique id and apply it."""
    _apply_gradient(grad, *unique_ids(ids, on_host=False), offsets, table_id, mode, impl)
    return grad.new_zeros(0)


@embedding_lookup_backward.register_fake
def _(grad, ids, offsets, table_id, mode, impl="auto"):
    return grad.new_empty(0)


def _bag_setup(ctx, inputs, output):
    _, ctx.ids, ctx.offsets, ctx.table_id, ctx.mode, _, ctx.impl = inputs


def _bag_backward(ctx, grad):
    weight_grad = torch.ops.hkv.embedding_lookup_backward(grad, ctx.ids, ctx.offsets, ctx.table_id, ctx.mode, ctx.impl)
    return weight_grad, None, None, None, None, None, None


embedding_lookup.register_autograd(_bag_backward, setup_context=_bag_setup)


# Ops that read or write a table's rows and optimizer state, held by the table, not by an argument.
EFFECTFUL = (lookup, update, embedding_lookup, embedding_lookup_backward)
for _op in EFFECTFUL:
    _op.register_effect(EffectType.ORDERED)


class EagerEmbeddingLookup(torch.autograd.Function):
    """``embedding_lookup`` for eager calls: the same computation, with the forward's dedup kept for the
    backward instead of recomputed, and without the custom op's dispatch (a few hundred µs per step
    and table on a CPU). Under torch.compile the modules call the op, which graphs capture."""

    @staticmethod
    def forward(ctx, weight, ids, offsets, table_id: int, mode: str, train: bool):
        out, ctx.uniq, ctx.inverse = _pooled_lookup(ids, offsets, table_id, mode, train, "auto")
        ctx.offsets, ctx.table_id, ctx.mode = offsets, table_id, mode
        return out

    @staticmethod
    def backward(ctx, grad):
        _apply_gradient(grad, ctx.uniq, ctx.inverse, ctx.offsets, ctx.table_id, ctx.mode, "auto")
        return grad.new_zeros(0), None, None, None, None, None
