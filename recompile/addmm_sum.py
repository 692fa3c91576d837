"""addmm_sum: a sum whose terms include matrix products as the other terms' sum accumulated into each product by
``addmm`` (an Inductor post-grad pass on every graph rec_ascend compiles, run by ``narrow_gemm.NarrowGemm``).

Pattern -> replacement: a tree of ``add`` (its inner sums read by the tree alone) on float32 CPU tensors that only
extern calls read (a custom op, a matrix product), ``t_1 + ... + reshape(mm(a, b), shape) + ...`` with ``shape``
[..., N] the product's [M, N] with its leading sizes flattened -> ``reshape(addmm(... addmm(reshape(rest, [M, N]),
a_1, b_1) ..., a_k, b_k), shape)``, ``rest`` the sum of the other terms, in their order, a term
``scatter_add(zeros, dim, index, src)`` scattered into it (``scatter_add(rest, dim, index, src)``).
Why: Inductor keeps a matrix product as an extern call, so a sum reading one waits for it, and where only extern
calls read the sum it is a C++ kernel of its own (one C++ build at the cold compile, about 0.7-1 s CPU). ``rest``
needs no product: it fuses into the kernel that writes the products' operands where the two share data, and the
GEMMs add their products to it. AOT autograd writes such sums for the gradient of a tensor several layers read:
NARM's GRU output, read by the attention's two linears (``gather_linear``), the weighted sum and the last position's
gather, whose gradient ``recompile::gru_backward`` reads. A sum that a pointwise op reads is left as it is: Inductor
fuses it into its reader.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from recompile.passes.utils import call_with_val, erase_unused

aten = torch.ops.aten


def _terms(node: fx.Node, root: fx.Node) -> list[fx.Node]:
    """The terms of the tree of plain ``add`` at ``node``: an inner ``add`` read by the tree alone is opened."""
    inner = node is root or len(node.users) == 1
    opened = node.target == aten.add.Tensor and inner and not node.kwargs
    if not (opened and all(isinstance(a, fx.Node) for a in node.args)):
        return [node]
    return [t for a in node.args for t in _terms(a, root)]


def _product(term: fx.Node, shape: torch.Size) -> fx.Node | None:
    """The ``mm`` that ``term`` reshapes to ``shape`` (its leading sizes flattened), read by the sum alone."""
    reshaped = term.target in (aten.reshape.default, aten.view.default) and len(term.users) == 1
    mm = term.args[0] if reshaped else term
    if not (isinstance(mm, fx.Node) and mm.target == aten.mm.default and len(mm.users) == 1 and not mm.kwargs):
        return None
    rows, columns = mm.meta["val"].shape
    sized = _sizes(shape) is not None and _sizes(mm.meta["val"].shape) is not None
    same = shape and all(map(statically_known_true, (shape[-1] == columns, math.prod(shape[:-1]) == rows)))
    return mm if sized and same else None


def _sizes(shape: torch.Size) -> list[int] | None:
    """``shape`` as a reshape's sizes, a symbolic size (a dynamic batch) as -1; None where two are symbolic or one is
    0 (-1 would then be ambiguous)."""
    sizes = [s if isinstance(s, int) else -1 for s in shape]
    return sizes if sizes.count(-1) <= 1 and 0 not in sizes else None


def _zeros_scatter(term: fx.Node) -> bool:
    """``term`` is ``scatter_add(zeros, dim, index, src)`` read by the sum alone: ``rest + term`` is
    ``scatter_add(rest, dim, index, src)``, whose copy of ``rest`` fuses where ``rest`` is computed."""
    if term.target != aten.scatter_add.default or len(term.users) != 1:
        return False
    zeros = term.args[0]
    return isinstance(zeros, fx.Node) and zeros.target == aten.full.default and zeros.args[1] == 0


def _like(x, val: torch.Tensor) -> bool:
    return (isinstance(x, torch.Tensor) and x.dtype == val.dtype and x.device == val.device and x.dim() == val.dim()
            and all(statically_known_true(a == b) for a, b in zip(x.shape, val.shape)))


def _summable(node: fx.Node) -> bool:
    """A float32 CPU sum that Inductor writes to a buffer of its own: only extern calls read it (a custom op, a
    matrix product), none of which Inductor fuses it into."""
    val = node.meta.get("val")
    return (isinstance(val, torch.Tensor) and val.dtype == torch.float32 and val.device.type == "cpu"
            and all(_extern(u) for u in node.users))


def _extern(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and (
        target.namespace not in ("aten", "prims") or target in (aten.mm.default, aten.addmm.default))


def sums_into_products(graph: fx.Graph, skip: Callable[[fx.Node], bool] = lambda mm: False) -> None:
    """Each ``add`` tree of ``graph`` with both matrix products (but those ``skip`` names) and other terms of its
    shape as an ``addmm`` chain."""
    erased: set[fx.Node] = set()
    for node in reversed(graph.find_nodes(op="call_function", target=aten.add.Tensor)):
        if node in erased or not _summable(node) or not all(isinstance(a, fx.Node) for a in node.args):
            continue
        val = node.meta["val"]
        shape, terms = val.shape, _terms(node, node)
        found = {t: _product(t, shape) for t in terms}
        products = [mm for mm in found.values() if mm is not None and not skip(mm)]
        rest = [t for t, mm in found.items() if mm not in products]
        if not products or not rest or not all(_like(t.meta.get("val"), val) for t in rest):
            continue
        scatters = [t for t in rest if _zeros_scatter(t)]
        rest = [t for t in rest if t not in scatters] or scatters[:1]
        scatters = [t for t in scatters if t not in rest]
        with graph.inserting_before(node):
            out = rest[0]
            for t in rest[1:]:
                out = call_with_val(graph, aten.add.Tensor, out, t)
            for t in scatters:
                out = call_with_val(graph, aten.scatter_add.default, out, *t.args[1:])
            out = call_with_val(graph, aten.reshape.default, out, _sizes(products[0].meta["val"].shape))
            for mm in products:
                out = call_with_val(graph, aten.addmm.default, out, *mm.args)
            out = call_with_val(graph, aten.reshape.default, out, _sizes(shape))
        node.replace_all_uses_with(out)
        erase_unused([node], erased)  # the tree, its products and their reshapes

