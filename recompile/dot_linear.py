"""dot_linear: a linear with one output column as a dot product per row, in every graph rec_ascend hands to Inductor
(a step before Inductor, like ``split_padding``, not a rec pass: it finds no region and runs on the captured graph
too; after the rec passes, whose patterns read such linears as normalize writes them).

Pattern -> replacement -> why:

- ``linear(x, w, b)`` with ``w`` [1, K] (floating point, ``x`` of rank 2 or more and ``w``'s dtype) ->
  ``sum(x * w, -1, keepdim=True) + b``. Inductor runs a linear as an extern GEMM call on CPU, which needs its
  operand in a buffer and ends the C++ kernel before it; with one output column the GEMM is a dot per row, which as
  a reduction fuses into the kernel that makes ``x`` and the one that reads the result. RecBole's NARM scores its
  attention with ``v_t(mask * sigmoid(q1 + q2))`` (``Linear(H, 1)``) and weighs the GRU's outputs with it: its
  forward compiled into four C++ kernels, one C++ build each (about 0.7 s CPU: g++ loading the precompiled
  header), against plain Inductor's two; the attention is now one kernel.

The numbers do not change but for the summation order of each dot.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from recompile.passes.utils import arg, is_call, tensor_meta
from recompile.pipeline import call_before, rewrite_each

LINEAR = torch._C._nn.linear  # F.linear and nn.Linear calls, as Dynamo records them


def _dot_weight(node: fx.Node) -> fx.Node | None:
    """``w`` where ``node`` is ``linear(x, w, b)`` with one output column that the replacement computes as is."""
    if not is_call(node, LINEAR):
        return None
    x, w = tensor_meta(arg(node, 0, "input")), tensor_meta(arg(node, 1, "weight"))
    if x is None or w is None or w.dim() != 2 or w.shape[0] != 1 or x.dim() < 2 or x.dtype != w.dtype:
        return None
    return arg(node, 1, "weight") if w.dtype.is_floating_point else None


def linears_as_dots(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with each one-column linear a dot per row (``rewrite_each``)."""
    return rewrite_each(gm, _dot_weight, _dot)


def _dot(graph: fx.Graph, node: fx.Node, w: fx.Node) -> fx.Node:
    """The nodes, before ``node`` (a linear), of ``sum(x * w, -1, keepdim=True) + b``."""
    product = call_before(graph, operator.mul, (arg(node, 0, "input"), w), node)
    dot = call_before(graph, torch.sum, (product, -1), node, keepdim=True)
    bias = arg(node, 2, "bias")
    return dot if bias is None else call_before(graph, operator.add, (dot, bias), node)
