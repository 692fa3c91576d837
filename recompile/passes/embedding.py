"""embedding: group the embedding lookups that feed one stack/cat into one grouped lookup.

Patterns (a *lookup*), each on its own table:
- ``F.embedding_bag(ids, weight, offsets, mode="sum"|"mean", per_sample_weights=..., include_last_offset=...,
  padding_idx=..., sparse=...)`` with 1-D ids + offsets or 2-D ids (how Dynamo records ``nn.EmbeddingBag``);
- ``torch.sum|mean(F.embedding(ids2d, weight), 1)`` (a bag of fixed size written by hand);
- either followed by a no-op ``.float()`` on a float32 table (how Dynamo records TorchRec's
  ``EmbeddingBagCollection`` fed a ``KeyedJaggedTensor``: one ``F.embedding_bag`` per feature with
  ``include_last_offset=True``, cast, then ``torch.cat(..., dim=1)`` into the KeyedTensor's values);
feeding one consumer ``torch.stack(items, dim=1)`` or ``torch.cat(items, dim=1)`` of 2-D items.

Replacement: every run of two or more consecutive lookups of ``items`` (distinct tables, one dtype)
becomes one ``recompile.grouped_embedding_bag`` written in the consumer's layout (``"stack"``
``[B, T, D]`` or ``"concat"`` ``[B, sum(D)]``). The consumer disappears when the run is all of it;
otherwise a stack becomes ``torch.cat([x.unsqueeze(1), grouped, ...], 1)`` (DLRM's
``stack([x] + embs, 1)``) and a cat keeps its other items around the grouped output.

Quantized tables (``recompile.quantize``) are grouped the same way: each of their lookups is a one-table
``recompile.grouped_embedding_bag_quantized`` call, and a run of them (one ``qdtype``) becomes one call of it.

Unpooled lookups ``F.embedding(ids1d, weight)`` (and their no-op ``.float()``: TorchRec's
``EmbeddingCollection``) on distinct tables of one dtype and dim become one ``"sequence"`` call
``[sum(len(ids)), D]``; each lookup's value is its slice ``torch.narrow(grouped, 0, start, len(ids))``.

Masked pooling over a padded lookup (RecBole's ``embed_token_seq_fields`` and the usual hand-written bag):
``torch.sum(emb * mask, 1)``, ``torch.sum(masked_fill(emb, ~mask, 0), 1)`` or ``torch.sum(where(mask, emb, 0), 1)``
(``keepdim`` either way) with ``emb = F.embedding(ids, weight)``, ``ids`` ``[B, L]`` and ``mask`` the test
``ids != p`` (or ``~(ids == p)``) of the same ``ids`` against a constant padding id ``p``, cast and broadcast
(``float()``, ``to``, ``unsqueeze(-1)``, ``[..., None]``, ``expand_as``) to ``emb``'s shape -> a SUM lookup
with ``padding_idx = p``: each bag's non-padding rows summed, padding ids contributing nothing forward and
receiving no gradient, as the mask gives. A mean is that sum divided by a count the model computes itself
(RecBole's ``sum / (count + 1e-8)``, ``sum / count.clamp(min=1)``): the division stays as written, so every
epsilon and clamp keeps its exact arithmetic, all-padding rows included. Such a lookup joins a group like any
other; alone, it becomes a one-table call (``"concat"`` layout, ``unsqueeze(., 1)`` for ``keepdim``), which
reads the table rows once instead of materialising ``[B, L, D]``. Left alone: a mask of other ids, another
test (``ids > 0``) or a non-constant ``p``, a table whose own ``padding_idx`` is another id, a product that
promotes the table's dtype (a bag would round its sum to the table's dtype), an ``emb`` with other users.

Field lookups (RecBole's ``FMEmbedding``: every token field's id plus its field's offset, looked up in one table;
``FMFirstOrderLinear``: the same ids in a width-1 table): ``F.embedding(ids, weight)`` with ``ids`` of two or more
dims ``[B, F, ...]`` that nothing pools, on distinct tables of one dtype and device whose ids have one shape, become
one ``"concat"`` call over bags of one id (``ids.reshape(-1, 1)`` per table, ``[B * F, sum(D)]``); each lookup's
value is its slice ``narrow(grouped, 1, start, D).reshape(-1, F, ..., D)``. The ids are what the graph computes
(the offsets stay an add Inductor fuses), so one call reads the second-order and the first-order tables; pure
nodes making a later lookup's ids move up to the call. Left alone: a table with a ``padding_idx`` (its row is
read forward, but a bag would drop it), ids whose trailing dims are not static.

Lookups left alone are reported as notes in ``ctx.fallbacks`` with the reason (``max`` pooling,
``max_norm``, ``scale_grad_by_freq``, a lookup with other users, no stack/cat consumer, ...).
"""
from __future__ import annotations

