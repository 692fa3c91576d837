"""Draw an FX graph (the JSON of ``recompile.dump.graph_to_json``) as a self-contained SVG.

The layout is an arc diagram: one row per node in graph order (the order of the generated code), and
each edge an arc on the left from the producer's row to the consumer's. It needs no layout engine, its
width does not grow with the graph, and rows line up with the code listing beside it.
"""
from __future__ import annotations

import math
from html import escape

from recompile.pipeline import region_colours

ROW = 22  # px per node
BOX_W = 400
MAX_LABEL = 40
OP_COLORS = {"placeholder": "#eef1f5", "get_attr": "#eef1f5", "output": "#dde3ea"}


def short_target(node: dict) -> str:
    if node["op"] == "placeholder":
        return "input"
    if node["op"] == "output":
        return "return"
    target = node["target"]
    if target.startswith("torch.ops."):  # custom and ATen ops keep their namespace: recompile.complete_cumsum
        return target.removeprefix("torch.ops.").removesuffix(".default")
    return target.rsplit(".", 1)[-1]


def _label(node: dict) -> str:
    text = node["name"] if node["op"] in ("placeholder", "output") else f"{node['name']} = {short_target(node)}"
    return text if len(text) <= MAX_LABEL else text[: MAX_LABEL - 1] + "\u2026"


def _shape(node: dict) -> str:
    value = node.get("value")
    return f"{value['dtype']}[{','.join(value['shape'])}]" if value else ""


def _tooltip(node: dict) -> str:
    parts = [f"{node['name']}: {node['op']} {node['target']}"]
    if node.get("value"):
        parts.append(_shape(node))
    if node.get("source"):
        parts.append(node["source"])
    return "\n".join(parts)


def graph_svg(nodes: list[dict], id_prefix: str, regions: dict[str, tuple[int, str]]) -> str:
    """SVG of ``nodes``; a node in ``regions`` (name -> (region id, kind)) is coloured and links to its region."""
    row = {n["name"]: i for i, n in enumerate(nodes)}
    edges = [(row[n["name"]], row[u]) for n in nodes for u in n["users"] if u in row]
    max_span = max((b - a for a, b in edges), default=1)
    margin = int(min(260, 16 + 14 * math.sqrt(max_span)))
    width, height = margin + BOX_W + 8, ROW * len(nodes) + 8
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="graph" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="11">'
    ]
    for a, b in edges:
        ya, yb, bulge = _mid(a), _mid(b), min(margin - 4, 8 + 14 * math.sqrt(b - a))
        out.append(
            f'<path class="edge" d="M{margin} {ya} C{margin - bulge} {ya} {margin - bulge} {yb} {margin} {yb}" '
            f'fill="none" stroke="#8a96a3" stroke-width="1"/>'
        )
    colours = region_colours()
    for i, node in enumerate(nodes):
        out.append(_node(node, i, margin, id_prefix, regions.get(node["name"]), colours))
    out.append("</svg>")
    return "\n".join(out)


def _mid(row: int) -> int:
    return 4 + row * ROW + ROW // 2


def _node(
    node: dict, row: int, x: int, id_prefix: str, region: tuple[int, str] | None, colours: dict[str, str]
) -> str:
    y = 4 + row * ROW + 2
    fill = colours[region[1]] if region else OP_COLORS.get(node["op"], "#ffffff")
    cls = f"node region-node kind-{region[1]}" if region else "node"
    data = f' data-region="{region[0]}"' if region else ""
    body = (
        f"<title>{escape(_tooltip(node))}</title>"
        f'<rect x="{x}" y="{y}" width="{BOX_W}" height="{ROW - 4}" rx="3" fill="{fill}" stroke="#5b6875"/>'
        f'<text x="{x + 6}" y="{y + ROW - 9}">{escape(_label(node))}</text>'
        f'<text x="{x + BOX_W - 5}" y="{y + ROW - 9}" text-anchor="end" fill="#5b6875">{escape(_shape(node))}</text>'
    )
    if region:
        body = f'<a href="#region-{region[0]}">{body}</a>'
    return f'<g class="{cls}" id="{id_prefix}-node-{escape(node["name"])}" data-node="{escape(node["name"])}"{data}>{body}</g>'
