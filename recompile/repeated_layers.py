"""Repeated layers compiled once: the calls of identical children of one ``nn.ModuleList`` / ``nn.Sequential`` in a
graph become calls of one shared subgraph (``torch.ops.higher_order.invoke_subgraph``), so AOT autograd traces and
partitions the layer once and Inductor lowers, generates and compiles its code once, however many layers call it.

Pattern: the nodes Dynamo traced inside ``<container>.<i>`` for several ``i`` (read from each node's
``nn_module_stack``; a node a rec pass added without one belongs to the layer all its users belong to), where every
layer is the same ops in the same order on the same kinds of inputs (each input's type, dtype, shape, strides,
device and ``requires_grad``; constants equal; parameters are graph inputs, so each layer's own are its operands).
Replacement: one ``GraphModule`` holding the first such layer's nodes, and per layer
``invoke_subgraph(layer_subgraph, identifier, *operands)`` plus a ``getitem`` per value the rest of the graph reads.
Why: Dynamo with rec_ascend's tracing settings captures a stack of layers as one graph without breaks, so Inductor
compiled every layer's code anew (HSTU, SASRec, BERT4Rec with n_layers > 1), where plain Inductor breaks the graph
inside a layer and Dynamo reuses the compiled layer frame for the next.

A layer is left inline where it cannot be proven identical to another, where moving it out would reorder the graph
(a value leaving it comes back into it), where it mutates a tensor, draws random numbers, calls a submodule or
returns a value that is not a tensor, or, in a graph that needs gradients, creates a data-dependent size (Inductor's
backward fails on it, torch 2.13). A graph calling a layer subgraph in training compiles with Inductor's buffer reuse
off (``BUFFER_REUSE_OFF``: Inductor overwrote values the layer's backward saved). The rec passes run before, on the
whole graph, so their regions are found in every layer as before, and the outlined layer holds its rewritten ops.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import re
from collections import defaultdict
from typing import Any, Hashable, Sequence

import torch
import torch.fx as fx
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import free_symbols, free_unbacked_symbols
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.tools_common import legalize_graph
from torch.fx.passes.utils.fuser_utils import validate_partition
from torch.multiprocessing.reductions import StorageWeakRef

from recompile.passes.dropout import SPELLINGS
from recompile.passes.utils import arg, is_training, meta_value

log = logging.getLogger(__name__)

# Identifiers are unique per process: AOT autograd caches a subgraph's trace by its identifier for a whole Dynamo
# frame, and the autotune race compiles several graphs of one frame.
_identifiers = itertools.count()

# ``<container>.<i>`` or ``<container>[<i>]``: the outermost indexed child in a module path.
_INDEXED_CHILD = re.compile(r"^(?P<container>.*?)(?:\.(?P<dot>\d+)|\[(?P<bracket>\d+)\])(?=$|[.\[])")

_CALLS = ("call_function", "call_method")

# torch 2.13's Inductor does not know that the outputs of an ``invoke_subgraph`` call can share storage with each
# other or with its operands: the partitioned forward of a layer returns the values its backward saves beside the
# layer's outputs, and these are often the same buffer (``tanh(x)`` is both), or a view of an output or an operand
# (``qx.t()``, ``x.t()`` for a matmul's weight gradient). Once the outer graph has read an output or an operand for
# the last time it writes another value into that buffer (``inplace_buffers``: a residual add in place;
# ``allow_buffer_reuse``: a later allocation), and the backward reads the overwritten saved value: outputs right,
# gradients wrong. Plain ``nested_compile_region`` with backend="inductor" does the same (docs/repeated_layers.md has
# the repro); aot_eager is right. A graph calling a layer subgraph in training compiles with both off.
BUFFER_REUSE_OFF = {"inplace_buffers": False, "allow_buffer_reuse": False}

# Fewer computing nodes than this (a lone ``nn.Linear`` of a Sequential) are left inline: what outlining saves is
# the layer's compile, what it costs is fusion across the layer's edges.
MIN_LAYER_NODES = 4


def layer_of(node: fx.Node) -> tuple[str, int] | None:
    """(container path, child index) of the outermost indexed child ``node`` was traced in, None if none."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    match = _INDEXED_CHILD.match(path)
    if match is None:
        return None
    return match["container"], int(match["dot"] or match["bracket"])