import inspect
import operator
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from recompile.options import embedding_optimizer_spec
from recompile.passes.utils import arg, erase_unused, has_effects, is_call, meta_value, tensor_meta
from recompile.pipeline import Fallback, PassContext, graph_fake_mode, register_pass
from recompile.runtime.embedding import MEAN, NONE, POOLING_NAMES, SUM

OP = "recompile::grouped_embedding_bag"
QUANTIZED_OP = "recompile::grouped_embedding_bag_quantized"
EMBEDDING_BAG = (F.embedding_bag,)
EMBEDDING = (F.embedding,)
BAG_REDUCTIONS = {torch.sum: SUM, torch.mean: MEAN}
CONSUMERS = {torch.stack: "stack", torch.cat: "concat"}
NOOP_CASTS = {"float": torch.float32}
_SIGNATURES = {fn: inspect.signature(fn) for fn in (*EMBEDDING_BAG, *EMBEDDING)}


class NotGroupable(Exception):
    """A lookup the pass cannot prove safe to group; the message says why."""


@dataclass
class Lookup:
    erased: list[fx.Node]  # the nodes the grouped call replaces, the one the consumer uses first
    weight: fx.Node
    indices: fx.Node
    offsets: Optional[fx.Node]
    per_sample_weights: Optional[fx.Node]
    pooling: int
    padding_idx: int
    include_last_offset: bool
    sparse: bool
    keepdim: Optional[bool] = None  # a masked pooling's reduction kept its dim; None: not a masked pooling
    qdtype: Optional[str] = None  # a quantized table's format ("int8", "int4"), None for a float one
    name: Optional[str] = None  # the feature's name where the lookup gives it

    @property
    def table(self) -> torch.Tensor:
        return tensor_meta(self.weight)


def _bound(node: fx.Node) -> dict[str, Any]:
    bound = _SIGNATURES[node.target].bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return bound.arguments


def _check_common(a: dict[str, Any]) -> torch.Tensor:
    weight = tensor_meta(a["weight"])
    if weight is None or weight.dim() != 2:
        raise NotGroupable("the table is not a 2-D tensor")
    if a["max_norm"] is not None:
        raise NotGroupable("max_norm renormalises table rows in place")
    if a["scale_grad_by_freq"]:
        raise NotGroupable("scale_grad_by_freq is not a TBE option")
    return weight


def _padding(a: dict[str, Any], rows: int) -> int:
    pad = a["padding_idx"]
    if pad is None:
        return -1
    if not isinstance(pad, int):
        raise NotGroupable("padding_idx is not a constant")
    return pad + rows if pad < 0 else pad


def _embedding_bag(node: fx.Node) -> Lookup:
    a = _bound(node)
    weight = _check_common(a)
    if a["mode"] not in ("sum", "mean"):
        raise NotGroupable(f"mode {a['mode']!r} pooling is not grouped (TBE pools by sum or mean)")
    ids = tensor_meta(a["input"])
    if ids is None or ids.dim() != (1 if a["offsets"] is not None else 2):
        raise NotGroupable("ids are neither 1-D with offsets nor 2-D")
    return Lookup([node], a["weight"], a["input"], a["offsets"], a["per_sample_weights"], POOLING_NAMES[a["mode"]],
                  _padding(a, weight.shape[0]), bool(a["include_last_offset"]), bool(a["sparse"]))


def _embedding_then_reduce(node: fx.Node) -> Lookup:
    embedding = node.args[0]
    a = _bound(embedding)
    _check_common(a)
    ids = tensor_meta(a["input"])
    if ids is None or ids.dim() != 2:
        raise NotGroupable("a reduced F.embedding needs 2-D ids")
    if a["padding_idx"] is not None:
        raise NotGroupable("F.embedding's padding_idx row still counts in a hand-written sum")
    dim = arg(node, 1, "dim")
    dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
    if dim not in (1, -2) or arg(node, 2, "keepdim", False) or node.kwargs.get("dtype") is not None:
        raise NotGroupable("the reduction is not over the bag dimension")
    if len(embedding.users) != 1:
        raise NotGroupable("the F.embedding output has other users")
    return Lookup([node, embedding], a["weight"], a["input"], None, None, BAG_REDUCTIONS[node.target], -1, False,
                  bool(a["sparse"]))


