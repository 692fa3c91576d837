"""The HTML report of ``recompile inspect --html``: one self-contained file, drawn from ``Report.to_dict()``.

Per graph, the stages side by side (the graph drawn, and its code), fused regions coloured in the
stages up to their pass (the code they replaced) and in every stage from it on (the op that replaced
it), each linked to its row in the region table: op, kernel chosen for the target, where it runs,
and the measured times when the report was profiled. No script and nothing fetched at view time.
"""
from __future__ import annotations

from html import escape

from recompile.graph_svg import graph_svg
from recompile.pipeline import region_colours

STYLE = """
body { font-family: system-ui, sans-serif; margin: 16px; color: #1d2733; }
h1 { font-size: 20px; } h2 { font-size: 17px; margin-top: 28px; } h3 { font-size: 14px; margin: 4px 0; }
table { border-collapse: collapse; font-size: 13px; max-width: 100%; } td, th { border: 1px solid #c8d0d9; padding: 3px 7px; vertical-align: top; }
td.wrap { overflow-wrap: anywhere; min-width: 9em; }
th { background: #eef1f5; text-align: left; }
.plan-only { background: #fff4d6; border: 1px solid #e0b84c; padding: 6px 10px; display: inline-block; }
.stages { display: flex; gap: 14px; overflow-x: auto; align-items: flex-start; padding-bottom: 8px; }
.stage { flex: 0 0 auto; border: 1px solid #c8d0d9; border-radius: 4px; padding: 6px; max-width: 720px; }
pre.code { font-size: 11px; overflow-x: auto; max-width: 700px; margin: 4px 0; }
pre.code span { display: block; white-space: pre; }
pre.replaced { font-size: 11px; margin: 2px 0; white-space: pre-wrap; }
.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.region:target, .region-line:target { outline: 2px solid #d9480f; }
"""


def _e(value) -> str:
    return escape(str(value))


def _kind_style() -> str:
    return "\n".join(f".kind-{k} {{ background: {c}; }}" for k, c in region_colours().items())


