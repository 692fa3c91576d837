"""interaction: feature interactions (DLRM dot, DCN-v2 cross, FM second order) -> one fused op each.

Patterns (Inductor pattern-matcher expressions over the torch-level graph, built from the tables
below; every commuted and respelled variant is generated, none is an if-chain) and replacements:

- dot interaction: ``D = bmm(T, transpose(T, 1, 2))`` (or ``matmul``) with ``T`` ``[B, F, D]``, then the
  pairs ``D[:, rows, cols]`` (``rows, cols`` = ``triu_indices``/``tril_indices`` with offset ±1 or 0,
  or the same pairs built by Python loops: ``torch.tensor([i for i ...])``), ``D[:, mask]`` or
  ``masked_select(D, mask)`` (``mask`` a constant ``[F, F]`` bool triangle; Dynamo captures these only
  with ``capture_dynamic_output_shape_ops``) -> ``recompile.dot_interaction(items, prefix, upper,
  self_interaction)`` (flattened for ``masked_select``); a following ``cat([prefix, pairs], 1)`` is
  fused into it (the op writes the final layout). The index tensors and masks must evaluate to
  constants (in-graph constructors or module buffers) and select exactly one of the four orders, or the
  graph is left alone. ``items`` are what ``T`` is joined from when only the pattern reads it
  (``stack([x] + embs, 1)``, or ``cat([x.unsqueeze(1), E], 1)`` around a grouped lookup): the op reads
  them in place and the join goes away; else ``[T]``.
- Python pair loops over a feature list: ``cat([x, *[(f_i * f_j).sum(1, keepdim=True) for i, j in P]], 1)``
  (or ``stack([(f_i * f_j).sum(1) ...], 1)``) with ``P`` one of the four orders
  -> ``recompile.dot_interaction(features, x, upper, self_interaction)``.
- DCN-v2 cross layer: ``x0 * linear(x, W, b) + x`` -> ``recompile.cross_layer(x0, x, W, b, None)``;
  low rank ``x0 * linear(linear(x, V), U, b) + x`` -> ``recompile.cross_layer(x0, x, U, b, V)``
  (the bias, the product with ``x0`` and the residual add are the matmul's fused epilogue). Two or more
  such ops in a row (each output only the next one's ``x``, one ``x0``, one form) -> one
  ``recompile.cross_stack(x0, x, [W...], [b...], [V...], save)`` (the layers' regions become the stack's;
  ``save``: autograd will run through the graph, so the op keeps what its backward reads).
- DCN-Mix (TorchRec ``LowRankMixtureCrossNet``): ``g = softmax(linear(x, G), 1)``, ``experts =
  stack([x0 * linear(act(linear(act(linear(x, V_e)), C_e)), U_e, b_e) ...], 2)`` (the C stage optional,
  ``act`` relu or none, biases all or none), then ``sum(experts * unsqueeze(g, 1), 2) + x`` or
  ``squeeze(matmul(experts, unsqueeze(g, 2)), 2) + x`` -> ``recompile.cross_mixture(x0, x, G, [V...],
  [C...], [U...], [b...], act, save)[0]`` (``save`` as for the cross stack); every intermediate must be used
  only inside the layer.
- FM second order, per dimension: ``0.5 * (sum(v, 1)^2 - sum(v * v, 1))`` for ``v`` ``[B, F, D]`` ->
  ``recompile.fm_second_order(v, False)``; a following ``sum(_, 1, keepdim=True)`` is fused
  (``reduce=True``), and so is DeepFM's ``0.5 * sum(_, 1, keepdim=True)`` (the half outside the sum).
  The flattened TorchRec ``FactorizationMachine`` form
  ``sum(sum(x, 1, keepdim=True)^2 - sum(x * x, 1, keepdim=True), 1, keepdim=True) * 0.5`` for ``x``
  ``[B, N]`` -> ``recompile.fm_second_order(x.unsqueeze(-1), True)``.
"""
from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch._inductor.pattern_matcher import (
    Arg,
    CallFunction,
    ListOf,
    KeywordArg,
    Match,
    PatternExpr,
    PatternMatcherPass,
    is_match,
    register_graph_pattern,
)