def _quantized(node: fx.Node) -> Lookup | None:
    """A one-table pooled quantized lookup (recompile.quantize's QuantizedEmbeddingBag), None for any other call."""
    weights, indices, offsets, psw, pooling, padding_idx, last, qdtype, layout, names = node.args[:10]
    if len(weights) != 1 or layout != "concat":
        return None
    return Lookup([node], weights[0], indices[0], offsets[0], psw[0], pooling[0], padding_idx[0], last[0], False,
                  qdtype=qdtype, name=names)


def _is_noop_cast(node: Any) -> bool:
    """``x.float()`` on a float32 ``x`` (TorchRec's EmbeddingBagCollection casts every pooled lookup)."""
    return (isinstance(node, fx.Node) and node.op == "call_method" and node.target in NOOP_CASTS and len(node.args) == 1
            and not node.kwargs and getattr(tensor_meta(node.args[0]), "dtype", None) == NOOP_CASTS[node.target])


def _lookup(node: Any) -> Lookup | None:
    """The lookup ``node`` computes, None when it is none; raises NotGroupable for one left alone."""
    if _is_noop_cast(node) and len(node.args[0].users) == 1:
        lookup = _lookup(node.args[0])
        if lookup is not None:
            lookup.erased = [node, *lookup.erased]
        return lookup
    if is_call(node, *EMBEDDING_BAG):
        return _embedding_bag(node)
    if is_call(node, torch.ops.recompile.grouped_embedding_bag_quantized.default):
        return _quantized(node)
    if is_call(node, *BAG_REDUCTIONS) and is_call(node.args[0], *EMBEDDING):
        return _embedding_then_reduce(node)
    if is_call(node, torch.sum):
        return _masked_sum(node)
    return None


# masked pooling: the mask ``ids != p`` through the casts and broadcasts that keep its 0/1 value per (b, l)
MASK_CASTS = frozenset({"float", "half", "bfloat16", "double", "bool", "int", "long", "to", "type_as", "expand",
                        "expand_as"})
PADDING_TESTS = {operator.ne: True, torch.ne: True, operator.eq: False, torch.eq: False}
NEGATIONS = (operator.invert, torch.logical_not)


def _peeled_mask(node: Any) -> tuple[fx.Node, int, bool] | None:
    """(ids, p, keep) when ``node`` is the test ``ids != p`` (keep) or ``ids == p`` (not keep) against an int
    ``p``, cast, negated, broadcast in place or given trailing unit dims; None otherwise."""
    negated = False
    while isinstance(node, fx.Node):
        meta, source = tensor_meta(node), tensor_meta(node.args[0]) if node.args else None
        if meta is None or source is None:
            return None
        if node.op == "call_method" and node.target in MASK_CASTS and source.dim() == meta.dim():
            node = node.args[0]
        elif is_call(node, torch.unsqueeze) and node.args[1] in (source.dim(), -1):
            node = node.args[0]
        elif is_call(node, operator.getitem) and node.args[1] in ((Ellipsis, None), (slice(None), slice(None), None)):
            node = node.args[0]
        elif is_call(node, *NEGATIONS) and (node.target is torch.logical_not or meta.dtype == torch.bool):
            node, negated = node.args[0], not negated
        elif is_call(node, *PADDING_TESTS) and len(node.args) == 2 and not node.kwargs:
            p = node.args[1]
            if type(p) is not int or source.dtype not in (torch.int32, torch.int64):
                return None
            return node.args[0], p, PADDING_TESTS[node.target] != negated
        else:
            return None
    return None


def _is_zero(value: Any) -> bool:
    return type(value) in (int, float) and value == 0


