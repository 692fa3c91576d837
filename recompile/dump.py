"""Graph dumps: every stage of the pipeline as readable Python and as JSON."""
from __future__ import annotations

import json
import os
import re
import tempfile

import torch
import torch.fx as fx

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FRAME = re.compile(r'\s*File "([^"]+)", line (\d+)')


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


def target_name(node: fx.Node) -> str:
    if isinstance(node.target, str):
        return node.target
    return fx.node._get_qualified_name(node.target) if callable(node.target) else repr(node.target)


def _value_meta(node: fx.Node) -> dict | None:
    value = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, torch.Tensor):
        return {"shape": [str(s) for s in value.shape], "dtype": str(value.dtype).removeprefix("torch.")}
    return None


def source_line(node: fx.Node) -> str | None:
    """Where the user's code made this node, "file.py:12: code": the innermost frame outside torch itself."""
    trace = (node.meta.get("stack_trace") or "").rstrip().splitlines()
    frames = [(i, m) for i, m in ((i, _FRAME.match(line)) for i, line in enumerate(trace)) if m]
    if not frames:
        return None
    user = [(i, m) for i, m in frames if not m.group(1).startswith(_TORCH_DIR)]
    i, match = (user or frames)[-1]
    code = trace[i + 1].strip() if i + 1 < len(trace) else ""
    return f"{os.path.basename(match.group(1))}:{match.group(2)}: {code}"


def graph_to_json(gm: fx.GraphModule) -> dict:
    nodes = []
    for node in gm.graph.nodes:
        nodes.append(
            {
                "name": node.name,
                "op": node.op,
                "target": target_name(node),
                "args": _describe(node.args),
                "kwargs": _describe(node.kwargs),
                "users": [u.name for u in node.users],
                "value": _value_meta(node),
                "source": source_line(node),
            }
        )
    return {"nodes": nodes}


def readable_code(gm: fx.GraphModule) -> str:
    """The graph as Python with the shape and dtype of every value and the user source line of each node."""
    return gm.print_readable(print_output=False)


def write_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed into place)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_stage(dump_dir: str, graph_id: int, index: int, name: str, gm: fx.GraphModule) -> None:
    """``graph<id>_<index>_<stage>.py`` (the graph as Python, with shapes and source lines) and ``.json``."""
    stem = os.path.join(dump_dir, f"graph{graph_id}_{index:02d}_{name}")
    header = f"# recompile: graph {graph_id}, stage {index} ({name}), {len(gm.graph.nodes)} nodes\n"
    write_file(stem + ".py", header + readable_code(gm))
    write_file(stem + ".json", json.dumps(graph_to_json(gm), indent=1))
