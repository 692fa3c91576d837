"""normalize: one spelling per computation, so that every later pass states one pattern (built once).

Pattern -> replacement (each rule keyed by the call it rewrites, in ``RULES``; see docs/canonical_graph.md):

- spelling: ``x.name(*args)`` -> ``torch.name(x, *args)`` (``METHOD_FUNCTIONS``; sizes given as varargs become
  the one tuple); ``operator.add/sub/mul/truediv/matmul`` on tensors -> ``torch.add/...``; aliases
  (``torch.concat`` -> ``cat``, ``F.softmax`` -> ``torch.softmax``, ``F.relu`` -> ``torch.relu``, ``multiply``
  -> ``mul``, ``bmm`` -> ``matmul``, ``view`` -> ``reshape``, ``W.T`` / ``t(W)`` -> ``transpose(W, 0, 1)``,
  a two-axis ``permute`` -> ``transpose``).
- arguments bound to one signature (``torch.fx.operator_schemas.normalize_function``) for the calls in
  ``BOUND``: every positional parameter given positionally, defaults explicit, keyword-only ones only when not
  default; dims non-negative (the input's rank known); ``transpose``'s two dims in ascending order.
- commutative ``add`` / ``mul``: tensors before numbers, then the operand defined first.
- squares ``pow(x, 2)`` / ``square(x)`` -> ``mul(x, x)``; ``div(x, 2^k)`` -> ``mul(x, 2^-k)`` (exact).
- linear algebra, whatever holds the weight (module, raw Parameter, buffer, ParameterList item): ``x @ W``,
  ``matmul``, ``mm``, ``addmm(b, x, W)``, a linear ``einsum`` -> ``linear(x, transpose(W, 0, 1), b)`` with
  ``W`` [in, out] (``meta["weight_layout"] = "in_out"``), ``F.linear`` / ``nn.Linear`` calls stay
  ``linear(x, W, b)`` [out, in]; ``linear(x, W, None) + b`` (``b`` [out], the linear used once) -> ``linear(x, W, b)``.
  Dot products with a vector ``w`` [D] (DCN-v1's ``x_l . w_l``): ``x @ w``, ``tensordot(x, w, dims=([-1], [0]))``
  and ``sum(x * w, -1)`` -> ``squeeze(linear(x, transpose(unsqueeze(w, 1), 0, 1)), -1)`` (``keepdim``: without the
  squeeze, as ``matmul(x, w.unsqueeze(-1))`` becomes); ``tensordot`` with a matrix -> ``linear``, over a column
  batch [.., D, 1] -> its column form; ``unsqueeze(squeeze(a, d), d)`` -> ``a``; ``A @ B`` with ``A`` [.., N, 1]
  and ``B`` [.., 1, M] (an outer product) -> ``A * B``; ``transpose(op(transpose(a), c))`` for a pointwise ``op``
  of matrices -> ``op(a, c^T)`` (a vector ``c`` as ``unsqueeze(c, 1)``).
- column vectors (DCN written as ``W @ x_l`` over ``x_l`` [B, N, 1], TorchRec's cross nets, RecBole's DCNV2):
  ``matmul(W, X)`` with ``X`` [.., N, 1] -> ``unsqueeze(linear(squeeze(X, -1), W), -1)``; pointwise ops sink
  below a shared ``unsqueeze`` (``op(unsqueeze(a, d), c)`` -> ``unsqueeze(op(a, squeeze(c, d)), d)`` when ``c``
  is 1 along ``d``); ``squeeze(unsqueeze(a, d), d)`` -> ``a``; ``stack([a], d)`` -> ``unsqueeze(a, d)``;
  ``stack([linear(x, w_i) ...], 1)`` of [B, 1] outputs -> ``unsqueeze(linear(x, cat(w_i)), 2)`` (per-gate linears).
- upper-triangle pairs: ``D[:, rows, cols]`` (``triu_indices`` / ``tril_indices``, buffers or built in the graph,
  Python pair lists), ``D[:, mask]``, ``masked_select(D, mask)`` (a constant triangle mask),
  ``D.flatten(1)[:, idx]`` and ``gather(D.flatten(1), 1, idx)`` with precomputed pair positions, for ``D``
  [B, F, F] -> ``index_select(flatten(D, 1, 2), 1, pairs)`` (``flatten`` of it for ``masked_select``), with
  ``pairs`` a constant buffer of flat positions and ``meta["pairs"] = (F, upper, self_interaction)``; only when
  the selection is exactly one of the four triangle orders. ``E[:, idx]`` with a constant index and ``E``
  [B, F, D] -> ``index_select(E, 1, idx)`` (PNN's per-pair gathers).
The numbers do not change (each rewrite computes the same values; a bias fused into a linear, gates batched in
one linear and a batched gather differ at most by rounding order). Rules that need a shape read the example
values Dynamo recorded and leave a node without one alone.
"""
from __future__ import annotations