def _masked_embedding(node: fx.Node) -> tuple[fx.Node, tuple[fx.Node, int, bool]] | None:
    """(the F.embedding node, (ids, p, keep)) of ``emb * mask``, ``masked_fill(emb, mask, 0)``,
    ``where(mask, emb, 0)`` or ``where(mask, 0, emb)``, ``keep`` saying whether the ids that pass the test are
    the rows kept; None for another form, or a mask not of ``emb``'s rank (broadcast from the left)."""
    args = node.args
    if is_call(node, torch.mul) and len(args) == 2:
        (emb, mask), drops = (args if is_call(args[0], *EMBEDDING) else args[::-1]), False
    elif is_call(node, torch.masked_fill) and len(args) == 3 and _is_zero(args[2]):
        (emb, mask), drops = args[:2], True
    elif is_call(node, torch.where) and len(args) == 3 and (_is_zero(args[1]) or _is_zero(args[2])):
        drops = _is_zero(args[1])
        emb, mask = args[2 if drops else 1], args[0]
    else:
        return None
    if not is_call(emb, *EMBEDDING) or getattr(tensor_meta(mask), "ndim", None) != 3:
        return None
    found = _peeled_mask(mask)
    if found is None:
        return None
    ids, p, keep = found
    return emb, (ids, p, keep != drops)


def _mask_shape_of(node: fx.Node, emb: fx.Node, masked: fx.Node) -> bool:
    """``mask.expand_as(emb)`` (RecBole's) or ``mask.type_as(emb)`` that only feeds ``masked``: it goes when
    ``masked`` goes."""
    if not (node.op == "call_method" and node.target in ("expand_as", "type_as") and node.args[1:] == (emb,)):
        return False
    while len(node.users) == 1 and node is not masked:
        node = next(iter(node.users))
    return node is masked


def _masked_sum(node: fx.Node) -> Lookup | None:
    """``torch.sum(masked(F.embedding(ids, W)), 1)`` over the mask ``ids != p`` as a SUM lookup with padding p."""
    masked = node.args[0]
    found = _masked_embedding(masked) if isinstance(masked, fx.Node) else None
    if found is None:
        return None
    emb, (ids, p, keep) = found
    a = _bound(emb)
    weight = _check_common(a)
    if ids is not a["input"] or tensor_meta(ids).dim() != 2:
        raise NotGroupable("its mask tests other ids than the lookup's, or they are not [B, L]")
    if not keep:
        raise NotGroupable("its mask keeps the padding ids and drops the rest")
    if not 0 <= p < weight.shape[0] or _padding(a, weight.shape[0]) not in (-1, p):
        raise NotGroupable(f"padding id {p} is outside the table or not the table's own padding_idx")
    dim = arg(node, 1, "dim")
    dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
    if dim not in (1, -2) or node.kwargs.get("dtype") is not None:
        raise NotGroupable("the masked sum is not over the bag dimension")
    same_shape = statically_known_true(sym_eq(tuple(tensor_meta(masked).shape), tuple(tensor_meta(emb).shape)))
    if not same_shape or tensor_meta(masked).dtype != weight.dtype:
        raise NotGroupable("the mask broadcasts the lookup to another shape or promotes the table's dtype")
    if len(masked.users) != 1 or not all(u is masked or _mask_shape_of(u, emb, masked) for u in emb.users):
        raise NotGroupable("the masked lookup has other users")
    return Lookup([node, masked, emb], a["weight"], ids, None, None, SUM, p, False, bool(a["sparse"]),
                  keepdim=bool(arg(node, 2, "keepdim", False)))


def _consumer_layout(consumer: fx.Node) -> str | None:
    if not is_call(consumer, *CONSUMERS) or not isinstance(consumer.args[0], (list, tuple)):
        return None
    items = [tensor_meta(x) for x in consumer.args[0]]
    if any(x is None or x.dim() != 2 for x in items):
        return None
    dim = arg(consumer, 1, "dim", 0)
    layout = CONSUMERS[consumer.target]
    return layout if dim in ((1, -2) if layout == "stack" else (1, -1)) else None


def _runs(items: list, lookups: dict[fx.Node, Lookup]) -> list[tuple[int, int]]:
    """[start, end) of every run of 2+ consecutive lookups on distinct tables of one dtype."""
    runs, start = [], 0
    while start < len(items):
        end, tables = start, set()
        while end < len(items) and items[end] in lookups:
            lookup = lookups[items[end]]
            kind, first = (lookup.table.dtype, lookup.qdtype), lookups[items[start]]
            if lookup.weight in tables or (tables and kind != (first.table.dtype, first.qdtype)):
                break
            tables.add(lookup.weight)
            end += 1
        if end - start >= 2:
            runs.append((start, end))
        start = max(end, start + 1)
    return runs


def feature_name(weight: fx.Node) -> str:
    """``embeddings.3`` from Dynamo's ``l_self_modules_embeddings_modules_3_parameters_weight_``."""
    name = re.sub(r"^l_(self_)?", "", weight.name)
    name = re.sub(r"_parameters_weight_$", "", name).removeprefix("modules_")
    return name.replace("_modules_", ".").replace(",", "_")


