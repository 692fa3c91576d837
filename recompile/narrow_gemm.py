"""narrow_gemm: a CPU matrix product with few output columns computed transposed (an Inductor post-grad pass on
every graph rec_ascend compiles, forward and backward).

Pattern: ``aten.mm(a, b)`` or ``aten.addmm(bias, a, b)`` on float32 CPU tensors whose result [M, N] has a static
``MIN_COLUMNS <= N < MAX_COLUMNS``, more rows than columns, ``K >= MIN_INNER`` and ``M * K >= MIN_WORK`` (``a``:
[M, K]).
Replacement: ``clone(permute(mm(permute(b), permute(a))), contiguous)`` (``addmm`` with its bias transposed alike:
a [N] bias as [N, 1], an [M, N] one permuted): the same product as ``[N, M] = b^T a^T``, copied back to the
original's layout (M x N floats, a few per row, which Inductor fuses into the copy's consumers where it can), except
where only matrix products read it, itself or transposed (their extern calls take the transposed view as it is; the
copy was a C++ kernel of its own, as NARM's and GRU4Rec's sequence-output gradient was: one C++ build, about 0.7 s
CPU). The layout must not change elsewhere: a forward's output saved for the backward keeps the strides AOT autograd
traced the backward with (a transposed one is read with the batch it was compiled at fixed in its stride).
Why: ATen hands both to MKL's SGEMM, which is several times slower on an output of a few columns than on its
transpose, most of all when ``a`` is itself a transposed view, as the weight gradient of a linear layer or of a
full-softmax logits product is (``mm(grad.t(), x)``). A full-softmax loss over 1683 items with 8-wide embeddings,
batch 2048 (RecBole GRU4Rec / NARM at the corpus's sizes): the item table's gradient [1683, 8] 17.5 ms, transposed
2.2 ms; the sequence output's [2048, 8] 4.9 ms, transposed 2.1 ms (one thread, CPU time, under load). One output
column is a matrix-vector product (no gain), and from 16 columns on the two orders run alike.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from recompile import addmm_sum, crop_pad
from recompile.passes import utils
from recompile.passes.utils import call_with_val

aten = torch.ops.aten
FILES = (__file__, addmm_sum.__file__, crop_pad.__file__, utils.__file__)  # what the pass runs: its FX graph cache key

MIN_COLUMNS, MAX_COLUMNS = 2, 16
# rows x inner size below which the copy back costs about what the transposed product saves (TorchRec DLRM's
# forward at batch 128, static: 0.169 against 0.160 ms with its [128, 16] x [16, 8] product transposed)
MIN_WORK = 1 << 16
# inner size below which the product is bound by its output's bytes, and the copy back costs more than the swap
# saves (RecBole AFM's pair projection at batch 2048, [43008, 8] x [8, 8]: 0.49 ms, transposed and copied 0.57 ms;
# [8192, 16] x [16, 8] 0.32 -> 0.21 ms)
MIN_INNER = 16


PRODUCTS = (aten.mm.default, aten.addmm.default)  # read an operand in either layout: no copy back for these users
TRANSPOSES = (aten.permute.default, aten.t.default)


def _products_read(node: fx.Node) -> bool:
    """Only matrix products read ``node``, itself or transposed."""
    return all(user.target in PRODUCTS or (user.target in TRANSPOSES and _products_read(user)) for user in node.users)


def _narrow(node: fx.Node) -> bool:
    """``node`` is a float32 CPU matrix product whose static column count is narrow, whose rows outnumber it, whose
    inner size is at least ``MIN_INNER`` and whose rows x inner size are at least ``MIN_WORK`` (a symbolic size
    counts as large)."""
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.dtype != torch.float32 or out.device.type != "cpu":
        return False
    (rows, columns), inner = out.shape, node.args[-2].meta["val"].shape[1]
    if not (isinstance(columns, int) and MIN_COLUMNS <= columns < MAX_COLUMNS):
        return False
    if (isinstance(rows, int) and rows <= columns) or (isinstance(inner, int) and inner < MIN_INNER):
        return False
    return not (isinstance(rows, int) and isinstance(inner, int)) or rows * inner >= MIN_WORK


def _transposed_bias(graph: fx.Graph, bias: fx.Node) -> fx.Node:
    """The bias of ``[N, M] = b^T a^T``: a [N] row broadcast as an [N, 1] column, a 2-D one transposed."""
    if bias.meta["val"].dim() == 1:
        return call_with_val(graph, aten.unsqueeze.default, bias, 1)
    return call_with_val(graph, aten.permute.default, bias, [1, 0])


def transpose_narrow_products(graph: fx.Graph) -> None:
    """Each narrow ``mm`` / ``addmm`` of ``graph`` (no keywords: no alpha or beta) as its transposed product."""
    for node in graph.find_nodes(op="call_function", target=aten.mm.default) + graph.find_nodes(
            op="call_function", target=aten.addmm.default):
        if node.kwargs or not _narrow(node):
            continue
        *bias, a, b = node.args
        if bias and bias[0].meta["val"].dim() not in (1, 2):
            continue
        with graph.inserting_before(node):
            bias = [_transposed_bias(graph, x) for x in bias]
            operands = [call_with_val(graph, aten.permute.default, x, [1, 0]) for x in (b, a)]
            product = call_with_val(graph, node.target, *bias, *operands)
            out = call_with_val(graph, aten.permute.default, product, [1, 0])
            if not _products_read(node):
                out = call_with_val(graph, aten.clone.default, out, memory_format=torch.contiguous_format)
        node.replace_all_uses_with(out)
        graph.erase_node(node)


class NarrowGemm(CustomGraphPass):
    """``crop_pad.crops_as_slices``, ``addmm_sum.sums_into_products`` (not into the narrow products, which are
    transposed) and ``transpose_narrow_products`` as Inductor's ``post_grad_custom_pre_pass``,
    then ``after``: the pass the user's Inductor config held, which it would otherwise replace. Its uuid keys
    Inductor's FX graph cache: the hash of the files it runs (``FILES``) and ``after``'s (None, so no caching, where
    ``after`` is a plain callable Inductor cannot key)."""

    def __init__(self, after: Optional[Callable[[fx.Graph], None]] = None):
        self.after = after

    def __call__(self, graph: fx.Graph) -> None:
        crop_pad.crops_as_slices(graph)
        addmm_sum.sums_into_products(graph, skip=_narrow)
        transpose_narrow_products(graph)
        if self.after is not None:
            self.after(graph)

    def uuid(self) -> Any:
        if self.after is None:
            return get_hash_for_files(FILES)
        theirs = self.after.uuid() if isinstance(self.after, CustomGraphPass) else None
        return None if theirs is None else (get_hash_for_files(FILES), theirs)
