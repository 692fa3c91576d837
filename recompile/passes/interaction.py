"""interaction: feature interactions (DLRM dot, PNN inner products, DCN-v1 and -v2 cross, DCN-Mix, FM) -> one op each.

Patterns are Inductor pattern-matcher expressions over the graph ``normalize`` leaves (one spelling per
computation: bound arguments with non-negative dims, ``x @ W`` / ``mm`` / ``addmm`` / ``einsum`` as ``linear``,
column-vector layers in row form, squares as ``x * x``, halves as ``x * 0.5``, triangle pair selections as one
form), so each computation is one pattern: ``pattern_count()`` is 16 (1,225 when the graph still had every
spelling). The matcher is built once; handlers read the running pass's context from ``_CONTEXT``.
Patterns and replacements:

- dot interaction: ``index_select(flatten(matmul(T, transpose(T, 1, 2)), 1, 2), 1, pairs)`` with ``T``
  ``[B, F, D]`` and ``pairs`` the constant flat positions of one of the four triangle orders (normalize's form
  of ``D[:, rows, cols]``, ``D[:, mask]``, ``masked_select``, ``gather`` with index buffers, ...)
  -> ``recompile.dot_interaction(items, prefix, upper, self_interaction)``; a following
  ``cat([prefix, pairs], 1)`` is fused into it (the op writes the final layout). ``items`` are what ``T`` is
  joined from when only the pattern reads it (``stack([x] + embs, 1)``, or ``cat([x.unsqueeze(1), E], 1)``
  around a grouped lookup): the op reads them in place and the join goes away; else ``[T]``.
- PNN inner products: ``sum(index_select(E, 1, rows) * index_select(E, 1, cols), 2)`` with constant ``rows,
  cols`` of one triangle order -> ``recompile.dot_interaction([E], None, upper, self_interaction)``.
- Python pair loops over a feature list: ``cat([x, *[(f_i * f_j).sum(1, keepdim=True) for i, j in P]], 1)``
  (or ``stack([(f_i * f_j).sum(1) ...], 1)``) with ``P`` one of the four orders
  -> ``recompile.dot_interaction(features, x, upper, self_interaction)``.
- DCN-v2 cross layer: ``x + x0 * linear(x, W, b)`` -> ``recompile.cross_layer(x0, x, W, b, None)``;
  low rank ``x0 * linear(linear(x, V), U, b) + x`` -> ``recompile.cross_layer(x0, x, U, b, V)``
  (the bias, the product with ``x0`` and the residual add are the matmul's fused epilogue). Two or more
  such ops in a row (each output only the next one's ``x``, one ``x0``, one form) -> one
  ``recompile.cross_stack(x0, x, [W...], [b...], [V...], save)`` (the layers' regions become the stack's;
  ``save``: autograd will run through the graph, so the op keeps what its backward reads).
- DCN-v1 vector cross (RecBole's ``DCN``, TorchRec's ``VectorCrossNet``, raw Parameters): ``x + (x0 * linear(x, w)
  + b)`` with ``w`` [1, D] (normalize's one form of ``x . w``: ``tensordot``, ``x @ w``, ``(x * w).sum(-1)``,
  ``matmul(x, w.unsqueeze(-1))``, the column form) and ``b`` [D] -> ``recompile.vector_cross(x0, x, [w], [b])``;
  without a bias it is the cross layer's pattern with a [1, D] weight -> ``vector_cross(x0, x, [w], [])``.
  Chains (each output only the next one's ``x``, one ``x0``, all with or all without biases) -> one
  ``vector_cross`` over all their layers (its kernel keeps a sample's row in cache across the layers).
- DCN-Mix (TorchRec ``LowRankMixtureCrossNet``, its per-expert gates one ``linear`` after normalize):
  ``g = softmax(linear(x, G), 1)``, ``experts =
  stack([x0 * linear(act(linear(act(linear(x, V_e)), C_e)), U_e, b_e) ...], 2)`` (the C stage optional,
  ``act`` relu or none, biases all or none), then ``sum(experts * unsqueeze(g, 1), 2) + x`` or
  ``squeeze(matmul(experts, unsqueeze(g, 2)), 2) + x`` -> ``recompile.cross_mixture(x0, x, G, [V...],
  [C...], [U...], [b...], act, save)[0]`` (``save`` as for the cross stack); every intermediate must be used
  only inside the layer.
- FM second order (RecBole's FM, DeepFM, NFM layer too), per dimension: ``0.5 * (sum(v, 1)^2 - sum(v * v, 1))`` for ``v`` ``[B, F, D]`` ->
  ``recompile.fm_second_order(v, False)``; a following ``sum(_, 1, keepdim=True)`` is fused
  (``reduce=True``), and so is DeepFM's ``0.5 * sum(_, 1, keepdim=True)`` (the half outside the sum).
  The flattened TorchRec ``FactorizationMachine`` form
  ``sum(sum(x, 1, keepdim=True)^2 - sum(x * x, 1, keepdim=True), 1, keepdim=True) * 0.5`` for ``x``
  ``[B, N]`` -> ``recompile.fm_second_order(x.unsqueeze(-1), True)``.
"""
from __future__ import annotations

