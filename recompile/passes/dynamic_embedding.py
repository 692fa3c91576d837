"""dynamic_embedding: lower dynamic-embedding lookups to one deduplicated hash-table call per table.

Pattern: ``torch.ops.hkv.embedding_lookup(weight, ids, offsets, table_id, mode, train)`` (what
``hkv.DynamicEmbedding`` / ``hkv.DynamicEmbeddingBag`` call), one or more per table in a graph.
Replacement, per table:
    unique_ids, inverse, n = hkv.unique(cat(ids of every lookup), on_host)   # dedup once per batch
    rows = hkv.lookup(weight, unique_ids, n, table_id, train, impl)          # find (or insert) once
    out_i = embedding_bag(inverse_i, rows, offsets_i, mode) | embedding(inverse_i, rows)   # expand back
``unique_ids`` is padded to the length of the ids (``n`` of them are real), so no shape depends on
data. ``on_host`` is ``options.offload == "partial"`` (Rec SDK's non-fully-offloaded mode: dedup on the host);
``"full"`` keeps it on the device. The backward of ``hkv.lookup`` applies the table's optimizer once
per unique row (``hkv.update``); the expansion's backward, which Inductor compiles, sums the gradients.
Lookups of one table with different ``train`` flags are lowered separately. Sharing one update per
table per batch is the exact (deduplicated) semantics; eager calls of the module update once per call.
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx
import torch.nn.functional as F

import hkv  # noqa: F401  (defines torch.ops.hkv.*)
from recompile.passes.utils import arg, replace_node
from recompile.pipeline import PassContext, register_pass

OP = "hkv::lookup"
LOOKUPS = (torch.ops.hkv.embedding_lookup, torch.ops.hkv.embedding_lookup.default)
ARGS = ("weight", "ids", "offsets", "table_id", "mode", "train")


def _lookup_args(node: fx.Node) -> dict | None:
    if node.op != "call_function" or node.target not in LOOKUPS:
        return None
    args = {name: arg(node, i, name) for i, name in enumerate(ARGS)}
    if arg(node, 6, "impl", "auto") != "auto":  # already given a kernel: leave it
        return None
    return args


@register_pass("dynamic_embedding")
def dynamic_embedding(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    groups: dict[tuple, list[tuple[fx.Node, dict]]] = defaultdict(list)
    for node in gm.graph.nodes:
        args = _lookup_args(node)
        if args is not None:
            groups[(args["table_id"], args["train"], args["weight"])].append((node, args))
    on_host = ctx.options.offload == "partial"
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for (table_id, train, weight), lookups in groups.items():
        for batch in _shareable(lookups, order):
            _lower_table(gm.graph, table_id, train, weight, batch, on_host, ctx)
    return gm


def _shareable(lookups, order):
    """Split a table's lookups into runs that can share one dedup: every ids tensor of a run exists
    before the run's first lookup (where the shared unique + lookup is inserted)."""
    runs = []
    for node, args in lookups:
        ids = args["ids"]
        if runs and order.get(ids, -1) < order[runs[-1][0][0]]:
            runs[-1].append((node, args))
        else:
            runs.append([(node, args)])
    return runs


def _lower_table(graph: fx.Graph, table_id: int, train: bool, weight: fx.Node, lookups, on_host: bool,
                 ctx: PassContext) -> None:
    impl = ctx.lower(OP)
    first = lookups[0][0]
    with graph.inserting_before(first):
        ids = [args["ids"] for _, args in lookups]
        all_ids = ids[0] if len(ids) == 1 else graph.call_function(torch.cat, (ids,))
        unique = graph.call_function(torch.ops.hkv.unique.default, (all_ids, on_host))
        unique_ids = graph.call_function(operator.getitem, (unique, 0))
        inverse = graph.call_function(operator.getitem, (unique, 1))
        num_unique = graph.call_function(operator.getitem, (unique, 2))
        rows = graph.call_function(torch.ops.hkv.lookup.default,
                                   (weight, unique_ids, num_unique, table_id, train, impl.impl))
        if len(ids) == 1:
            inverses = [inverse]
        else:
            sizes = [graph.call_method("size", (i, 0)) for i in ids]
            parts = graph.call_function(torch.split, (inverse, sizes))
            inverses = [graph.call_function(operator.getitem, (parts, k)) for k in range(len(ids))]
    for (node, args), inv in zip(lookups, inverses):
        with graph.inserting_before(node):
            if args["mode"] == "none":
                out = graph.call_function(F.embedding, (inv, rows))
            else:
                out = graph.call_function(F.embedding_bag, (inv, rows, args["offsets"]), {"mode": args["mode"]})
        ctx.record_region("dynamic_embedding", [node], OP, impl)
        replace_node(node, out)

