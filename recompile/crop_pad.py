"""crop_pad: a constant padding that only crops (every pad <= 0) as slices, views of its input (an Inductor
post-grad pass on every graph rec_ascend compiles, run by ``narrow_gemm.NarrowGemm``).

Pattern -> replacement: ``constant_pad_nd(x, pads)`` with no positive pad -> ``slice(x, dim, -before, after or end)``
for each dimension it crops.
Why: Inductor lowers ``constant_pad_nd`` as a pointwise copy, which a matrix product (an extern call) cannot fuse: a
C++ kernel of its own, one C++ build at the cold compile (about 0.7-1 s CPU), where the slice is a strided view the
GEMM reads as it is. AOT autograd writes the backward of a padding as such a cropping padding: the two products of one
input that ``gather_linear`` pads and sums side by side (NARM's ``a_1`` / ``a_2``) take their gradients as crops of
the sum's, each read by two GEMMs (the input's and the weight's gradients).
"""
from __future__ import annotations

import sys

import torch
import torch.fx as fx

from recompile.passes.utils import call_with_val

aten = torch.ops.aten


def crops_as_slices(graph: fx.Graph) -> None:
    """Each ``constant_pad_nd`` of ``graph`` whose pads are all <= 0, one of them < 0, as slices of its input."""
    for node in graph.find_nodes(op="call_function", target=aten.constant_pad_nd.default):
        x, pads = node.args[0], node.args[1]
        if not all(isinstance(p, int) and p <= 0 for p in pads) or not any(pads):
            continue
        out = x
        with graph.inserting_before(node):
            for i in range(0, len(pads), 2):  # pads run from the last dimension back, (before, after) each
                before, after = pads[i], pads[i + 1]
                if before == 0 and after == 0:
                    continue
                dim = x.meta["val"].dim() - 1 - i // 2
                end = after if after < 0 else sys.maxsize  # from the end: no size, which may be symbolic, named
                out = call_with_val(graph, aten.slice.Tensor, out, dim, -before, end)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