from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from recompile.passes.utils import arg, eliminate_dead_code, is_call, is_training, meta_value, only_user, tensor_meta
from recompile.pipeline import PassContext, register_pass
from runtime.interaction import ACTIVATIONS, pair_indices

MUL = [torch.mul, operator.mul]
ADD = [torch.add, operator.add]
SUB = [torch.sub, operator.sub]
LINEAR = [torch._C._nn.linear, torch.nn.functional.linear]
SUM = [torch.sum]
REGION = "recompile_region"  # node meta: the region an op node replaced (a cross stack takes its layers' over)


def commuted(fns: list, a: Any, b: Any) -> list[PatternExpr]:
    return [CallFunction(fns, a, b), CallFunction(fns, b, a)]


# --------------------------------------------------------------------------------------------------
# pattern tables


def _transposed(t: PatternExpr) -> list[PatternExpr]:
    return [CallFunction(torch.transpose, t, a, b) for a, b in ((1, 2), (2, 1), (-1, -2), (-2, -1))]


def _products(t: PatternExpr) -> list[PatternExpr]:
    """``T @ T^T`` as Dynamo records it."""
    return [CallFunction([torch.bmm, torch.matmul, operator.matmul], t, tt) for tt in _transposed(t)]


def dot_patterns() -> Iterator[PatternExpr]:
    """``D[:, rows, cols]``, ``D[:, mask]`` and ``masked_select(D, mask)`` (the pairs of all samples, flat)
    with ``D = T @ T^T``."""
    for dots in _products(KeywordArg("T")):
        yield CallFunction(operator.getitem, dots, (slice(None), KeywordArg("rows"), KeywordArg("cols")))
        yield CallFunction(operator.getitem, dots, (slice(None), KeywordArg("mask")))
        yield CallFunction(torch.masked_select, dots, KeywordArg("mask"))


def _pair_products(keepdim: bool) -> list[PatternExpr]:
    """One pair of a Python loop: ``(a * b).sum(-1)`` (``Arg``s: the pair's two features, in order)."""
    product = CallFunction(MUL, Arg(), Arg())
    dims = (1, -1)
    if keepdim:
        return [CallFunction(SUM, product, d, keepdim=True) for d in dims] + [
            CallFunction(SUM, product, d, True) for d in dims]
    return [CallFunction(SUM, product, d) for d in dims]


def loop_patterns() -> Iterator[PatternExpr]:
    """``cat([prefix?, *[(f_i * f_j).sum(1, keepdim=True) for i, j in pairs]], 1)`` or ``stack`` without keepdim."""
    for join, keepdim in ((torch.cat, True), (torch.stack, False)):
        for pair in _pair_products(keepdim):
            for dim in (1, -1):
                yield CallFunction(join, ListOf(pair, partial=True), dim)
                yield CallFunction(join, ListOf(pair, partial=True), dim=dim)


def cross_patterns() -> Iterator[PatternExpr]:
    x0, x, bias = KeywordArg("x0"), KeywordArg("x"), KeywordArg("bias")
    hidden = [
        CallFunction(LINEAR, x, KeywordArg("weight"), bias),
        CallFunction(LINEAR, CallFunction(LINEAR, x, KeywordArg("down"), None), KeywordArg("weight"), bias),
    ]
    for h in hidden:
        for scaled in commuted(MUL, x0, h):
            yield from commuted(ADD, scaled, x)


def _squares(t: PatternExpr) -> list[PatternExpr]:
    return [CallFunction(MUL, t, t), CallFunction([torch.pow, operator.pow], t, 2), CallFunction(torch.square, t)]


