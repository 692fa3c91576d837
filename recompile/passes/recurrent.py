"""recurrent: a GRU or an LSTM (``nn.GRU`` / ``nn.LSTM``, as Dynamo traces them under rec_ascend's ``allow_rnn``)
becomes one op.

Pattern: ``torch.gru(input, hx, [w_ih, w_hh, (b_ih, b_hh)] * L, has_biases, L, dropout, train, bidirectional,
batch_first)``, the one call ``nn.GRU.forward`` makes, or ``torch.lstm(input, (hx, cx), ...)`` with the same
arguments (``nn.LSTM.forward``'s), with a 3-D floating-point ``input``, not bidirectional, no dropout between
layers where it applies (``dropout == 0``, ``train`` off, or one layer), no LSTM projections, its results read
only by index. An initial state built by ``torch.zeros`` (what the modules pass without one) is dropped: the op's
None.
Replacement:
    output, h_n, _saved = recompile.gru(input, hx or None, weights, has_biases, L, batch_first, save)
    output, h_n, c_n, _saved = recompile.lstm(input, hx or None, cx or None, weights, has_biases, L, batch_first, save)
with ``save`` where autograd runs through the graph (the op keeps its gates for its backward).
Why: ATen's ``gru`` / ``lstm`` are CompositeImplicitAutograd, so AOT autograd unrolls them into a handful of ops
per step and layer, forward and backward, and Inductor's compile of that graph takes several times a plain
compile's (RecBole GRU4Rec's full sort: 52.7 s against 4.7 s), so a graph holding them runs eagerly
(``recompile.autotune.unrolls``); as one op (``runtime/recurrent.py``) each stays one node in both graphs, its
forward and its backward through time native, its sequence length symbolic. The packed-sequence form,
bidirectional layers and dropout between layers in training stay ATen's (``docs/recurrent.md``).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from recompile.passes.utils import each_match, erase_if_unused, is_call, is_training, replace_node, tensor_meta
from recompile.pipeline import PassContext, example_value, register_pass
from recompile.runtime.recurrent import computes

# torch.gru / torch.lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
ARITY = 9
KINDS = {torch.gru: "gru", torch.lstm: "lstm"}


def recurrent_arguments(node: fx.Node) -> tuple | None:
    """``(kind, input, states, params, has_biases, num_layers, batch_first)`` of a ``torch.gru`` / ``torch.lstm``
    call the op computes (``states``: the GRU's ``(hx,)``, the LSTM's ``(hx, cx)``), or None."""
    if not is_call(node, *KINDS) or len(node.args) != ARITY or node.kwargs:
        return None
    kind = KINDS[node.target]
    input, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first = node.args
    states = tuple(hx) if kind == "lstm" and isinstance(hx, (list, tuple)) else (hx,)
    if (not isinstance(params, (list, tuple)) or len(states) != (2 if kind == "lstm" else 1)
            or not computes(kind, tensor_meta(input), params, has_biases, layers, dropout, train, bidirectional)):
        return None
    if any(user.target is not operator.getitem for user in node.users):
        return None
    return kind, input, states, list(params), bool(has_biases), layers, bool(batch_first)


def _initial_state(state: fx.Node) -> fx.Node | None:
    """``state``, or None where it is ``torch.zeros(...)`` (the modules' default)."""
    return None if is_call(state, torch.zeros) else state


@register_pass("recurrent", order=70, regions={"recurrent": "#9fe0d2"})
def recurrent(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph, save = gm.graph, is_training(gm)
    for node, (kind, input, states, params, has_biases, layers, batch_first) in each_match(gm, recurrent_arguments):
        args = (input, *map(_initial_state, states), params, has_biases, layers, batch_first, save)
        impl = ctx.lower(f"recompile::{kind}", *args)
        op = getattr(torch.ops.recompile, kind).default
        with graph.inserting_before(node):
            out = graph.call_function(op, (*args, impl.impl))
        example_value(out)  # its own fake value (replace_node would keep the tuple of torch.gru / lstm)
        ctx.record_region("recurrent", [node], f"recompile::{kind}", impl)
        replace_node(node, out)
        erase_if_unused(*states)
    return gm