import inspect
import math
import operator
import re
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq
from torch.fx.operator_schemas import get_signature_for_torch_op, normalize_function

from recompile.passes.utils import (CONSTANT_FUNCTIONS, arg, classify_pairs, constant_value, is_call, meta_value,
                                    tensor_meta)
from recompile.pipeline import PassContext, register_pass

# Tensor methods whose torch function takes the tensor first and the same arguments after it.
METHOD_FUNCTIONS = {
    name: getattr(torch, name)
    for name in (
        "sum", "mean", "amax", "amin", "max", "min", "prod", "cumsum", "softmax", "log_softmax",
        "bmm", "matmul", "mm", "transpose", "permute", "reshape", "unsqueeze", "squeeze", "flatten",
        "index_select", "gather", "masked_fill", "sigmoid", "relu", "tanh", "exp", "log", "sqrt",
        "rsqrt", "clamp", "split", "chunk", "triu", "tril", "mul", "add", "sub", "div", "pow", "neg",
        "abs", "square", "repeat_interleave", "narrow", "select", "unbind", "masked_select",
        "logical_not", "eq", "ne", "lt", "le", "gt", "ge", "t",
    )
} | {"view": torch.reshape}

# Methods that accept sizes as separate arguments where their torch function takes one sequence.
SIZE_VARARG_METHODS = frozenset({"reshape", "permute", "view"})

OPERATOR_FUNCTIONS = {
    operator.add: torch.add,
    operator.sub: torch.sub,
    operator.mul: torch.mul,
    operator.truediv: torch.div,
    operator.matmul: torch.matmul,
    operator.pow: torch.pow,
}

# Other names of one function (the arguments line up; F.softmax's and F.relu's extra ones are checked below).
ALIASES = {
    torch.concat: torch.cat, torch.concatenate: torch.cat, torch.multiply: torch.mul, torch.subtract: torch.sub,
    torch.true_divide: torch.div, torch.bmm: torch.matmul, F.softmax: torch.softmax, F.relu: torch.relu,
    F.tanh: torch.tanh, F.sigmoid: torch.sigmoid,
}

# Calls whose arguments are bound to one signature.
BOUND = (torch.sum, torch.mean, torch.amax, torch.amin, torch.softmax, torch.log_softmax, torch.cat, torch.stack,
         torch.unsqueeze, torch.squeeze, torch.transpose, torch.flatten, torch.index_select, torch.gather,
         torch._C._nn.linear, torch.add, torch.mul, torch.sub, torch.div, torch.matmul, torch.masked_select)
FULL_REDUCTIONS = (torch.sum, torch.mean)
DIM_PARAMETERS = frozenset({"dim", "dim0", "dim1", "start_dim", "end_dim"})
COMMUTATIVE = (torch.add, torch.mul)
POINTWISE_BINARY = (torch.add, torch.sub, torch.mul, torch.div)
POINTWISE_UNARY = (torch.relu, torch.tanh, torch.sigmoid)
LINEAR = torch._C._nn.linear  # F.linear and nn.Linear calls, as Dynamo records them

MAX_SWEEPS = 4
Rule = Callable[[fx.Node], "fx.Node | None"]
RULES: dict[Any, list[Rule]] = {}
# Targets normalize may leave unused (it erases them): pure calls it rewrites or creates.
PURE = {*ALIASES.values(), *BOUND, *POINTWISE_UNARY, torch.reshape, torch.pow, torch.square, torch.mm, torch.addmm,
        torch.functional.einsum, torch.einsum, torch.functional.tensordot, torch.t, torch.permute, operator.getitem,
        getattr, *OPERATOR_FUNCTIONS, *CONSTANT_FUNCTIONS}


def rule(*targets: Any) -> Callable[[Rule], Rule]:
    """Register ``fn`` as a rewrite of calls to ``targets``: it returns the node that replaces the call, or None."""

    def register(fn: Rule) -> Rule:
        for target in dict.fromkeys(targets):
            RULES.setdefault(target, []).append(fn)
        return fn

    return register


# --------------------------------------------------------------------------------------------------
# building nodes


def _example(target: Any, args: tuple, kwargs: dict) -> Any:
    """The example value of ``target(*args, **kwargs)`` over the inputs' example values (fake tensors)."""
    values = fx.node.map_arg((args, kwargs), meta_value)
    fake_mode = _fake_mode(torch.utils._pytree.tree_leaves(values))
    if fake_mode is None:
        return None
    with fake_mode, torch.no_grad():
        return target(*values[0], **values[1])


def _fake_mode(values: list) -> FakeTensorMode | None:
    """The fake mode the graph's example values live in (not the ambient one: explain traces in its own)."""
    return next((v.fake_mode for v in values if isinstance(v, FakeTensor)), None)


def emit(before: fx.Node, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    """A call of ``target`` inserted before ``before``, with its example value, itself normalized."""
    graph = before.graph
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs)
    value = _example(target, args, kwargs)
    if value is not None:
        node.meta["example_value"] = value
    return _rewrite(node)