def _sums(t: PatternExpr, keepdim: bool, dim_name: str = "dim") -> list[PatternExpr]:
    dim = KeywordArg(dim_name)
    if keepdim:
        return [CallFunction(SUM, t, dim, True), CallFunction(SUM, t, dim, keepdim=True),
                CallFunction(SUM, t, dim=dim, keepdim=True)]
    return [CallFunction(SUM, t, dim), CallFunction(SUM, t, dim=dim)]


def _halves(t: PatternExpr) -> list[PatternExpr]:
    return [*commuted(MUL, t, 0.5), CallFunction([torch.div, operator.truediv], t, 2)]


def _fm_differences(keepdim: bool) -> Iterator[PatternExpr]:
    v = KeywordArg("v")
    for s, vv in itertools.product(_sums(v, keepdim), _squares(v)):
        for square_of_sum, sum_of_square in itertools.product(_squares(s), _sums(vv, keepdim)):
            yield CallFunction(SUB, square_of_sum, sum_of_square)


@dataclass(frozen=True)
class FMForm:
    """How an FM second-order pattern is written: the rank of ``v`` and whether the sum over D is inside."""

    v_dim: int  # 3: fields [B, F, D]; 2: TorchRec's flattened [B, N] (v = x.unsqueeze(-1))
    reduced: bool  # the pattern already sums over D (else a following keepdim sum is fused when present)


def fm_patterns() -> Iterator[tuple[PatternExpr, FMForm]]:
    """Per dimension over [B, F, D]; DeepFM's ``0.5 * (...).sum(1, keepdim=True)`` (the half outside the sum
    over D); TorchRec's over [B, N] with keepdim sums."""
    for diff in _fm_differences(keepdim=False):
        for half in _halves(diff):
            yield half, FMForm(3, reduced=False)
        for outer in _sums(diff, keepdim=True, dim_name="outer_dim"):
            for half in _halves(outer):
                yield half, FMForm(3, reduced=True)
    for diff in _fm_differences(keepdim=True):
        for outer in _sums(diff, keepdim=True, dim_name="outer_dim"):
            for half in _halves(outer):
                yield half, FMForm(2, reduced=True)


# --------------------------------------------------------------------------------------------------
# constants the patterns need (pair indices)

# Constructors a constant subgraph may use; anything else (a model input, a random op) is not constant.
CONSTANT_FUNCTIONS = {
    torch.tensor, torch.triu_indices, torch.tril_indices, torch.ones, torch.ones_like, torch.triu, torch.tril,
    torch.arange, torch.ne, torch.eq, torch.gt, torch.lt, torch.ge, torch.le, torch.logical_not, torch.stack,
    operator.getitem, operator.invert, torch.Tensor.bool, torch.Tensor.to,
}
CONSTANT_METHODS = {"bool", "to", "long", "int", "__getitem__"}


def constant_value(node: Any, gm: fx.GraphModule) -> Any:
    """The value of ``node`` if it is computable at compile time (a buffer or in-graph constant), else None."""
    if not isinstance(node, fx.Node):
        return node
    if node.op == "placeholder":  # a module buffer holding indices: Dynamo keeps the real tensor
        example = getattr(node.meta.get("grapharg"), "example", None)
        is_index = isinstance(example, torch.Tensor) and not example.is_floating_point() and not example.requires_grad
        return example if is_index else None
    if node.op == "get_attr":
        return getattr(gm, node.target, None)
    is_function = node.op == "call_function" and node.target in CONSTANT_FUNCTIONS
    is_method = node.op == "call_method" and node.target in CONSTANT_METHODS
    if not (is_function or is_method):
        return None
    unknown: list[fx.Node] = []

    def value(n: fx.Node) -> Any:
        v = constant_value(n, gm)
        if v is None:
            unknown.append(n)
        return v

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
    if unknown:
        return None
    fn = getattr(args[0], node.target) if is_method else node.target
    with torch.no_grad():
        return fn(*(args[1:] if is_method else args), **kwargs)