import contextvars
import functools
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch._inductor.pattern_matcher import (
    Arg,
    CallFunction,
    KeywordArg,
    ListOf,
    Match,
    PatternExpr,
    PatternMatcherPass,
    is_match,
    register_graph_pattern,
)
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from recompile.passes.utils import (arg, classify_pairs, constant_value, eliminate_dead_code, is_call, is_training,
                                    meta_value, only_user, tensor_meta)
from recompile.pipeline import PassContext, register_pass
from recompile.runtime.interaction import ACTIVATIONS

LINEAR = torch._C._nn.linear
REGION = "recompile_region"  # node meta: the region an op node replaced (a cross stack takes its layers' over)
_CONTEXT: contextvars.ContextVar[PassContext] = contextvars.ContextVar("recompile_interaction_context")


def commuted(fn: Any, a: Any, b: Any) -> list[PatternExpr]:
    """Both operand orders of a commutative call, where normalize's order (operands by definition) cannot tell
    which comes first."""
    return [CallFunction(fn, a, b), CallFunction(fn, b, a)]


# --------------------------------------------------------------------------------------------------
# pattern tables, over the graph normalize leaves: one spelling per computation, arguments bound (dims
# non-negative, defaults explicit), ``x @ W`` as ``linear``, squares as ``x * x``, halves as ``* 0.5``, pairs of an
# [F, F] product as ``index_select(flatten(D, 1, 2), 1, pairs)``.


def dot_patterns() -> Iterator[PatternExpr]:
    """The pairs of ``D = T @ T^T``."""
    T = KeywordArg("T")
    dots = CallFunction(torch.matmul, T, CallFunction(torch.transpose, T, 1, 2))
    yield CallFunction(torch.index_select, CallFunction(torch.flatten, dots, 1, 2), 1, KeywordArg("pairs"))


def gathered_patterns() -> Iterator[PatternExpr]:
    """PNN: ``(E[:, rows] * E[:, cols]).sum(-1)`` for ``E`` [B, F, D]."""
    E = KeywordArg("E")
    rows = CallFunction(torch.index_select, E, 1, KeywordArg("rows"))
    cols = CallFunction(torch.index_select, E, 1, KeywordArg("cols"))
    yield CallFunction(torch.sum, CallFunction(torch.mul, rows, cols), 2, False)


def loop_patterns() -> Iterator[PatternExpr]:
    """``cat([prefix?, *[(f_i * f_j).sum(1, keepdim=True) for i, j in pairs]], 1)`` or ``stack`` without keepdim."""
    for join, keepdim in ((torch.cat, True), (torch.stack, False)):
        pair = CallFunction(torch.sum, CallFunction(torch.mul, Arg(), Arg()), 1, keepdim)
        yield CallFunction(join, ListOf(pair, partial=True), 1)


def cross_patterns() -> Iterator[PatternExpr]:
    x0, x, bias = KeywordArg("x0"), KeywordArg("x"), KeywordArg("bias")
    hidden = [
        CallFunction(LINEAR, x, KeywordArg("weight"), bias),
        CallFunction(LINEAR, CallFunction(LINEAR, x, KeywordArg("down"), None), KeywordArg("weight"), bias),
    ]
    for h in hidden:
        for scaled in commuted(torch.mul, x0, h):
            yield CallFunction(torch.add, x, scaled)