def _rewrite(node: fx.Node) -> fx.Node:
    """``node`` after every rule for its target has had its say (a rule's result is normalized already)."""
    _bind(node)
    for fn in RULES.get(node.target, ()) if node.op == "call_function" else ():
        try:
            new = fn(node)
        except Exception:  # the form cannot be built here (its nodes left unused are erased): keep the call
            continue
        if new is not None:
            new.meta.setdefault("example_value", meta_value(node))
            return new
    return node


def _constant(before: fx.Node, value: torch.Tensor, like: fx.Node) -> fx.Node:
    """A buffer of the graph module holding ``value`` on ``like``'s device, read by a ``get_attr`` node."""
    gm = before.graph.owning_module
    name = f"_recompile_constant_{sum(1 for n in gm.graph.nodes if n.op == 'get_attr')}"
    while hasattr(gm, name):
        name += "_"
    gm.register_buffer(name, value.to(tensor_meta(like).device), persistent=False)
    with before.graph.inserting_before(before):
        node = before.graph.get_attr(name)
    fake_mode = _fake_mode([tensor_meta(like)])
    if fake_mode is not None:
        node.meta["example_value"] = fake_mode.from_tensor(getattr(gm, name), static_shapes=True)
    return node


# --------------------------------------------------------------------------------------------------
# shapes


def _known(a: Any, b: Any) -> bool:
    """``a == b`` for sizes, decided without guarding on symbolic sizes."""
    return statically_known_true(sym_eq(a, b))


def _rank(node: Any) -> int | None:
    meta = tensor_meta(node)
    return None if meta is None else meta.dim()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --------------------------------------------------------------------------------------------------
# spelling and arguments


def _function_for(node: fx.Node) -> Any:
    if node.op == "call_method":
        if node.target == "view" and any(isinstance(a, torch.dtype) for a in node.args):
            return None  # a reinterpreting view
        return METHOD_FUNCTIONS.get(node.target)
    if node.op == "call_function" and node.target in OPERATOR_FUNCTIONS and any(
            tensor_meta(a) is not None for a in node.args[:2]):
        return OPERATOR_FUNCTIONS[node.target]
    return None


def _is_sequence(value: Any) -> bool:
    value = value.meta.get("example_value") if isinstance(value, fx.Node) else value
    return isinstance(value, (list, tuple))


def _function_args(node: fx.Node) -> tuple:
    self_arg, *rest = node.args
    if node.target in SIZE_VARARG_METHODS and not (len(rest) == 1 and _is_sequence(rest[0])):
        return (self_arg, tuple(rest))
    return node.args


def _respell(node: fx.Node) -> None:
    """Methods, operators and aliases -> the one torch function, in place."""
    fn = _function_for(node)
    if fn is not None:
        if node.op == "call_method":
            node.args = _function_args(node)
        node.op, node.target = "call_function", fn
    if node.op != "call_function" or node.target not in ALIASES:
        return
    args, kwargs = node.args, dict(node.kwargs)
    if node.target is F.softmax:  # F.softmax(input, dim, _stacklevel, dtype)
        dim, dtype = arg(node, 1, "dim"), arg(node, 3, "dtype")
        if dim is None:
            return  # the implicit dim of the deprecated form
        args, kwargs = (args[0], dim), {} if dtype is None else {"dtype": dtype}
    if node.target is F.relu:
        if arg(node, 1, "inplace", False):
            return  # an in-place relu keeps its spelling
        args, kwargs = args[:1], {}
    if node.target is torch.bmm and not all(_rank(a) == 3 for a in node.args):
        return
    node.target, node.args, node.kwargs = ALIASES[node.target], args, kwargs


def _arg_type(value: Any) -> type:
    value = meta_value(value) if isinstance(value, fx.Node) else value
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    if isinstance(value, torch.SymInt):
        return int
    return type(value)


# (target, argument types, keyword names and types) -> the signature the call binds to (None: ambiguous).
_SIGNATURES: dict[tuple, inspect.Signature | None] = {}


def _signature(node: fx.Node) -> inspect.Signature | None:
    """The one signature of ``node``'s target its arguments bind to, decided once per argument types."""
    arg_types = tuple(_arg_type(a) for a in node.args)
    kwarg_types = {k: _arg_type(v) for k, v in node.kwargs.items()}
    key = (node.target, arg_types, tuple(kwarg_types.items()))
    if key not in _SIGNATURES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # schemas with parametric types it cannot check
                pair = normalize_function(node.target, node.args, node.kwargs, arg_types, kwarg_types,
                                          normalize_to_only_use_kwargs=True)
        except Exception:  # an overload the schemas cannot tell apart: leave the call as written
            pair = None
        names = None if pair is None else list(pair.kwargs)
        signatures = (get_signature_for_torch_op(node.target) or ()) if names else ()
        _SIGNATURES[key] = next((sig for sig in signatures if list(sig.parameters) == names), None)
    return _SIGNATURES[key]


