"""layout: graph layouts that keep Inductor from fusing, rewritten into ones it fuses (no rec region).

Pattern -> replacement -> why (each rule keyed by the call it rewrites, in ``RULES``):

- ``sum(stack([x_1 .. x_n], d), d)`` (floating point, the stack used only there) -> ``x_1 + x_2 + ... + x_n``.
  Inductor realizes a stack of many inputs as a buffer (each input written into its slice) and reads it again to
  reduce: RecBole's FwFM writes its 21 weighted pair products, [B, 21, D], and reads them back, and its backward
  goes through the stack's slices. The sum of the terms fuses into the loop that makes them.
- ``getitem(expand(w, [*lead, -1, ..]), (:, .., :, i, ..))`` with only ``w``'s own dims indexed (ints or full
  slices) -> ``expand(getitem(w, (i, ..)), [*lead, -1, ..])``: pick before broadcasting. Indexing a broadcast
  weight makes autograd scatter each pick's gradient into a [*lead, *w.shape] buffer per row, then sum it over the
  rows (FwFM's ``self.weight.expand(B, -1, -1, -1)[:, Fi, Fj]``: 2048 x 49 selects per pair in the backward); the
  pick first leaves the expand's backward, a sum over the rows of the pick's own gradient.
The numbers do not change but for the summation order (the stack summed in the same order, one term at a time).
"""
from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from recompile.passes.utils import arg, each_match, meta_value, only_user, tensor_meta
from recompile.pipeline import PassContext, register_pass

Rule = Callable[[fx.Node], "fx.Node | None"]
RULES: dict[Any, Rule] = {}
FULL = slice(None, None, None)


def rule(target: Any) -> Callable[[Rule], Rule]:
    def wrap(fn: Rule) -> Rule:
        RULES[target] = fn
        return fn
    return wrap


def _key(node: fx.Node) -> Any:
    return node.target if node.op in ("call_function", "call_method") else None


def _call(graph: fx.Graph, op: str, target: Any, args: tuple, like: fx.Node) -> fx.Node:
    """A new call before ``like``, its example value computed from its inputs' (under their fake mode)."""
    with graph.inserting_before(like):
        node = graph.create_node(op, target, args)
    value = meta_value(like)
    if isinstance(value, torch.Tensor):
        fn = target if op == "call_function" else (lambda x, *rest: getattr(x, target)(*rest))
        concrete = fx.node.map_arg(args, meta_value)
        with getattr(value, "fake_mode", None) or contextlib.nullcontext():
            node.meta["example_value"] = fn(*concrete)
    return node


@rule(torch.sum)
def _sum_of_stack(node: fx.Node) -> fx.Node | None:
    """``sum(stack(xs, d), d)`` -> ``xs[0] + xs[1] + ...``."""
    stacked, dim = node.args[0] if node.args else None, arg(node, 1, "dim")
    if not (isinstance(stacked, fx.Node) and stacked.op == "call_function" and stacked.target is torch.stack):
        return None
    out, terms = tensor_meta(node), arg(stacked, 0, "tensors")
    if (arg(node, 2, "keepdim", False) is not False or node.kwargs.get("dtype") is not None or out is None
            or not out.is_floating_point() or only_user(stacked) is not node or not isinstance(terms, (list, tuple))
            or len(terms) < 2 or not all(isinstance(t, fx.Node) for t in terms)):
        return None
    rank = out.dim() + 1
    if not isinstance(dim, int) or dim % rank != arg(stacked, 1, "dim", 0) % rank:
        return None
    if any(tensor_meta(t) is None or tensor_meta(t).dtype != out.dtype for t in terms):
        return None
    total = terms[0]
    for term in terms[1:]:
        total = _call(node.graph, "call_function", torch.add, (total, term), node)
    return total


@rule("expand")
def _pick_before_expand(node: fx.Node) -> fx.Node | None:
    """Every ``getitem(expand(w, sizes), (:, .., idx))`` that picks in ``w``'s own dims -> ``expand(w[idx], ..)``;
    returns the expand when all its users were rewritten (so the pass erases it), else None."""
    weight, sizes = node.args[0], list(node.args[1:])
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = list(sizes[0])
    w = tensor_meta(weight)
    lead = len(sizes) - (w.dim() if w is not None else len(sizes))
    if w is None or lead < 1 or any(s != -1 for s in sizes[lead:]) or not node.users:
        return None
    picks = [u for u in node.users if _pick(u, lead, w.dim())]
    if len(picks) != len(node.users):
        return None
    for user in picks:
        index = tuple(user.args[1][lead:])
        picked = _call(node.graph, "call_function", operator.getitem, (weight, index), user)
        rest = tensor_meta(picked).dim()
        again = _call(node.graph, "call_method", "expand", (picked, *sizes[:lead], *([-1] * rest)), user)
        user.replace_all_uses_with(again)
        node.graph.erase_node(user)
    return node


def _pick(user: fx.Node, lead: int, rank: int) -> bool:
    """``user`` is ``x[:, .., :, i, ..]``: full slices over the ``lead`` broadcast dims, then ints or full slices
    over at most ``rank`` dims of the weight."""
    if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], tuple)):
        return False
    index = user.args[1]
    own = index[lead:]
    return (len(index) > lead and len(own) <= rank and all(i == FULL for i in index[:lead])
            and all(type(i) is int or i == FULL for i in own) and tensor_meta(user) is not None)


@register_pass("layout", order=5)
def layout(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node, new in each_match(gm, lambda n: RULES[_key(n)](n) if not n._erased and _key(n) in RULES else None):
        if new is not node:
            node.replace_all_uses_with(new)
        if not node.users:
            gm.graph.erase_node(node)
    for node in reversed(list(gm.graph.nodes)):  # the stacks summed away
        if node.op == "call_function" and node.target is torch.stack and not node.users:
            gm.graph.erase_node(node)
    return gm