def vector_cross_patterns() -> Iterator[PatternExpr]:
    """DCN-v1: ``x + (x0 * linear(x, w) + b)`` with ``w`` [1, D] (normalize's ``x . w``: tensordot, ``x @ w``,
    ``(x * w).sum(-1, keepdim=True)``, ``matmul(x, w.unsqueeze(-1))``, TorchRec's column form)."""
    x0, x = KeywordArg("x0"), KeywordArg("x")
    scaled = CallFunction(torch.mul, x0, CallFunction(LINEAR, x, KeywordArg("weight"), None))
    for biased in commuted(torch.add, scaled, KeywordArg("bias")):
        yield CallFunction(torch.add, x, biased)


@dataclass(frozen=True)
class FMForm:
    """How an FM second-order pattern is written: the rank of ``v`` and whether the sum over D is inside."""

    v_dim: int  # 3: fields [B, F, D]; 2: TorchRec's flattened [B, N] (v = x.unsqueeze(-1))
    reduced: bool  # the pattern already sums over D (else a following keepdim sum is fused when present)


def _fm_difference(keepdim: bool) -> PatternExpr:
    """``sum(v, dim)^2 - sum(v * v, dim)``."""
    v, dim = KeywordArg("v"), KeywordArg("dim")
    total = CallFunction(torch.sum, v, dim, keepdim)
    squares = CallFunction(torch.sum, CallFunction(torch.mul, v, v), dim, keepdim)
    return CallFunction(torch.sub, CallFunction(torch.mul, total, total), squares)


def fm_patterns() -> Iterator[tuple[PatternExpr, FMForm]]:
    """Per dimension over [B, F, D]; DeepFM's ``0.5 * (...).sum(1, keepdim=True)`` (the half outside the sum
    over D); TorchRec's over [B, N] with keepdim sums."""
    def half_of_sum(diff: PatternExpr) -> PatternExpr:
        return CallFunction(torch.mul, CallFunction(torch.sum, diff, KeywordArg("outer_dim"), True), 0.5)

    yield CallFunction(torch.mul, _fm_difference(keepdim=False), 0.5), FMForm(3, reduced=False)
    yield half_of_sum(_fm_difference(keepdim=False)), FMForm(3, reduced=True)
    yield half_of_sum(_fm_difference(keepdim=True)), FMForm(2, reduced=True)


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


def _replace(match: Match, anchor: fx.Node, op: str, args: tuple, replaced: list[fx.Node], then: tuple = ()) -> None:
    """Replace ``anchor`` by ``op(*args)`` (or ``f(op(*args), *rest)`` for ``then = (f, *rest)``) and erase the
    ``replaced`` nodes left unused. The pass context is the running pass's (``_CONTEXT``)."""
    ctx = _CONTEXT.get()
    impl = ctx.lower(op, *args)
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


def _pair_order(num_features: int, flat: Any) -> tuple[bool, bool] | None:
    return None if flat is None else classify_pairs(num_features, flat)


def _handle_dot(match: Match, T: fx.Node, pairs: fx.Node) -> None:
    features = _float_tensor(T, 3)
    if features is None or not isinstance(features.shape[1], int):
        return
    order = _pair_order(features.shape[1], constant_value(pairs, match.graph.owning_module))
    if order is None:
        return
    items, absorbed = feature_items(T, match.nodes)
    out = match.output_node()
    replaced = list(match.nodes) + absorbed
    prefix = None
    fused = _fused_cat(out)
    if fused is not None:
        out, prefix = fused
        replaced.append(out)
    _replace(match, out, "recompile::dot_interaction", (items, prefix, *order), replaced)


def _handle_gathered(match: Match, E: fx.Node, rows: fx.Node, cols: fx.Node) -> None:
    """PNN's inner products: the pairs ``(rows[p], cols[p])`` of one triangle order (either way round: the
    product is symmetric)."""
    features = _float_tensor(E, 3)
    if features is None or not isinstance(features.shape[1], int):
        return
    num_features, gm = features.shape[1], match.graph.owning_module
    rows, cols = constant_value(rows, gm), constant_value(cols, gm)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in (rows, cols)) or rows.shape != cols.shape:
        return
    order = _pair_order(num_features, rows * num_features + cols) or _pair_order(num_features, cols * num_features + rows)
    if order is not None:
        _replace(match, match.output_node(), "recompile::dot_interaction", ([E], None, *order), list(match.nodes))