@functools.lru_cache(maxsize=256)
def _pair_orders(num_features: int) -> list[tuple[tuple[bool, bool], torch.Tensor]]:
    """((upper, self_interaction), flat pair positions) for the four orders dot_interaction computes."""
    orders = []
    for upper, self_interaction in itertools.product((True, False), (False, True)):
        rows, cols = pair_indices(num_features, upper, self_interaction)
        orders.append(((upper, self_interaction), rows * num_features + cols))
    return orders


def classify_pairs(num_features: int, flat: torch.Tensor) -> tuple[bool, bool] | None:
    """The (upper, self_interaction) order whose pairs are exactly ``flat`` (positions in F*F), or None."""
    flat = flat.to("cpu", torch.int64).flatten()
    for order, want in _pair_orders(num_features):
        if flat.numel() == want.numel() and torch.equal(flat, want):
            return order
    return None


def _selected_pairs(rows: fx.Node, cols: fx.Node, num_features: int, gm: fx.GraphModule) -> torch.Tensor | None:
    """Flat positions in the [F, F] product the selector picks, in output order; None if not constant."""
    rows, cols = constant_value(rows, gm), constant_value(cols, gm)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 1 and not t.is_floating_point() for t in (rows, cols)):
        return None
    if rows.shape != cols.shape or rows.dtype == torch.bool:
        return None
    if any(bool(((t < -num_features) | (t >= num_features)).any()) for t in (rows, cols)):
        return None  # out of range: eager raises, and so must the compiled graph
    rows, cols = rows.long() % num_features, cols.long() % num_features
    return rows * num_features + cols


def _masked_pairs(mask: fx.Node, num_features: int, gm: fx.GraphModule) -> torch.Tensor | None:
    """Flat positions a constant [F, F] boolean mask selects, in row-major (output) order; None otherwise."""
    mask = constant_value(mask, gm)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != (num_features, num_features):
        return None
    return mask.flatten().nonzero().flatten()


# --------------------------------------------------------------------------------------------------
# replacements


