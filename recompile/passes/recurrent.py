"""recurrent: a GRU (``nn.GRU``, as Dynamo traces it under rec_ascend's ``allow_rnn``) becomes one op.

Pattern: ``torch.gru(input, hx, [w_ih, w_hh, (b_ih, b_hh)] * L, has_biases, L, dropout, train, bidirectional,
batch_first)``, the one call ``nn.GRU.forward`` makes, with a 3-D floating-point ``input``, not bidirectional, no
dropout between layers where it applies (``dropout == 0``, ``train`` off, or one layer), its results read only by
index. ``hx`` built by ``torch.zeros`` (what ``nn.GRU`` passes without one) is dropped: the op's None.
Replacement:
    output, h_n, _saved = recompile.gru(input, hx or None, weights, has_biases, L, batch_first, save)
with ``save`` where autograd runs through the graph (the op keeps its gates for its backward).
Why: ATen's ``gru`` is CompositeImplicitAutograd, so AOT autograd unrolls it into a handful of ops per step and
layer, forward and backward, and Inductor's compile of that graph takes several times a plain compile's (RecBole
GRU4Rec's full sort: 52.7 s against 4.7 s); as one op (``runtime/recurrent.py``) it stays one node in both graphs,
its forward and its backward through time native. The packed-sequence form, bidirectional GRUs and dropout between
layers in training stay ATen's (``docs/recurrent.md``).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from recompile.passes.utils import each_match, erase_if_unused, is_call, is_training, replace_node, tensor_meta
from recompile.pipeline import PassContext, example_value, register_pass
from recompile.runtime.recurrent import DTYPES

# torch.gru(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
ARITY = 9


def gru_arguments(node: fx.Node) -> tuple | None:
    """``(input, hx, params, has_biases, num_layers, batch_first)`` of a ``torch.gru`` call the op computes, or None."""
    if not is_call(node, torch.gru) or len(node.args) != ARITY or node.kwargs:
        return None
    input, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first = node.args
    x = tensor_meta(input)
    if (not isinstance(params, (list, tuple)) or x is None or x.dim() != 3 or x.dtype not in DTYPES
            or bidirectional is not False or not isinstance(layers, int)
            or (dropout and train and layers > 1)):  # dropout between layers: ATen's draw stays
        return None
    if any(user.target is not operator.getitem for user in node.users):
        return None
    return input, hx, list(params), bool(has_biases), layers, bool(batch_first)


def _initial_state(hx: fx.Node) -> fx.Node | None:
    """``hx``, or None where it is ``torch.zeros(...)`` (nn.GRU's default)."""
    return None if is_call(hx, torch.zeros) else hx


@register_pass("recurrent", order=70, regions={"recurrent": "#9fe0d2"})
def recurrent(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph, save = gm.graph, is_training(gm)
    for node, (input, hx, params, has_biases, layers, batch_first) in each_match(gm, gru_arguments):
        h0 = _initial_state(hx)
        args = (input, h0, params, has_biases, layers, batch_first, save)
        impl = ctx.lower("recompile::gru", *args)
        with graph.inserting_before(node):
            out = graph.call_function(torch.ops.recompile.gru.default, (*args, impl.impl))
        example_value(out)  # its own fake value (replace_node would keep the 2-tuple of torch.gru)
        ctx.record_region("recurrent", [node], "recompile::gru", impl)
        replace_node(node, out)
        erase_if_unused(hx)
    return gm
