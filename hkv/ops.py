"""``torch.ops.hkv.*``: dynamic embedding lookups as custom ops, so torch.compile can capture them.

- ``embedding_lookup(weight, ids, offsets, table_id, mode, train)``: what the modules call; one op for
  dedup, lookup (insert when training) and pooling. Its backward is ``embedding_lookup_backward``.
- The lowered form (``recompile/passes/dynamic_embedding.py`` rewrites the former into it):
  ``unique(ids, on_host) -> (unique_ids, inverse, num_unique)``; ``lookup(weight, unique_ids,
  num_unique, table_id, train)`` -> rows, whose backward ``update`` applies the optimizer; then an ATen
  ``embedding_bag`` / ``embedding`` over ``inverse`` expands and pools the rows.
A table is named by its integer id (``hkv.embedding.TABLES``); ``weight`` is the module's empty
parameter, through which autograd reaches the fused optimizer update. ``impl`` names the kernel
probing the table (``hkv.kernels``); ``"auto"`` keeps the table's own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hkv.embedding import get_table
from hkv.kernels import using_kernel

LIB = "hkv"


def unique_ids(ids: torch.Tensor, on_host: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Dedup ids once per batch; ``on_host``: on the CPU (Rec SDK's partial offload), results moved back."""
    where = ids.cpu() if on_host else ids
    uniq, inverse = torch.unique(where.to(torch.int64), return_inverse=True)
    return uniq.to(ids.device), inverse.to(ids.device)


def pool(rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor | None, mode: str) -> torch.Tensor:
    """Expand unique rows back to the ids and pool them per bag."""
    if mode == "none":
        return F.embedding(inverse, rows)
    return F.embedding_bag(inverse, rows, offsets, mode=mode)


def pool_backward(grad: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor | None, mode: str,
                  num_rows: int) -> torch.Tensor:
    """The gradient of ``pool`` with respect to ``rows``: output gradients summed per unique row."""
    if mode != "none":
        lengths = torch.diff(offsets, append=offsets.new_tensor([inverse.numel()]))
        bag = torch.repeat_interleave(torch.arange(offsets.numel(), device=grad.device), lengths)
        grad = grad[bag] if mode == "sum" else grad[bag] / lengths[bag, None].to(grad.dtype)
    return grad.new_zeros(num_rows, grad.shape[1]).index_add_(0, inverse, grad)


@torch.library.custom_op("hkv::unique", mutates_args=())
def unique(ids: torch.Tensor, on_host: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unique ids padded to len(ids), inverse, number of unique ids as a 1-element tensor).

    Padding keeps every shape a function of the input's, so graphs need no data-dependent sizes.
    """
    uniq, inverse = unique_ids(ids, on_host)
    padded = torch.zeros_like(inverse)
    padded[:uniq.numel()] = uniq
    return padded, inverse, inverse.new_full((1,), uniq.numel())


@unique.register_fake
def _(ids, on_host):
    return ids.new_empty(ids.shape, dtype=torch.int64), ids.new_empty(ids.shape, dtype=torch.int64), ids.new_empty(
        1, dtype=torch.int64)


@torch.library.custom_op("hkv::lookup", mutates_args=())
def lookup(weight: torch.Tensor, unique_ids: torch.Tensor, num_unique: torch.Tensor, table_id: int, train: bool,
           impl: str = "reference") -> torch.Tensor:
    """Rows of the first ``num_unique`` ids (found, or inserted when training); padding rows are zero."""
    table = get_table(table_id)
    n = int(num_unique)
    rows = unique_ids.new_zeros(unique_ids.shape[0], table.dim, dtype=table.table.dtype)
    with using_kernel(table.table, impl):
        rows[:n] = table.lookup(unique_ids[:n], train)
    return rows


@lookup.register_fake
def _(weight, unique_ids, num_unique, table_id, train, impl="reference"):
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
    _, ctx.unique_ids, ctx.num_unique, ctx.table_id, _, ctx.impl = inputs


def _lookup_backward(ctx, grad):
    weight_grad = torch.ops.hkv.update(grad, ctx.unique_ids, ctx.num_unique, ctx.table_id, ctx.impl)
    return weight_grad, None, None, None, None, None


lookup.register_autograd(_lookup_backward, setup_context=_lookup_setup)


@torch.library.custom_op("hkv::embedding_lookup", mutates_args=())
def embedding_lookup(weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None, table_id: int,
                     mode: str, train: bool, impl: str = "auto") -> torch.Tensor:
    uniq, inverse = unique_ids(ids, on_host=False)
    table = get_table(table_id)
    with using_kernel(table.table, impl):
        rows = table.lookup(uniq, train)
    return pool(rows, inverse, offsets, mode)


@embedding_lookup.register_fake
def _(weight, ids, offsets, table_id, mode, train, impl="auto"):
    table = get_table(table_id)
    rows = ids.shape[0] if mode == "none" else offsets.shape[0]
    return ids.new_empty(rows, table.dim, dtype=table.table.dtype)


@torch.library.custom_op("hkv::embedding_lookup_backward", mutates_args=())
def embedding_lookup_backward(grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None, table_id: int,
                              mode: str, impl: str = "auto") -> torch.Tensor:
    """Sum the output gradient per unique id (through the pooling's own backward) and apply it."""
    uniq, inverse = unique_ids(ids, on_host=False)
    table = get_table(table_id)
    with using_kernel(table.table, impl):
        table.update(uniq, pool_backward(grad, inverse, offsets, mode, uniq.numel()))
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
