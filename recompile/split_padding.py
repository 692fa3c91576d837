"""split_padding: the pieces of one split padded at once, in every graph rec_ascend hands to Inductor (a step
before Inductor, like ``repeated_layers``, not a rec pass: it finds no region and runs on the captured graph too).

Pattern -> replacement -> why:

- ``fbgemm.jagged_to_padded_dense(x_i, [offsets], [N], p)`` for two or more pieces ``x_i`` of one
  ``split(x, size, dim=-1)`` (same offsets, N and padding value) -> one ``jagged_to_padded_dense(x[:, a:b],
  [offsets], [N], p)`` of the columns ``a:b`` the pieces cover, each piece's padding a slice ``[..., a_i - a:b_i
  - a]`` of it. Inductor runs the padding as an extern call on CPU, which needs its operand in a buffer: a piece of
  a split of a pointwise result (HSTU's ``u, v, q, k = split(silu(x @ uvqk))``, Meta's generative-recommenders)
  is then computed into a buffer of its own, one C++ kernel per piece, where one kernel now writes the columns
  they cover. Plain Inductor does not meet this: its graph breaks after the split, whose pieces it returns as
  views of one realized buffer. gr/HSTU forward: 11 C++ kernels built against plain Inductor's 8, now 9.

The numbers do not change (a padded copy of the columns, then the same columns picked). Applied only where every
user of a piece takes the slice as it took the piece (its example value computed again; not an output, nothing
written into it), since the slice is not contiguous.
"""
from __future__ import annotations

import contextlib
import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

from recompile.passes.utils import arg, is_call, meta_value, replace_node, tensor_meta, written
from recompile.pipeline import call_before, graph_fake_mode
from recompile.runtime.fbgemm import fbgemm_ops


READS_STRIDES = (torch.as_strided, "as_strided")  # a view that takes the strides it is given, not its input's


def _pad_targets() -> tuple:
    if "jagged_to_padded_dense" not in fbgemm_ops():
        return ()
    packet = torch.ops.fbgemm.jagged_to_padded_dense
    return packet, packet.default


def _split_piece(values: Any) -> tuple[fx.Node, int, int] | None:
    """``(x, start, end)`` when ``values`` is a piece of ``split(x, size, dim)`` (or ``x.split``) over the last dim of
    2-D ``x``: its columns ``start:end``."""
    if not (is_call(values, operator.getitem) and isinstance(values.args[1], int)):
        return None
    split = values.args[0]
    if not (is_call(split, torch.split) or (split.op == "call_method" and split.target == "split")):
        return None
    x, dim = split.args[0], arg(split, 2, "dim", 0)
    size = arg(split, 1, "split_size_or_sections", split.kwargs.get("split_size"))
    meta = tensor_meta(x)
    if meta is None or meta.dim() != 2 or dim not in (1, -1) or not isinstance(meta.shape[1], int):
        return None
    sizes = [size] * -(-meta.shape[1] // size) if isinstance(size, int) else list(size)
    index = values.args[1]
    if not all(isinstance(s, int) for s in sizes) or not 0 <= index < len(sizes):
        return None
    sizes[-1] = meta.shape[1] - sum(sizes[:-1])
    start = sum(sizes[:index])
    return x, start, start + sizes[index]


def _padding_key(node: fx.Node) -> tuple | None:
    """What padding calls of one split share (the split's input, offsets, N, padding value), with the piece's
    columns, for a ``jagged_to_padded_dense`` of one split piece."""
    if not is_call(node, *_pad_targets()):
        return None
    offsets, lengths = arg(node, 1, "offsets"), arg(node, 2, "max_lengths")
    piece = _split_piece(arg(node, 0, "values"))
    if piece is None or len(offsets) != 1 or len(lengths) != 1 or not isinstance(lengths[0], int):
        return None
    x, start, end = piece
    return (x, offsets[0], lengths[0], arg(node, 3, "padding_value", 0.0)), (start, end)


def _takes(user: fx.Node, piece: fx.Node, value: torch.Tensor) -> bool:
    """Whether ``user`` computes a value of the same shape from ``value`` (a non-contiguous slice) in place of
    ``piece``, run on its inputs' fake values."""
    if user.op not in ("call_function", "call_method") or written(user) or user.target in READS_STRIDES:
        return False
    args, kwargs = fx.node.map_arg((user.args, user.kwargs), lambda n: value if n is piece else meta_value(n))
    target = getattr(args[0], user.target) if user.op == "call_method" else user.target
    try:
        with graph_fake_mode(user.graph) or contextlib.nullcontext():
            got = target(*args[user.op == "call_method":], **kwargs)
    except Exception:  # noqa: BLE001  (a view the slice's strides do not allow)
        return False
    want = meta_value(user)
    return not isinstance(want, torch.Tensor) or (isinstance(got, torch.Tensor) and got.shape == want.shape)


def pad_split_once(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with the paddings of each split's pieces merged (a new GraphModule; ``gm`` is left as it is: the race
    runs it eagerly), or ``gm`` itself where there are none."""
    groups: dict[tuple, list[tuple[fx.Node, tuple[int, int]]]] = defaultdict(list)
    for node in gm.graph.nodes:
        if (found := _padding_key(node)) is not None:
            groups[found[0]].append((node, found[1]))
    groups = {key: calls for key, calls in groups.items() if len(calls) > 1}
    if not groups:
        return gm
    graph, mapping = fx.Graph(), {}
    graph.output(graph.graph_copy(gm.graph, mapping))
    merged = sum(_merge(graph, [(mapping[n], cols) for n, cols in calls], mapping[x], mapping[offsets], n, pad)
                 for (x, offsets, n, pad), calls in groups.items())
    return fx.GraphModule(gm, graph) if merged else gm


def _merge(graph: fx.Graph, calls: list[tuple[fx.Node, tuple[int, int]]], x: fx.Node, offsets: fx.Node, n: int,
           padding_value: Any) -> bool:
    """Replace ``calls`` (paddings of columns of ``x``) by slices of one padding; False where a user of a piece
    would not take its slice."""
    first = calls[0][0]
    start, end = min(c[0] for _, c in calls), max(c[1] for _, c in calls)
    width = tensor_meta(x).shape[1]
    columns = (slice(None), slice(start, end))
    source = x if (start, end) == (0, width) else call_before(graph, operator.getitem, (x, columns), first)
    padded = call_before(graph, first.target, (source, [offsets], [n], padding_value), first)
    slices = [call_before(graph, operator.getitem, (padded, (Ellipsis, slice(a - start, b - start))), first)
              for _, (a, b) in calls]
    if all(_takes(user, call, meta_value(piece)) for (call, _), piece in zip(calls, slices) for user in call.users):
        for (call, _), piece in zip(calls, slices):
            replace_node(call, piece)
        return True
    for node in (*reversed(slices), padded, *([source] if source is not x else [])):
        graph.erase_node(node)
    return False