def _non_negative(name: str, value: Any, rank: int | None) -> Any:
    if name not in DIM_PARAMETERS or rank is None:
        return value
    if isinstance(value, int) and value < 0:
        return value + rank
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return type(value)(v + rank if v < 0 else v for v in value)
    return value


def _dim_rank(node: fx.Node, bound: dict) -> int | None:
    """The rank a ``dim`` argument of ``node`` counts in (the output's for ``unsqueeze`` and ``stack``)."""
    first = next(iter(bound.values()))
    rank = _rank(first[0]) if isinstance(first, (list, tuple)) and first else _rank(first)
    if rank is not None and node.target in (torch.unsqueeze, torch.stack):
        rank += 1
    return rank


def _bind(node: fx.Node) -> None:
    """Bind a ``BOUND`` call's arguments to its signature: positional parameters by position with defaults
    explicit, keyword-only ones only when not default, dims non-negative."""
    if node.op != "call_function" or node.target not in BOUND:
        return
    if node.target in COMMUTATIVE and len(node.args) == 2 and not node.kwargs and _swapped(*node.args):
        node.args = node.args[::-1]
    signature = _signature(node)
    if signature is None:
        return
    bound = signature.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    rank = _dim_rank(node, bound.arguments)
    args, kwargs = [], {}
    for name, parameter in signature.parameters.items():
        value = _non_negative(name, bound.arguments[name], rank)
        if parameter.kind is parameter.KEYWORD_ONLY:
            if value is not parameter.default and value != parameter.default:
                kwargs[name] = value
        else:
            args.append(value)
    if node.target in FULL_REDUCTIONS and len(args) == 1:
        kwargs.setdefault("dtype", None)  # bare, it also matches sum(List[int]): pattern matching is ambiguous
    if node.target is torch.transpose and isinstance(args[1], int) and isinstance(args[2], int):
        args[1:3] = sorted(args[1:3])
    node.args, node.kwargs = tuple(args), kwargs


def _swapped(a: Any, b: Any) -> bool:
    """Whether the commutative operands ``a, b`` are out of order (tensors first, then by definition)."""
    if isinstance(a, fx.Node) and isinstance(b, fx.Node):
        return b < a
    return not isinstance(a, fx.Node) and isinstance(b, fx.Node)


# --------------------------------------------------------------------------------------------------
# squares, halves, transposes


@rule(torch.pow)
def _square_of_pow(node: fx.Node) -> fx.Node | None:
    x, exponent = arg(node, 0, "input"), arg(node, 1, "exponent")
    if tensor_meta(x) is None or node.kwargs or exponent not in (2, 2.0) or isinstance(exponent, bool):
        return None
    return emit(node, torch.mul, x, x)


@rule(torch.square)
def _square(node: fx.Node) -> fx.Node | None:
    return emit(node, torch.mul, node.args[0], node.args[0]) if len(node.args) == 1 and not node.kwargs else None


@rule(torch.div)
def _exact_reciprocal(node: fx.Node) -> fx.Node | None:
    """``x / 2^k`` -> ``x * 2^-k``: the same number (a power of two's reciprocal is exact)."""
    if len(node.args) != 2 or node.kwargs or not _is_number(node.args[1]) or tensor_meta(node.args[0]) is None:
        return None
    divisor = float(node.args[1])
    if divisor == 0 or not math.isfinite(divisor) or math.frexp(abs(divisor))[0] != 0.5:
        return None
    return emit(node, torch.mul, node.args[0], 1.0 / divisor)


@rule(getattr)
def _matrix_transpose_attribute(node: fx.Node) -> fx.Node | None:
    if node.args[1] == "T" and _rank(node.args[0]) == 2:
        return emit(node, torch.transpose, node.args[0], 0, 1)
    return None


@rule(torch.t)
def _t(node: fx.Node) -> fx.Node | None:
    return emit(node, torch.transpose, node.args[0], 0, 1) if _rank(node.args[0]) == 2 else None


@rule(torch.permute)
def _swap_permute(node: fx.Node) -> fx.Node | None:
    """``permute`` that swaps two axes -> ``transpose``."""
    dims = arg(node, 1, "dims")
    rank = _rank(node.args[0])
    if rank is None or not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return None
    dims = [d % rank for d in dims]
    moved = [i for i, d in enumerate(dims) if i != d]
    if sorted(dims) != list(range(rank)) or len(moved) != 2:
        return None
    return emit(node, torch.transpose, node.args[0], *moved)


@rule(torch.transpose)
def _double_transpose(node: fx.Node) -> fx.Node | None:
    inner = node.args[0]
    if is_call(inner, torch.transpose) and inner.args[1:] == node.args[1:]:
        return inner.args[0]
    return None