def _fused_cat(pairs: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(cat, prefix) when the pairs' only use is ``cat([prefix, pairs], 1)`` with a [B, K] prefix."""
    cat = only_user(pairs)
    if cat is None or cat.op != "call_function" or cat.target is not torch.cat:
        return None
    tensors = cat.args[0] if cat.args else cat.kwargs.get("tensors")
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or tensors[1] is not pairs or dim not in (1, -1):
        return None
    prefix, pairs_meta = tensor_meta(tensors[0]), tensor_meta(pairs)
    if prefix is None or prefix.dim() != 2 or prefix.dtype != pairs_meta.dtype:
        return None
    return cat, tensors[0]


def _replace(ctx: PassContext, match: Match, anchor: fx.Node, op: str, args: tuple, replaced: list[fx.Node],
             then: tuple = ()) -> None:
    """Replace ``anchor`` by ``op(*args)`` (or ``f(op(*args), *rest)`` for ``then = (f, *rest)``) and erase the
    ``replaced`` nodes left unused."""
    impl = ctx.lower(op)
    graph = anchor.graph
    with graph.inserting_before(anchor):
        call = new = graph.call_function(getattr(torch.ops.recompile, op.split("::")[1]).default, (*args, impl.impl))
        if then:
            new = graph.call_function(then[0], (call, *then[1:]))
    new.meta["example_value"] = meta_value(anchor)
    ctx.record_region("interaction", replaced, op, impl)
    call.meta[REGION] = ctx.regions[-1]
    anchor.replace_all_uses_with(new)
    for node in reversed(replaced):
        if not node._erased and not node.users:
            graph.erase_node(node)
    match.erase_nodes()


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, decided without adding a guard on symbolic sizes."""
    return a.dim() == b.dim() and all(statically_known_true(sym_eq(p, q)) for p, q in zip(a.shape, b.shape))


def _float_tensor(node: Any, dim: int) -> torch.Tensor | None:
    meta = tensor_meta(node)
    return meta if meta is not None and meta.dim() == dim and meta.is_floating_point() else None


def _unsqueezed(node: Any) -> fx.Node | None:
    """``a`` when ``node`` is ``unsqueeze(a, 1)`` of a 2-D ``a``."""
    if is_call(node, torch.unsqueeze) and arg(node, 1, "dim") == 1 and _float_tensor(node.args[0], 2) is not None:
        return node.args[0]
    return None


def feature_items(T: fx.Node, match_nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """(items, absorbed): the [B, D] / [B, n, D] pieces ``T`` is stacked or concatenated from along dim 1, read
    in place by the op instead of ``T``, and the stack/cat that then goes away; ``[T]`` when ``T`` has other
    users or is built otherwise."""
    joined = is_call(T, torch.stack, torch.cat) and arg(T, 1, "dim", 0) == 1
    if not joined or any(user not in match_nodes for user in T.users):
        return [T], []
    tensors = arg(T, 0, "tensors")
    if T.target is torch.stack:
        return (list(tensors), [T]) if all(_float_tensor(t, 2) is not None for t in tensors) else ([T], [])
    items = [_unsqueezed(t) or t for t in tensors]
    if any(_float_tensor(t, 2 if t not in tensors else 3) is None for t in items):
        return [T], []
    return items, [T]


def _dot_handler(ctx: PassContext) -> Callable:
    def handle(match: Match, T: fx.Node, rows: Any = None, cols: Any = None, mask: Any = None) -> None:
        features = _float_tensor(T, 3)
        if features is None or not isinstance(features.shape[1], int):
            return
        num_features = features.shape[1]
        gm = match.graph.owning_module
        if mask is None:
            flat = _selected_pairs(rows, cols, num_features, gm)
        else:
            flat = _masked_pairs(mask, num_features, gm)
        order = None if flat is None else classify_pairs(num_features, flat)
        if order is None:
            return
        items, absorbed = feature_items(T, match.nodes)
        pairs = match.output_node()
        if pairs.target is torch.masked_select:  # [B * P], row-major: the op's pairs, flattened
            _replace(ctx, match, pairs, "recompile::dot_interaction", (items, None, *order), list(match.nodes) + absorbed,
                     then=(torch.flatten,))
            return
        replaced = list(match.nodes) + absorbed
        prefix = None
        fused = _fused_cat(pairs)
        if fused is not None:
            pairs, prefix = fused
            replaced.append(pairs)
        _replace(ctx, match, pairs, "recompile::dot_interaction", (items, prefix, *order), replaced)

    return handle


def _feature_orders(pairs: list[tuple[fx.Node, fx.Node]]) -> Iterator[list[fx.Node]]:
    """Candidate feature orders: first appearance in (a, b) order (upper pairs) or (b, a) order (lower)."""
    for flip in (False, True):
        seen: dict[fx.Node, None] = {}
        for a, b in pairs:
            seen.update(dict.fromkeys((b, a) if flip else (a, b)))
        yield list(seen)


def _loop_handler(ctx: PassContext) -> Callable:
    def handle(match: Match, pairs: list[tuple[fx.Node, fx.Node]]) -> None:
        join = match.output_node()
        items = join.args[0]
        prefix = [item for item in items if item not in match.nodes]
        if len(prefix) > 1 or (prefix and items[0] is not prefix[0]) or (prefix and join.target is torch.stack):
            return
        if prefix and (tensor_meta(prefix[0]) is None or tensor_meta(prefix[0]).dim() != 2):
            return
        metas = [_float_tensor(n, 2) for pair in pairs for n in pair]
        if any(m is None or not _same_shape(m, metas[0]) for m in metas):
            return
        for features in _feature_orders(pairs):
            position = {node: i for i, node in enumerate(features)}
            flat = torch.tensor([position[a] * len(features) + position[b] for a, b in pairs])
            order = classify_pairs(len(features), flat)
            if order is not None:
                break
        else:
            return
        args = (features, prefix[0] if prefix else None, *order)
        _replace(ctx, match, join, "recompile::dot_interaction", args, list(match.nodes))

    return handle


def _cross_handler(ctx: PassContext) -> Callable:
    def handle(match: Match, x0: fx.Node, x: fx.Node, weight: fx.Node, bias: Any, down: Any = None) -> None:
        xs = [_float_tensor(x0, 2), _float_tensor(x, 2)]
        if any(t is None for t in xs) or _float_tensor(weight, 2) is None:
            return
        if not _same_shape(xs[0], xs[1]) or not _same_shape(tensor_meta(match.output_node()), xs[1]):
            return  # x0 * h + x must not broadcast
        if bias is not None and (tensor_meta(bias) is None or tensor_meta(bias).dim() != 1):
            return
        _replace(ctx, match, match.output_node(), "recompile::cross_layer", (x0, x, weight, bias, down), list(match.nodes))

    return handle


def _fm_handler(ctx: PassContext, form: FMForm) -> Callable:
    def handle(match: Match, v: fx.Node, dim: int, outer_dim: int = 1) -> None:
        meta = _float_tensor(v, form.v_dim)
        if meta is None or dim not in (1, -meta.dim() + 1) or outer_dim not in (1, -1):
            return
        out = match.output_node()
        replaced = list(match.nodes)
        reduce = form.reduced
        total = None if reduce else only_user(out)
        if total is not None and _is_keepdim_sum(total):  # fuse the sum over D
            out, reduce = total, True
            replaced.append(total)
        graph = out.graph
        if form.v_dim == 2:
            with graph.inserting_before(out):
                v = graph.call_function(torch.unsqueeze, (v, -1))
        _replace(ctx, match, out, "recompile::fm_second_order", (v, reduce), replaced)

    return handle


def _is_keepdim_sum(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not torch.sum:
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return dim in (1, -1) and keepdim is True


# --------------------------------------------------------------------------------------------------
# mixture of low-rank experts (DCN-Mix): the combine is the registered pattern, the stacked experts are
# matched one by one against the expert table below.

def _activated(t: PatternExpr, activation: str) -> list[PatternExpr]:
    """``t`` after the activation as Dynamo records it (``nn.ReLU``, ``F.relu``, ``torch.relu``)."""
    if activation == "identity":
        return [t]
    return [CallFunction(torch.nn.functional.relu, t, inplace=False),
            CallFunction([torch.relu, torch.nn.functional.relu], t)]


def expert_patterns() -> Iterator[tuple[PatternExpr, bool, str]]:
    """(pattern, has_mid, activation) of one expert: ``x0 * linear(act(linear(act(linear(x, V)), C)), U, b)``
    (TorchRec's ``U act(C act(V x))``) or without C; ``b`` may be None."""
    x0, x = KeywordArg("x0"), KeywordArg("x")
    for activation in ACTIVATIONS:
        for down in _activated(CallFunction(LINEAR, x, KeywordArg("down"), None), activation):
            mid = CallFunction(LINEAR, down, KeywordArg("mid"), None)
            for z, has_mid in [(down, False), *((m, True) for m in _activated(mid, activation))]:
                up = CallFunction(LINEAR, z, KeywordArg("up"), KeywordArg("bias"))
                for expert in commuted(MUL, x0, up):
                    yield expert, has_mid, activation


@dataclass(frozen=True)
class MixtureForm:
    """How the gates meet the stacked experts [B, D, E]: the axis ``g`` [B, E] is unsqueezed at."""

    gate_axes: tuple[int, ...]  # (1, -2): weighted sum over [B, 1, E]; (2, -1): matmul with [B, E, 1]


WEIGHTED_SUM, MATMUL = MixtureForm((1, -2)), MixtureForm((2, -1))


def mixture_patterns() -> Iterator[tuple[PatternExpr, MixtureForm]]:
    """``sum(experts * unsqueeze(g, 1), 2) + x`` or ``squeeze(matmul(experts, unsqueeze(g, 2)), 2) + x`` with
    ``g = softmax(linear(x, G), 1)``; the handler checks the axes and that ``experts`` stacks experts."""
    x, experts = KeywordArg("x"), KeywordArg("experts")
    logits = CallFunction(LINEAR, x, KeywordArg("gate"), None)
    softmaxes = [CallFunction([torch.softmax, torch.nn.functional.softmax], logits, dim=KeywordArg("gate_dim")),
                 CallFunction(torch.softmax, logits, KeywordArg("gate_dim"))]
    for gates in softmaxes:
        column = CallFunction(torch.unsqueeze, gates, KeywordArg("gate_axis"))
        product = CallFunction([torch.matmul, operator.matmul], experts, column)
        combined = [(CallFunction(torch.squeeze, product, KeywordArg("expert_dim")), MATMUL)]
        for weighted in commuted(MUL, experts, column):
            combined += [(CallFunction(SUM, weighted, KeywordArg("expert_dim")), WEIGHTED_SUM),
                         (CallFunction(SUM, weighted, dim=KeywordArg("expert_dim")), WEIGHTED_SUM)]
        for combine, form in combined:
            for pattern in commuted(ADD, combine, x):
                yield pattern, form


@functools.lru_cache(maxsize=1)
def _expert_table() -> list[tuple[PatternExpr, bool, str]]:
    return list(expert_patterns())


def _match_expert(node: fx.Node, x: fx.Node) -> tuple[Match, bool, str] | None:
    """The first expert form ``node`` computes from ``x`` (without C, ``U relu(V x')`` also matches a C stage
    with x' = relu(V x): the input pins it down)."""
    for pattern, has_mid, activation in _expert_table():
        m = pattern.match(node)
        if is_match(m) and m.kwargs["x"] is x:
            return m, has_mid, activation
    return None


def _mixture_handler(ctx: PassContext, form: MixtureForm) -> Callable:
    def handle(match: Match, x: fx.Node, gate: fx.Node, experts: fx.Node, gate_dim: int, gate_axis: int,
               expert_dim: int) -> None:
        meta = _float_tensor(x, 2)
        if meta is None or not is_call(experts, torch.stack) or arg(experts, 1, "dim", 0) not in (2, -1):
            return
        if gate_dim not in (1, -1) or gate_axis not in form.gate_axes or expert_dim not in (2, -1):
            return
        stacked = arg(experts, 0, "tensors")
        found = [_match_expert(node, x) for node in stacked]
        if any(f is None for f in found) or len({(has_mid, act) for _, has_mid, act in found}) != 1:
            return
        kwargs = [m.kwargs for m, _, _ in found]
        x0 = kwargs[0]["x0"]
        if any(k["x0"] is not x0 for k in kwargs) or _float_tensor(x0, 2) is None:
            return
        if not _same_shape(tensor_meta(x0), meta) or len({k["bias"] is None for k in kwargs}) != 1:
            return
        shapes = {name: {tuple(tensor_meta(k[name]).shape) for k in kwargs if tensor_meta(k.get(name)) is not None}
                  for name in ("down", "mid", "up")}
        if len(shapes["down"]) != 1 or len(shapes["up"]) != 1 or len(shapes["mid"]) > 1:
            return  # experts of one rank (the op batches them)
        if not all(_same_shape(tensor_meta(node), meta) for node in stacked):
            return  # x0 * expert must not broadcast
        nodes = {n for m, _, _ in found for n in m.nodes} | {experts, *match.nodes}
        anchor = match.output_node()
        if any(user not in nodes for n in nodes if n is not anchor for user in n.users):
            return  # an intermediate is used elsewhere
        has_mid, activation = found[0][1], found[0][2]
        params = ([k["down"] for k in kwargs], [k["mid"] for k in kwargs] if has_mid else [],
                  [k["up"] for k in kwargs], [] if kwargs[0]["bias"] is None else [k["bias"] for k in kwargs])
        order = {n: i for i, n in enumerate(anchor.graph.nodes)}
        replaced = sorted(nodes, key=order.__getitem__)
        args = (x0, x, gate, *params, activation, is_training(anchor.graph.owning_module))
        _replace(ctx, match, anchor, "recompile::cross_mixture", args, replaced, then=(operator.getitem, 0))

    return handle


# --------------------------------------------------------------------------------------------------
# cross stacks: consecutive cross_layer ops over one x0 -> one cross_stack


def _cross_chains(graph: fx.Graph) -> list[list[fx.Node]]:
    """Runs of ``cross_layer`` nodes where each one's output is only the next one's ``x``, all with the same
    ``x0`` and the same form (with or without bias, full or low rank)."""
    layer = torch.ops.recompile.cross_layer.default
    chains, seen = [], set()
    for node in graph.nodes:
        if node.target is not layer or node in seen:
            continue
        chain = [node]
        while True:
            last, nxt = chain[-1], only_user(chain[-1])
            if nxt is None or nxt.target is not layer or nxt.args[1] is not last or nxt.args[0] is not node.args[0]:
                break
            if any((nxt.args[i] is None) != (node.args[i] is None) for i in (3, 4)):
                break
            chain.append(nxt)
        seen.update(chain)
        if len(chain) > 1:
            chains.append(chain)
    return chains


def stack_cross_layers(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Replace each chain of cross layers by one ``cross_stack`` (its region takes over the layers' regions)."""
    save = is_training(gm)
    for chain in _cross_chains(gm.graph):
        first, last = chain[0], chain[-1]
        x0, x, _, bias, down, _ = first.args
        args = (x0, x, [n.args[2] for n in chain], [] if bias is None else [n.args[3] for n in chain],
                [] if down is None else [n.args[4] for n in chain], save)
        impl = ctx.lower("recompile::cross_stack")
        graph = gm.graph
        with graph.inserting_before(last):
            stack = graph.call_function(torch.ops.recompile.cross_stack.default, (*args, impl.impl))
            out = graph.call_function(operator.getitem, (stack, 0))
        value = meta_value(last)
        fake_mode = getattr(value, "fake_mode", None)
        if fake_mode is not None:  # Dynamo's graphs; the stack's outputs are only needed by later passes
            with fake_mode:
                stack.meta["example_value"] = torch.ops.recompile.cross_stack.default(
                    *fx.node.map_arg(args, meta_value), impl.impl)
        out.meta["example_value"] = value
        last.replace_all_uses_with(out)
        regions = [n.meta[REGION] for n in chain]
        ctx.regions[:] = [r for r in ctx.regions if not any(r is q for q in regions)]
        ctx.record_region("interaction", [name for r in regions for name in r.replaced], "recompile::cross_stack", impl)
        for node in reversed(chain):
            graph.erase_node(node)


def build_matcher(ctx: PassContext) -> PatternMatcherPass:
    matcher = PatternMatcherPass(pass_name="recompile.interaction")
    for pattern in dot_patterns():
        register_graph_pattern(pattern, pass_dict=matcher)(_dot_handler(ctx))
    for pattern in loop_patterns():
        register_graph_pattern(pattern, pass_dict=matcher)(_loop_handler(ctx))
    for pattern in cross_patterns():
        register_graph_pattern(pattern, pass_dict=matcher)(_cross_handler(ctx))
    for pattern, form in fm_patterns():
        register_graph_pattern(pattern, pass_dict=matcher)(_fm_handler(ctx, form))
    for pattern, form in mixture_patterns():
        register_graph_pattern(pattern, pass_dict=matcher)(_mixture_handler(ctx, form))
    return matcher


@register_pass("interaction")
def interaction(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    build_matcher(ctx).apply(gm)
    stack_cross_layers(gm, ctx)
    eliminate_dead_code(gm)
    return gm
