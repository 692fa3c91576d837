"""jagged: rewrite padded-dense code over jagged data into jagged ops.

Patterns and replacements:
- offsets from lengths, ``F.pad(torch.cumsum(lengths, 0), (1, 0))`` with 1-D integer ``lengths``
  -> ``recompile.complete_cumsum(lengths)``.
- a padded region: a padding of jagged values, per-position ops on the padded batch, attention, and
  the gather back -> the same ops on the jagged values (``[total, ...]``), so nothing is computed on
  padding. Paddings: ``fbgemm.jagged_to_padded_dense(values, [offsets], [N])`` (or
  ``recompile.jagged_to_padded_dense``), index writes at (row, position) and ``pad_sequence`` (see
  ``recompile.passes.jagged_index``). Gathers back: ``fbgemm.dense_to_jagged(y, [offsets])[0]``
  (or ``recompile.dense_to_jagged``), indexing by the same (row, position) or the padding mask, the
  rows cut to their sizes and concatenated. Per-position ops: Linear, LayerNorm over feature dims,
  SiLU/ReLU/GELU/sigmoid/tanh, dropout with ``training=False``, elementwise ops with operands that
  broadcast over the features only, splits and views that keep ``[B, N]`` (or ``[B * N]``), the
  ``[B, N] <-> [N, B]`` transpose. Attention on head-first ``[B, H, N, D]`` views, as matmuls or
  einsums, and ``nn.MultiheadAttention`` (see ``recompile.passes.jagged_attention``) ->
  ``recompile.hstu_attention`` / ``recompile.jagged_softmax_attention`` (region kind "attention").
  The values are guarded by ``recompile.jagged_within`` (every sequence fits the padded length N). The jagged
  ops emitted check their offsets per ``options.bounds_check`` ("fatal" / "warning" / "ignore").
  Paddings with the same offsets and N form one region (q, k and v padded one by one).
- attention on histories that come padded (ids ``[B, N]`` with a padding id, as RecBole's SASRec and
  BERT4Rec): ``matmul(softmax(matmul(q, k^T) * scale + mask), v)`` with an additive mask made from the ids or
  the lengths -> ``recompile.padded_softmax_attention``: every row as the padded formula gives it (padded
  rows included), the keys after the last one any query attends to cut off at run time (a check of the
  mask itself; a mask that hides every key of some row keeps all N: the padded path). Where the outputs are
  proven to be read at one row per sequence (``gather(h, 1, item_seq_len - 1 ...)``, through row-wise ops and
  attentions on the same mask: ``recompile.passes.jagged_rows``), the op gets those rows and computes only the
  query rows they depend on (checked on the mask at run time), 0 in the others.
- dense self-attention over a model's fields (AutoInt): ``nn.MultiheadAttention`` with no mask over a batched
  ``[N, B, E]`` of fixed N, weights unused, no dropout in training -> in-projection,
  ``recompile.padded_softmax_attention`` with a zero ``[1, 1, 1, N]`` mask (the native kernel's dense path), out-
  projection (``_field_attention``).
A padded node whose users cannot all be proven position-wise keeps its padded computation; a gather
back that is not reached by a jagged equivalent stays, and the report says why.
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from recompile.passes.jagged_attention import (
    AttentionMatch, Lengths, ScoreBias, Unproven, is_score_product, match_attention, match_mha,
    has_mha_mask, match_dense_mha,
    match_padded_attention, prove_bias, prove_mask, prove_mha_mask, same_sizes, size_hint,
)
from recompile.passes.jagged_index import (
    IndexGather, index_gather, index_padding, prove_gather, row_slices, sequence_padding,
)
from recompile.passes.jagged_rows import hoist, read_rows
from recompile.passes.utils import arg, eliminate_dead_code, is_call, meta_value, replace_node, tensor_meta
from recompile.pipeline import Fallback, PassContext, register_pass
from recompile.runtime.fbgemm import fbgemm_ops

PAD_FUNCTIONS = (torch._C._nn.pad, torch.nn.functional.pad)


def _offsets_source(pad: fx.Node) -> fx.Node | None:
    """``lengths`` when ``pad`` is ``F.pad(torch.cumsum(lengths, 0), (1, 0))`` with zero fill."""
    if not is_call(pad, *PAD_FUNCTIONS):
        return None
    cumsum = pad.args[0]
    if tuple(arg(pad, 1, "pad", ())) != (1, 0) or arg(pad, 2, "mode", "constant") != "constant":
        return None
    if arg(pad, 3, "value", None) not in (None, 0):
        return None
    if not is_call(cumsum, torch.cumsum) or len(cumsum.users) != 1 or arg(cumsum, 2, "dtype") is not None:
        return None
    lengths = cumsum.args[0]
    meta = tensor_meta(lengths)
    if meta is None or meta.dim() != 1 or meta.dtype not in (torch.int32, torch.int64):
        return None
    if arg(cumsum, 1, "dim") not in (0, -1):
        return None
    return lengths


def _rewrite_offsets(gm: fx.GraphModule, ctx: PassContext) -> None:
    op = "recompile::complete_cumsum"
    for pad in list(gm.graph.nodes):
        lengths = _offsets_source(pad)
        if lengths is None:
            continue
        impl = ctx.lower(op, lengths)
        cumsum = pad.args[0]
        with gm.graph.inserting_before(pad):
            offsets = gm.graph.call_function(torch.ops.recompile.complete_cumsum.default, (lengths, impl.impl))
        ctx.record_region("jagged", [cumsum, pad], op, impl)
        replace_node(pad, offsets)
        gm.graph.erase_node(cumsum)


# ---------------------------------------------------------------------------------------------
# Padded regions


@dataclass
class PaddedBatch:
    """The paddings of jagged values with one offsets into batches of one padded length N."""

    offsets: fx.Node
    n: int
    lengths: Lengths
    total: int | None  # the number of jagged values traced (None: data-dependent)
    lifted: list[fx.Node] = field(default_factory=list)


@dataclass
class Padded:
    """A padded node whose rows that are not padding are ``twin``'s values.

    ``layout`` "bn": ``[B, N, *f]`` with twin ``[total, *f]``; "bhn": ``[B, H, N, D]`` with twin
    ``[total, H, D]``; "flat": ``[B * N, *f]`` (row ``b * N + position``) with twin ``[total, *f]``.
    """

    region: PaddedBatch
    layout: str
    twin: Any  # an fx.Node (or a tuple of them, for a split)


@functools.cache
def _fbgemm_targets(name: str) -> tuple:
    """``torch.ops.fbgemm.<name>`` and its default overload as Dynamo records them; () without FBGEMM."""
    if name not in fbgemm_ops():
        return ()
    packet = getattr(torch.ops.fbgemm, name)
    return packet, packet.default


def _pad_source(node: fx.Node) -> tuple[fx.Node, fx.Node, Any] | None:
    """``(values, offsets, N)`` of a ``jagged_to_padded_dense`` call (the padding value never matters:
    padded rows are dropped, and masks are proven to hide padded keys)."""
    if is_call(node, *_fbgemm_targets("jagged_to_padded_dense")):
        values, offsets, lengths = arg(node, 0, "values"), arg(node, 1, "offsets"), arg(node, 2, "max_lengths")
        if len(offsets) != 1 or len(lengths) != 1:
            return None
        offsets, n = offsets[0], lengths[0]
    elif is_call(node, torch.ops.recompile.jagged_to_padded_dense.default):
        values, offsets, n = node.args[:3]
    else:
        return None
    meta = tensor_meta(values)
    if meta is None or meta.dim() != 2 or not isinstance(n, int):
        return None
    return values, offsets, n


def _sink(node: fx.Node) -> tuple[fx.Node, Any] | None:
    """``(dense, offsets)`` when ``node`` gathers a padded batch back to jagged values with offsets,
    ``(dense, IndexGather)`` when it indexes a padded batch with tensors (proven when checked), or
    ``(dense, sizes)`` when it concatenates the rows cut to Python sizes."""
    if is_call(node, operator.getitem) and node.args[1] == 0:
        call = node.args[0]
        if is_call(call, *_fbgemm_targets("dense_to_jagged")):
            offsets = arg(call, 1, "x_offsets")
            if len(offsets) == 1:
                return arg(call, 0, "dense"), offsets[0]
    if is_call(node, torch.ops.recompile.dense_to_jagged.default):
        return node.args[0], node.args[1]
    if (gather := index_gather(node)) is not None:
        return gather.dense, gather
    if (rows := row_slices(node)) is not None:
        return rows
    return None


def _lengths_of(offsets: fx.Node) -> fx.Node | None:
    if is_call(offsets, torch.ops.recompile.complete_cumsum.default):
        return offsets.args[0]
    return None


def _numel(sizes) -> int:
    return functools.reduce(operator.mul, (size_hint(s) for s in sizes), 1)


def _lead_dims(info: Padded, before, after, shape) -> tuple[str, Sequence] | None:
    """``(layout, feature sizes)`` of a view of a padded node that keeps its rows; None if it mixes them."""
    n = info.region.n
    if info.layout == "bn" and len(shape) >= 2 and same_sizes(after.shape[:2], before.shape[:2]):
        return "bn", shape[2:]
    if info.layout == "bn" and len(shape) >= 1 and _numel(after.shape[1:]) == _numel(before.shape[2:]):
        return "flat", shape[1:]  # [B, N, *f] -> [B * N, *g]
    if info.layout == "flat" and len(shape) >= 2 and after.shape[1] == n and isinstance(shape[1], int):
        if _numel(after.shape[2:]) == _numel(before.shape[1:]):
            return "bn", shape[2:]  # [B * N, *f] -> [B, N, *g]
    return None


# einsum equations, letters renamed (b batch, h heads, n/m query/key positions, d features) ->
# (transpose operand a over dims 1, 2; the same for b; the same for the output; transpose b over the last two).
EINSUM_SCORES = {  # the output is "bhnm"
    ("bnhd", "bmhd"): (True, True, False, True),
    ("bhnd", "bhmd"): (False, False, False, True),
    ("bhnd", "bmhd"): (False, True, False, True),
    ("bnhd", "bhmd"): (True, False, False, True),
}
EINSUM_OUTPUTS = {  # operand a is "bhnm"
    ("bmhd", "bnhd"): (False, True, True, False),
    ("bhmd", "bhnd"): (False, False, False, False),
    ("bmhd", "bhnd"): (False, True, False, False),
    ("bhmd", "bnhd"): (False, False, True, False),
}


def _spell(letters: str, rename: dict[str, str]) -> str:
    return "".join(rename.get(x, "?") for x in letters)


def einsum_form(equation: Any) -> tuple[bool, bool, bool, bool] | None:
    """The transposes that make ``equation`` an attention matmul (see the tables above), or None."""
    if not isinstance(equation, str) or equation.count(",") != 1 or "->" not in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    a, b = inputs.split(",")
    if not (len(a) == len(b) == len(out) == 4 == len(set(a)) == len(set(b)) == len(set(out))):
        return None
    contracted = (set(a) & set(b)) - set(out)
    if len(contracted) != 1:
        return None
    (c,) = contracted
    rename = {**dict(zip(out, "bhnm")), c: "d"}  # scores: the contraction is over the features
    scores = EINSUM_SCORES.get((_spell(a, rename), _spell(b, rename)))
    if scores is not None:
        return scores
    rename = dict(zip(a, "bhnm"))  # output: the contraction is over the key positions
    rename.update({x: "d" for x in set(b) - set(a)})
    if c != a[3] or not set(b) | set(out) <= set(rename):
        return None
    return EINSUM_OUTPUTS.get((_spell(b, rename), _spell(out, rename)))


class _Chain:
    """Emits calls one after the other, after ``node``."""

    def __init__(self, node: fx.Node):
        self.last = node

    def __call__(self, target, *args, method: bool = False) -> fx.Node:
        with self.last.graph.inserting_after(self.last):
            call = self.last.graph.call_method if method else self.last.graph.call_function
            self.last = call(target, args)
        return self.last


# (ndim, swapped dims, layout) -> the layout after the transpose
TRANSPOSES = {
    (4, frozenset({1, 2}), "bn"): "bhn",
    (4, frozenset({1, 2}), "bhn"): "bn",
    (3, frozenset({0, 1}), "bn"): "nb",
    (3, frozenset({0, 1}), "nb"): "bn",
}


class Inherited(Unproven):
    """An op reads a node that was left padded: the reason is that node's."""