def _transposed_operand(node: fx.Node, operand: Any) -> Any:
    """``operand`` of a pointwise op over a transposed [D, B] matrix, as it broadcasts against [B, D]."""
    if _is_number(operand) or _rank(operand) == 0:
        return operand
    if _rank(operand) == 1:
        return emit(node, torch.unsqueeze, operand, 1)
    return emit(node, torch.transpose, operand, 0, 1) if _rank(operand) == 2 else None


@rule(torch.transpose)
def _transpose_through_pointwise(node: fx.Node) -> fx.Node | None:
    """``transpose(op(transpose(a), c))`` of matrices -> ``op(a, c^T)`` (RecBole DCN's
    ``(x0.transpose(0, 1) * s).transpose(0, 1)`` is ``x0 * s.unsqueeze(1)``)."""
    inner = node.args[0]
    if node.args[1:] != (0, 1) or _rank(node) != 2 or not is_call(inner, *POINTWISE_BINARY):
        return None
    if len(inner.users) != 1 or inner.kwargs or len(inner.args) != 2:
        return None
    if not any(is_call(a, torch.transpose) and a.args[1:] == (0, 1) and _rank(a) == 2 for a in inner.args):
        return None
    operands = [_transposed_operand(node, a) for a in inner.args]
    return None if any(o is None for o in operands) else emit(node, inner.target, *operands)


# --------------------------------------------------------------------------------------------------
# linear algebra


def _linear(node: fx.Node, x: Any, weight: Any, bias: Any = None, in_out: bool = False) -> fx.Node:
    if in_out:
        weight = emit(node, torch.transpose, weight, 0, 1)
    out = emit(node, LINEAR, x, weight, bias)
    out.meta["weight_layout"] = "in_out" if in_out else "out_in"
    return out


def _dot(node: fx.Node, x: Any, w: Any) -> fx.Node:
    """``x . w`` over x's last axis for a vector ``w`` [D]: ``squeeze(linear(x, [w]), -1)``."""
    return emit(node, torch.squeeze, _linear(node, x, emit(node, torch.unsqueeze, w, 1), in_out=True), _rank(x) - 1)


@rule(torch.matmul)
def _matmul_with_matrix(node: fx.Node) -> fx.Node | None:
    """``x @ W`` -> ``linear(x, W^T)`` (``x @ w`` for a vector ``w`` -> ``x . w``); ``W @ X`` for a column batch
    ``X`` [.., N, 1] -> its column form; ``A @ B`` with ``A`` [.., N, 1] and ``B`` [.., 1, M] (an outer product,
    one product per element) -> ``A * B``."""
    a, b = node.args[:2]
    if _rank(b) == 2 and (_rank(a) or 0) >= 1:
        return _linear(node, a, b, in_out=True)
    if _rank(b) == 1 and (_rank(a) or 0) >= 2:
        return _dot(node, a, b)
    if _rank(a) == 2 and (_rank(b) or 0) >= 3 and _known(tensor_meta(b).shape[-1], 1):
        last = _rank(b) - 1
        column = emit(node, torch.squeeze, b, last)
        return emit(node, torch.unsqueeze, _linear(node, column, a), last)
    if (_rank(a) or 0) >= 2 and (_rank(b) or 0) >= 2 and _known(tensor_meta(a).shape[-1], 1) and _known(
            tensor_meta(b).shape[-2], 1):
        return emit(node, torch.mul, a, b)
    return None


def _contracted_axes(node: fx.Node) -> tuple[int, int] | None:
    """(axis of a, axis of b) of a ``tensordot(a, b, dims)`` over one axis pair, non-negative."""
    a, b = node.args[:2]
    dims = arg(node, 2, "dims", 2)
    ranks = _rank(a), _rank(b)
    if None in ranks:
        return None
    if dims == 1:
        return ranks[0] - 1, 0
    if not isinstance(dims, (list, tuple)) or len(dims) != 2:
        return None
    axes = [d if isinstance(d, int) else d[0] if isinstance(d, (list, tuple)) and len(d) == 1 else None for d in dims]
    if any(not isinstance(d, int) or isinstance(d, bool) for d in axes):
        return None
    return axes[0] % ranks[0], axes[1] % ranks[1]


@rule(torch.functional.tensordot)
def _tensordot(node: fx.Node) -> fx.Node | None:
    """``tensordot(x, W, dims=([k], [0]))`` with ``W`` [D] or [D, M] -> ``linear`` over x's last axis (k last),
    or its column form for a column batch ``x`` [.., D, 1] (k the one before; DCN-v1's ``x_l . w_l``)."""
    x, w = node.args[:2]
    axes = _contracted_axes(node)
    if axes is None or axes[1] != 0 or _rank(w) not in (1, 2) or len(node.args) + len(node.kwargs) != 3:
        return None
    rank = _rank(x)
    if axes[0] == rank - 1:
        return _dot(node, x, w) if _rank(w) == 1 else _linear(node, x, w, in_out=True)
    if axes[0] != rank - 2 or not _known(tensor_meta(x).shape[-1], 1):
        return None
    column = emit(node, torch.squeeze, x, rank - 1)
    if _rank(w) == 1:
        return _linear(node, column, emit(node, torch.unsqueeze, w, 1), in_out=True)
    one = _known(tensor_meta(w).shape[1], 1)  # [.., 1, 1]: the last axis, as the column form's other unsqueezes
    return emit(node, torch.unsqueeze, _linear(node, column, w, in_out=True), rank - 1 if one else rank - 2)