def _feature_orders(pairs: list[tuple[fx.Node, fx.Node]]) -> Iterator[list[fx.Node]]:
    """Candidate feature orders: first appearance in (a, b) order or in (b, a) order."""
    for flip in (False, True):
        seen: dict[fx.Node, None] = {}
        for a, b in pairs:
            seen.update(dict.fromkeys((b, a) if flip else (a, b)))
        yield list(seen)


def _loop_order(pairs: list[tuple[fx.Node, fx.Node]]) -> tuple[list[fx.Node], tuple[bool, bool]] | None:
    """(features, order) such that the unordered pairs (a product is symmetric) are one triangle order."""
    for features in _feature_orders(pairs):
        n = len(features)
        position = {node: i for i, node in enumerate(features)}
        low_high = torch.tensor([sorted((position[a], position[b])) for a, b in pairs]).reshape(-1, 2)
        for first, second in ((0, 1), (1, 0)):  # upper pairs read (low, high), lower ones (high, low)
            order = classify_pairs(n, low_high[:, first] * n + low_high[:, second])
            if order is not None:
                return features, order
    return None


def _handle_loop(match: Match, pairs: list[tuple[fx.Node, fx.Node]]) -> None:
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
    found = _loop_order(pairs)
    if found is not None:
        features, order = found
        args = (features, prefix[0] if prefix else None, *order)
        _replace(match, join, "recompile::dot_interaction", args, list(match.nodes))


def _cross_inputs(match: Match, x0: fx.Node, x: fx.Node, weight: fx.Node) -> tuple[torch.Tensor, int] | None:
    """(x's meta, the weight's rows) when ``x0`` and ``x`` are one [B, D] float shape (``x0 * h + x`` does not
    broadcast) and ``weight`` is a float matrix."""
    xs = [_float_tensor(x0, 2), _float_tensor(x, 2)]
    w = _float_tensor(weight, 2)
    if any(t is None for t in xs) or w is None:
        return None
    if not _same_shape(xs[0], xs[1]) or not _same_shape(tensor_meta(match.output_node()), xs[1]):
        return None
    return xs[1], w.shape[0]


def _is_vector(meta: Any, x: torch.Tensor) -> bool:
    """``meta`` holds one [D] vector of ``x`` [B, D]'s dtype ([D], [1, D] or [D, 1])."""
    return (meta is not None and meta.dim() in (1, 2) and meta.dtype == x.dtype
            and statically_known_true(sym_eq(meta.numel(), x.shape[1])) and max(meta.shape) == meta.numel())


def _handle_cross(match: Match, x0: fx.Node, x: fx.Node, weight: fx.Node, bias: Any, down: Any = None) -> None:
    found = _cross_inputs(match, x0, x, weight)
    if found is None or (bias is not None and (tensor_meta(bias) is None or tensor_meta(bias).dim() != 1)):
        return
    meta, rows = found
    if rows == 1 and bias is None and down is None and _is_vector(tensor_meta(weight), meta):  # DCN-v1, no bias
        _replace(match, match.output_node(), "recompile::vector_cross", (x0, x, [weight], []), list(match.nodes))
    elif statically_known_true(sym_eq(rows, meta.shape[1])):
        _replace(match, match.output_node(), "recompile::cross_layer", (x0, x, weight, bias, down), list(match.nodes))


def _handle_vector_cross(match: Match, x0: fx.Node, x: fx.Node, weight: fx.Node, bias: Any) -> None:
    found = _cross_inputs(match, x0, x, weight)
    if found is None or found[1] != 1 or not _is_vector(tensor_meta(weight), found[0]):
        return
    if not _is_vector(tensor_meta(bias), found[0]) or tensor_meta(bias).dim() != 1:
        return  # a [D] bias: anything else broadcasts differently
    _replace(match, match.output_node(), "recompile::vector_cross", (x0, x, [weight], [bias]), list(match.nodes))


def _handle_fm(form: FMForm, match: Match, v: fx.Node, dim: int, outer_dim: int = 1) -> None:
    meta = _float_tensor(v, form.v_dim)
    if meta is None or dim != 1 or outer_dim != 1:
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
            v = graph.call_function(torch.unsqueeze, (v, 2))
    _replace(match, out, "recompile::fm_second_order", (v, reduce), replaced)


def _is_keepdim_sum(node: fx.Node) -> bool:
    return is_call(node, torch.sum) and node.args[1:] == (1, True)