class Lifter:
    """Walks the graph once, giving each padded node a jagged twin where that is provably the same."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext):
        self.gm, self.graph, self.ctx = gm, gm.graph, ctx
        self.padded: dict[fx.Node, Padded] = {}
        self.tainted: set[fx.Node] = set()  # nodes whose value depends on padding
        self.blocked: dict[fx.Node, str] = {}  # padded nodes left padded, and why
        self.attention_regions: list[tuple[fx.Node, str, Any, list[fx.Node]]] = []  # (twin, op, impl, nodes)
        self.batches: dict[tuple[fx.Node, int], PaddedBatch] = {}  # by (offsets, N)
        self.unproven_paddings: list[tuple[fx.Node, str]] = []  # index writes of jagged values, and why
        self.offsets: dict[fx.Node, fx.Node] = {}  # lengths -> the offsets made for them
        # what the jagged ops emitted do with malformed offsets; a keyword: ``impl`` stays the last argument,
        # which the autotune race rewrites
        self.checked = {"bounds_check": ctx.options.bounds_check}

    # -- helpers -------------------------------------------------------------------------------
    def emit(self, after: fx.Node, target, args, kwargs=None, method: bool = False) -> fx.Node:
        with self.graph.inserting_after(after):
            if method:
                return self.graph.call_method(target, args, kwargs or {})
            return self.graph.call_function(target, args, kwargs or {})

    def offsets_before(self, node: fx.Node) -> Callable[[fx.Node], fx.Node]:
        """``lengths -> recompile.complete_cumsum(lengths)``, made once per lengths, before ``node`` (the first
        padding that needs them)."""

        def offsets_of(lengths: fx.Node) -> fx.Node:
            if lengths not in self.offsets:
                with self.graph.inserting_before(node):
                    impl = self.ctx.lower("recompile::complete_cumsum")
                    offsets = self.graph.call_function(
                        torch.ops.recompile.complete_cumsum.default, (lengths, impl.impl))
                offsets.meta["example_value"] = F.pad(torch.cumsum(meta_value(lengths), 0), (1, 0))
                self.offsets[lengths] = offsets
            return self.offsets[lengths]

        return offsets_of

    def emit_padded(self, after: fx.Node, target, *args, lift: bool = True) -> fx.Node:
        """A new padded-side call after ``after``, with its example value, lifted like a traced one (unless
        ``lift`` is False: k^T, which the attention takes whole)."""
        node = self.emit(after, target, args)
        node.meta["example_value"] = target(*(a.meta["example_value"] if isinstance(a, fx.Node) else a for a in args))
        self.tainted.add(node)
        if lift and any(a in self.padded for a in node.all_input_nodes):
            self.lift(node)
        return node

    def operands(self, node: fx.Node) -> list[fx.Node]:
        return [a for a in node.all_input_nodes if a in self.tainted]

    def twin_args(self, node: fx.Node, region: PaddedBatch, feature_ndim: int, exempt=()) -> tuple[tuple, dict]:
        """``node``'s args with padded operands swapped for twins; others must broadcast over features only."""

        def swap(x: Any, position: Any) -> Any:
            if isinstance(x, (list, tuple)):
                return type(x)(swap(y, position) for y in x)
            if not isinstance(x, fx.Node):
                return x
            if x in self.padded:
                info = self.padded[x]
                if info.region is not region or info.layout != "bn":
                    raise Unproven(f"{node.name} mixes padded batches")
                return info.twin
            if x in self.tainted:
                raise Inherited(f"{node.name} reads {x.name}, which depends on padding")
            meta = tensor_meta(x)
            if meta is not None and position not in exempt and meta.dim() > feature_ndim:
                raise Unproven(f"{node.name}: operand {x.name} broadcasts over the batch or position dims")
            return x

        args = tuple(swap(a, i) for i, a in enumerate(node.args))
        kwargs = {k: swap(v, k) for k, v in node.kwargs.items()}
        return args, kwargs

    def region_of(self, node: fx.Node) -> PaddedBatch:
        regions = {id(self.padded[a].region): self.padded[a].region for a in self.operands(node) if a in self.padded}
        if len(regions) != 1:
            raise Unproven(f"{node.name} mixes padded batches")
        return next(iter(regions.values()))

    # -- rules ---------------------------------------------------------------------------------
    def positionwise(self, node: fx.Node, exempt=()) -> Padded:
        region = self.region_of(node)
        meta = tensor_meta(node)
        if meta is None or meta.dim() < 2:
            raise Unproven(f"{node.name} does not keep the [B, N] dims")
        args, kwargs = self.twin_args(node, region, meta.dim() - 2, exempt)
        return Padded(region, "bn", self.emit(node, node.target, args, kwargs, node.op == "call_method"))

    def layer_norm(self, node: fx.Node) -> Padded:
        shape = arg(node, 1, "normalized_shape")
        if len(shape) > tensor_meta(node).dim() - 2:
            raise Unproven(f"{node.name}: layer norm over the position dim")
        return self.positionwise(node, exempt=(2, 3, "weight", "bias"))

    def linear(self, node: fx.Node) -> Padded:
        return self.positionwise(node, exempt=(1, 2, "weight", "bias"))

    def dropout(self, node: fx.Node) -> Padded:
        if arg(node, 2, "training", True) is not False:
            raise Unproven(f"{node.name}: dropout in training mode (the jagged values would draw other masks)")
        return self.positionwise(node)

    def split(self, node: fx.Node) -> Padded:
        x = node.args[0]
        ndim = tensor_meta(x).dim()
        dim = arg(node, 2, "dim", 0)
        if dim % ndim < 2:
            raise Unproven(f"{node.name}: split over the batch or position dim")
        info = self.padded[x]
        if info.layout != "bn":
            raise Unproven(f"{node.name}: split of a head-first batch")
        twin_dim = dim if dim < 0 else dim - 1
        twin = self.emit(node, node.target, (info.twin, node.args[1]), {"dim": twin_dim})
        return Padded(info.region, "bn", twin)

    def getitem(self, node: fx.Node) -> Padded:
        source, index = node.args
        info = self.padded[source]
        if is_call(source, F.multi_head_attention_forward) and index == 0:
            return Padded(info.region, info.layout, info.twin)
        if not is_call(source, torch.split, torch.functional.split, torch.chunk) or not isinstance(index, int):
            raise Unproven(f"{node.name}: indexing a padded batch")
        return Padded(info.region, "bn", self.emit(node, operator.getitem, (info.twin, index)))

    def multihead(self, node: fx.Node) -> Padded:
        """``nn.MultiheadAttention`` -> in-projection, ``recompile.jagged_softmax_attention``, out-projection
        on the jagged values (its output 0; the weights, output 1, must be unused)."""
        match = match_mha(node)
        info = self.padded.get(match.x)
        if info is None or info.layout != "nb":
            raise Unproven(f"{node.name}: the queries are not a [N, B, E] view of a padded batch")
        region = info.region
        if match.key_padding_mask in self.tainted or match.attn_mask in self.tainted:
            raise Unproven(f"{node.name}: the mask depends on padding")
        causal = prove_mha_mask(match, region.lengths, region.n)
        embed = size_hint(tensor_meta(match.x).shape[-1])
        heads = match.num_heads
        op = "recompile::jagged_softmax_attention"
        impl = self.ctx.lower(op)
        chain = _Chain(node)
        qkv = chain(F.linear, info.twin, match.in_weight, match.in_bias)
        q, k, v = (chain("reshape", chain(operator.getitem, chain(torch.chunk, qkv, 3, -1), i), -1, heads,
                         embed // heads, method=True) for i in range(3))
        attended = chain(torch.ops.recompile.jagged_softmax_attention.default, q, k, v, region.offsets,
                         1.0 / math.sqrt(embed // heads), causal, impl.impl)
        attended.kwargs = self.checked

        out = chain(F.linear, chain("reshape", attended, -1, embed, method=True), match.out_weight, match.out_bias)
        self.attention_regions.append((attended, op, impl, [node]))
        return Padded(region, "nb", out)

    def view(self, node: fx.Node) -> Padded:
        x = node.args[0]
        info = self.padded[x]
        shape = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        before, after = tensor_meta(x), tensor_meta(node)
        lead = _lead_dims(info, before, after, shape)
        if lead is None:
            raise Unproven(f"{node.name}: a view that does not keep the [B, N] (or [B * N]) dims")
        layout, features = lead
        if any(isinstance(s, int) and s == -1 for s in features):
            raise Unproven(f"{node.name}: a view with an inferred feature dim")
        return Padded(info.region, layout, self.emit(node, "reshape", (info.twin, -1, *features), method=True))

    def flatten(self, node: fx.Node) -> Padded:
        info = self.padded[node.args[0]]
        start, end = arg(node, 1, "start_dim", 0), arg(node, 2, "end_dim", -1)
        ndim = tensor_meta(node.args[0]).dim()
        if info.layout != "bn" or start % ndim < 2 or end % ndim < 2:
            raise Unproven(f"{node.name}: a flatten over the batch or position dim")
        twin_dims = [d if d < 0 else d - 1 for d in (start, end)]
        return Padded(info.region, "bn", self.emit(node, torch.flatten, (info.twin, *twin_dims)))

    def transpose(self, node: fx.Node) -> Padded:
        x = node.args[0]
        info = self.padded[x]
        ndim = tensor_meta(x).dim()
        swap = (ndim, frozenset(d % ndim for d in node.args[1:3]), info.layout)
        if swap not in TRANSPOSES:
            raise Unproven(f"{node.name}: a transpose other than positions <-> heads or batch <-> positions")
        return Padded(info.region, TRANSPOSES[swap], info.twin)

    def same(self, node: fx.Node) -> Padded:
        return self.padded[node.args[0]]

    def einsum(self, node: fx.Node) -> Padded:
        """An attention einsum on ``[B, N, H, D]`` / ``[B, H, N, D]`` operands, rewritten as the transposes and
        matmuls the attention patterns match (the same contraction)."""
        equation, *operands = node.args
        form = einsum_form(equation) if len(operands) == 2 else None
        if form is None:
            raise Unproven(f"{node.name}: einsum {equation!r} is not an attention product over [B, N, H, D]")
        (a, b), (swap_a, swap_b, swap_out, transpose_b) = operands, form
        after = node
        if swap_a:
            a = after = self.emit_padded(after, torch.transpose, a, 1, 2)
        if swap_b:
            b = after = self.emit_padded(after, torch.transpose, b, 1, 2)
        if transpose_b:
            b = after = self.emit_padded(after, torch.transpose, b, -2, -1, lift=False)
        out = after = self.emit_padded(after, torch.matmul, a, b)
        if swap_out:
            out = self.emit_padded(after, torch.transpose, out, 1, 2)
        node.replace_all_uses_with(out)
        if out in self.padded:
            return self.padded[out]
        if is_score_product(after):
            raise Inherited(f"{node.name}: q @ k^T, taken whole by the attention that uses it")
        raise Inherited(f"{node.name}: its matmul form {after.name} is left padded")

    def attention(self, node: fx.Node) -> Padded:
        match = match_attention(node)
        qkv = [self.padded.get(x) for x in (match.q, match.k, match.v)]
        if any(p is None or p.layout != "bhn" for p in qkv):
            raise Unproven(f"{node.name}: q, k, v are not head-first views of one padded batch")
        region = qkv[0].region
        if any(p.region is not region for p in qkv):
            raise Unproven(f"{node.name}: q, k, v come from different padded batches")
        if match.mask is not None and match.mask in self.tainted:
            raise Unproven(f"{node.name}: the mask depends on padding")
        causal = match.causal_flag or prove_mask(match.mask, match.keep_if_true, region.lengths, region.n)
        q, k, v = (p.twin for p in qkv)
        if match.kind == "hstu":
            op, args = self.hstu_args(match, region, causal, q, k, v)
        else:
            op = "recompile::jagged_softmax_attention"
            args = (q, k, v, region.offsets, match.alpha, causal)
        impl = self.ctx.lower(op, *args)
        target = getattr(torch.ops.recompile, op.split("::")[1]).default
        twin = self.emit(node, target, (*args, impl.impl), self.checked)
        self.attention_regions.append((twin, op, impl, list(match.nodes)))
        return Padded(region, "bhn", twin)

    def hstu_args(self, match: AttentionMatch, region: PaddedBatch, causal: bool, q, k, v) -> tuple[str, tuple]:
        n = region.n
        if abs(match.post_scale * n - 1.0) > 1e-9:
            raise Unproven(f"the weights are scaled by {match.post_scale}, not by 1 / N = 1 / {n} as HSTU's")
        bias = ScoreBias() if match.rel_bias is None else prove_bias(match.rel_bias, n, self.padded.__contains__)
        timestamps = None
        if bias.timestamps is not None:
            info = self.padded[bias.timestamps]
            if info.region is not region or info.layout != "bn":
                raise Unproven(f"the timestamps {bias.timestamps.name} are not padded like q, k and v")
            timestamps = info.twin
        return "recompile::hstu_attention", (
            q, k, v, region.offsets, n, match.alpha, causal, None, 0, bias.rel_bias, timestamps, bias.time_bias,
        )

    def lift(self, node: fx.Node) -> None:
        if node.op == "call_method":
            rule = METHOD_RULES.get(node.target)
        else:
            rule = FUNCTION_RULES.get(node.target) if node.op == "call_function" else None
        try:
            if rule is None:
                raise Unproven(f"{node.name} ({node.target}) is not a per-position op")
            self.padded[node] = rule(self, node)
            self.padded[node].region.lifted.append(node)
        except Unproven as why:
            # q @ k^T (and k^T) are taken whole by the attention that uses them; an op that only reads a
            # node left padded is no reason of its own
            if isinstance(why, Inherited):
                return
            # (a node the einsum rule just emitted has no users yet: it is blocked unless it is q @ k^T)
            if not is_score_product(node) and not (node.users and all(map(is_score_product, node.users))):
                self.blocked[node] = str(why)

    # -- driver --------------------------------------------------------------------------------
    def start_region(self, node: fx.Node, values: fx.Node, lengths: Lengths, n: int, layout: str = "bn") -> None:
        total = size_hint(tensor_meta(values).shape[0])
        region = self.batches.setdefault((lengths.offsets, n), PaddedBatch(lengths.offsets, n, lengths, total))
        impl = self.ctx.lower("recompile::jagged_within")
        guarded = self.emit(node, torch.ops.recompile.jagged_within.default, (values, lengths.offsets, n, impl.impl),
                            self.checked)
        self.padded[node] = Padded(region, layout, guarded)
        region.lifted.append(node)

    def source(self, node: fx.Node) -> bool:
        """Starts a region at ``node`` if it pads jagged values; False if it does not."""
        if (source := _pad_source(node)) is not None:
            values, offsets, n = source
            batch = size_hint(tensor_meta(node).shape[0])
            self.start_region(node, values, Lengths(_lengths_of(offsets), offsets, batch), n)
            return True
        if (padding := sequence_padding(node)) is not None:
            offsets = [0, *itertools.accumulate(padding.sizes)]
            with self.graph.inserting_before(node):
                constant = self.graph.call_function(
                    torch.tensor, (offsets,), {"dtype": torch.int64, "device": tensor_meta(padding.values).device})
            n = max(padding.sizes)
            self.start_region(node, padding.values, Lengths(None, constant, len(padding.sizes), padding.sizes), n,
                              padding.layout)
            return True
        try:
            padding = index_padding(node, self.offsets_before(node))
        except Unproven as why:
            self.unproven_paddings.append((node, str(why)))
            return False
        if padding is None:
            return False
        self.start_region(node, padding.values, padding.lengths, padding.n, padding.layout)
        return True

    def run(self) -> list[tuple[fx.Node, fx.Node]]:
        """Lift every padded node it can; returns the gathers back (sink, twin) that can be replaced."""
        sinks = []
        for node in list(self.graph.nodes):
            if node in self.padded or node.op in ("placeholder", "output"):
                continue
            if self.source(node):
                self.tainted.add(node)
                continue
            if not any(a in self.tainted for a in node.all_input_nodes):
                continue
            if (sink := _sink(node)) is not None and sink[0] in self.tainted:
                sinks.append((node, sink))
                continue
            self.tainted.add(node)
            if any(a in self.padded for a in node.all_input_nodes):
                self.lift(node)
        return [self.check_sink(node, dense, offsets) for node, (dense, offsets) in sinks]

    def check_sink(self, node: fx.Node, dense: fx.Node, how: fx.Node | IndexGather):
        info = self.padded.get(dense)
        if info is None:
            return node, None, self.why_not(dense)
        if isinstance(how, IndexGather):
            if info.layout != ("flat" if how.kind == "flat" else "bn"):
                return node, None, f"{dense.name} is indexed in another layout than it was padded in"
            try:
                # the region's total: a gather by data-dependent indices has a data-dependent size
                prove_gather(how, info.region.lengths, info.region.n, info.region.total)
            except Unproven as why:
                return node, None, f"{dense.name} is gathered back by other indices than its padding: {why}"
        elif isinstance(how, tuple):
            if info.layout != "bn" or info.region.lengths.sizes != how:
                return node, None, f"{dense.name} is cut into rows of other lengths than it was padded with"
        elif info.layout != "bn" or info.region.offsets is not how:
            return node, None, f"{dense.name} is gathered with other offsets than it was padded with"
        return node, info, ""

    def why_not(self, node: fx.Node) -> str:
        """The reason of the last node before ``node`` where the region stopped: the nearest blocked ancestor
        on the paths back to the padded nodes."""
        seen, stack, blocked = set(), [node], []
        while stack:
            x = stack.pop()
            if x in self.blocked:
                blocked.append(x)
            seen.add(x)
            if x not in self.padded:
                stack.extend(a for a in x.all_input_nodes if a in self.tainted and a not in seen)
        if not blocked:
            return f"{node.name} is not reached from a padding of jagged values"
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        return self.blocked[max(blocked, key=order.__getitem__)]


def _rule(fn_name: str) -> Callable:
    return lambda lifter, node: getattr(lifter, fn_name)(node)


POSITIONWISE_FUNCTIONS = (
    F.silu, F.relu, F.gelu, torch.relu, torch.sigmoid, torch.tanh, F.sigmoid, F.tanh, torch.add, torch.sub,
    torch.mul, torch.div, operator.add, operator.sub, operator.mul, operator.truediv,
)
FUNCTION_RULES: dict[Any, Callable] = {
    **{fn: _rule("positionwise") for fn in POSITIONWISE_FUNCTIONS},
    F.layer_norm: _rule("layer_norm"),
    torch._C._nn.linear: _rule("linear"),
    F.linear: _rule("linear"),
    F.dropout: _rule("dropout"),
    torch.split: _rule("split"),
    torch.functional.split: _rule("split"),
    operator.getitem: _rule("getitem"),
    torch.reshape: _rule("view"),
    torch.flatten: _rule("flatten"),
    torch.transpose: _rule("transpose"),
    torch.matmul: _rule("attention"),
    torch.functional.einsum: _rule("einsum"),
    torch.einsum: _rule("einsum"),
    F.scaled_dot_product_attention: _rule("attention"),
    F.multi_head_attention_forward: _rule("multihead"),
}
METHOD_RULES: dict[str, Callable] = {
    "view": _rule("view"),
    "reshape": _rule("view"),
    "transpose": _rule("transpose"),
    "flatten": _rule("flatten"),
    "contiguous": _rule("same"),
}


def _lift_padded_regions(gm: fx.GraphModule, ctx: PassContext) -> None:
    lifter = Lifter(gm, ctx)
    results = lifter.run()
    for node, why in lifter.unproven_paddings:
        ctx.fallbacks.append(Fallback(ctx.current_pass, f"left padded at {node.name}: {why}"))
    for sink, info, why in results:
        if info is None:
            ctx.fallbacks.append(Fallback(ctx.current_pass, f"left padded at {sink.name}: {why}"))
        else:
            replace_node(sink, info.twin)
    erased = eliminate_dead_code(gm)
    for twin, op, impl, nodes in lifter.attention_regions:
        if twin not in erased:
            ctx.record_region("attention", nodes, op, impl)
    regions = {id(info.region): info.region for _, info, _ in results if info is not None}
    for region in regions.values():
        op = "recompile::jagged_within"
        ctx.record_region("jagged", [n for n in region.lifted if n in erased], op, ctx.lower(op))


def _padded_attention(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Attention on padded histories left padded (no jagged values to lift: ids ``[B, N]`` with a padding id, or
    lengths) with an additive mask -> ``recompile.padded_softmax_attention``, which cuts the keys no query
    attends to at run time."""
    op = "recompile::padded_softmax_attention"
    groups: dict[fx.Node, list[fx.Node]] = {}  # by mask
    for node in list(gm.graph.nodes):
        try:
            match = match_padded_attention(node)
        except Unproven:
            continue
        chain = _Chain(node)
        k = chain(torch.permute, match.k, (0, 2, 1, 3)) if match.k_heads_last else match.k
        impl = ctx.lower(op, match.q, k, match.v, match.mask, match.scale)
        fused = chain(torch.ops.recompile.padded_softmax_attention.default, match.q, k, match.v, match.mask,
                      match.scale, impl.impl)
        ctx.record_region("attention", list(match.nodes), op, impl)
        replace_node(node, fused)
        groups.setdefault(match.mask, []).append(fused)
    eliminate_dead_code(gm)
    for group in groups.values():
        _cut_query_rows(group)


def _field_attention(gm: fx.GraphModule, ctx: PassContext) -> None:
    """``nn.MultiheadAttention`` self-attention with no mask over ``x [N, B, E]`` (AutoInt's interacting layers
    over a CTR model's N fields; ``F.multi_head_attention_forward``, one call in Dynamo's graph, its weights
    unused) -> the in-projection, ``recompile.padded_softmax_attention`` on ``[B, H, N, E / H]`` views of it with a
    zero ``[1, 1, 1, N]`` mask (the native kernel's dense path, ``csrc/field_attention.h``), the out-projection.
    Why: ATen runs the core as ``B * H`` products of N x N tiny matrices (baddbmm, softmax, bmm) or, without the
    weights, CPU flash attention on 4-wide heads: most of AutoInt's time. Masked ones are the lifter's; dropout
    on the weights in training is left to ATen (reported)."""
    op = "recompile::padded_softmax_attention"
    for node in list(gm.graph.nodes):
        if not is_call(node, F.multi_head_attention_forward) or has_mha_mask(node):
            continue
        try:
            match = match_dense_mha(node)
        except Unproven as why:
            ctx.fallbacks.append(Fallback(ctx.current_pass, f"left unfused at {node.name}: {why}"))
            continue
        n, embed = (size_hint(s) for s in (tensor_meta(match.x).shape[0], tensor_meta(match.x).shape[-1]))
        heads, scale = match.num_heads, 1.0 / math.sqrt(embed // match.num_heads)
        chain = _Chain(node)
        # batch first ([B, N, E]: AutoInt's x is the transpose of one), so that a sequence's rows lie together
        rows = chain(torch.transpose, match.x, 0, 1)
        qkv = chain(torch.chunk, chain(F.linear, rows, match.in_weight, match.in_bias), 3, -1)
        q, k, v = (chain(torch.permute, chain("unflatten", chain(operator.getitem, qkv, i), -1,
                                              (heads, embed // heads), method=True), (0, 2, 1, 3)) for i in range(3))
        mask = chain("new_zeros", match.x, (1, 1, 1, n), method=True)
        impl = ctx.lower(op, q, k, v, mask, scale)
        attended = chain(torch.ops.recompile.padded_softmax_attention.default, q, k, v, mask, scale, impl.impl)
        merged = chain(torch.flatten, chain(torch.permute, attended, (0, 2, 1, 3)), -2)
        out = chain(torch.transpose, chain(F.linear, merged, match.out_weight, match.out_bias), 0, 1)
        for user in list(node.users):
            if user.args[1] == 0:
                replace_node(user, out)
        ctx.record_region("attention", [node], op, impl)
    eliminate_dead_code(gm)


def _cut_query_rows(group: list[fx.Node]) -> None:
    """Give the attentions of one mask the rows their outputs are read at, where ``read_rows`` proves it: they
    then compute only the query rows those rows depend on (``recompile.runtime.padded_attention``). Unproven: every row,
    which is the padded formula (no fallback to report)."""
    try:
        rows = read_rows(group)
        hoist(rows, group[0])
    except Unproven:
        return
    for fused in group:
        fused.kwargs = {"rows": rows}  # a keyword: ``impl`` stays the last argument (the race rewrites it)


@register_pass("jagged", order=30, regions={"jagged": "#ffd27f", "attention": "#f7b0d0"})
def jagged(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    _rewrite_offsets(gm, ctx)
    _lift_padded_regions(gm, ctx)
    _padded_attention(gm, ctx)
    _field_attention(gm, ctx)
    return gm