@rule(torch.mm)
def _mm(node: fx.Node) -> fx.Node | None:
    return _linear(node, node.args[0], node.args[1], in_out=True) if len(node.args) == 2 and not node.kwargs else None


@rule(torch.addmm)
def _addmm(node: fx.Node) -> fx.Node | None:
    bias, x, weight = node.args[:3]
    if len(node.args) != 3 or any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")) or _rank(bias) != 1:
        return None
    return _linear(node, x, weight, bias, in_out=True)


def _linear_einsum(equation: str) -> bool | None:
    """For ``x, W``: True when ``equation`` is ``...i,ij->...j`` (W [in, out]), False for ``...i,ji->...j``."""
    match = re.fullmatch(r"((?:\.\.\.)?[a-z]*)([a-z]),([a-z])([a-z])->((?:\.\.\.)?[a-z]*)([a-z])", equation)
    if match is None:
        return None
    batch, k, w0, w1, out_batch, n = match.groups()
    if batch != out_batch or len({k, n}) != 2 or {k, n} & set(batch) or {w0, w1} != {k, n}:
        return None
    return w0 == k


@rule(torch.functional.einsum, torch.einsum)
def _einsum(node: fx.Node) -> fx.Node | None:
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or len(operands) != 2 or node.kwargs or _rank(operands[1]) != 2:
        return None
    in_out = _linear_einsum(equation.replace(" ", ""))
    return None if in_out is None else _linear(node, operands[0], operands[1], in_out=in_out)


@rule(torch.sum)
def _weighted_sum(node: fx.Node) -> fx.Node | None:
    """``sum(x * w, -1, keepdim)`` for a vector ``w`` [D] -> ``linear(x, [w])`` (``x . w``, squeezed unless
    keepdim)."""
    product, dims, keepdim, *rest = node.args + (None,) * 3
    dim = dims[0] if isinstance(dims, (list, tuple)) and len(dims) == 1 else dims
    if not is_call(product, torch.mul) or len(product.users) != 1 or rest[0] is not None or node.kwargs:
        return None
    if dim != (_rank(product) or 0) - 1 or not isinstance(keepdim, bool):
        return None
    for x, w in (product.args, reversed(product.args)):
        xm, wm = tensor_meta(x), tensor_meta(w)
        if xm is not None and wm is not None and xm.dim() >= 2 and wm.dim() == 1 and _known(
                wm.shape[0], xm.shape[-1]) and xm.dim() == _rank(product) and wm.dtype == xm.dtype:
            return _linear(node, x, emit(node, torch.unsqueeze, w, 1), in_out=True) if keepdim else _dot(node, x, w)
    return None


@rule(torch.add)
def _bias_into_linear(node: fx.Node) -> fx.Node | None:
    """``linear(x, W, None) + b`` (``b`` [out]) -> ``linear(x, W, b)``."""
    if len(node.args) != 2 or node.kwargs:
        return None
    for lin, bias in (node.args, reversed(node.args)):
        if not is_call(lin, LINEAR) or len(lin.users) != 1 or lin.args[2] is not None:
            continue
        out, b = tensor_meta(lin), tensor_meta(bias)
        if b is not None and b.dim() == 1 and b.dtype == out.dtype and _known(b.shape[0], out.shape[-1]):
            return _linear(node, lin.args[0], lin.args[1], bias)
    return None


# --------------------------------------------------------------------------------------------------
# column vectors: unsqueeze sinks below pointwise ops


def _axis_in(operand: Any, dim: int, rank: int) -> int | None:
    """Which axis of a pointwise ``operand`` lines up with axis ``dim`` of the rank-``rank`` output: -1 when it
    does not reach it (or is a number), None when it is not 1 there (the axis cannot be dropped)."""
    if _is_number(operand):
        return -1
    meta = tensor_meta(operand)
    if meta is None or meta.dim() > rank:
        return None
    own = dim - (rank - meta.dim())
    return -1 if own < 0 else own if _known(meta.shape[own], 1) else None


@rule(*POINTWISE_BINARY)
def _sink_unsqueeze_binary(node: fx.Node) -> fx.Node | None:
    """``op(unsqueeze(a, d), c)`` -> ``unsqueeze(op(a, c'), d)`` with ``c'`` = ``c`` without axis ``d``."""
    out = tensor_meta(node)
    if len(node.args) != 2 or node.kwargs or out is None:
        return None
    dims = {a.args[1] for a in node.args if is_call(a, torch.unsqueeze) and _rank(a) == out.dim()}
    if len(dims) != 1:
        return None
    dim = dims.pop()
    axes = [_axis_in(a, dim, out.dim()) for a in node.args]
    if not isinstance(dim, int) or not _known(out.shape[dim], 1) or None in axes:
        return None
    operands = [a if axis < 0 else emit(node, torch.squeeze, a, axis) for a, axis in zip(node.args, axes)]
    return emit(node, torch.unsqueeze, emit(node, node.target, *operands), dim)


