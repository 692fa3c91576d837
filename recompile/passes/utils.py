"""Helpers the passes share for reading and rewriting FX graphs."""
from __future__ import annotations

import functools
import itertools
import operator
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from recompile.runtime.interaction import pair_indices


def meta_value(node: Any) -> Any:
    """The example value Dynamo (``example_value``) or AOT (``val``) recorded for a node, else None."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def input_metas(gm: fx.GraphModule) -> list[Any]:
    """The example values of the graph's inputs."""
    return [meta_value(n) for n in gm.graph.find_nodes(op="placeholder")]


def is_training(gm: fx.GraphModule) -> bool:
    """Autograd will run through the graph: grad mode is on and an input requires grad (Dynamo guards on both,
    so the graph is never differentiated otherwise)."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in input_metas(gm))


def tensor_meta(node: Any) -> torch.Tensor | None:
    value = meta_value(node)
    return value if isinstance(value, torch.Tensor) else None


def is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def calls(node: Any, function: Any, method: str) -> bool:
    """``node`` calls ``function``, or ``method`` on a tensor (the two spellings Dynamo records of one call)."""
    return is_call(node, function) or (isinstance(node, fx.Node) and node.op == "call_method" and node.target == method)


def call_with_val(graph: fx.Graph, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    """A new call of ``target`` at the graph's insertion point, its ``val`` (AOT autograd's fake value, which a
    post-grad pass keeps for Inductor's lowering) computed from its inputs' ``val``."""
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = target(*fx.node.map_arg(args, lambda n: n.meta["val"]), **kwargs)
    return node


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a call, passed by position ``index`` or by keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def replace_node(old: fx.Node, new: fx.Node) -> None:
    """Point every user of ``old`` at ``new``, keep ``old``'s example value, and erase it."""
    new.meta.setdefault("example_value", meta_value(old))
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


def only_user(node: Any) -> fx.Node | None:
    """The one node that uses ``node`` (None for several, none, or a non-node)."""
    return next(iter(node.users)) if isinstance(node, fx.Node) and len(node.users) == 1 else None


def erase_if_unused(*nodes: fx.Node) -> None:
    for node in nodes:
        if isinstance(node, fx.Node) and not node.users and node.op != "placeholder":
            node.graph.erase_node(node)


def each_match(gm: fx.GraphModule, match: Callable[[fx.Node], Any]) -> Iterator[tuple[fx.Node, Any]]:
    """Every node of ``gm`` with what ``match`` found at it (when not None), over the nodes as they were: the
    caller may replace each one."""
    for node in list(gm.graph.nodes):
        found = match(node)
        if found is not None:
            yield node, found


# Constant subgraphs (pair indices and masks) and the dot interaction's pair orders.

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


# Python's augmented and item assignments (``x += y``, ``x[i] = y``), which Dynamo records as these functions.
IN_PLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
    operator.imatmul, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.setitem,
})


def written(node: fx.Node) -> list[Any]:
    """The arguments ``node`` writes into: ``x.add_(y)``, ``torch.relu_(x)``, ``x += y``, ``x[i] = y``,
    ``inplace=True``, ``out=``, and an op's arguments its schema marks mutable (``Tensor(a!)``). Not
    ``operator.and_`` (``x & y``), whose trailing underscore only avoids the keyword."""
    target = node.target
    if node.op not in ("call_function", "call_method"):
        return []
    if isinstance(target, torch._ops.OpOverload):
        return [node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
                for i, a in enumerate(target._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    in_place = name.endswith("_") and not name.endswith("__") and getattr(target, "__module__", None) != "_operator"
    writes = [node.args[0]] if node.args and (
        target in IN_PLACE_OPERATORS or in_place or node.kwargs.get("inplace") is True) else []
    return writes + ([node.kwargs["out"]] if node.kwargs.get("out") is not None else [])


def has_effects(node: fx.Node) -> bool:
    """Whether ``node`` must run though nothing uses its result: it writes into a tensor, or FX deems it impure
    (random ops, asserts, effectful or mutable-schema ops)."""
    return bool(written(node)) or node.is_impure()


def erase_unused(nodes: list[fx.Node], erased: set[fx.Node]) -> None:
    """Erase ``nodes`` and, transitively, their inputs, where nothing uses them any more (calls without effects
    only), but not those in ``erased``; each erased node is added to ``erased``."""
    while nodes:
        node = nodes.pop()
        if node not in erased and not node.users and node.op in ("call_function", "call_method") and not has_effects(node):
            nodes += node.all_input_nodes
            node.graph.erase_node(node)
            erased.add(node)


def eliminate_dead_code(gm: fx.GraphModule) -> set[fx.Node]:
    """Erase the nodes whose results nothing uses, keeping those with effects (``x.add_(1)``, ``x[i] = y``:
    FX's own pass drops a method call whose result is unused); returns the erased nodes."""
    before = set(gm.graph.nodes)
    gm.graph.eliminate_dead_code(is_impure_node=has_effects)
    return before - set(gm.graph.nodes)