def _table(headers: list[str], rows: list[str]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _cells(*values, cls: str = "") -> str:
    attr = f' class="{cls}"' if cls else ""
    return "".join(f"<td{attr}>{v}</td>" for v in values)


def _break_reason(data: dict, graph: dict) -> str:
    return "" if graph["break"] is None else data["breaks"][graph["break"]]["reason"]


def _summary(data: dict) -> str:
    graphs = [
        f"<tr>{_cells(g['id'], g['num_nodes_before'], g['num_nodes_after'], _e(_break_reason(data, g)))}</tr>"
        for g in data["graphs"]
    ]
    passes = [
        f"<tr>{_cells(p['graph'], _e(p['pass']), _e(p['doc']), p['num_nodes_before'], p['num_nodes_after'], p['regions'], _e(', '.join(p['removed'])), _e(', '.join(p['added'])), _e(', '.join(p['retargeted'])))}</tr>"
        for p in data["passes"]
    ]
    fallbacks = [f"<tr>{_cells(_e(f['pass']), _e(f['reason']))}</tr>" for f in data["fallbacks"]]
    return (
        f'<section id="summary"><h2>Graphs captured: {len(data["graphs"])}</h2>'
        + _table(["graph", "nodes before", "nodes after", "graph break"], graphs)
        + "<h2>Passes</h2>"
        + _table(["graph", "pass", "what it does", "nodes before", "nodes after", "regions", "removed", "added", "retargeted"], passes)
        + f'<h2 id="fallbacks">Fallbacks: {len(data["fallbacks"])}</h2>'
        + (_table(["pass", "reason"], fallbacks) if fallbacks else "<p>none</p>")
        + "</section>"
    )


def _stage_index(data: dict) -> dict[tuple[int, str], int]:
    index, seen = {}, {}
    for stage in data["stages"]:
        position = seen.get(stage["graph"], 0)
        index[stage["graph"], stage["name"]] = position
        seen[stage["graph"]] = position + 1
    return index


def _node_link(graph: int, stage: int, name: str, part: str) -> str:
    return f'<a href="#g{graph}-s{stage}-{part}-{_e(name)}">{_e(name)}</a>'


def _regions(data: dict) -> str:
    index = _stage_index(data)
    profiled = any(r["profile"] for r in data["regions"])
    headers = ["#", "kind", "graph", "pass", "replaced (code)", "fused as", "op", "kernel", "kernel kind", "runs as"]
    if profiled:
        headers += ["eager ms", "fused ms", "speedup"]
    rows = []
    for r in data["regions"]:
        before, after = index[r["graph"], r["stage_before"]], index[r["graph"], r["stage_after"]]
        replaced = ", ".join(_node_link(r["graph"], before, n, "code") for n in r["replaced"])
        code = "".join(f'<pre class="replaced">{_e(c)}</pre>' for c in r["replaced_code"])
        code += "".join(f'<pre class="replaced source">from {_e(s)}</pre>' for s in r["source"])
        fused = ", ".join(_node_link(r["graph"], after, n, "node") for n in r["fused"])
        cells = _cells(r["id"], f'<span class="kind-{_e(r["kind"])}">{_e(r["kind"])}</span>', r["graph"], _e(r["pass"]))
        cells += _cells(replaced + code, fused, _e(r["op"]), _e(r["kernel"]), cls="wrap")
        cells += _cells(_e(r["kernel_kind"]), _e(r["runs_as"]))
        if profiled:
            p = r["profile"] or {}
            cells += _cells(*(f"{p[k]:.4f}" if k in p else "" for k in ("eager_ms", "fused_ms")), cls="num")
            cells += _cells(f"{p['speedup']:.2f}x" if p else "", cls="num")
        rows.append(f'<tr class="region" id="region-{r["id"]}" data-kind="{_e(r["kind"])}">{cells}</tr>')
    note = f'<p class="profile-note">{_e(data["profile_note"])}</p>' if data["profile_note"] else ""
    return (
        f'<section id="regions"><h2>Fused regions: {len(data["regions"])}</h2>'
        + (_table(headers, rows) if rows else "<p>none</p>")
        + note
        + "</section>"
    )


def _plan(data: dict) -> str:
    target = data["target"]
    state = "executed here" if data["executed"] else "not executed: planned from the target tables"
    items = "".join(
        f"<li><b>{_e(runs)}</b>: {len(entries)}<ul>{''.join(f'<li>{_e(x)}</li>' for x in entries)}</ul></li>"
        for runs, entries in data["plan"].items()
    )
    return f'<section id="plan"><h2>Plan for {_e(target["name"])} ({_e(state)})</h2><ul>{items}</ul></section>'


def _highlights(data: dict, graph: int, stage_names: list[str]) -> list[dict[str, tuple[int, str]]]:
    """For each stage of ``graph``: node name -> (region id, kind) of the regions visible in it: the
    replaced nodes up to the stage their pass started from, the fused ones from the pass's stage on."""
    marks: list[dict[str, tuple[int, str]]] = [{} for _ in stage_names]
    for r in (r for r in data["regions"] if r["graph"] == graph):
        mark = (r["id"], r["kind"])
        for earlier in marks[: stage_names.index(r["stage_before"]) + 1]:
            earlier.update((n, mark) for n in r["replaced"])
        for later in marks[stage_names.index(r["stage_after"]):]:
            later.update((n, mark) for n in r["fused"])
    return marks


def _code(stage: dict, prefix: str, marks: dict[str, tuple[int, str]]) -> str:
    by_line = {line: name for name, line in stage["lines"].items()}
    spans = []
    for i, text in enumerate(stage["readable"].splitlines()):
        name = by_line.get(i)
        attrs = f' id="{prefix}-code-{_e(name)}"' if name else ""
        if name in marks:
            attrs += f' class="region-line kind-{marks[name][1]}" data-region="{marks[name][0]}"'
        spans.append(f"<span{attrs}>{_e(text) or ' '}</span>")
    return f'<pre class="code">{"".join(spans)}</pre>'


def _graph_section(data: dict, graph: dict) -> str:
    stages = [s for s in data["stages"] if s["graph"] == graph["id"]]
    marks = _highlights(data, graph["id"], [s["name"] for s in stages])
    columns = []
    for i, (stage, mark) in enumerate(zip(stages, marks)):
        prefix = f"g{graph['id']}-s{i}"
        columns.append(
            f'<div class="stage" id="{prefix}" data-stage="{_e(stage["name"])}">'
            f'<h3>{i}. {_e(stage["name"])} &middot; {stage["num_nodes"]} nodes</h3>'
            f"{graph_svg(stage['nodes'], prefix, mark)}"
            f"<details><summary>code</summary>{_code(stage, prefix, mark)}</details></div>"
        )
    brk = f" &middot; graph break: {_e(_break_reason(data, graph))}" if graph["break"] is not None else ""
    return (
        f'<section class="graph" id="graph-{graph["id"]}"><h2>Graph {graph["id"]}: stages{brk}</h2>'
        f'<div class="stages">{"".join(columns)}</div></section>'
    )


def render_html(data: dict, title: str) -> str:
    """The report ``data`` (``Report.to_dict()``) as one HTML page."""
    target = data["target"]
    banner = (
        "" if data["executed"]
        else f'<p class="plan-only">Plan only: {_e(target["name"])} is not present on this machine; nothing was executed on it.</p>'
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>recompile inspect: {_e(title)}</title><style>{STYLE}{_kind_style()}</style></head><body>"
        f"<h1>recompile inspect: {_e(title)}</h1>"
        f'<p>target <b>{_e(target["name"])}</b> ({_e(target["chip"])}, {target["num_cores"]} cores, '
        f'triton: {_e(target["triton"])}, {target["fbgemm_ops"]} FBGEMM ops)</p>{banner}'
        + _regions(data)
        + _plan(data)
        + _summary(data)
        + "".join(_graph_section(data, g) for g in data["graphs"])
        + "</body></html>"
    )