# --------------------------------------------------------------------------------------------------
# mixture of low-rank experts (DCN-Mix): the combine is the registered pattern, the stacked experts are
# matched one by one against the expert table below.

def _activated(t: PatternExpr, activation: str) -> PatternExpr:
    """``t`` after the activation (``nn.ReLU``, ``F.relu`` and ``torch.relu`` are all ``torch.relu`` here)."""
    return t if activation == "identity" else CallFunction(torch.relu, t)


def expert_patterns() -> Iterator[tuple[PatternExpr, bool, str]]:
    """(pattern, has_mid, activation) of one expert: ``x0 * linear(act(linear(act(linear(x, V)), C)), U, b)``
    (TorchRec's ``U act(C act(V x))``) or without C; ``b`` may be None."""
    x0, x = KeywordArg("x0"), KeywordArg("x")
    for activation in ACTIVATIONS:
        down = _activated(CallFunction(LINEAR, x, KeywordArg("down"), None), activation)
        mid = _activated(CallFunction(LINEAR, down, KeywordArg("mid"), None), activation)
        for z, has_mid in ((down, False), (mid, True)):
            up = CallFunction(LINEAR, z, KeywordArg("up"), KeywordArg("bias"))
            for expert in commuted(torch.mul, x0, up):
                yield expert, has_mid, activation


@dataclass(frozen=True)
class MixtureForm:
    """How the gates meet the stacked experts [B, D, E]: the axis ``g`` [B, E] is unsqueezed at."""

    gate_axis: int  # 1: weighted sum over [B, 1, E]; 2: matmul with [B, E, 1]


WEIGHTED_SUM, MATMUL = MixtureForm(1), MixtureForm(2)


def mixture_patterns() -> Iterator[tuple[PatternExpr, MixtureForm]]:
    """``x + sum(experts * unsqueeze(g, 1), 2)`` or ``x + squeeze(matmul(experts, unsqueeze(g, 2)), 2)`` with
    ``g = softmax(linear(x, G), 1)``; the handler checks the axes and that ``experts`` stacks experts."""
    x, experts = KeywordArg("x"), KeywordArg("experts")
    gates = CallFunction(torch.softmax, CallFunction(LINEAR, x, KeywordArg("gate"), None), KeywordArg("gate_dim"),
                         None)
    column = CallFunction(torch.unsqueeze, gates, KeywordArg("gate_axis"))
    product = CallFunction(torch.matmul, experts, column)
    yield CallFunction(torch.add, x, CallFunction(torch.squeeze, product, KeywordArg("expert_dim"))), MATMUL
    for weighted in commuted(torch.mul, experts, column):
        yield CallFunction(torch.add, x, CallFunction(torch.sum, weighted, KeywordArg("expert_dim"), False)), WEIGHTED_SUM


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


def _handle_mixture(form: MixtureForm, match: Match, x: fx.Node, gate: fx.Node, experts: fx.Node, gate_dim: int,
                gate_axis: int, expert_dim: int) -> None:
    meta = _float_tensor(x, 2)
    if meta is None or not is_call(experts, torch.stack) or experts.args[1] != 2:
        return
    if gate_dim != 1 or gate_axis != form.gate_axis or expert_dim != 2:
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
    _replace(match, anchor, "recompile::cross_mixture", args, replaced, then=(operator.getitem, 0))


# --------------------------------------------------------------------------------------------------
# cross stacks: consecutive cross layers over one x0 -> one op


def _chains(graph: fx.Graph, layer: Any, same_form: Callable[[fx.Node, fx.Node], bool]) -> list[list[fx.Node]]:
    """Runs of ``layer`` nodes (args ``x0, x, ...``) where each one's output is only the next one's ``x``, all
    with the same ``x0`` and ``same_form`` as the first."""
    chains, seen = [], set()
    for node in graph.nodes:
        if node.target is not layer or node in seen:
            continue
        chain = [node]
        while True:
            last, nxt = chain[-1], only_user(chain[-1])
            if nxt is None or nxt.target is not layer or nxt.args[1] is not last or nxt.args[0] is not node.args[0]:
                break
            if not same_form(node, nxt):
                break
            chain.append(nxt)
        seen.update(chain)
        if len(chain) > 1:
            chains.append(chain)
    return chains


