"""Recognising attention over padded sequences, for the ``jagged`` pass.

An attention core on head-first padded ``q, k, v [B, H, N, D]`` is one of

- HSTU: ``matmul(mask * silu(matmul(q, k^T) * alpha [+ rel_bias]) / N, v)``, the mask applied by
  ``*`` or ``torch.where(mask, x, 0)``, scales and mask after the SiLU in any order;
- softmax: ``matmul(softmax(masked_fill(matmul(q, k^T) * scale, ~mask, -inf), -1), v)`` (or
  ``torch.where(mask, x, -inf)``), or ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask | is_causal)``.

The mask and the bias are proven, not guessed: they depend only on ``arange``s, constants and the
region's lengths/offsets, so their subgraph is evaluated for every sequence length ``0..N`` and
compared with the jagged op's semantics on the rows that are not padding (a padded key must never be
attended to, since padded keys hold whatever the per-position ops made of the padding).
"""
from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from recompile.passes.utils import arg, calls, is_call, meta_value, tensor_meta
from recompile.runtime.jagged_attention import TIME_BUCKET_BASE, relative_time_index


class Unproven(Exception):
    """The region cannot be shown equivalent to a jagged op; the message says why."""


# ---------------------------------------------------------------------------------------------
# Evaluating the data-independent cone of a mask or bias

# Calls a mask or bias subgraph may contain: index arithmetic, compares, logic, views.
CONE_FUNCTIONS = {
    torch.arange, torch.ones, torch.zeros, torch.eye, torch.tril, torch.triu, torch.where,
    torch.add, torch.sub, torch.mul, torch.neg, torch.clamp, torch.minimum, torch.maximum, torch.abs,
    torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge, torch.logical_and, torch.logical_or,
    torch.logical_not, torch.bitwise_and, torch.bitwise_or, torch.bitwise_not, torch.unsqueeze, torch.reshape,
    torch.transpose, torch.squeeze, torch.diff, torch.ops.aten.sym_size.int, torch.searchsorted,
    torch.repeat_interleave, torch.cumsum, torch.log, torch.div, torch._C._nn.pad,
    torch.ops.recompile.complete_cumsum.default, operator.truediv, operator.floordiv, torch.zeros_like,
    torch.full, torch.masked_fill, torch.nonzero, torch.masked_select, torch.bucketize,
    operator.add, operator.sub, operator.mul, operator.neg, operator.eq, operator.ne, operator.lt, operator.le,
    operator.gt, operator.ge, operator.and_, operator.or_, operator.invert, operator.getitem,
}
CONE_METHODS = {
    "view", "reshape", "unsqueeze", "squeeze", "expand", "transpose", "t", "to", "bool", "long", "int", "float",
    "double",
    "logical_not", "logical_and", "logical_or", "size", "tril", "triu", "eq", "ne", "lt", "le", "gt", "ge",
    "__getitem__", "clamp", "flip", "contiguous", "masked_fill", "masked_fill_", "nonzero", "masked_select",
    "expand_as",
}
# Cone calls that read only the size of their tensor operand.
SIZE_READS = {torch.ops.aten.sym_size.int, "size"}


def buffer_value(node: fx.Node) -> torch.Tensor | None:
    """The tensor a module buffer placeholder holds (Dynamo keeps the real tensor), read as a constant the way
    ``passes.utils.constant_value`` reads index buffers; None for inputs, parameters and anything else."""
    grapharg = node.meta.get("grapharg") if node.op == "placeholder" else None
    example = getattr(grapharg, "example", None)
    source = getattr(getattr(grapharg, "source", None), "name", "")
    if "._buffers[" not in source or not isinstance(example, torch.Tensor):
        return None
    return None if example.requires_grad else example


