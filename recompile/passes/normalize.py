"""normalize: one spelling per operation, so that later passes match a single form.

Pattern and replacement:
- ``call_method`` ``x.name(*args)`` for a method in ``METHOD_FUNCTIONS`` -> ``torch.name(x, *args)``;
  sizes a method takes as varargs (``x.reshape(2, -1)``) become the one tuple its function takes.
- ``operator.add/sub/mul/truediv/matmul(x, y)`` with a tensor ``x`` -> ``torch.add/sub/mul/div/matmul``.
- a full reduction ``torch.sum(x)`` / ``torch.mean(x)`` -> ``torch.sum(x, dtype=None)``: the same call, bound to
  one overload (bare, it also matches ``sum(List[int])``, which leaves pattern matching ambiguous).
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

# Methods that accept sizes as separate arguments where their torch function takes one sequence.
SIZE_VARARG_METHODS = frozenset({"reshape", "permute"})

# Reductions whose bare one-argument call matches several overloads.
FULL_REDUCTIONS = (torch.sum, torch.mean)

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


def _is_sequence(arg) -> bool:
    value = arg.meta.get("example_value") if isinstance(arg, fx.Node) else arg
    return isinstance(value, (list, tuple))


def _function_args(node: fx.Node) -> tuple:
    self_arg, *rest = node.args
    if node.target in SIZE_VARARG_METHODS and not (len(rest) == 1 and _is_sequence(rest[0])):
        return (self_arg, tuple(rest))
    return node.args


@register_pass("normalize", order=0)
def normalize(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node in gm.graph.nodes:
        fn = _function_for(node)
        if fn is not None:
            if node.op == "call_method":
                node.args = _function_args(node)
            node.op, node.target = "call_function", fn
        if node.op == "call_function" and node.target in FULL_REDUCTIONS and len(node.args) == 1 and not node.kwargs:
            node.kwargs = {"dtype": None}
    return gm
