"""gather_linear: a linear of one gathered position per sequence computed at every position, then gathered, in every
graph rec_ascend hands to Inductor (a step before Inductor, like ``dot_linear``, not a rec pass: it finds no region
and runs on the captured graph too).

Pattern -> replacement -> why:

- ``linear(squeeze(gather(x, 1, i.expand(B, 1, H)), 1), w, b)`` with ``x`` [B, T, H], ``i`` [B, 1, 1] (one
  position per row: RecBole's ``gather_indexes``, NARM's ``a_2(ht)`` of the last position's GRU output) ->
  ``squeeze(gather(linear(x, w, b), 1, i.expand(B, 1, N)), 1)``. Inductor runs a linear as an extern GEMM on CPU,
  which needs its operand in a buffer: the gathered rows were a C++ kernel of their own before the GEMM. Now the GEMM
  reads ``x`` as it is (NARM: the GRU op's output) and the gather is an indexed load in the kernel that reads the
  product. NARM's full sort compiles into two C++ kernels (three before, plain Inductor's two), one C++ build each
  (about 0.7 s CPU).
- In a training graph, where a linear with no bias reads the same ``x`` (NARM's ``a_1(gru_out)``), the two products
  are side by side, ``pad(linear(x, w_1), (0, n)) + pad(linear(x, w), (m, 0))``, each read as its column block: the
  attention's gradient is then one [B, T, m + n] tensor, made in one kernel, each GEMM reading its crop as a view
  (``crop_pad``). Otherwise the forward keeps the gathered product for the backward (a kernel of its own) and the
  backward computes the two products' gradients in two kernels. Not ``linear(x, cat([w_1, w]))``: the weights'
  concatenation was a C++ kernel of its own (one C++ build, about 0.8-1 s CPU at the cold compile), and not
  ``cat`` of the two products, which Inductor copies into a buffer on CPU (a kernel too). NARM's training step:
  seven C++ kernels (ten before this rewrite; plain Inductor's six, without the attention). Not in inference: no
  gradient to make one.
Only where the linear has no more output columns than input ones, so that the product at every position is no
larger than ``x`` itself: GRU4Rec's full-softmax logits of its last position ([B, 8] x [8, 1683]) at every position
made its training step at batch 2048 66.9 ms, against plain Inductor's 57.5 ms in the same run (rec_ascend's 24.9 ms
in the last full corpus run). Cost: the product at T positions instead of one
(NARM: [B * T, 16] x [16, 16] more; its steps within noise, CPU time under load).
The numbers do not change (the pads add zeros) but for rounding where the GEMM of every position blocks a row's
product otherwise than the GEMM of one row per sequence.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from recompile.dot_linear import LINEAR
from recompile.passes.utils import arg, calls, is_call, replace_node, tensor_meta
from recompile.pipeline import call_before, rewrite_each


def _gathered_row(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(x, i)`` where ``node`` is ``squeeze(gather(x, 1, i.expand(B, 1, H)), 1)``: row ``i[b]`` of each ``x[b]``."""
    if not calls(node, torch.squeeze, "squeeze") or arg(node, 1, "dim") != 1:
        return None
    gather = node.args[0]
    if not calls(gather, torch.gather, "gather") or arg(gather, 1, "dim") != 1:
        return None
    x, index = gather.args[0], arg(gather, 2, "index")
    if not calls(index, torch.Tensor.expand, "expand"):
        return None
    x_meta, i_meta = tensor_meta(x), tensor_meta(index.args[0])
    if x_meta is None or i_meta is None or x_meta.dim() != 3 or tuple(i_meta.shape) != (x_meta.shape[0], 1, 1):
        return None
    return x, index.args[0]


def _linear_of_row(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(x, i)`` where ``node`` is a linear of ``x``'s row ``i[b]`` per ``b`` with a 2-D weight of ``x``'s dtype
    and no more output columns than input ones."""
    if not is_call(node, LINEAR) or (row := _gathered_row(arg(node, 0, "input"))) is None:
        return None
    w = tensor_meta(arg(node, 1, "weight"))
    if w is None or w.dim() != 2 or w.dtype != tensor_meta(row[0]).dtype:
        return None
    return row if w.shape[0] <= w.shape[1] else None  # no wider than x: at every position, no larger than x


def _sibling(x: fx.Node, node: fx.Node) -> fx.Node | None:
    """A linear of ``x`` itself that can share one GEMM with ``node`` (a differentiated linear of one row of ``x``):
    neither has a bias and both weights are 2-D graph inputs (parameters), defined before either linear."""
    if not tensor_meta(node).requires_grad or not _input_weight(node):
        return None
    return next((user for user in x.users if arg(user, 0, "input") is x and _input_weight(user)), None)


def _input_weight(node: fx.Node) -> bool:
    weight = arg(node, 1, "weight")
    return (is_call(node, LINEAR) and arg(node, 2, "bias") is None and weight.op == "placeholder"
            and tensor_meta(weight).dim() == 2)


def _all_rows(graph: fx.Graph, node: fx.Node, x: fx.Node) -> fx.Node:
    """``node``'s linear at every position of ``x``: its own GEMM, or the right block of the sibling's GEMM and its
    own side by side (each padded to both's columns, then summed: ``_side_by_side``)."""
    if (sibling := _sibling(x, node)) is None:
        return call_before(graph, LINEAR, (x, arg(node, 1, "weight"), arg(node, 2, "bias")), node)
    first = next(n for n in graph.nodes if n in (sibling, node))
    columns = tensor_meta(arg(sibling, 1, "weight")).shape[0]
    both = _side_by_side(graph, [call_before(graph, LINEAR, (x, arg(n, 1, "weight")), first) for n in (sibling, node)],
                         first)
    replace_node(sibling, call_before(graph, operator.getitem, (both, (Ellipsis, slice(None, columns))), sibling))
    return call_before(graph, operator.getitem, (both, (Ellipsis, slice(columns, None))), node)


def _side_by_side(graph: fx.Graph, products: list[fx.Node], before: fx.Node) -> fx.Node:
    """``cat(products, -1)`` as ``pad(left, (0, n)) + pad(right, (m, 0))``: Inductor fuses the pads into the sum's
    readers (on CPU it copies a concatenation's pieces into a buffer, a C++ kernel where the products are extern
    GEMMs), and each product's gradient is a crop of the sum's, which ``crop_pad`` hands its GEMMs as a view."""
    left, right = (tensor_meta(p).shape[-1] for p in products)
    pads = [call_before(graph, torch.nn.functional.pad, (p, pad), before)
            for p, pad in zip(products, [(0, right), (left, 0)])]
    return call_before(graph, operator.add, tuple(pads), before)


def gathers_after_linears(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with each linear of one gathered row per sequence a gather of the linear at every position
    (``rewrite_each``)."""
    return rewrite_each(gm, _linear_of_row, _gather_after)


def _gather_after(graph: fx.Graph, node: fx.Node, row: tuple[fx.Node, fx.Node]) -> fx.Node:
    """The nodes, before ``node`` (a linear of row ``i[b]`` of each ``x[b]``), of the linear of ``x`` read at row
    ``i[b]``."""
    x, i = row
    index = call_before(graph, torch.Tensor.expand, (i, -1, -1, tensor_meta(node).shape[-1]), node)
    gathered = call_before(graph, torch.gather, (_all_rows(graph, node, x), 1, index), node)
    return call_before(graph, torch.squeeze, (gathered, 1), node)