@rule(*POINTWISE_UNARY)
def _sink_unsqueeze_unary(node: fx.Node) -> fx.Node | None:
    x = node.args[0]
    if len(node.args) != 1 or node.kwargs or not is_call(x, torch.unsqueeze):
        return None
    return emit(node, torch.unsqueeze, emit(node, node.target, x.args[0]), x.args[1])


@rule(torch.softmax)
def _sink_unsqueeze_softmax(node: fx.Node) -> fx.Node | None:
    x, dim, *dtype = node.args
    if dtype != [None] or node.kwargs or not is_call(x, torch.unsqueeze) or not isinstance(dim, int):
        return None
    axis = x.args[1]
    if dim == axis:
        return None
    return emit(node, torch.unsqueeze, emit(node, torch.softmax, x.args[0], dim - (dim > axis)), axis)


@rule(torch.unsqueeze)
def _unsqueeze_of_squeeze(node: fx.Node) -> fx.Node | None:
    """``unsqueeze(squeeze(a, d), d)`` -> ``a`` (``a`` is 1 along ``d``)."""
    x = node.args[0]
    if len(node.args) == 2 and is_call(x, torch.squeeze) and len(x.args) == 2 and x.args[1] == node.args[1]:
        return x.args[0] if _rank(x.args[0]) == _rank(node) else None
    return None


@rule(torch.squeeze)
def _squeeze_of_unsqueeze(node: fx.Node) -> fx.Node | None:
    x = node.args[0]
    if len(node.args) == 2 and is_call(x, torch.unsqueeze) and x.args[1] == node.args[1]:
        return x.args[0]
    return None


@rule(torch.stack)
def _stack(node: fx.Node) -> fx.Node | None:
    """``stack([a], d)`` -> ``unsqueeze(a, d)``; ``stack([linear(x, w_i, b_i) ...], 1)`` of [B, 1] outputs (one
    linear per gate) -> ``unsqueeze(linear(x, cat(w_i), cat(b_i)), 2)``."""
    tensors, dim = node.args[:2]
    if not isinstance(tensors, (list, tuple)) or not tensors:
        return None
    if len(tensors) == 1:
        return emit(node, torch.unsqueeze, tensors[0], dim)
    if dim != 1 or not all(is_call(t, LINEAR) and _rank(t) == 2 and t.args[0] is tensors[0].args[0] for t in tensors):
        return None
    if not all(_known(tensor_meta(t).shape[1], 1) for t in tensors):
        return None
    biases = [t.args[2] for t in tensors]
    if len({b is None for b in biases}) != 1:
        return None
    weight = emit(node, torch.cat, [t.args[1] for t in tensors], 0)
    bias = None if biases[0] is None else emit(node, torch.cat, biases, 0)
    return emit(node, torch.unsqueeze, _linear(node, tensors[0].args[0], weight, bias), 2)


# --------------------------------------------------------------------------------------------------
# upper-triangle pairs


def _pairs(node: fx.Node, dots: Any, flat: torch.Tensor | None) -> fx.Node | None:
    """``index_select(flatten(dots, 1, 2), 1, flat)`` when ``flat`` (positions in [F, F]) is one of the four
    triangle orders of the [B, F, F] ``dots``, else None."""
    meta = tensor_meta(dots)
    if flat is None or meta is None or meta.dim() != 3 or not isinstance(meta.shape[1], int):
        return None
    num_features = meta.shape[1]
    if not _known(meta.shape[2], num_features):
        return None
    order = classify_pairs(num_features, flat)
    if order is None:
        return None
    index = _constant(node, flat.to(torch.int64), dots)
    out = emit(node, torch.index_select, emit(node, torch.flatten, dots, 1, 2), 1, index)
    out.meta["pairs"] = (num_features, *order)
    return out


def _flattened(node: Any) -> fx.Node | None:
    """``D`` when ``node`` is ``D`` [B, F, F] with its last two axes merged (``flatten(D, 1, 2)`` or a reshape)."""
    if is_call(node, torch.flatten) and node.args[1:] == (1, 2):
        return node.args[0]
    if is_call(node, torch.reshape) and _rank(node.args[0]) == 3 and _rank(node) == 2:
        dots, out = tensor_meta(node.args[0]), tensor_meta(node)
        if _known(out.shape[0], dots.shape[0]):
            return node.args[0]
    return None


