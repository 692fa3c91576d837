"""dropout: the dropout masks drawn by a counter-based hash instead of a Bernoulli draw per element.

Pattern: ``F.dropout(x, p, training=True, inplace=False)`` or ``torch.dropout(x, p, True)`` with ``0 < p < 1``
and a floating-point ``x``, where the target has a dropout kernel of its own (the native CPU one: elsewhere the
pass leaves dropout to Inductor's fused random numbers) and ``torch._inductor.config.fallback_random`` is off
(it asks for eager's random numbers).
Replacement:
    seed = torch.randint(0, SEED_BOUND, (2,), dtype=torch.int64, device=x.device)  # the default generator
    out = recompile.dropout(x, p, seed)  # backward: recompile.dropout(grad, p, seed), no mask stored
On this CPU eager's ``bernoulli_`` takes about 9 ns an element and Inductor's generated draw about 6; the hash
takes under one (``runtime/dropout.py``, ``models.bench_sequential``). The masks differ from eager's, as Inductor's do, so ``verify``
does not compare this pass's output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch._inductor.config as inductor_config
import torch.fx as fx
import torch.nn.functional as F

from recompile.passes.utils import arg, each_match, meta_value, replace_node, tensor_meta
from recompile.pipeline import PassContext, register_pass
from recompile.runtime.dropout import SEED_BOUND


@dataclass(frozen=True)
class Spelling:
    """Where a dropout call takes its arguments: (position, keyword, default) of each."""
    p: tuple[int, str, float | None]
    training: tuple[int, str, bool | None]
    inplace: tuple[int, str, bool] | None


SPELLINGS = {
    F.dropout: Spelling((1, "p", 0.5), (2, "training", True), (3, "inplace", False)),
    torch.dropout: Spelling((1, "p", None), (2, "train", None), None),
}


def dropout_rate(node: fx.Node) -> float | None:
    """``p`` of an active, out-of-place dropout of a floating-point tensor with ``0 < p < 1``; else None."""
    spelling = SPELLINGS.get(node.target) if node.op == "call_function" else None
    if spelling is None:
        return None
    p, training = arg(node, *spelling.p), arg(node, *spelling.training)
    inplace = arg(node, *spelling.inplace) if spelling.inplace else False
    x = tensor_meta(node.args[0])
    if training is not True or inplace is not False or x is None or not x.is_floating_point():
        return None
    return float(p) if isinstance(p, (int, float)) and 0 < p < 1 else None


def _seed(graph: fx.Graph, like: fx.Node) -> fx.Node:
    """A fresh ``seed`` node on ``like``'s device, with a fake example value where Dynamo's graph has them."""
    value = meta_value(like)
    seed = graph.call_function(torch.randint, (0, SEED_BOUND, (2,)), {"dtype": torch.int64, "device": value.device})
    fake_mode = getattr(value, "fake_mode", None)
    if fake_mode is not None:
        with fake_mode:
            seed.meta["example_value"] = torch.empty(2, dtype=torch.int64, device=value.device)
    return seed


@register_pass("dropout", order=60, regions={"dropout": "#c8ccd2"}, draws_other_random=True)
def dropout(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    impl = ctx.lower("recompile::dropout")
    if impl.kind == "reference" or inductor_config.fallback_random:
        return gm
    graph = gm.graph
    for node, p in each_match(gm, dropout_rate):
        x = node.args[0]
        with graph.inserting_before(node):
            seed = _seed(graph, x)
            impl = ctx.lower("recompile::dropout", x, p, seed)
            if impl.kind == "reference":  # no kernel of ours reads x: eager's dropout stays
                graph.erase_node(seed)
                continue
            out = graph.call_function(torch.ops.recompile.dropout.default, (x, p, seed, impl.impl))
        ctx.record_region("dropout", [node], "recompile::dropout", impl)
        replace_node(node, out)
    return gm
