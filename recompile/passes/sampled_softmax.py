"""sampled_softmax: a sampled softmax cross entropy with the positive first becomes one op.

Pattern (``labels`` all zeros: ``torch.zeros_like(t)`` or ``torch.zeros(...)`` of an integer dtype):
    hit = unsqueeze(neg_ids, 0) == unsqueeze(target_ids, 1)          # optional: the accidental hits
    logits = cat([pos, masked_fill(neg, hit, -inf)], 1) / T           # or * s, or unscaled
    loss = F.cross_entropy(logits, labels, reduction="none")          # ignore_index not 0, no weight or smoothing
with ``pos`` ``[N, 1]``, ``neg`` ``[N, K]`` float and every intermediate used only there.
Replacement:
    loss = recompile.sampled_softmax_loss(pos, neg, neg_ids, target_ids, 1 / T)[0]
The ``[N, K + 1]`` logits and the ``[N, K]`` hit mask are never built: on this CPU Inductor's code for the int64
outer compare alone takes milliseconds at the main job's 2190 x 1024, and its fused log-softmax kernels pay for
it in forward and backward. The pass runs where the target has a kernel of its own (the native CPU one).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from recompile.passes.utils import arg, each_match, is_call, only_user, replace_node, tensor_meta
from recompile.pipeline import PassContext, register_pass

EQ = (operator.eq, torch.eq)
MUL = (operator.mul, torch.mul)  # normalize leaves ``number * tensor`` as operator.mul
DIV = (operator.truediv, torch.div)
ZEROS = (torch.zeros_like, torch.zeros)


def _zero_labels(labels: Any) -> bool:
    dtype = labels.kwargs.get("dtype") if isinstance(labels, fx.Node) else None
    meta = tensor_meta(labels)
    return is_call(labels, *ZEROS) and meta is not None and not meta.is_floating_point() and dtype is not torch.bool


def _scale(logits: fx.Node) -> tuple[fx.Node, float] | None:
    """(the cat, the factor) of ``cat / T``, ``cat * s``, ``s * cat`` or the cat itself."""
    if is_call(logits, torch.cat):
        return logits, 1.0
    if not is_call(logits, *DIV, *MUL) or len(logits.args) != 2 or logits.kwargs:
        return None
    a, b = logits.args
    if is_call(logits, *MUL) and isinstance(a, (int, float)):
        a, b = b, a
    if not is_call(a, torch.cat) or not isinstance(b, (int, float)) or b == 0 or only_user(a) is not logits:
        return None
    return a, (1.0 / b if is_call(logits, *DIV) else float(b))


def _unsqueezed(node: Any, dim: int) -> Any:
    """``t`` of ``unsqueeze(t, dim)`` with a 1-D integer ``t``."""
    if not is_call(node, torch.unsqueeze) or arg(node, 1, "dim") != dim:
        return None
    meta = tensor_meta(node.args[0])
    return node.args[0] if meta is not None and meta.dim() == 1 and not meta.is_floating_point() else None


def _hit_ids(mask: Any, fill: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(neg_ids, target_ids) of ``unsqueeze(neg_ids, 0) == unsqueeze(target_ids, 1)`` (either order)."""
    if not is_call(mask, *EQ) or len(mask.args) != 2 or only_user(mask) is not fill:
        return None
    a, b = mask.args
    for row, col in ((a, b), (b, a)):
        neg_ids, target_ids = _unsqueezed(row, 0), _unsqueezed(col, 1)
        if neg_ids is not None and target_ids is not None:
            return neg_ids, target_ids
    return None


def _negatives(node: Any, cat: fx.Node) -> tuple[fx.Node, fx.Node | None, fx.Node | None] | None:
    """(neg, neg_ids, target_ids): ``masked_fill(neg, hit, -inf)`` of the hit mask, or ``neg`` itself."""
    if not is_call(node, torch.masked_fill):
        return node, None, None
    value = arg(node, 2, "value")
    ids = _hit_ids(arg(node, 1, "mask"), node)
    if value != float("-inf") or ids is None or only_user(node) is not cat:
        return None
    return node.args[0], *ids


def match(loss: fx.Node) -> tuple | None:
    """The op's arguments (pos, neg, neg_ids, target_ids, scale) if ``loss`` is the pattern; else None."""
    if not is_call(loss, F.cross_entropy) or arg(loss, 6, "reduction", "mean") != "none":
        return None
    if any(arg(loss, i, name) is not None for i, name in ((2, "weight"), (3, "size_average"), (5, "reduce"))):
        return None
    if arg(loss, 7, "label_smoothing", 0.0) != 0.0:
        return None
    if arg(loss, 4, "ignore_index", -100) == 0 or not _zero_labels(arg(loss, 1, "target")):
        return None
    logits = arg(loss, 0, "input")
    scaled = _scale(logits) if only_user(logits) is loss else None
    if scaled is None:
        return None
    cat, scale = scaled
    parts, dim = arg(cat, 0, "tensors"), arg(cat, 1, "dim", 0)
    if dim not in (1, -1) or not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    negatives = _negatives(parts[1], cat)
    if negatives is None:
        return None
    pos, (neg, neg_ids, target_ids) = parts[0], negatives
    pos_meta, neg_meta = tensor_meta(pos), tensor_meta(neg)
    if pos_meta is None or neg_meta is None or pos_meta.dim() != 2 or neg_meta.dim() != 2 or pos_meta.shape[1] != 1:
        return None
    if not neg_meta.is_floating_point() or pos_meta.dtype != neg_meta.dtype:
        return None
    return pos, neg, neg_ids, target_ids, scale


@register_pass("sampled_softmax", order=50, regions={"sampled_softmax": "#ffb38a"})
def sampled_softmax(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    impl = ctx.lower("recompile::sampled_softmax_loss")
    if impl.kind == "reference":
        return gm
    graph = gm.graph
    for node, args in each_match(gm, match):
        impl = ctx.lower("recompile::sampled_softmax_loss", *args)
        if impl.kind == "reference":  # no kernel of ours reads these logits: the graph stays
            continue
        chain = _chain(node, args)
        replaced = [n for n in graph.nodes if n in chain]
        with graph.inserting_before(node):
            call = graph.call_function(torch.ops.recompile.sampled_softmax_loss.default, (*args, impl.impl))
            loss = graph.call_function(operator.getitem, (call, 0))
        ctx.record_region("sampled_softmax", replaced, "recompile::sampled_softmax_loss", impl)
        replace_node(node, loss)
        for n in reversed(replaced[:-1]):  # the loss itself is gone
            graph.erase_node(n)
    return gm


def _chain(loss: fx.Node, args: tuple) -> set[fx.Node]:
    """The nodes the op replaces: the loss and what only it uses up to the op's arguments (scaling, cat, hit
    mask, labels)."""
    nodes, todo = set(), [loss]
    keep = set(args[:4])
    while todo:
        node = todo.pop()
        if not isinstance(node, fx.Node) or node in nodes or node in keep or node.op != "call_function":
            continue
        nodes.add(node)
        todo.extend(n for n in node.all_input_nodes if only_user(n) is node)
    return nodes