def _index_positions(index: Any, gm: fx.GraphModule, size: Any) -> torch.Tensor | None:
    """A constant 1-D integer index into an axis of ``size`` as non-negative positions, else None."""
    value = constant_value(index, gm)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        value = torch.tensor(value, dtype=torch.int64)
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.is_floating_point() or not isinstance(size, int):
        return None
    if value.dtype == torch.bool:
        return value.nonzero().flatten() if value.numel() == size else None
    if bool(((value < -size) | (value >= size)).any()):
        return None  # out of range: eager raises, and so must the compiled graph
    return value.long() % size


def _mask_positions(mask: Any, gm: fx.GraphModule, num_features: Any) -> torch.Tensor | None:
    value = constant_value(mask, gm)
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool or value.shape != (num_features,) * 2:
        return None
    return value.flatten().nonzero().flatten()


@rule(operator.getitem)
def _constant_selection(node: fx.Node) -> fx.Node | None:
    """``D[:, rows, cols]``, ``D[:, mask]``, ``D.flatten(1)[:, idx]`` -> the pairs form; ``E[:, idx]`` ->
    ``index_select(E, 1, idx)``."""
    x, index = node.args
    meta = tensor_meta(x)
    if meta is None or not isinstance(index, tuple) or len(index) not in (2, 3) or index[0] != slice(None):
        return None
    gm = node.graph.owning_module
    if meta.dim() == 3 and len(index) == 3:
        rows, cols = (_index_positions(i, gm, meta.shape[1]) for i in index[1:])
        if rows is None or cols is None or rows.shape != cols.shape:
            return None
        return _pairs(node, x, rows * meta.shape[1] + cols)
    if meta.dim() == 3:
        mask = _mask_positions(index[1], gm, meta.shape[1])
        if mask is not None:
            return _pairs(node, x, mask)
        positions = _index_positions(index[1], gm, meta.shape[1])
        if positions is None or not meta.is_floating_point():
            return None
        return emit(node, torch.index_select, x, 1, _constant(node, positions, x))
    if meta.dim() == 2 and _flattened(x) is not None:
        return _pairs(node, _flattened(x), _index_positions(index[1], gm, meta.shape[1]))
    return None


@rule(torch.masked_select)
def _masked_pairs(node: fx.Node) -> fx.Node | None:
    dots, mask = node.args[:2]
    meta = tensor_meta(dots)
    if meta is None or meta.dim() != 3:
        return None
    pairs = _pairs(node, dots, _mask_positions(mask, node.graph.owning_module, meta.shape[1]))
    return None if pairs is None else emit(node, torch.flatten, pairs, 0, 1)


@rule(torch.gather)
def _gathered_pairs(node: fx.Node) -> fx.Node | None:
    """``gather(D.flatten(1), 1, idx.expand(B, P))`` with ``idx`` constant pair positions -> the pairs form."""
    flat, dim, index = node.args[:3]
    if dim != 1 or _flattened(flat) is None or node.kwargs:
        return None
    while isinstance(index, fx.Node) and index.op == "call_method" and index.target == "expand":
        index = index.args[0]
    value = constant_value(index, node.graph.owning_module)
    if not isinstance(value, torch.Tensor) or value.dim() not in (1, 2) or (value.dim() == 2 and value.shape[0] != 1):
        return None
    return _pairs(node, _flattened(flat), _index_positions(value.flatten(), None, tensor_meta(flat).shape[1]))


@rule(torch.index_select)
def _selected_pairs(node: fx.Node) -> fx.Node | None:
    """``index_select(D.flatten(1), 1, idx)`` written by the user -> the pairs form (records the order)."""
    flat, dim, index = node.args[:3]
    if "pairs" in node.meta or dim != 1 or _flattened(flat) is None:
        return None
    if isinstance(index, fx.Node) and index.op == "get_attr" and index.target.startswith("_recompile_constant"):
        return None  # made here: _pairs records its order
    positions = _index_positions(index, node.graph.owning_module, tensor_meta(flat).shape[1])
    return _pairs(node, _flattened(flat), positions)


# --------------------------------------------------------------------------------------------------
# the pass


def _erase_unused(nodes: list[fx.Node]) -> None:
    """Erase the nodes normalize made unused (only pure calls it knows), last first, until none is left."""
    for node in reversed(nodes):
        if not node._erased and not node.users and node.op == "call_function" and node.target in PURE:
            node.graph.erase_node(node)


def _sweep(gm: fx.GraphModule) -> int:
    """Normalize every call once, in graph order (a node's inputs first); the number of calls replaced."""
    replaced = 0
    for node in list(gm.graph.nodes):
        if node._erased or node.op not in ("call_function", "call_method"):
            continue
        _respell(node)
        new = _rewrite(node)
        if new is not node:
            node.replace_all_uses_with(new)
            replaced += 1
    _erase_unused(list(gm.graph.nodes))
    return replaced


@register_pass("normalize", order=0)
def normalize(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    # Again while something changed: a rewrite can enable one upstream (a bias add whose linear had a second,
    # now erased, user).
    for _ in range(MAX_SWEEPS):
        if not _sweep(gm):
            break
    return gm
