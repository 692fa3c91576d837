"""Padding and unpadding by (row, position) indices, for the ``jagged`` pass.

Users pad jagged values ``[T, C]`` (sequences ``offsets[b] .. offsets[b + 1]``) without FBGEMM by writing
them into a tensor at index ``(row, position)`` computed from the offsets or the lengths:

- ``base.index_copy(0, dest, values)``, ``base.index_put((dest,), values)``,
  ``base.scatter(0, dest[:, None].expand(T, C), values)`` on a flat ``base [B * N, C]`` with
  ``dest = row * N + position``;
- ``base.index_put((row, position), values)`` on ``base [B, N, C]``;

and gather back with the same indices (``flat[dest]``, ``padded[row, position]``) or the padding mask
(``padded[arange(N) < lengths[:, None]]``). The content of ``base`` never matters: padded rows are dropped
by the gather back and masked out of attention.

``torch.nn.utils.rnn.pad_sequence(torch.split(values, sizes))`` pads values split by Python ints (Dynamo
specialises the graph to them); it is unpadded by ``torch.cat([padded[i, :sizes[i]] for i ...])``.

The indices are proven, not guessed: their subgraph may read only the offsets/lengths, ``arange``s and
index arithmetic (``searchsorted``, ``repeat_interleave``, compares), and it is evaluated on batches of
lengths with the traced batch size and total (full rows, empty rows, even and random splits) and compared
with the row and position of every value.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch.nn.functional as F

from recompile.passes.jagged_attention import Lengths, Unproven, cone_leaves, evaluate_cone, meta_value, size_hint
from recompile.passes.utils import arg, is_call, tensor_meta

NUM_RANDOM_PROBES = 4


def _ancestors(node: fx.Node) -> Iterator[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        yield x
        stack.extend(x.all_input_nodes)


def lengths_leaves(index: Any, offsets_of: Callable[[fx.Node], fx.Node]) -> Lengths | None:
    """The lengths the index subgraph is computed from: the offsets ``recompile.complete_cumsum(lengths)``
    it reads, if one, else the one tensor it reads if that is 1-D integer lengths (``offsets_of`` gives
    their offsets)."""
    nodes = [index] if isinstance(index, fx.Node) else [i for i in index if isinstance(i, fx.Node)]
    found = {x for n in nodes for x in _ancestors(n) if is_call(x, torch.ops.recompile.complete_cumsum.default)}
    if len(found) == 1:
        offsets = found.pop()
        return Lengths(offsets.args[0], offsets, size_hint(meta_value(offsets).shape[0]) - 1)
    leaves = cone_leaves(nodes) if not found else set()
    if len(leaves) != 1:
        return None
    (lengths,) = leaves
    meta = tensor_meta(lengths)
    if meta.dim() != 1 or meta.dtype not in (torch.int32, torch.int64):
        return None
    return Lengths(lengths, offsets_of(lengths), size_hint(meta.shape[0]))


def jagged_probes(batch: int, total: int, n: int) -> Iterator[torch.Tensor]:
    """Lengths of ``batch`` sequences of at most ``n`` positions summing to ``total``: full rows first, full
    rows last, an even split, random splits."""
    if total is None:
        raise Unproven("the number of jagged values is data-dependent")
    if total > batch * n:
        raise Unproven(f"{total} values do not fit {batch} sequences of at most {n} positions")
    if batch == 0:
        return
    full = torch.full((batch,), n)
    front = (total - torch.cat([torch.zeros(1, dtype=torch.long), full.cumsum(0)[:-1]])).clamp(0, n)
    yield front
    yield front.flip(0)
    yield torch.full((batch,), total // batch) + (torch.arange(batch) < total % batch).long()
    gen = torch.Generator().manual_seed(0)
    for _ in range(NUM_RANDOM_PROBES):  # the rows of ``total`` distinct random slots of the [batch, n] grid
        slots = torch.randperm(batch * n, generator=gen)[:total]
        yield torch.bincount(slots // n, minlength=batch)


def _leaves(lengths: Lengths, probe: torch.Tensor) -> dict[fx.Node, torch.Tensor]:
    leaves = {lengths.offsets: F.pad(torch.cumsum(probe, 0), (1, 0)).to(meta_value(lengths.offsets).dtype)}
    if lengths.lengths is not None:
        leaves[lengths.lengths] = probe.to(meta_value(lengths.lengths).dtype)
    return leaves


def rows_and_positions(probe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.repeat_interleave(torch.arange(len(probe)), probe)
    starts = torch.cumsum(probe, 0) - probe
    return rows, torch.arange(len(rows)) - starts[rows]


def prove_index(index: Any, lengths: Lengths, total: int, n: int, expected) -> None:
    """Raises Unproven unless ``index`` evaluates to ``expected(rows, positions)`` on every probe."""
    for probe in jagged_probes(lengths.batch, total, n):
        got = evaluate_cone(index, _leaves(lengths, probe))
        want = expected(*rows_and_positions(probe))
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        if len(got) != len(want) or not all(torch.equal(torch.as_tensor(g), w) for g, w in zip(got, want)):
            raise Unproven("the padding indices are not (row, position) of each value")


def flat_dest(n: int):
    return lambda rows, positions: rows * n + positions


def scattered_dest(n: int, width: int):
    """``dest[:, None].expand(T, width)``, the index ``scatter`` reads."""
    return lambda rows, positions: (rows * n + positions).unsqueeze(1).expand(-1, width)


def row_position(rows, positions):
    return rows, positions


@dataclass
class IndexPadding:
    """A padding by indices: ``values [T, C]`` written at (row, position) into ``[B * N, C]`` ("flat") or
    ``[B, N, C]`` ("bn")."""

    values: fx.Node
    lengths: Lengths
    n: int
    layout: str


def index_padding(node: fx.Node, offsets_of: Callable[[fx.Node], fx.Node]) -> IndexPadding | None:
    """The padding ``node`` performs, if it is one of the index writes above and its indices are proven;
    raises Unproven for an index write of jagged-looking values whose indices are not. ``offsets_of(lengths)``
    gives the offsets of indices computed from the lengths alone."""
    write = _index_write(node)
    if write is None:
        return None
    base, index, values, kind = write
    base_meta, values_meta = tensor_meta(base), tensor_meta(values)
    if base_meta is None or values_meta is None or values_meta.dim() != 2 or base_meta.dtype != values_meta.dtype:
        return None
    lengths = lengths_leaves(index, offsets_of)
    if lengths is None:
        return None  # not computed from offsets: an index write of something else
    total = size_hint(values_meta.shape[0])
    if kind == "pair":
        if base_meta.dim() != 3:
            raise Unproven(f"{node.name}: index_put by (row, position) into a {base_meta.dim()}-D tensor")
        n = base_meta.shape[1]
        if not isinstance(n, int) or size_hint(base_meta.shape[0]) != lengths.batch:
            raise Unproven(f"{node.name}: the padded tensor is not [batch, N, C] with a static N")
        prove_index(index, lengths, total, n, row_position)
        return IndexPadding(values, lengths, n, "bn")
    if base_meta.dim() != 2 or lengths.batch == 0 or size_hint(base_meta.shape[0]) % lengths.batch:
        raise Unproven(f"{node.name}: the padded tensor is not [batch * N, C]")
    n = size_hint(base_meta.shape[0]) // lengths.batch
    dest = flat_dest(n) if kind == "flat" else scattered_dest(n, size_hint(values_meta.shape[1]))
    prove_index(index, lengths, total, n, dest)
    return IndexPadding(values, lengths, n, "flat")


def _index_write(node: fx.Node) -> tuple[fx.Node, Any, fx.Node, str] | None:
    """``(base, index, values, kind)`` of an out-of-place index write along dim 0 without accumulation."""
    method = node.op == "call_method"
    name = node.target if method else getattr(node.target, "__name__", None)
    if node.op not in ("call_method", "call_function") or name not in INDEX_WRITES:
        return None
    if not method and node.target is not getattr(torch, name, None):
        return None
    return INDEX_WRITES[name](node)


def _index_copy(node):
    base, dim, index, values = (arg(node, i, k) for i, k in enumerate(("input", "dim", "index", "source")))
    return (base, index, values, "flat") if dim == 0 else None


def _scatter(node):
    base, dim, index, values = (arg(node, i, k) for i, k in enumerate(("input", "dim", "index", "src")))
    if dim != 0 or not isinstance(values, fx.Node) or arg(node, 4, "reduce") is not None:
        return None
    return base, index, values, "scatter"


def _index_put(node):
    base, indices, values = (arg(node, i, k) for i, k in enumerate(("input", "indices", "values")))
    if arg(node, 3, "accumulate", False) or not isinstance(indices, (list, tuple)):
        return None
    if len(indices) == 1:
        return base, indices[0], values, "flat"
    return (base, tuple(indices), values, "pair") if len(indices) == 2 else None


INDEX_WRITES = {"index_copy": _index_copy, "scatter": _scatter, "index_put": _index_put}


# ---------------------------------------------------------------------------------------------
# The gather back


@dataclass
class IndexGather:
    dense: fx.Node
    index: Any
    kind: str  # "flat" (flat[dest]), "pair" (padded[row, position]) or "mask" (padded[valid])


def index_gather(node: fx.Node) -> IndexGather | None:
    """``padded[index]`` with a tensor index (or a pair of them): a candidate gather back to jagged."""
    if not is_call(node, operator.getitem) or not isinstance(node.args[0], fx.Node):
        return None
    dense, index = node.args
    if isinstance(index, fx.Node):
        meta = tensor_meta(index)
        if meta is None:
            return None
        return IndexGather(dense, index, "mask" if meta.dtype == torch.bool else "flat")
    if isinstance(index, tuple) and len(index) == 2 and all(tensor_meta(i) is not None for i in index):
        return IndexGather(dense, index, "pair")
    return None


def prove_gather(gather: IndexGather, lengths: Lengths, n: int, total: int) -> None:
    if gather.kind == "mask":
        for probe, leaves in lengths.probes(n):
            keep = torch.as_tensor(evaluate_cone(gather.index, leaves))
            if not torch.equal(keep, torch.arange(n).view(1, n) < probe.view(-1, 1)):
                raise Unproven("the gather mask is not arange(N) < lengths[:, None]")
        return
    prove_index(gather.index, lengths, total, n, flat_dest(n) if gather.kind == "flat" else row_position)


# ---------------------------------------------------------------------------------------------
# pad_sequence over a split by Python sizes, and the concatenation of its rows back

PAD_SEQUENCE = (torch._C._nn.pad_sequence, torch.nn.utils.rnn.pad_sequence)


@dataclass
class SequencePadding:
    values: fx.Node
    sizes: tuple[int, ...]
    layout: str  # "bn" (batch_first) or "nb"


def sequence_padding(node: fx.Node) -> SequencePadding | None:
    """``pad_sequence(torch.split(values, sizes))`` with right padding, every split in order."""
    if not is_call(node, *PAD_SEQUENCE) or arg(node, 3, "padding_side", "right") != "right":
        return None
    sequences = arg(node, 0, "sequences")
    if not isinstance(sequences, (list, tuple)) or not sequences:
        return None
    split = sequences[0].args[0] if is_call(sequences[0], operator.getitem) else None
    if not is_call(split, torch.split, torch.functional.split) or arg(split, 2, "dim", 0) != 0:
        return None
    sizes = split.args[1]
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) for s in sizes):
        return None
    if list(sequences) != [x for x in sequences if is_call(x, operator.getitem) and x.args[0] is split] or [
        x.args[1] for x in sequences
    ] != list(range(len(sizes))):
        return None
    return SequencePadding(split.args[0], tuple(sizes), "bn" if arg(node, 1, "batch_first", False) else "nb")


def row_slices(node: fx.Node) -> tuple[fx.Node, tuple[int, ...]] | None:
    """``(padded, sizes)`` when ``node`` is ``torch.cat([padded[i, :sizes[i]] for i in range(B)])``."""
    if not is_call(node, torch.cat) or arg(node, 1, "dim", 0) != 0:
        return None
    rows = arg(node, 0, "tensors")
    if not isinstance(rows, (list, tuple)) or not rows:
        return None
    dense, sizes = None, []
    for i, row in enumerate(rows):
        if not is_call(row, operator.getitem) or not isinstance(row.args[1], tuple) or len(row.args[1]) != 2:
            return None
        index, cut = row.args[1]
        if dense not in (None, row.args[0]) or index != i or not isinstance(cut, slice):
            return None
        if cut.start not in (None, 0) or cut.step not in (None, 1) or not isinstance(cut.stop, int):
            return None
        dense = row.args[0]
        sizes.append(cut.stop)
    return dense, tuple(sizes)