def assign_layers(graph: fx.Graph) -> dict[fx.Node, tuple[str, int]]:
    """Each call node's layer: its own ``nn_module_stack``'s, else (a node a pass added) the one all its users have,
    if it comes after that layer's first own node (a value computed before the layer and read only by it, such as
    the layer's input, stays outside)."""
    nodes = [n for n in graph.nodes if n.op in _CALLS]
    own = {n: layer for n in nodes if (layer := layer_of(n)) is not None}
    first: dict[tuple[str, int], int] = {}
    for i, n in enumerate(nodes):
        if n in own:
            first.setdefault(own[n], i)
    layers: dict[fx.Node, tuple[str, int]] = {}
    for i in reversed(range(len(nodes))):
        node = nodes[i]
        layer = own.get(node)
        if layer is None and node.users:
            users = {layers.get(user) for user in node.users}
            layer = users.pop() if len(users) == 1 else None
            layer = layer if layer is not None and first[layer] < i else None
        if layer is not None:
            layers[node] = layer
    return layers


class Region:
    """One layer's nodes in graph order, the values it reads from outside (in order of first use) and the values
    of it the rest of the graph reads (in graph order)."""

    def __init__(self, nodes: list[fx.Node]):
        self.nodes = nodes
        members = set(nodes)
        self.inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in members))
        self.outputs = [n for n in nodes if any(u not in members for u in n.users)]
        values = [meta_value(n) for n in self.inputs]
        given = {v.node.expr for v in values if isinstance(v, torch.SymInt)}
        # Inductor lowers the subgraph on its own: each size symbol of its inputs must come in as an operand of its
        # own, as Dynamo lifts them for nested_compile_region ("For s2 + 1, expected [s2] to have been codegen-ed")
        self.symbols = sorted(set().union(*map(free_symbols, values)) - given, key=str)

    def key(self) -> Hashable | None:
        """The layer's structure: equal keys compute the same function of their inputs; None if it cannot be
        outlined (``why_not``)."""
        if self.why_not() is not None:
            return None
        local = {n: ("node", i) for i, n in enumerate(self.nodes)}
        local.update({n: ("input", i) for i, n in enumerate(self.inputs)})
        try:
            body = tuple((n.op, n.target, _structure(_compared_args(n), local), _structure(n.kwargs, local))
                         for n in self.nodes)
        except TypeError:  # a constant argument we cannot compare
            return None
        return (body, tuple(_value_key(n) for n in self.inputs), tuple(local[n] for n in self.outputs))

    def why_not(self) -> str | None:
        """Why the layer cannot be outlined, read from its nodes; None if nothing there forbids it."""
        for node in self.nodes:
            if node.op not in _CALLS:
                return f"{node.name} is a {node.op}"
            if _mutates_or_draws(node):
                return f"{node.name} ({node.target}) mutates or draws random numbers"
        if not self.outputs:
            return "nothing outside reads it"
        if sum(n.target is not operator.getitem for n in self.nodes) < MIN_LAYER_NODES:
            return f"it has fewer than {MIN_LAYER_NODES} nodes"
        if not validate_partition(self.nodes):
            return "a value leaving it comes back into it"
        return None

    def why_not_run(self, training: bool) -> str | None:
        """Why the layer cannot be outlined, read from its nodes run again as a subgraph on its inputs' fake values
        (a rec pass's replacement keeps the example value of the node it replaced: a jagged region's output still
        carries the size ``dense_to_jagged`` created), None if nothing there forbids it. ``invoke_subgraph`` wants
        tensors out, none of them aliasing an input or another output; in a graph that needs gradients, no size
        created inside (Inductor's backward of such a layer fails in torch 2.13: ``u19 not in dict_keys([u0])``)."""
        inputs = [meta_value(n) for n in self.inputs]
        fake_mode = next((v.fake_mode for v in inputs if isinstance(v, FakeTensor)), None)
        if fake_mode is None:
            return "its inputs have no fake values"
        subgraph = layer_subgraph(self)
        shape_env = fake_mode.shape_env
        try:
            with shape_env.ignore_fresh_unbacked_symbols() if shape_env else contextlib.nullcontext():
                outputs = FakeTensorProp(subgraph, fake_mode).propagate_dont_convert_inputs(*inputs)
        except Exception as exc:  # noqa: BLE001  (left inline, as the graph was)
            return f"it does not run on fake inputs ({type(exc).__name__}: {exc})"
        if not all(isinstance(v, torch.Tensor) for v in outputs):
            return "it returns a value that is not a tensor"
        storages = [StorageWeakRef(v.untyped_storage()) for v in (*inputs, *outputs) if isinstance(v, torch.Tensor)]
        if len(set(storages)) < len(storages):
            return "an output aliases an input or another output"
        given = free_unbacked_symbols(inputs)
        if training and any(free_unbacked_symbols(n.meta.get("val")) - given for n in subgraph.graph.nodes):
            return "it creates a data-dependent size in a graph that needs gradients"
        return None


