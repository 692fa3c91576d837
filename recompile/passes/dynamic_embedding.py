"""dynamic_embedding: lower dynamic-embedding lookups to one deduplicated hash-table call per table.

Pattern: ``torch.ops.hkv.embedding_lookup(weight, ids, offsets, table_id, mode, train)`` (what
``hkv.DynamicEmbedding`` / ``hkv.DynamicEmbeddingBag`` call), one or more per table in a graph.
Replacement, per table:
    unique_ids, inverse, n, grouping = hkv.unique(cat(ids of every lookup), on_host, table_id)  # dedup once
    rows = hkv.lookup(weight, unique_ids, n, grouping, table_id, train, impl)  # find (or insert) once
    out = embedding_bag(inverse, rows, cat(offsets_i + ids before i), mode) | embedding(inverse, rows)
    out_i = split(out, bags of each lookup)                                   # expand back, as TBE
``unique_ids`` is padded to the length of the ids (``n`` of them are real), so no shape depends on
data. ``on_host`` is ``options.offload == "partial"`` (Rec SDK's non-fully-offloaded mode: hashing, dedup
and bucketing on the host; the unique ids come grouped by the table's bucket, ``grouping`` its bucket
count, and the device-side lookup consumes them bucket by bucket); ``"full"`` keeps all of it on the
device. The backward of ``hkv.lookup`` applies the table's optimizer once per unique row
(``hkv.update``); the expansion's backward, which Inductor compiles, sums the gradients. Lookups of
one table with different ``train`` flags are lowered separately. Sharing one update per table per batch
is the exact (deduplicated) semantics; eager calls of the module update once per call.
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


@register_pass("dynamic_embedding", order=20, regions={"dynamic_embedding": "#d7b8ff"})
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
    """Split a table's lookups into runs that can share one dedup: the ids and offsets of a run exist
    before the run's first lookup (where the shared unique, lookup and expansion are inserted)."""
    runs = []
    for node, args in lookups:
        inputs = [args["ids"], args["offsets"]]
        if runs and all(order.get(x, -1) < order[runs[-1][0][0]] for x in inputs if isinstance(x, fx.Node)):
            runs[-1].append((node, args))
        else:
            runs.append([(node, args)])
    return runs


def _lower_table(graph: fx.Graph, table_id: int, train: bool, weight: fx.Node, lookups, on_host: bool,
                 ctx: PassContext) -> None:
    impl = ctx.lower(OP, table_id=table_id)
    with graph.inserting_before(lookups[0][0]):
        ids = [args["ids"] for _, args in lookups]
        all_ids = ids[0] if len(ids) == 1 else graph.call_function(torch.cat, (ids,))
        unique = graph.call_function(torch.ops.hkv.unique.default, (all_ids, on_host, table_id))
        unique_ids, inverse, num_unique, grouping = (graph.call_function(operator.getitem, (unique, i))
                                                     for i in range(4))
        rows = graph.call_function(torch.ops.hkv.lookup.default,
                                   (weight, unique_ids, num_unique, grouping, table_id, train, impl.impl))
        sizes = [graph.call_method("size", (i, 0)) for i in ids]
    by_mode: dict[str, list[int]] = defaultdict(list)
    for k, (_, args) in enumerate(lookups):
        by_mode[args["mode"]].append(k)
    for mode, members in by_mode.items():
        _expand(graph, [lookups[k] for k in members], members, sizes, inverse, rows, mode, len(lookups))
    for node, _ in lookups:
        ctx.record_region("dynamic_embedding", [node], OP, impl)


def _expand(graph: fx.Graph, lookups, members: list[int], sizes, inverse, rows, mode: str, total: int) -> None:
    """One embedding_bag (or embedding) over the lookups of one mode, as TBE batches tables: their
    bags laid end to end (offsets shifted by the ids before them), the output split back per lookup.
    One expansion means one dense row gradient in the backward, however many lookups share the table."""
    with graph.inserting_before(lookups[0][0]):
        if len(members) == total:
            inv = inverse
        else:
            parts = graph.call_function(torch.split, (inverse, sizes))
            chosen = [graph.call_function(operator.getitem, (parts, k)) for k in members]
            inv = graph.call_function(torch.cat, (chosen,))
        if mode == "none":
            out = graph.call_function(F.embedding, (inv, rows))
            out_sizes = [sizes[k] for k in members]
        else:
            shifted, start = [], None
            for k, (_, args) in zip(members, lookups):
                offsets = args["offsets"]
                shifted.append(offsets if start is None else graph.call_function(torch.add, (offsets, start)))
                start = sizes[k] if start is None else graph.call_function(operator.add, (start, sizes[k]))
            all_offsets = shifted[0] if len(shifted) == 1 else graph.call_function(torch.cat, (shifted,))
            out = graph.call_function(F.embedding_bag, (inv, rows, all_offsets), {"mode": mode})
            out_sizes = [graph.call_method("size", (args["offsets"], 0)) for _, args in lookups]
        if len(lookups) == 1:
            pieces = [out]
        else:
            split = graph.call_function(torch.split, (out, out_sizes))
            pieces = [graph.call_function(operator.getitem, (split, k)) for k in range(len(lookups))]
    for (node, _), piece in zip(lookups, pieces):
        replace_node(node, piece)