def is_cone_call(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in CONE_FUNCTIONS
    return node.op == "call_method" and node.target in CONE_METHODS


def cone_leaves(nodes: list[fx.Node]) -> set[fx.Node]:
    """The tensors the cone of ``nodes`` reads other than through cone calls (sizes read aside)."""
    leaves, seen, stack = set(), set(), list(nodes)
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if not is_cone_call(x):
            if tensor_meta(x) is not None:
                leaves.add(x)
        elif x.target not in SIZE_READS:
            stack.extend(x.all_input_nodes)
    return leaves


def evaluate_cone(node: Any, leaves: dict[fx.Node, Any]) -> Any:
    """The value of ``node`` computed from ``leaves`` (nodes bound to concrete values) through cone ops only."""
    memo: dict[fx.Node, Any] = dict(leaves)

    def ev(x: Any) -> Any:
        if isinstance(x, (list, tuple)):
            return type(x)(ev(y) for y in x)
        if isinstance(x, dict):
            return {k: ev(v) for k, v in x.items()}
        if not isinstance(x, fx.Node):
            return x
        if x in memo:
            return memo[x]
        if x.op == "placeholder" and isinstance(meta_value(x), torch.SymInt):
            return size_hint(meta_value(x))  # a traced size (the batch): probes use its traced value
        if (buffer := buffer_value(x)) is not None:
            return buffer  # a module buffer (a causal mask made once): its value is the proof's constant
        if x.op == "call_function" and (is_cone_call(x) or _moved_from(x) is not None):
            fn: Callable = x.target
        elif is_cone_call(x) or _moved_from(x) is not None:
            def fn(self, *a, _name=x.target, **k):
                return getattr(self, _name)(*a, **k)
        else:
            raise Unproven(f"{x.name} ({x.target}) is not index arithmetic over arange and the lengths")
        memo[x] = fn(*ev(x.args), **ev(dict(x.kwargs)))
        return memo[x]

    return ev(node)


def size_hint(size: Any) -> int:
    if isinstance(size, torch.SymInt):
        return size.node.hint
    return int(size)


def same_sizes(a: Any, b: Any) -> bool:
    """Sizes equal by construction (the same symbol or the same int), without adding guards."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.SymInt) or isinstance(y, torch.SymInt):
            if not (isinstance(x, torch.SymInt) and isinstance(y, torch.SymInt) and x.node.expr == y.node.expr):
                return False
        elif x != y:
            return False
    return True


@dataclass(frozen=True)
class Lengths:
    """How a region's mask may read the sequence lengths: the lengths node and/or the offsets node."""

    lengths: fx.Node | None
    offsets: fx.Node
    batch: int  # the batch size the graph was traced with
    sizes: tuple[int, ...] | None = None  # the lengths, where the graph was specialised to them

    def probes(self, n: int):
        """Batches of lengths that together cover every length ``0..n``, as cone leaves (the lengths
        themselves where the graph is specialised to them)."""
        if self.sizes is not None:
            yield torch.tensor(self.sizes), {}
            return
        for start in range(0, n + 1, self.batch):
            lengths = (torch.arange(self.batch) + start).clamp(max=n)
            leaves = {self.offsets: F.pad(torch.cumsum(lengths, 0), (1, 0))}
            if self.lengths is not None:
                leaves[self.lengths] = lengths
            yield lengths, leaves


def _mask_verdict(keep: torch.Tensor, lens: torch.Tensor, n: int) -> bool:
    """True if ``keep [B, n, n]`` is causal over valid keys on the valid rows, False if keys-only."""
    pos = torch.arange(n)
    rows = pos.view(1, n, 1) < lens.view(-1, 1, 1)
    valid_keys = (pos.view(1, 1, n) < lens.view(-1, 1, 1)) & rows
    if torch.equal(keep & rows, valid_keys & (pos.view(1, n, 1) >= pos.view(1, 1, n))):
        return True
    if torch.equal(keep & rows, valid_keys):
        return False
    raise Unproven("the attention mask is neither causal over the sequence nor the sequence's keys "
                   "(a padded key would be attended to, or a valid one dropped)")


def keep_of(mask: Any, keep_if_true: bool = True, additive: bool = False) -> torch.Tensor:
    """The attended positions of an evaluated mask: bool (True = attend if ``keep_if_true``), float
    multiplied in (0 or 1), or float added to the scores (``additive``: 0 or -inf)."""
    mask = torch.as_tensor(mask)
    if not mask.is_floating_point():
        return mask.bool() if keep_if_true else ~mask.bool()
    if additive:
        if not ((mask == 0) | (mask == -math.inf)).all():
            raise Unproven("the float attention mask adds values other than 0 and -inf to the scores")
        return mask == 0
    if not ((mask == 0) | (mask == 1)).all():
        raise Unproven("the float attention mask weights positions by values other than 0 and 1")
    return mask == 1


def prove_keep(keep: Callable[[dict], torch.Tensor], lengths: Lengths, n: int) -> bool:
    """Whether the attended positions ``keep(leaves)`` (``[B or 1, (1,) N, N]``) are causal; raises Unproven
    if they are neither causal over the sequence's keys nor exactly its keys, on the rows that are not padding."""
    verdicts = set()
    for lens, leaves in lengths.probes(n):
        attended = keep(leaves)
        if attended.dim() == 4:
            if attended.shape[1] != 1:
                raise Unproven("the attention mask differs across heads")
            attended = attended[:, 0]
        verdicts.add(_mask_verdict(attended.expand(lengths.batch, n, n), lens, n))
    if len(verdicts) != 1:
        raise Unproven("the attention mask changes form with the sequence length")
    return verdicts.pop()


def prove_mask(mask: fx.Node, keep_if_true: bool, lengths: Lengths, n: int) -> bool:
    """``prove_keep`` of one mask node (True = attend if ``keep_if_true``, or a 0/1 float factor)."""
    return prove_keep(lambda leaves: keep_of(evaluate_cone(mask, leaves), keep_if_true), lengths, n)


@dataclass
class MHAMatch:
    """``F.multi_head_attention_forward`` (what ``nn.MultiheadAttention`` runs) in self-attention over
    ``x [N, B, E]`` with the packed in-projection."""

    x: fx.Node
    num_heads: int
    in_weight: fx.Node
    in_bias: Any
    out_weight: fx.Node
    out_bias: Any
    key_padding_mask: Any
    attn_mask: Any


MHA_PARAMETERS = tuple(inspect.signature(F.multi_head_attention_forward).parameters)


def _mha_argument(node: fx.Node, name: str) -> Any:
    return arg(node, MHA_PARAMETERS.index(name), name)


def _mha_arguments(node: fx.Node) -> dict[str, Any]:
    """``F.multi_head_attention_forward``'s arguments by name, where it is a self-attention of one packed
    in-projection whose attention weights (output 1) are unused; else Unproven."""
    a = {name: _mha_argument(node, name) for name in MHA_PARAMETERS}
    if not (a["query"] is a["key"] is a["value"]):
        raise Unproven(f"{node.name}: multi-head attention with other keys or values than its queries")
    unsupported = {
        "bias_k": a["bias_k"] is not None, "add_zero_attn": bool(a["add_zero_attn"]),
        "use_separate_proj_weight": bool(a["use_separate_proj_weight"]),
        "static_k/static_v": a["static_k"] is not None or a["static_v"] is not None,
        "dropout in training": bool(a["training"]) and scalar(a["dropout_p"]) != 0.0,
        "need_weights (the weights are used)": a["need_weights"] is not False
        and any(u.users and not (is_call(u, operator.getitem) and u.args[1] == 0) for u in node.users),
    }
    if any(unsupported.values()):
        raise Unproven(f"{node.name}: multi-head attention with {', '.join(k for k, v in unsupported.items() if v)}")
    return a


def _mha_match(a: dict[str, Any]) -> MHAMatch:
    return MHAMatch(a["query"], a["num_heads"], a["in_proj_weight"], a["in_proj_bias"], a["out_proj_weight"],
                    a["out_proj_bias"], a["key_padding_mask"], a["attn_mask"])


def match_mha(node: fx.Node) -> MHAMatch:
    a = _mha_arguments(node)
    if a["key_padding_mask"] is None and a["attn_mask"] is None:
        raise Unproven(f"{node.name}: no mask, so padded keys are attended to")
    return _mha_match(a)


def has_mha_mask(node: fx.Node) -> bool:
    return _mha_argument(node, "key_padding_mask") is not None or _mha_argument(node, "attn_mask") is not None


def match_dense_mha(node: fx.Node) -> MHAMatch:
    """``nn.MultiheadAttention`` self-attention with no mask over a batched ``x [N, B, E]`` of a fixed N:
    every one of the N rows (a CTR model's fields) attends to all N."""
    a = _mha_arguments(node)
    if has_mha_mask(node) or bool(a["is_causal"]):
        raise Unproven(f"{node.name}: a masked multi-head attention")
    meta = tensor_meta(a["query"])
    if meta is None or meta.dim() != 3 or isinstance(meta.shape[0], torch.SymInt):
        raise Unproven(f"{node.name}: the queries are not a batched [N, B, E] of a fixed N")
    return _mha_match(a)


def prove_mha_mask(match: MHAMatch, lengths: Lengths, n: int) -> bool:
    """Whether the keys ``nn.MultiheadAttention`` attends to (not in ``key_padding_mask [B, N]``, not in
    ``attn_mask [N, N]``: True or -inf = ignored) are causal (True) or the sequence's keys (False)."""

    def keep(leaves):
        attended = torch.ones(1, n, n, dtype=torch.bool)
        if match.key_padding_mask is not None:
            keys = keep_of(evaluate_cone(match.key_padding_mask, leaves), keep_if_true=False, additive=True)
            attended = attended & keys.view(-1, 1, n)
        if match.attn_mask is not None:
            pairs = keep_of(evaluate_cone(match.attn_mask, leaves), keep_if_true=False, additive=True)
            if pairs.dim() != 2:
                raise Unproven("a per-head (3-D) attn_mask")
            attended = attended & pairs
        return attended

    return prove_keep(keep, lengths, n)


# Calls that only move entries: each output entry is a fixed entry of the one tensor operand, or the padding
# constant, whatever the values (the other arguments are sizes, dims, slices, pads).
MOVE_FUNCTIONS = {torch._C._nn.pad, F.pad, torch.reshape, torch.unsqueeze, torch.squeeze, torch.transpose,
                  torch.flatten, operator.getitem}
MOVE_METHODS = {"repeat", "view", "reshape", "unsqueeze", "squeeze", "transpose", "expand", "contiguous", "flatten",
                "__getitem__"}


def _moved_from(node: Any) -> fx.Node | None:
    """The one tensor ``node`` moves entries of (a move call whose other arguments hold no tensor), else None."""
    moves = (node.op == "call_function" and node.target in MOVE_FUNCTIONS) or (
        node.op == "call_method" and node.target in MOVE_METHODS)
    if not moves or not isinstance(node.args[0], fx.Node):
        return None
    if is_call(node, torch._C._nn.pad, F.pad) and arg(node, 2, "mode", "constant") != "constant":
        return None
    others: list[fx.Node] = []
    fx.node.map_arg((node.args[1:], node.kwargs), others.append)
    return None if others else node.args[0]


def _table_of_moves(bias: fx.Node, n: int) -> fx.Node:
    """``w`` when ``bias`` is ``w [2N - 1]`` moved into ``w[N - 1 + j - i]`` by copies only (generative-
    recommenders writes ``F.pad(w, [0, n]).repeat(n)[:-n].reshape(1, n, 3n - 2)[..., r:-r]``). Moves copy an
    entry or a constant independently of the values, so two probes, distinct and of opposite signs, that both
    come out as ``probe[N - 1 + j - i]`` prove it for every ``w``."""
    chain, table = [], bias
    while (source := _moved_from(table)) is not None:
        chain.append(table)
        table = source
    meta = tensor_meta(table)
    if not chain or meta is None or meta.dim() != 1 or size_hint(meta.shape[0]) != 2 * n - 1:
        raise Unproven(f"the additive score bias {bias.name} is not a table of 2 * N - 1 = {2 * n - 1} relative "
                       "positions, indexed or moved into place")
    pos = torch.arange(n)
    index = n - 1 + pos.view(1, n) - pos.view(n, 1)
    for probe in (torch.arange(1.0, 2 * n), -0.5 * torch.arange(1.0, 2 * n)):
        got = torch.as_tensor(evaluate_cone(bias, {table: probe}))
        if got.numel() != n * n or got.shape[-2:] != (n, n) or not torch.equal(got.reshape(n, n), probe[index]):
            raise Unproven(f"{bias.name} does not move {table.name} into {table.name}[N - 1 + j - i]")
    return table


def prove_relative_bias(bias: fx.Node, n: int) -> fx.Node:
    """``w`` when ``bias`` is ``w[n - 1 + j - i]`` over an ``[n, n]`` grid (HSTU's relative position bias): read at
    an index tensor, or moved into place (``_table_of_moves``)."""
    if not is_call(bias, operator.getitem) or not isinstance(bias.args[1], fx.Node):
        return _table_of_moves(bias, n)
    table, index = bias.args
    meta = tensor_meta(table)
    if meta is None or meta.dim() != 1 or size_hint(meta.shape[0]) != 2 * n - 1:
        raise Unproven(f"the relative position table {table.name} does not have 2 * N - 1 = {2 * n - 1} entries")
    got = torch.as_tensor(evaluate_cone(index, {}))
    pos = torch.arange(n)
    if got.shape[-2:] != (n, n) or not torch.equal(got.reshape(n, n), n - 1 + pos.view(1, n) - pos.view(n, 1)):
        raise Unproven(f"the index of {table.name} is not N - 1 + j - i")
    return table


@dataclass
class ScoreBias:
    """The additive score bias of HSTU: a relative position table and/or a relative time table read at the
    padded ``timestamps [B, N]`` (a padded node of the region)."""

    rel_bias: fx.Node | None = None
    time_bias: fx.Node | None = None
    timestamps: fx.Node | None = None


def _terms(x: fx.Node) -> list[fx.Node]:
    if is_call(x, torch.add, operator.add) and len(x.args) == 2 and all(isinstance(a, fx.Node) for a in x.args):
        return _terms(x.args[0]) + _terms(x.args[1])
    return [x]


def _padded_leaves(node: fx.Node, is_padded: Callable[[fx.Node], bool]) -> set[fx.Node]:
    """The padded nodes ``node`` is computed from (the nearest ones on each path)."""
    found, seen, stack = set(), set(), [node]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if is_padded(x):
            found.add(x)
        else:
            stack.extend(x.all_input_nodes)
    return found


def prove_bias(bias: fx.Node, n: int, is_padded: Callable[[fx.Node], bool]) -> ScoreBias:
    """The tables of ``bias``: a sum of ``w[N - 1 + j - i]`` (relative position) and ``w[bucket(ts_i - ts_j)]``
    (relative time, HSTU's bucketization) terms, ``[N, N]`` or, unsqueezed over the heads, ``[B, N, N]``."""
    x = bias
    if is_call(x, torch.unsqueeze) and arg(x, 1, "dim") == 1:
        x = x.args[0]
        if tensor_meta(x) is None or tensor_meta(x).dim() != 3:
            raise Unproven(f"the score bias {bias.name} is not [B, N, N] broadcast over the heads")
    elif tensor_meta(x) is None or tensor_meta(x).dim() != 2:
        raise Unproven(f"the score bias {bias.name} is not [N, N] nor [B, N, N] broadcast over the heads")
    found = ScoreBias()
    for term in _terms(x):
        padded = _padded_leaves(term, is_padded)
        if not padded and found.rel_bias is None:
            found.rel_bias = prove_relative_bias(term, n)
        elif len(padded) == 1 and found.time_bias is None and is_call(term, operator.getitem):
            found.timestamps = padded.pop()
            found.time_bias = prove_time_bias(term, found.timestamps, n)
        else:
            raise Unproven(f"the score bias term {term.name} is neither one relative position nor one relative "
                           "time table read at padded timestamps")
    return found


def _timestamp_probe(n: int, num_buckets: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of ``n`` timestamps, each starting at 0, whose gaps straddle every time bucket's edges."""
    edges = torch.exp(torch.arange(num_buckets + 2, dtype=torch.float64) * TIME_BUCKET_BASE).floor()
    top = 10**12 if dtype.is_floating_point else min(10**12, torch.iinfo(dtype).max // 4)
    gaps = torch.cat([torch.arange(4.0), edges - 1, edges, edges + 1, torch.tensor([float(top)])]).unique()
    width = max(n - 1, 1)
    gaps = torch.cat([gaps, gaps[-1:].expand((-len(gaps)) % width)]).view(-1, width)
    return torch.cat([torch.zeros(len(gaps), 1, dtype=gaps.dtype), gaps], 1)[:, :n].to(dtype)


def prove_time_bias(term: fx.Node, timestamps: fx.Node, n: int) -> fx.Node:
    """``w`` when ``term`` is ``w[bucket(ts_i - ts_j)]`` over padded ``timestamps [B, N]``."""
    table, index = term.args
    meta, ts_meta = tensor_meta(table), tensor_meta(timestamps)
    if meta is None or meta.dim() != 1 or ts_meta is None or ts_meta.dim() != 2:
        raise Unproven(f"{term.name}: not a 1-D table read at [B, N] timestamps")
    probe = _timestamp_probe(n, size_hint(meta.shape[0]) - 1, ts_meta.dtype)
    got = torch.as_tensor(evaluate_cone(index, {timestamps: probe}))
    if not torch.equal(got, relative_time_index(probe, size_hint(meta.shape[0]) - 1)):
        raise Unproven(f"the index of {table.name} is not HSTU's time bucket "
                       f"clamp(long(log(clamp(|ts_i - ts_j|, min=1)) / {TIME_BUCKET_BASE}), 0, {meta.shape[0] - 1})")
    return table


# ---------------------------------------------------------------------------------------------
# Matching the score chain between q k^T and the product with v


def scalar(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _other(node: fx.Node, operand: fx.Node) -> Any:
    a, b = node.args[:2]
    return b if a is operand else a


def _scale_of(node: fx.Node) -> tuple[fx.Node, float] | None:
    """``(x, c)`` when ``node`` is ``x * c``, ``c * x`` or ``x / c`` with a Python scalar ``c``."""
    if is_call(node, torch.mul, operator.mul) and len(node.args) == 2:
        a, b = node.args
        if scalar(b) is not None and isinstance(a, fx.Node):
            return a, scalar(b)
        if scalar(a) is not None and isinstance(b, fx.Node):
            return b, scalar(a)
    if is_call(node, torch.div, operator.truediv) and scalar(node.args[1]) and isinstance(node.args[0], fx.Node):
        return node.args[0], 1.0 / scalar(node.args[1])
    return None


def _is_bool(node: Any) -> bool:
    meta = tensor_meta(node)
    return meta is not None and meta.dtype == torch.bool


def _reaches_product(node: fx.Node) -> bool:
    """Whether ``node`` is computed from a matmul (the scores), rather than from indices only."""
    seen, queue = set(), [node]
    while queue:
        x = queue.pop(0)
        if is_call(x, torch.matmul, torch.bmm, torch.functional.einsum):
            return True
        seen.add(x)
        queue.extend(a for a in x.all_input_nodes if a not in seen)
    return False


def _zero_mask_of(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(x, mask)`` when ``node`` is ``x * mask`` or ``torch.where(mask, x, 0)`` with a bool mask, or
    ``x * mask`` with a float mask computed from indices only (proven 0/1 by ``prove_mask``)."""
    if is_call(node, torch.mul, operator.mul) and len(node.args) == 2:
        a, b = node.args
        if _is_bool(b):
            return a, b
        if _is_bool(a):
            return b, a
        for x, mask in ((a, b), (b, a)):
            meta = tensor_meta(mask)
            if meta is not None and meta.is_floating_point() and not _reaches_product(mask):
                return x, mask
    if is_call(node, torch.where) and len(node.args) == 3 and scalar(node.args[2]) == 0.0:
        return node.args[1], node.args[0]
    return None


def _score_product(node: Any) -> tuple[fx.Node, fx.Node]:
    """``(q, k)`` when ``node`` is ``matmul(q, k.transpose(-2, -1))``."""
    if not is_call(node, torch.matmul) or len(node.args) != 2:
        raise Unproven(f"{getattr(node, 'name', node)} is not the q @ k^T product")
    q, kt = node.args
    if not (is_call(kt, torch.transpose) or (isinstance(kt, fx.Node) and kt.op == "call_method" and kt.target == "transpose")):
        raise Unproven(f"{node.name}: the key operand is not a transpose of k")
    dims = {d % 4 for d in kt.args[1:3]}
    if dims != {2, 3}:
        raise Unproven(f"{node.name}: k is transposed over dims {kt.args[1:3]}, not the last two")
    return q, kt.args[0]


def is_score_product(node: fx.Node) -> bool:
    try:
        _score_product(node)
    except Unproven:
        return False
    return True


@dataclass
class AttentionMatch:
    kind: str  # "hstu" | "softmax"
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None
    keep_if_true: bool
    causal_flag: bool  # SDPA's is_causal
    alpha: float = 1.0  # hstu: pre-activation scale; softmax: scale
    post_scale: float = 1.0  # hstu: scale after the SiLU
    rel_bias: fx.Node | None = None  # the relative position bias node (w[...]) before proof
    nodes: tuple[fx.Node, ...] = ()


def match_attention(out: fx.Node) -> AttentionMatch:
    """The attention core ending at ``out`` (a ``matmul(weights, v)`` or an SDPA call)."""
    if is_call(out, F.scaled_dot_product_attention):
        return _match_sdpa(out)
    if not is_call(out, torch.matmul) or len(out.args) != 2:
        raise Unproven(f"{out.name} is not an attention product")
    weights, v = out.args
    nodes = [out]
    if is_call(weights, torch.softmax, F.softmax):
        return _match_softmax(out, weights, v, nodes)
    post, mask, x = 1.0, None, weights
    while isinstance(x, fx.Node) and not is_call(x, F.silu, torch.nn.functional.silu):
        nodes.append(x)
        if (scaled := _scale_of(x)) is not None:
            x, c = scaled
            post *= c
        elif mask is None and (masked := _zero_mask_of(x)) is not None:
            x, mask = masked
        else:
            raise Unproven(f"{x.name} ({x.target}) between the SiLU and the product with v is not a scale or a mask")
    if not isinstance(x, fx.Node):
        raise Unproven(f"{out.name}: no SiLU of the scores")
    if mask is None:
        raise Unproven(f"{out.name}: no mask after the SiLU, so padded keys are attended to")
    nodes.append(x)
    scores = x.args[0]
    rel_bias = None
    if is_call(scores, torch.add, operator.add) and len(scores.args) == 2:
        nodes.append(scores)
        a, b = scores.args
        scores, rel_bias = (a, b) if is_call(_strip_scales(a, [])[0], torch.matmul) else (b, a)
    q, k, alpha = _scaled_scores(scores, nodes)
    return AttentionMatch("hstu", q, k, v, mask, True, False, alpha, post, rel_bias, tuple(nodes))


def _strip_scales(x: Any, nodes: list) -> tuple[Any, float]:
    """``(y, c)`` for ``x = y * c`` through any number of scalar scales (appended to ``nodes``)."""
    scale = 1.0
    while (scaled := _scale_of(x)) is not None:
        nodes.append(x)
        x, c = scaled
        scale *= c
    return x, scale


def _scaled_scores(x: Any, nodes: list) -> tuple[fx.Node, fx.Node, float]:
    """``(q, k, c)`` for ``x = matmul(q, k^T) * c``."""
    x, scale = _strip_scales(x, nodes)
    q, k = _score_product(x)
    nodes.append(x)
    return q, k, scale


def _match_softmax(out: fx.Node, weights: fx.Node, v: fx.Node, nodes: list) -> AttentionMatch:
    if arg(weights, 1, "dim") not in (-1, 3) or arg(weights, 2, "dtype") is not None:
        raise Unproven(f"{weights.name}: softmax is not over the keys")
    nodes.append(weights)
    x, mask, keep = weights.args[0], None, True
    if is_call(x, torch.masked_fill) and scalar(x.args[2]) == -math.inf:
        nodes.append(x)
        x, mask, keep = x.args[0], x.args[1], False
    elif is_call(x, torch.where) and scalar(x.args[2]) == -math.inf:
        nodes.append(x)
        x, mask, keep = x.args[1], x.args[0], True
    if mask is None:
        raise Unproven(f"{weights.name}: softmax over unmasked scores attends to padded keys")
    q, k, scale = _scaled_scores(x, nodes)
    return AttentionMatch("softmax", q, k, v, mask, keep, False, scale, nodes=tuple(nodes))


def _match_sdpa(out: fx.Node) -> AttentionMatch:
    q, k, v = out.args[:3]
    mask = arg(out, 3, "attn_mask")
    if scalar(arg(out, 4, "dropout_p", 0.0)) not in (None, 0.0):
        raise Unproven(f"{out.name}: attention dropout")
    causal = bool(arg(out, 5, "is_causal", False))
    if causal and mask is not None:
        raise Unproven(f"{out.name}: both attn_mask and is_causal")
    if mask is not None and not _is_bool(mask):
        raise Unproven(f"{out.name}: a float attn_mask")
    if arg(out, 7, "enable_gqa", False):
        raise Unproven(f"{out.name}: grouped-query attention")
    scale = arg(out, 6, "scale")
    if scale is None:
        scale = 1.0 / math.sqrt(size_hint(meta_value(q).shape[-1]))
    if mask is None and not causal:
        raise Unproven(f"{out.name}: no mask, so padded keys are attended to")
    return AttentionMatch("softmax", q, k, v, mask, True, causal, float(scale), nodes=(out,))


# ---------------------------------------------------------------------------------------------
# Attention over padded histories with an additive mask (RecBole's SASRec and BERT4Rec)


@dataclass
class PaddedAttentionMatch:
    q: fx.Node
    k: fx.Node  # [B, H, N, D], or a [B, N, H, D] view when ``k_heads_last``
    v: fx.Node
    mask: fx.Node
    scale: float
    k_heads_last: bool  # the key operand is ``k.permute(0, 2, 3, 1)`` of ``k [B, N, H, D]``
    nodes: tuple[fx.Node, ...]


def _identity_dropout(node: Any) -> bool:
    return is_call(node, F.dropout) and (arg(node, 1, "p", 0.5) == 0.0 or arg(node, 2, "training", True) is False)


def _key_operand(kt: Any) -> tuple[fx.Node, bool]:
    """``(k, heads_last)`` of the key operand of the scores: ``k.transpose(-2, -1)`` or ``k.permute(0, 2, 3, 1)``."""
    if calls(kt, torch.permute, "permute"):
        dims = kt.args[1] if len(kt.args) == 2 else kt.args[1:]
        if tuple(dims) == (0, 2, 3, 1):
            return kt.args[0], True
    if calls(kt, torch.transpose, "transpose"):
        if {d % 4 for d in kt.args[1:3]} == {2, 3}:
            return kt.args[0], False
    raise Unproven(f"{getattr(kt, 'name', kt)}: the key operand is not k^T")


def _data_free(mask: fx.Node) -> bool:
    """Whether ``mask`` is computed through mask arithmetic from integer or bool tensors only (ids, lengths,
    a padding mask): no gradient flows into it and no score reaches it."""
    return not any(leaf.is_floating_point() or leaf.is_complex() for leaf in map(tensor_meta, cone_leaves([mask])))


def match_padded_attention(out: fx.Node) -> PaddedAttentionMatch:
    """``matmul(dropout?(softmax(matmul(q, k^T) * scale + mask, -1)), v)`` with ``q, k, v [B, H, N, D]``, a
    dropout that is the identity (p = 0 or eval) and a 4-D additive float mask made from ids or lengths."""
    if not is_call(out, torch.matmul) or len(out.args) != 2:
        raise Unproven(f"{out.name} is not an attention product")
    weights, v = out.args
    nodes = [out]
    if _identity_dropout(weights):
        nodes.append(weights)
        weights = weights.args[0]
    if not is_call(weights, torch.softmax, F.softmax):
        raise Unproven(f"{out.name}: not a product of softmax weights with v")
    if arg(weights, 1, "dim") not in (-1, 3) or arg(weights, 2 if is_call(weights, torch.softmax) else 3, "dtype"):
        raise Unproven(f"{weights.name}: softmax is not over the keys")
    nodes.append(weights)
    total = weights.args[0]
    if not is_call(total, torch.add, operator.add) or len(total.args) != 2:
        raise Unproven(f"{weights.name}: no additive mask on the scores")
    nodes.append(total)
    a, b = total.args
    scores, mask = (a, b) if _reaches_product(a) else (b, a)
    meta = tensor_meta(mask)
    if meta is None or meta.dim() != 4 or not meta.is_floating_point() or not _data_free(mask):
        raise Unproven(f"{total.name}: the added term is not a 4-D float mask made from ids or lengths")
    scores, scale = _strip_scales(scores, nodes)
    if not is_call(scores, torch.matmul) or len(scores.args) != 2:
        raise Unproven(f"{total.name}: the scores are not q @ k^T")
    nodes.append(scores)
    q, kt = scores.args
    k, heads_last = _key_operand(kt)
    if any(tensor_meta(x) is None or tensor_meta(x).dim() != 4 for x in (q, k, v)):
        raise Unproven(f"{out.name}: q, k, v are not 4-D")
    _check_padded_shapes(out, q, k, v, mask, heads_last)
    return PaddedAttentionMatch(q, k, v, mask, scale, heads_last, tuple(nodes))


def _check_padded_shapes(out, q, k, v, mask, heads_last: bool) -> None:
    """q, k, v share ``[B, H]`` (no broadcasting in the products), k and v their keys, and the mask broadcasts
    to ``[B, H, Nq, N]`` (each dim 1 or the same size)."""
    (b, h, nq, _), (kb, kn, kh, _), vs = (tensor_meta(x).shape for x in (q, k, v))
    if not heads_last:
        kh, kn = kn, kh
    if not (same_sizes((b, h), (kb, kh)) and same_sizes((b, h, kn), vs[:3])):
        raise Unproven(f"{out.name}: q, k and v do not share their batch, head and key dims")
    for size, full in zip(tensor_meta(mask).shape, (b, h, nq, kn)):
        if not (same_sizes((size,), (1,)) or same_sizes((size,), (full,))):
            raise Unproven(f"{out.name}: the mask does not broadcast to [B, H, Nq, N]")