def _fake_mode(graph: fx.Graph) -> FakeTensorMode:
    """The fake mode of the graph's example values (new nodes get example values in it too)."""
    fake_mode = graph_fake_mode(graph)
    if fake_mode is None:
        raise NotGroupable("the graph carries no fake example values")
    return fake_mode


def _call(graph: fx.Graph, target, args, kwargs=None) -> fx.Node:
    """A new call node with its example value computed on the arguments' fake values."""
    node = graph.call_function(target, args, kwargs or {})
    values, kw = fx.node.map_arg((args, kwargs or {}), meta_value)
    with _fake_mode(graph):
        node.meta["example_value"] = target(*values, **kw)
    return node


def _no_weights(graph: fx.Graph, table: torch.Tensor) -> fx.Node:
    return _call(graph, torch.empty, (0,), {"dtype": table.dtype, "device": table.device})


def _trigger(gm: fx.GraphModule, table: torch.Tensor) -> fx.Node:
    """A scalar parameter of ``gm`` whose gradient carries the fused optimizer step (see grouped_embedding_bag_fused)."""
    name = f"_embedding_optimizer_trigger_{sum(1 for n, _ in gm.named_parameters() if 'trigger' in n)}"
    gm.register_parameter(name, torch.nn.Parameter(torch.zeros((), device=table.device)))
    node = gm.graph.get_attr(name)
    node.meta["example_value"] = _fake_mode(gm.graph).from_tensor(getattr(gm, name))
    return node


def _grouped_call(gm: fx.GraphModule, ctx: PassContext, run: list[Lookup], layout: str,
                  consumer: fx.Node | None = None) -> fx.Node:
    """One grouped call for ``run``; the region it records replaces the lookups and the ``consumer`` they fed."""
    graph = gm.graph
    op, qdtype = (OP, None) if run[0].qdtype is None else (QUANTIZED_OP, run[0].qdtype)
    no_weights = _no_weights(graph, run[0].table)
    psw = [x.per_sample_weights or no_weights for x in run]
    names = ",".join(x.name or feature_name(x.weight) for x in run)
    lookup = ([x.weight for x in run], [x.indices for x in run], [x.offsets for x in run], psw,
              [x.pooling for x in run], [x.padding_idx for x in run], [x.include_last_offset for x in run])
    impl = ctx.lower(op, *lookup, layout=layout)
    optimizer = ctx.options.embedding_optimizer
    if qdtype is not None:  # inference tables: no gradients, no optimizer
        args = (*lookup, qdtype, layout, names, ctx.options.bounds_check, impl.impl)
        grouped = _call(graph, torch.ops.recompile.grouped_embedding_bag_quantized.default, args)
    elif optimizer is None:
        args = (*lookup, [x.sparse for x in run], layout, names, ctx.options.bounds_check, impl.impl)
        grouped = _call(graph, torch.ops.recompile.grouped_embedding_bag.default, args)
    else:
        step = ctx.lower("recompile::embedding_optimizer_step", weights=lookup[0])
        args = (_trigger(gm, run[0].table), *lookup, layout, names, ctx.options.bounds_check,
                embedding_optimizer_spec(optimizer), step.impl, impl.impl)
        grouped = _call(graph, torch.ops.recompile.grouped_embedding_bag_fused.default, args)
    replaced = [n for x in run for n in x.erased] + ([consumer] if consumer is not None else [])
    ctx.record_region("embedding", replaced, op, impl)
    return grouped


def _rewrite_consumer(gm: fx.GraphModule, ctx: PassContext, consumer: fx.Node, layout: str, lookups: dict,
                      alone: dict) -> None:
    """Group the runs of lookups among ``consumer``'s items; the masked poolings no run takes go to ``alone``."""
    items = list(consumer.args[0])
    runs = _runs(items, lookups)
    grouped = {item for start, end in runs for item in items[start:end]}
    for item in items:
        if item in lookups and item not in grouped:
            if lookups[item].keepdim is not None:
                alone[item] = lookups[item]
                continue
            why = "no neighbouring lookup on another table of its dtype in its stack/cat to group with"
            ctx.fallbacks.append(Fallback("embedding", f"lookup {item.name} left alone: {why}"))
    if not runs:
        return
    graph = gm.graph
    parts: list[fx.Node] = []
    with graph.inserting_before(consumer):
        position = 0
        for start, end in runs:
            parts += [_as_part(graph, x, layout) for x in items[position:start]]
            parts.append(_grouped_call(gm, ctx, [lookups[x] for x in items[start:end]], layout, consumer))
            position = end
        parts += [_as_part(graph, x, layout) for x in items[position:]]
        new = parts[0] if len(parts) == 1 else _call(graph, torch.cat, (parts,), {"dim": 1})
    consumer.replace_all_uses_with(new)
    graph.erase_node(consumer)
    for start, end in runs:
        for item in items[start:end]:
            _erase(lookups[item])


