"""legacy_constructors: a legacy tensor type called on data (``torch.FloatTensor([1e-8])``) as ``torch.tensor``, in
every graph rec_ascend hands to Inductor (a step before Inductor, like ``dot_linear``: it finds no region and runs on
the captured graph too).

Pattern -> replacement -> why:

- ``torch.FloatTensor(data)`` (any CPU legacy type ``torch.<Scalar>Tensor``; its one argument a list or tuple of
  numbers, no keywords) -> ``torch.tensor(data, dtype=<the type's dtype>, device="cpu")``, the same tensor. AOT
  autograd's cache admits a graph only if it calls functions it knows to be safe, which the legacy types are not:
  a graph calling one bypasses that cache, so that every warm compile (a second process on the same cache folders)
  traces its forward and backward again. RecBole's context-aware models call one in their mean pooling of token
  sequence fields (``eps = torch.FloatTensor([1e-8])``, ``ContextRecommender.embed_token_seq_fields``), so each
  of their graphs did (RecBole FM's training step).

Called on a size (``torch.FloatTensor(3)``: uninitialized memory) or a tensor, a legacy type is left as it is.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from recompile.pipeline import call_before, rewrite_each

LEGACY_TYPES = {t: t.dtype for t in (torch.FloatTensor, torch.DoubleTensor, torch.HalfTensor, torch.BFloat16Tensor,
                                     torch.LongTensor, torch.IntTensor, torch.ShortTensor, torch.CharTensor,
                                     torch.ByteTensor, torch.BoolTensor)}


def _dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype of the tensor ``node`` makes, where it is a legacy type called on a list or tuple of numbers."""
    if node.op != "call_function" or node.target not in LEGACY_TYPES or node.kwargs or len(node.args) != 1:
        return None
    data = node.args[0]
    numbers = isinstance(data, (list, tuple)) and all(
        isinstance(leaf, (bool, int, float)) for leaf in torch.utils._pytree.tree_leaves(list(data)))
    return LEGACY_TYPES[node.target] if numbers else None


def legacy_constructors_as_tensor(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with each legacy type called on data a ``torch.tensor`` call (``rewrite_each``)."""
    return rewrite_each(gm, _dtype, _tensor)


def _tensor(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    return call_before(graph, torch.tensor, node.args, node, dtype=dtype, device=torch.device("cpu"))
