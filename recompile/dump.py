"""Graph dumps: every stage of the pipeline as readable Python and as JSON."""
from __future__ import annotations

import json
import os

import torch
import torch.fx as fx


def _describe(arg) -> object:
    if isinstance(arg, fx.Node):
        return {"node": arg.name}
    if isinstance(arg, (list, tuple)):
        return [_describe(a) for a in arg]
    if isinstance(arg, dict):
        return {str(k): _describe(v) for k, v in arg.items()}
    if isinstance(arg, (int, float, bool, str)) or arg is None:
        return arg
    return repr(arg)


def _target_name(node: fx.Node) -> str:
    if isinstance(node.target, str):
        return node.target
    return fx.node._get_qualified_name(node.target) if callable(node.target) else repr(node.target)


def _value_meta(node: fx.Node) -> dict | None:
    value = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, torch.Tensor):
        return {"shape": [str(s) for s in value.shape], "dtype": str(value.dtype).removeprefix("torch.")}
    return None


def graph_to_json(gm: fx.GraphModule) -> dict:
    nodes = []
    for node in gm.graph.nodes:
        nodes.append(
            {
                "name": node.name,
                "op": node.op,
                "target": _target_name(node),
                "args": _describe(node.args),
                "kwargs": _describe(node.kwargs),
                "users": [u.name for u in node.users],
                "value": _value_meta(node),
            }
        )
    return {"nodes": nodes}


def write_stage(dump_dir: str, graph_id: int, index: int, name: str, gm: fx.GraphModule) -> None:
    os.makedirs(dump_dir, exist_ok=True)
    stem = os.path.join(dump_dir, f"graph{graph_id}_{index:02d}_{name}")
    with open(stem + ".py", "w") as f:
        f.write(gm.code)
    with open(stem + ".json", "w") as f:
        json.dump(graph_to_json(gm), f, indent=1)