def _joins(group: dict[fx.Node, Lookup], lookup: Lookup) -> bool:
    """Whether ``lookup`` can share ``group``'s "concat" call: another table, its dtype and device, a batch size
    known to be the same."""
    first = next(iter(group.values()))
    return (all(x.weight is not lookup.weight for x in group.values())
            and (lookup.table.dtype, lookup.table.device) == (first.table.dtype, first.table.device)
            and statically_known_true(sym_eq(tensor_meta(lookup.indices).shape[0], tensor_meta(first.indices).shape[0])))


def _group_alone(gm: fx.GraphModule, ctx: PassContext, alone: dict[fx.Node, Lookup]) -> None:
    """The masked poolings no stack/cat group took, grouped where ``_joins`` allows into one "concat" call (each
    pooling its slice ``narrow(grouped, 1, start, D)``, unsqueezed for ``keepdim``), placed after their inputs;
    a group of one (or one whose output is used before its ids are made) is a call per pooling in place."""
    groups: list[dict[fx.Node, Lookup]] = []
    for node, lookup in alone.items():
        group = next((g for g in groups if _joins(g, lookup)), None)
        if group is None:
            group = {}
            groups.append(group)
        group[node] = lookup
    for group in groups:
        inputs = [x for lookup in group.values() for x in (lookup.weight, lookup.indices)]
        position = _after_inputs(gm.graph, inputs, [u for node in group for u in node.users])
        if len(group) == 1 or position is None:
            for node, lookup in group.items():
                _pool(gm, ctx, {node: lookup}, node)
        else:
            _pool(gm, ctx, group, position)


def _pool(gm: fx.GraphModule, ctx: PassContext, group: dict[fx.Node, Lookup], position: fx.Node) -> None:
    """One "concat" call for ``group``'s masked poolings, before ``position``; each pooling's users read its slice."""
    graph, start = gm.graph, 0
    with graph.inserting_before(position):
        grouped = _grouped_call(gm, ctx, list(group.values()), "concat")
        for node, lookup in group.items():
            dim = lookup.table.shape[1]
            part = grouped if len(group) == 1 else _call(graph, torch.narrow, (grouped, 1, start, dim))
            start += dim
            node.replace_all_uses_with(_call(graph, torch.unsqueeze, (part, 1)) if lookup.keepdim else part)
    for lookup in group.values():
        _erase(lookup)


def _erase(lookup: Lookup) -> None:
    """Erase the nodes ``lookup`` replaced; with a masked pooling, its mask's nodes nothing else reads."""
    for node in lookup.erased:
        inputs = [n for n in node.all_input_nodes if n not in lookup.erased]
        node.graph.erase_node(node)
        if lookup.keepdim is not None:
            erase_unused(inputs, set(lookup.erased))


def _as_part(graph: fx.Graph, item: fx.Node, layout: str) -> fx.Node:
    """A consumer item as a piece of the concatenation that replaces the consumer."""
    return _call(graph, torch.unsqueeze, (item, 1)) if layout == "stack" else item


