"""Which query rows of padded attentions matter, for the ``jagged`` pass (``recompile.padded_softmax_attention``'s
``rows`` argument).

RecBole's SASRec (and models written like it) runs its encoder on every row of the padded history, then reads one
row per sequence: ``gather(hidden, 1, (item_seq_len - 1).view(-1, 1, 1).expand(-1, -1, C))``. The rows the
mask lets no read row depend on need not be computed. ``read_rows`` proves, for the attentions sharing one mask,
that their outputs reach the graph's outputs only

- through row-wise ops (elementwise ops, dropout, Linear, LayerNorm over the features, views and transposes
  that keep the batch and row dims), as the queries, keys or values of attentions of the same group, and
- through gathers of one row per sequence at the same index ``rows [B]``,

and returns that index, hoisted before the group's first attention so the op can take it. The op computes the
rows the read rows depend on through the mask (checked at run time on the mask itself), and 0 elsewhere: rows
that, by this proof, reach no output and no gradient.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from recompile.passes.jagged_attention import Unproven, same_sizes
from recompile.passes.utils import arg, is_call, tensor_meta

ELEMENTWISE = {
    torch.add, torch.sub, torch.mul, torch.div, torch.erf, torch.tanh, torch.sigmoid, torch.relu, torch.exp,
    torch.neg, torch.sqrt, torch.rsqrt, torch.pow, F.gelu, F.relu, F.silu, F.sigmoid, F.tanh, F.dropout,
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
}
IDENTITY_METHODS = {"contiguous", "clone"}
Dims = tuple[int, int]  # (batch dim, row dim)


def _is_method(node: fx.Node, *names: str) -> bool:
    return node.op == "call_method" and node.target in names


def _rank(node: Any) -> int | None:
    meta = tensor_meta(node)
    return None if meta is None else meta.dim()


def _reshaped(node: fx.Node, source: fx.Node, dims: Dims) -> Dims:
    """The dims after a reshape that keeps the sizes up to and including both of them."""
    keep = max(dims) + 1
    before, after = tensor_meta(source), tensor_meta(node)
    if after.dim() < keep or not same_sizes(before.shape[:keep], after.shape[:keep]):
        raise Unproven(f"{node.name}: a view that mixes the batch or row dims")
    return dims


def _permuted(node: fx.Node, x: fx.Node, dims: Dims) -> Dims:
    ndim = _rank(x)
    if is_call(node, torch.transpose) or _is_method(node, "transpose"):
        a, b = (d % ndim for d in node.args[1:3])
        order = list(range(ndim))
        order[a], order[b] = b, a
    else:
        order = [d % ndim for d in (node.args[1] if len(node.args) == 2 else node.args[1:])]
    return order.index(dims[0]), order.index(dims[1])


def _rowwise(node: fx.Node, x: fx.Node, dims: Dims) -> Dims:
    """The dims of ``node``, a row-wise use of ``x`` (its rows computed from the same rows of ``x`` only)."""
    ndim = _rank(x)
    if node.op == "call_function" and node.target in ELEMENTWISE or _is_method(node, *IDENTITY_METHODS):
        if _rank(node) != ndim:
            raise Unproven(f"{node.name}: broadcasting adds dims to a padded attention's output")
        return dims
    if is_call(node, F.layer_norm) and node.args[0] is x:
        if len(arg(node, 1, "normalized_shape")) >= ndim - max(dims):
            raise Unproven(f"{node.name}: a layer norm over the row dim")
        return dims
    if is_call(node, F.linear, torch._C._nn.linear) and node.args[0] is x:
        if max(dims) >= ndim - 1:
            raise Unproven(f"{node.name}: a linear over the row dim")
        return dims
    if is_call(node, torch.reshape) or _is_method(node, "reshape", "view"):
        return _reshaped(node, x, dims)
    if is_call(node, torch.transpose, torch.permute) or _is_method(node, "transpose", "permute"):
        return _permuted(node, x, dims)
    raise Unproven(f"{node.name} ({getattr(node.target, '__name__', node.target)}) is not a row-wise op")


def _gathered_rows(node: fx.Node, x: fx.Node, dims: Dims) -> fx.Node | None:
    """``rows`` when ``node`` is ``gather(x, row dim, rows.view(-1, 1, 1).expand(-1, -1 | 1, C))`` (one row per
    sequence, RecBole's ``gather_indexes``)."""
    if not is_call(node, torch.gather) or node.args[0] is not x or dims != (0, 1) or _rank(x) != 3:
        return None
    if arg(node, 1, "dim") not in (1, -2):
        return None
    index = arg(node, 2, "index")
    if not _is_method(index, "expand") or not (is_call(index.args[0], torch.reshape) or
                                               _is_method(index.args[0], "view", "reshape")):
        return None
    rows = index.args[0].args[0]
    meta, shape = tensor_meta(rows), tensor_meta(index.args[0]).shape
    if meta is None or meta.dim() != 1 or meta.is_floating_point() or len(shape) != 3:
        return None
    if not same_sizes(shape[1:], (1, 1)) or not same_sizes(tensor_meta(index).shape[1:2], (1,)):
        return None
    return rows


def read_rows(group: list[fx.Node]) -> fx.Node:
    """The one ``rows`` node every output of the attentions in ``group`` (one mask) is read at (module
    docstring); raises Unproven otherwise."""
    members = set(group)
    dims_of: dict[fx.Node, Dims] = {node: (0, 2) for node in group}
    stack, rows = list(group), set()
    while stack:
        x = stack.pop()
        for user in x.users:
            if user in members:
                if any(a is x for a in user.args[3:]) or dims_of[x] != (0, 2):
                    raise Unproven(f"{user.name}: a padded attention's output reaches its mask, or not as [B, H, N, D]")
                continue
            if user.op == "output":
                raise Unproven(f"{x.name}: a padded attention's output is a graph output (every row is read)")
            if (read := _gathered_rows(user, x, dims_of[x])) is not None:
                rows.add(read)
                continue
            dims = _rowwise(user, x, dims_of[x])
            if dims_of.setdefault(user, dims) != dims:
                raise Unproven(f"{user.name} mixes rows of padded attentions in other layouts")
            stack.append(user)
    if len(rows) != 1:
        raise Unproven(f"the outputs are read at {len(rows)} row indices, not one")
    (read,) = rows
    if _depends_on(read, set(dims_of)):
        raise Unproven(f"the read rows {read.name} depend on the attention outputs")
    return read


def _depends_on(node: fx.Node, nodes: set[fx.Node]) -> bool:
    seen, stack = set(), [node]
    while stack:
        x = stack.pop()
        if x in nodes:
            return True
        if x not in seen:
            seen.add(x)
            stack.extend(x.all_input_nodes)
    return False


def hoist(node: fx.Node, before: fx.Node) -> None:
    """Move ``node`` and the ancestors of it that come after ``before`` to just before ``before`` (in order)."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    late, stack = set(), [node]
    while stack:
        x = stack.pop()
        if order[x] > order[before] and x not in late:
            late.add(x)
            stack.extend(x.all_input_nodes)
    for x in late:
        name = getattr(x.target, "__name__", str(x.target))
        if x.op not in ("call_function", "call_method") or x.is_impure() or name.endswith("_") or any(
                word in name for word in ("rand", "dropout", "bernoulli", "normal")):
            raise Unproven(f"the read rows need {x.name} ({name}) moved before the attention: not a pure op")
    for x in sorted(late, key=order.__getitem__):
        before.prepend(x)
