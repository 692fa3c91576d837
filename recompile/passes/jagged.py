"""jagged: rewrite padded-dense code over jagged data into jagged ops.

Patterns and replacements:
- offsets from lengths, ``F.pad(torch.cumsum(lengths, 0), (1, 0))`` with 1-D integer ``lengths``
  -> ``recompile.complete_cumsum(lengths)``.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from recompile.passes.utils import arg, is_call, replace_node, tensor_meta
from recompile.pipeline import PassContext, register_pass

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


@register_pass("jagged")
def jagged(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    op = "recompile::complete_cumsum"
    for pad in list(gm.graph.nodes):
        lengths = _offsets_source(pad)
        if lengths is None:
            continue
        impl = ctx.lower(op)
        cumsum = pad.args[0]
        with gm.graph.inserting_before(pad):
            offsets = gm.graph.call_function(torch.ops.recompile.complete_cumsum.default, (lengths, impl.impl))
        ctx.record_region("jagged", [cumsum, pad], op, impl)
        replace_node(pad, offsets)
        gm.graph.erase_node(cumsum)
    return gm