def _value_key(node: fx.Node) -> Hashable:
    """What a subgraph traced once for one layer's input assumes of another's: kind, dtype, sizes, strides, device,
    requires_grad (sizes as their symbolic expressions)."""
    value = meta_value(node)
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(map(str, value.shape)), tuple(map(str, value.stride())),
                str(value.device), value.requires_grad, type(value).__name__)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (type(value).__name__, str(value))
    return (type(value).__name__, repr(value))


def _compared_args(node: fx.Node) -> tuple:
    """The arguments that decide what ``node`` computes: a runtime assertion's message names each layer's own
    symbols, so only its condition counts."""
    return node.args[:1] if node.target is torch.ops.aten._assert_scalar.default else node.args


def _structure(arg: Any, local: dict[fx.Node, tuple[str, int]]) -> Hashable:
    """``arg`` with each node replaced by its place in the region; constants as themselves."""
    if isinstance(arg, fx.Node):
        return local[arg]
    if isinstance(arg, (list, tuple)):
        return (type(arg).__name__, tuple(_structure(a, local) for a in arg))
    if isinstance(arg, dict):
        return ("dict", tuple((k, _structure(v, local)) for k, v in arg.items()))
    if isinstance(arg, slice):
        return ("slice", _structure((arg.start, arg.stop, arg.step), local))
    if arg is None or isinstance(arg, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format, type(Ellipsis))):
        return (type(arg).__name__, arg)
    raise TypeError(f"cannot compare constant {arg!r}")


# torch-level functions and methods (Dynamo's graph) that draw random numbers; ATen ops say so by their tag.
_RANDOM = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "native_dropout",
    "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli", "multinomial",
    "normal", "poisson", "gumbel_softmax", "rrelu",
})


def _mutates_or_draws(node: fx.Node) -> bool:
    target = node.target
    if "out" in node.kwargs:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags
    if target in (operator.setitem, operator.iadd, operator.imul, operator.isub, operator.itruediv):
        return True
    spelling = SPELLINGS.get(target) if node.op == "call_function" else None
    if spelling is not None:  # dropout draws only while training
        return arg(node, *spelling.training) is not False
    name = target if node.op == "call_method" else getattr(target, "__name__", "")
    return name in _RANDOM or (name.endswith("_") and not name.startswith("_"))


def find_repeated_layers(gm: fx.GraphModule) -> list[list[Region]]:
    """Groups of two or more layers of one container that compute the same function, each a list of regions."""
    by_layer: dict[tuple[str, int], list[fx.Node]] = defaultdict(list)
    for node, layer in assign_layers(gm.graph).items():
        by_layer[layer].append(node)
    groups: dict[Hashable, list[Region]] = defaultdict(list)
    for (container, index), nodes in sorted(by_layer.items(), key=lambda item: item[0]):
        region = Region(sorted(nodes, key=_order(gm.graph)))
        key = region.key()
        if key is None:
            log.debug("repeated_layers: %s.%d left inline: %s", container, index, region.why_not())
            continue
        groups[(container, key)].append(region)
    found, training = [], is_training(gm)
    for (container, _), regions in groups.items():
        if len(regions) < 2:
            continue
        why = regions[0].why_not_run(training)  # the same nodes on inputs of the same kinds: one run tells for all
        if why is None:
            found.append(regions)
        else:
            log.debug("repeated_layers: %s (%d layers) left inline: %s", container, len(regions), why)
    return found


def _order(graph: fx.Graph):
    position = {n: i for i, n in enumerate(graph.nodes)}
    return position.__getitem__