def _unpooled(node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(output, nodes) of ``F.embedding(ids1d, weight)`` (and its no-op cast) that nothing pools."""
    if not is_call(node, *EMBEDDING):
        return None
    a = _bound(node)
    ids = tensor_meta(a["input"])
    if ids is None or ids.dim() != 1 or a["max_norm"] is not None or a["scale_grad_by_freq"]:
        return None
    cast = next(iter(node.users)) if len(node.users) == 1 else None
    return (cast, [cast, node]) if _is_noop_cast(cast) else (node, [node])


def _group_unpooled(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Group unpooled 1-D lookups of one dtype and dim (TorchRec's EmbeddingCollection) into one
    ``"sequence"`` call; each lookup becomes its slice ``torch.narrow(grouped, 0, start, len(ids))``."""
    groups: dict[tuple, dict[fx.Node, tuple]] = {}
    for node in list(gm.graph.nodes):
        found = _unpooled(node)
        if found is not None:
            weight = _bound(node)["weight"]
            table = tensor_meta(weight)
            groups.setdefault((table.dtype, table.shape[1], table.device), {}).setdefault(weight, (node, *found))
    for members in groups.values():
        if len(members) >= 2:
            _rewrite_unpooled(gm, ctx, list(members.values()))


def _after_inputs(graph: fx.Graph, inputs: list[fx.Node], users: list[fx.Node]) -> fx.Node | None:
    """The node a grouped call of ``inputs`` goes before (the first non-placeholder after the last of them),
    None when one of ``users`` (of the lookups it replaces) comes before that."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    position = max(inputs, key=order.__getitem__).next
    while position.op == "placeholder":
        position = position.next
    return None if users and min(order[u] for u in users) < order[position] else position


def _rewrite_unpooled(gm: fx.GraphModule, ctx: PassContext, members: list[tuple]) -> None:
    graph = gm.graph
    inputs = [x for lookup, _, _ in members for x in (_bound(lookup)["input"], _bound(lookup)["weight"])]
    position = _after_inputs(graph, inputs, [u for _, out, _ in members for u in out.users])
    if position is None:
        ctx.fallbacks.append(Fallback("embedding", "unpooled lookups left alone: their ids are made after their outputs are used"))
        return
    run = []
    for lookup, _, erased in members:
        a = _bound(lookup)
        run.append(Lookup(erased, a["weight"], a["input"], None, None, NONE, _padding(a, tensor_meta(a["weight"]).shape[0]),
                          False, bool(a["sparse"])))
    with graph.inserting_before(position):
        grouped = _grouped_call(gm, ctx, run, "sequence")
        start: Any = 0
        for (_, out, _), x in zip(members, run):
            length = graph.call_method("size", (x.indices, 0))
            length.meta["example_value"] = tensor_meta(x.indices).shape[0]
            part = _call(graph, torch.narrow, (grouped, 0, start, length))
            out.replace_all_uses_with(part)
            if start == 0:
                start = length
            else:
                start = graph.call_function(operator.add, (start, length))
                start.meta["example_value"] = meta_value(start.args[0]) + meta_value(length)
    for _, _, erased in members:
        for node in erased:
            graph.erase_node(node)


def _field_lookup(node: fx.Node) -> tuple[Lookup, str | None] | None:
    """``F.embedding(ids, weight)`` with ``ids`` ``[B, F, ...]`` as a lookup of bags of one id, with why it is left
    alone (None where it is not); None for another call."""
    if not is_call(node, *EMBEDDING):
        return None
    a = _bound(node)
    ids, table = tensor_meta(a["input"]), tensor_meta(a["weight"])
    if ids is None or ids.dim() < 2 or table is None or table.dim() != 2:
        return None
    if not all(isinstance(n, int) for n in ids.shape[1:]):  # fields are static; a history of dynamic length is not
        return None
    lookup = Lookup([node], a["weight"], a["input"], None, None, SUM, -1, False, bool(a["sparse"]))
    try:
        _check_common(a)
        if a["padding_idx"] is not None:
            raise NotGroupable("its padding_idx row is read forward, but a bag of one id would drop it")
    except NotGroupable as why:
        return lookup, str(why)
    return lookup, None


def _field_key(lookup: Lookup) -> tuple:
    ids, table = tensor_meta(lookup.indices), lookup.table
    return table.dtype, table.device, tuple(ids.shape[1:])


def _group_fields(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Group the unpooled lookups of ``[B, F, ...]`` ids (``_field_lookup``) whose ids have one shape, on distinct
    tables of one dtype and device, into one "concat" call each (see the module docstring). A lookup left alone
    is reported where another lookup of its ids' shape was found (a lone one is no group to miss)."""
    groups: dict[tuple, list[Lookup]] = {}
    refused: dict[tuple, list[tuple[fx.Node, str]]] = {}
    for node in list(gm.graph.nodes):
        found = _field_lookup(node)
        if found is None:
            continue
        lookup, why = found
        if why is not None:
            refused.setdefault(_field_key(lookup), []).append((node, why))
            continue
        group = groups.setdefault(_field_key(lookup), [])
        same_batch = not group or statically_known_true(
            sym_eq(tensor_meta(lookup.indices).shape[0], tensor_meta(group[0].indices).shape[0]))
        if same_batch and all(x.weight is not lookup.weight for x in group):
            group.append(lookup)
    for key, nodes in refused.items():
        if len(nodes) + len(groups.get(key, ())) >= 2:
            ctx.fallbacks += [Fallback("embedding", f"lookup {node.name} left alone: {why}") for node, why in nodes]
    for group in groups.values():
        if len(group) >= 2:
            _rewrite_fields(gm, ctx, group)


def _hoisted(graph: fx.Graph, inputs: list[fx.Node], before: fx.Node, replaced: set[fx.Node]) -> bool:
    """Move the nodes making ``inputs`` that come after ``before`` up before it, in order; False (nothing moved)
    where one of them, or a node they would move past, has effects, or one of them reads a node of ``replaced``."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    late, stack = set(), [n for n in inputs if order[n] >= order[before]]
    while stack:
        node = stack.pop()
        if node in late:
            continue
        if (node.op not in ("call_function", "call_method") or has_effects(node)
                or any(n in replaced for n in node.all_input_nodes)):
            return False
        late.add(node)
        stack += [n for n in node.all_input_nodes if order[n] >= order[before]]
    if not late:
        return True
    last = max(order[n] for n in late)
    if any(has_effects(n) for n in graph.nodes if order[before] <= order[n] < last and n not in late):
        return False
    for node in sorted(late, key=order.__getitem__):
        before.prepend(node)
    return True


def _rewrite_fields(gm: fx.GraphModule, ctx: PassContext, group: list[Lookup]) -> None:
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    position = min((u for x in group for u in x.erased[0].users), key=order.__getitem__, default=None)
    if position is None:
        return
    if not _hoisted(graph, [n for x in group for n in (x.weight, x.indices)], position, {x.erased[0] for x in group}):
        names = ", ".join(x.erased[0].name for x in group)
        ctx.fallbacks.append(Fallback("embedding", f"field lookups {names} left alone: some ids are made after an "
                                                   "effect, or from a lookup, that follows the first use of another"))
        return
    with graph.inserting_before(position):
        flat = [_call(graph, torch.reshape, (x.indices, (-1, 1))) for x in group]
        flat_lookups = [Lookup(x.erased, x.weight, ids, None, None, SUM, -1, False, x.sparse) for x, ids in zip(group, flat)]
        grouped = _grouped_call(gm, ctx, flat_lookups, "concat")
        start = 0
        for x in group:
            dim = x.table.shape[1]
            part = _call(graph, torch.narrow, (grouped, 1, start, dim))
            start += dim
            batch = graph.call_method("size", (x.indices, 0))  # not -1: a batch of 0 would leave it ambiguous
            batch.meta["example_value"] = tensor_meta(x.indices).shape[0]
            shape = (batch, *tensor_meta(x.indices).shape[1:], dim)
            x.erased[0].replace_all_uses_with(_call(graph, torch.reshape, (part, shape)))
    for x in group:
        graph.erase_node(x.erased[0])


@register_pass("embedding", order=10, regions={"embedding": "#9fd3ff"})
def embedding(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    lookups: dict[fx.Node, Lookup] = {}
    alone: dict[fx.Node, Lookup] = {}  # masked poolings no stack/cat group takes
    for node in list(gm.graph.nodes):
        try:
            lookup = _lookup(node)
        except NotGroupable as why:
            ctx.fallbacks.append(Fallback("embedding", f"lookup {node.name} left alone: {why}"))
            continue
        if lookup is None or (len(node.users) == 1 and _is_noop_cast(next(iter(node.users)))):
            continue  # not a lookup, or one whose cast is matched instead
        consumer = next(iter(node.users), None)
        if len(node.users) != 1 or _consumer_layout(consumer) is None:
            if lookup.keepdim is not None:
                alone[node] = lookup
                continue
            ctx.fallbacks.append(Fallback("embedding", f"lookup {node.name} left alone: it does not feed one stack/cat along dim 1"))
            continue
        lookups[node] = lookup
    consumers = {next(iter(node.users)) for node in lookups}
    for consumer in [n for n in gm.graph.nodes if n in consumers]:
        _rewrite_consumer(gm, ctx, consumer, _consumer_layout(consumer), lookups, alone)
    _group_alone(gm, ctx, alone)
    _group_unpooled(gm, ctx)
    _group_fields(gm, ctx)
    return gm