def _replace_chain(gm: fx.GraphModule, ctx: PassContext, chain: list[fx.Node], op: str, args: tuple,
                   output: int | None) -> None:
    """Replace ``chain`` by one ``op(*args)`` (its ``output``-th result for a tuple), whose region takes over the
    layers' regions."""
    last = chain[-1]
    impl = ctx.lower(op, *args)
    graph = gm.graph
    with graph.inserting_before(last):
        call = out = graph.call_function(getattr(torch.ops.recompile, op.split("::")[1]).default, (*args, impl.impl))
        if output is not None:
            out = graph.call_function(operator.getitem, (call, output))
    value = meta_value(last)
    fake_mode = getattr(value, "fake_mode", None)
    if fake_mode is not None and output is not None:  # Dynamo's graphs; the outputs are only needed by later passes
        with fake_mode:
            call.meta["example_value"] = call.target(*fx.node.map_arg(call.args, meta_value))
    out.meta["example_value"] = value
    last.replace_all_uses_with(out)
    regions = [n.meta[REGION] for n in chain]
    ctx.regions[:] = [r for r in ctx.regions if not any(r is q for q in regions)]
    ctx.record_region("interaction", [name for r in regions for name in r.replaced], op, impl)
    call.meta[REGION] = ctx.regions[-1]
    for node in reversed(chain):
        graph.erase_node(node)


def _same_bias_and_rank(a: fx.Node, b: fx.Node) -> bool:
    """Two cross_layer nodes both with or without a bias, both full or low rank."""
    return all((a.args[i] is None) == (b.args[i] is None) for i in (3, 4))


def _same_biases(a: fx.Node, b: fx.Node) -> bool:
    """Two vector_cross nodes both with or without biases."""
    return bool(a.args[3]) == bool(b.args[3])


def stack_cross_layers(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Replace each chain of DCN-v2 cross layers (one form: with or without bias, full or low rank) by one
    ``cross_stack``, and each chain of vector cross ops (all with or all without biases) by one ``vector_cross``
    over all their layers."""
    save = is_training(gm)
    for chain in _chains(gm.graph, torch.ops.recompile.cross_layer.default, _same_bias_and_rank):
        x0, x, _, bias, down, _ = chain[0].args
        args = (x0, x, [n.args[2] for n in chain], [] if bias is None else [n.args[3] for n in chain],
                [] if down is None else [n.args[4] for n in chain], save)
        _replace_chain(gm, ctx, chain, "recompile::cross_stack", args, output=0)
    for chain in _chains(gm.graph, torch.ops.recompile.vector_cross.default, _same_biases):
        args = (chain[0].args[0], chain[0].args[1], [w for n in chain for w in n.args[2]],
                [b for n in chain for b in n.args[3]])
        _replace_chain(gm, ctx, chain, "recompile::vector_cross", args, output=None)


def _registered(patterns: Iterator, handler: Callable) -> Iterator[tuple[PatternExpr, Callable]]:
    """(pattern, handler) for patterns alone or (pattern, form) pairs, whose handler takes the form first."""
    for item in patterns:
        if isinstance(item, tuple):
            yield item[0], functools.partial(handler, item[1])
        else:
            yield item, handler


@functools.cache
def matcher() -> PatternMatcherPass:
    """The pass's patterns, built once; handlers read the running pass's context from ``_CONTEXT``."""
    built = PatternMatcherPass(pass_name="recompile.interaction")
    tables = ((dot_patterns(), _handle_dot), (gathered_patterns(), _handle_gathered), (loop_patterns(), _handle_loop),
              (cross_patterns(), _handle_cross), (vector_cross_patterns(), _handle_vector_cross),
              (fm_patterns(), _handle_fm), (mixture_patterns(), _handle_mixture))
    for patterns, handler in tables:
        for pattern, handle in _registered(patterns, handler):
            register_graph_pattern(pattern, pass_dict=built)(handle)
    return built


def pattern_count() -> int:
    """How many patterns the pass matches (each is tried at the nodes whose target it starts with)."""
    return sum(len(entries) for entries in matcher().patterns.values())


@register_pass("interaction", order=40, regions={"interaction": "#b9eb9a"})
def interaction(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    token = _CONTEXT.set(ctx)
    try:
        matcher().apply(gm)
    finally:
        _CONTEXT.reset(token)
    stack_cross_layers(gm, ctx)
    eliminate_dead_code(gm)
    return gm