def layer_subgraph(region: Region, symbols: Sequence[fx.Node] = ()) -> fx.GraphModule:
    """The region's nodes as a graph of their own: ``symbols`` (nodes of its size symbols) then its inputs as
    placeholders, its outputs as a tuple."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in (*symbols, *region.inputs):
        env[node] = graph.placeholder(node.name)
        env[node].meta.update({k: node.meta[k] for k in ("example_value", "val") if k in node.meta})
    for node in region.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in region.outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def symbol_nodes(graph: fx.Graph, symbols: set, inside: set[fx.Node]) -> dict:
    """A node outside the layers (``inside``) for each of ``symbols``: a SymInt node that is the symbol, else a new
    ``sym_size`` of a tensor, a graph input first, one of whose sizes is the symbol. Symbols with none are left out."""
    outside = [n for n in graph.nodes if n not in inside and n.op != "output"]
    found = {}
    for node in outside:
        value = meta_value(node)
        if isinstance(value, torch.SymInt) and value.node.expr in symbols:
            found.setdefault(value.node.expr, node)
    last_input = max((n for n in outside if n.op == "placeholder"), key=_order(graph), default=None)
    for node in sorted(outside, key=lambda n: n.op != "placeholder"):
        value = meta_value(node)
        for dim, size in enumerate(getattr(value, "shape", ()) if isinstance(value, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and size.node.expr in symbols and size.node.expr not in found:
                with graph.inserting_after(last_input if node.op == "placeholder" else node):
                    found[size.node.expr] = graph.call_function(torch.ops.aten.sym_size.int, (node, dim))
                found[size.node.expr].meta["example_value"] = size
    return found


def outline(gm: fx.GraphModule, groups: list[list[Region]]) -> list[int]:
    """Replace each region of each group by a call of the group's one subgraph, in place; the number of layers of
    each group outlined."""
    graph = gm.graph
    inside = {n for regions in groups for region in regions for n in region.nodes}
    sources = symbol_nodes(graph, {s for regions in groups for s in regions[0].symbols}, inside)
    outlined = []
    for regions in groups:
        if any(s not in sources for s in regions[0].symbols):
            log.debug("repeated_layers: %d layers left inline: no node for their size symbols", len(regions))
            continue
        symbols = [sources[s] for s in regions[0].symbols]
        outlined.append(len(regions))
        identifier = f"repeated_layer_{next(_identifiers)}"
        gm.register_module(identifier, layer_subgraph(Region(regions[0].nodes), symbols))
        for region in regions:
            region = Region(region.nodes)  # its inputs as they are now: an earlier group's outputs were replaced
            members = set(region.nodes)
            last = region.nodes[-1]
            with graph.inserting_after(last):
                subgraph = graph.get_attr(identifier)
            with graph.inserting_after(subgraph):
                call = graph.call_function(invoke_subgraph, (subgraph, identifier, *symbols, *region.inputs))
            call.meta["example_value"] = tuple(meta_value(n) for n in region.outputs)
            for i, node in enumerate(region.outputs):
                with graph.inserting_after(call):
                    item = graph.call_function(operator.getitem, (call, i))
                item.meta.update(node.meta)
                node.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members)
            for node in reversed(region.nodes):
                graph.erase_node(node)
    legalize_graph(gm)
    return outlined


def outline_repeated_layers(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with each group of identical layers calling one shared subgraph (a new GraphModule; ``gm`` is left as
    it is: the race runs it eagerly), or ``gm`` itself where there is none."""
    copy = fx.GraphModule(gm, _copy_graph(gm.graph))
    outlined = outline(copy, find_repeated_layers(copy))
    if not outlined:
        return gm
    copy.recompile()
    log.debug("repeated_layers: %s layers call one subgraph each", outlined)
    return copy


def layer_config_patches(gm: fx.GraphModule) -> dict[str, Any]:
    """Inductor settings ``gm`` needs: ``BUFFER_REUSE_OFF`` where it calls a layer subgraph in training."""
    calls = gm.graph.find_nodes(op="call_function", target=invoke_subgraph)
    return dict(BUFFER_REUSE_OFF) if calls and is_training(gm) else {}


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    output = new.graph_copy(graph, {})
    new.output(output)
    return new
