"""normalize: one spelling per operation, so that later passes match a single form.

Pattern and replacement:
- ``call_method`` ``x.name(*args)`` for a method in ``METHOD_FUNCTIONS`` -> ``torch.name(x, *args)``;
  the varargs shape of ``x.reshape(a, b)`` / ``x.permute(0, 2, 1)`` becomes ``torch.reshape(x, (a, b))``.
- ``operator.add/sub/mul/truediv/matmul(x, y)`` with a tensor ``x`` -> ``torch.add/sub/mul/div/matmul``.
Nothing else changes; the computation is the same call under another name.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from recompile.passes.utils import tensor_meta
from recompile.pipeline import PassContext, register_pass

# Tensor methods whose torch function takes the tensor first and the same arguments after it.
METHOD_FUNCTIONS = {
    name: getattr(torch, name)
    for name in (
        "sum", "mean", "amax", "amin", "max", "min", "prod", "cumsum", "softmax", "log_softmax",
        "bmm", "matmul", "mm", "transpose", "permute", "reshape", "unsqueeze", "squeeze", "flatten",
        "index_select", "gather", "masked_fill", "sigmoid", "relu", "tanh", "exp", "log", "sqrt",
        "rsqrt", "clamp", "split", "chunk", "triu", "tril", "mul", "add", "sub", "div", "pow", "neg",
        "abs", "square", "repeat_interleave", "narrow", "select", "unbind", "masked_select",
        "logical_not", "eq", "ne", "lt", "le", "gt", "ge", "t",
    )
}

# Methods taking a shape as varargs whose torch function takes one sequence.
VARARG_SHAPE_METHODS = ("reshape", "permute")

OPERATOR_FUNCTIONS = {
    operator.add: torch.add,
    operator.sub: torch.sub,
    operator.mul: torch.mul,
    operator.truediv: torch.div,
    operator.matmul: torch.matmul,
}


def _function_for(node: fx.Node):
    if node.op == "call_method":
        return METHOD_FUNCTIONS.get(node.target)
    if node.op == "call_function" and node.target in OPERATOR_FUNCTIONS and tensor_meta(node.args[0]) is not None:
        return OPERATOR_FUNCTIONS[node.target]
    return None


def _varargs_shape(args: tuple) -> bool:
    """True for ``(a, b, ...)`` or a single size ``(a,)``; False for one sequence ``((a, b),)``."""
    if len(args) != 1:
        return len(args) > 1
    shape = args[0].meta.get("example_value") if isinstance(args[0], fx.Node) else args[0]
    return not isinstance(shape, (list, tuple))


@register_pass("normalize")
def normalize(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node in gm.graph.nodes:
        fn = _function_for(node)
        if fn is None:
            continue
        if node.op == "call_method" and node.target in VARARG_SHAPE_METHODS and _varargs_shape(node.args[1:]):
            node.args = (node.args[0], tuple(node.args[1:]))
        node.op, node.target = "call_function", fn
    return gm
