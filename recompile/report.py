"""What the pipeline did to a model: ``recompile.explain`` returns a Report.

``Report.to_dict()`` is the JSON form (keys: target, executed, graphs, passes, stages, regions, fallbacks,
plan, profile_note); ``to_text()`` the summary the CLI prints; ``recompile.html_report`` draws the dict.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterator

import torch.fx as fx

from recompile import dump
from recompile.lowering import Target
from recompile.pipeline import PASSES, PassContext, Region

# What a chosen kernel runs as, by lowering kind. Library ops are named by the library each target has.
LIBRARIES = {"fbgemm": {"cpu": "fbgemm-gpu-cpu op", "cuda": "fbgemm-gpu op", "npu": "fbgemm-ascend op"}}
HKV = "HKV call"  # torch.ops.hkv.* and hkv:: ops: the hash-table runtime, on every target
RUNS_AS = {
    "triton": "Triton kernel ({triton})",
    "cpu_kernel": "CPU kernel",
    "aten": "ATen ops, fused by Inductor",
    "reference": "reference (plain torch), fused by Inductor",
}
INDUCTOR = "Inductor (compile_fx)"
# Namespaces of the ops the rec passes insert; every other call of the final graph goes to Inductor.
REC_OP_NAMESPACES = ("recompile.", "hkv.")
_NODE_LINE = re.compile(r"^\s+(\w+)(?:: \"[^\"]*\")? = ")


# Graph-break reasons, as Dynamo words them -> the setting or rewrite that removes the break. rec_ascend traces
# with the settings of ``recompile.tracing.TRACING_CONFIG``; the others are rewrites of the user's code.
BREAK_REMEDIES = (
    (re.compile(r"Dynamic shape operator|capture_dynamic_output_shape_ops"),
     "an op whose output size depends on the data (repeat_interleave, nonzero, masked_select, a boolean mask "
     "index): compile with backend='rec_ascend' (it traces with capture_dynamic_output_shape_ops=True) or set "
     "torch._dynamo.config.capture_dynamic_output_shape_ops = True; "
     "repeat_interleave(..., output_size=values.shape[0]) avoids it"),
    (re.compile(r"Tensor\.item\(\)|capture_scalar_outputs"),
     "a Python number read from a tensor (.item(), int(t)): compile with backend='rec_ascend' (it traces with "
     "capture_scalar_outputs=True) or set torch._dynamo.config.capture_scalar_outputs = True"),
    (re.compile(r"[Dd]ata-dependent expression|GuardOnDataDependentSymNode"),
     "a size read from the data (.item(), nonzero) is checked against a number Dynamo cannot decide: state what "
     "holds right after reading it, e.g. torch._check(max_len > 0), or pad to a static max length"),
    (re.compile(r"generic_jump|[Dd]ata-dependent branching"),
     "a Python `if` on a tensor's value: write it as torch.where(...) or torch.cond(...), or move the check out "
     "of the compiled model"),
    (re.compile(r"graph break in loop"),
     "a break inside a for/while loop: Dynamo runs the whole function holding the loop eagerly; remove the break "
     "named above it (often a Python number read from a tensor in the loop), or write the loop as tensor ops"),
    (re.compile(r"builtin operator `print`|logging"),
     "a print or log call: remove it, or list the function in torch._dynamo.config.reorderable_logging_functions"),
    (re.compile(r"FBCODE_SKIP_TORCHREC|skip_torchrec"),
     "a TorchRec module Dynamo skips: compile with backend='rec_ascend' (it traces with skip_torchrec=False)"),
    (re.compile(r"RNN, GRU, or LSTM|allow_rnn"),
     "an nn.GRU / nn.LSTM / nn.RNN: compile with backend='rec_ascend' (it traces with allow_rnn=True; a GRU or an "
     "LSTM becomes one op, recompile::gru / lstm) or set torch._dynamo.config.allow_rnn = True"),
    (re.compile(r"marked as skipped|skip_files|[Ss]kipped"),
     "a call Dynamo does not trace: wrap it as a custom op (torch.library.custom_op) or allow it in the graph "
     "with torch.compiler.allow_in_graph"),
)


@dataclass
class GraphBreak:
    """Why Dynamo ended a graph before its frame's end, where in the user's code, and what removes it."""

    reason: str
    where: str | None = None

    @property
    def remedy(self) -> str | None:
        return next((fix for pattern, fix in BREAK_REMEDIES if pattern.search(self.reason)), None)

    @property
    def summary(self) -> str:
        """The reason's first line that says something: Dynamo heads some with a line ending in ':'."""
        lines = [line.strip() for line in self.reason.splitlines() if line.strip()]
        return next((line for line in lines if not line.endswith(":")), lines[0] if lines else "")

    def to_dict(self) -> dict:
        return {"reason": self.reason, "summary": self.summary, "at": self.where, "remedy": self.remedy}


def runs_as(region: Region, target: Target) -> str:
    if region.impl.kind != "library" and not region.op.startswith("hkv::"):
        return RUNS_AS[region.impl.kind].format(triton=target.triton)
    library = region.impl.describe.removeprefix("torch.ops.").split(".")[0]
    if library == "hkv" or region.op.startswith("hkv::"):
        return HKV
    return LIBRARIES.get(library, {}).get(target.name, f"{library} op")


def node_lines(code: str) -> dict[str, int]:
    """Line number (0-based) of each node's assignment in ``code``; the output node is the ``return``."""
    lines = {}
    for i, line in enumerate(code.splitlines()):
        match = _NODE_LINE.match(line)
        if match:
            lines.setdefault(match.group(1), i)
        elif line.strip().startswith("return"):
            lines["output"] = i
    return lines


def fused_nodes(before: fx.GraphModule, after: fx.GraphModule, replaced: list[str]) -> list[str]:
    """The nodes a pass put in place of ``replaced``: new nodes that read the region's inputs and feed its users."""
    old = {n.name: n for n in before.graph.nodes}
    region = set(replaced) & old.keys()
    entries = {a.name for r in region for a in old[r].all_input_nodes if a.name not in region}
    exits = {u.name for r in region for u in old[r].users if u.name not in region}
    new = [n for n in after.graph.nodes if n.name not in old]
    reads, feeds = set(), set()
    for n in new:
        if any(a.name in entries or a.name in reads for a in n.all_input_nodes):
            reads.add(n.name)
    for n in reversed(new):
        if any(u.name in exits or u.name in feeds for u in n.users):
            feeds.add(n.name)
    fused = [n.name for n in new if n.name in reads and n.name in feeds]
    # A pass that rewrote the region's nodes in place (same names, new targets) made no new node.
    return fused or [
        n.name for n in after.graph.nodes if n.name in region and dump.target_name(n) != dump.target_name(old[n.name])
    ]


def _is_rec_op(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith(REC_OP_NAMESPACES)


@dataclass
class GraphReport:
    ctx: PassContext
    graph_break: GraphBreak | None  # the break (one of Report.breaks) that ended this graph, None at the frame's end
    modules: list[fx.GraphModule] = field(default_factory=list)  # the graph at each stage, as ctx.stages
    inputs: list | None = None  # the inputs Dynamo passed to this graph; profiling runs the stages on them

    def to_dict(self) -> dict:
        stages = self.ctx.stages
        return {
            "id": self.ctx.graph_id,
            "num_nodes_before": stages[0].num_nodes,
            "num_nodes_after": stages[-1].num_nodes,
            "inductor_nodes": sum(1 for n in self.modules[-1].graph.nodes if n.op.startswith("call") and not _is_rec_op(n)),
        }

    def stage_index(self, name: str) -> int:
        """Index of stage ``name``; the stage before it holds the graph its pass started from."""
        return [s.name for s in self.ctx.stages].index(name)

    def stage_dicts(self) -> list[dict]:
        out = []
        for stage, gm in zip(self.ctx.stages, self.modules):
            code = dump.readable_code(gm)
            out.append({**stage.to_dict(), "readable": code, "lines": node_lines(code), **dump.graph_to_json(gm)})
        return out

    def pass_dicts(self) -> list[dict]:
        """Per pass: node counts, regions, and the nodes it removed, added or retargeted."""
        out = []
        for i in range(1, len(self.modules)):
            before = {n.name: dump.target_name(n) for n in self.modules[i - 1].graph.nodes}
            after = {n.name: dump.target_name(n) for n in self.modules[i].graph.nodes}
            name = self.ctx.stages[i].name
            out.append(
                {
                    "graph": self.ctx.graph_id,
                    "pass": name,
                    "doc": PASSES[name].summary.removeprefix(f"{name}: ").rstrip("."),
                    "num_nodes_before": len(before),
                    "num_nodes_after": len(after),
                    "regions": sum(1 for r in self.ctx.regions if r.pass_name == name),
                    "removed": [n for n in before if n not in after],
                    "added": [n for n in after if n not in before],
                    "retargeted": [n for n in after if n in before and before[n] != after[n]],
                }
            )
        return out

    def region_details(self, region: Region) -> dict:
        index = self.stage_index(region.pass_name)
        before, after = self.modules[index - 1], self.modules[index]
        code = dump.readable_code(before)
        lines, code_lines = node_lines(code), code.splitlines()
        nodes = [n for n in before.graph.nodes if n.name in region.replaced]
        return {
            "graph": self.ctx.graph_id,
            "stage_before": self.ctx.stages[index - 1].name,
            "stage_after": region.pass_name,
            "fused": fused_nodes(before, after, region.replaced),
            # The replaced nodes' lines, less the `;  x = None` that frees dead values.
            "replaced_code": [code_lines[lines[n.name]].strip().split(";  ")[0] for n in nodes],
            "source": list(dict.fromkeys(s for s in map(dump.source_line, nodes) if s)),
        }


@dataclass
class Report:
    target: Target
    graphs: list[GraphReport] = field(default_factory=list)
    # Region id -> measured times (recompile.profile); why nothing was measured, when it was asked for.
    profile: dict[int, dict] = field(default_factory=dict)
    profile_note: str | None = None
    # Every graph break Dynamo made, in order: also those that end no captured graph (a break before a frame's
    # first op, a break in a loop after which Dynamo runs the whole function eagerly).
    breaks: list[GraphBreak] = field(default_factory=list)

    def regions(self) -> Iterator[tuple[GraphReport, Region]]:
        for g in self.graphs:
            for r in g.ctx.regions:
                yield g, r

    def to_dict(self) -> dict:
        contexts = [g.ctx for g in self.graphs]
        regions = [
            {
                "id": i,
                **r.to_dict(),
                **g.region_details(r),
                "runs_as": runs_as(r, self.target),
                "profile": self.profile.get(i),
            }
            for i, (g, r) in enumerate(self.regions())
        ]
        return {
            "target": self.target.to_dict(),
            "executed": self.target.available,
            "graphs": [{**g.to_dict(), "break": self._break_index(g)} for g in self.graphs],
            "breaks": [b.to_dict() for b in self.breaks],
            "passes": [p for g in self.graphs for p in g.pass_dicts()],
            "stages": [s for g in self.graphs for s in g.stage_dicts()],
            "regions": regions,
            "fallbacks": [f.to_dict() for c in contexts for f in c.fallbacks],
            "plan": self._plan(regions),
            "profile_note": self.profile_note,
            "autotune": [{"graph": c.graph_id, **c.tuning} for c in contexts if c.tuning],
        }

    def _break_index(self, graph: GraphReport) -> int | None:
        """Which of ``breaks`` ended ``graph``, None if it ended with its frame."""
        return next((i for i, b in enumerate(self.breaks) if b is graph.graph_break), None)

    def _plan(self, regions: list[dict]) -> dict[str, list[str]]:
        """Where each region runs on the target (every library and kernel kind the target has, even if
        empty), and how much of each graph is left to Inductor."""
        target = self.target
        plan: dict[str, list[str]] = {LIBRARIES["fbgemm"][target.name]: []}
        if target.triton:
            plan[RUNS_AS["triton"].format(triton=target.triton)] = []
        plan[HKV] = []
        for r in regions:
            plan.setdefault(r["runs_as"], []).append(f"#{r['id']} {r['op']} via {r['kernel']}")
        plan[INDUCTOR] = [f"rest of graph {g['id']}: {g['inductor_nodes']} calls" for g in (x.to_dict() for x in self.graphs)]
        return plan

    def to_text(self) -> str:
        d = self.to_dict()
        lines = [f"target: {self.target.name} ({self.target.chip})"]
        if not self.target.available:
            lines.append("  plan only: this target is not present here; nothing was executed on it")
        lines.append(f"graphs captured: {len(self.graphs)}")
        for g in d["graphs"]:
            brk = "" if g["break"] is None else f"; ended by graph break #{g['break']}"
            lines.append(f"  graph {g['id']}: {g['num_nodes_before']} -> {g['num_nodes_after']} nodes{brk}")
        if d["breaks"]:
            lines.append(f"graph breaks Dynamo made: {len(d['breaks'])}")
        for i, b in enumerate(d["breaks"]):
            lines.append(f"  #{i} {b['summary']}")
            lines.extend(f"      {label}: {b[key]}" for label, key in (("at", "at"), ("fix", "remedy")) if b[key])
        lines.append("passes:")
        lines.extend(_pass_line(p) for p in d["passes"])
        lines.append(f"regions: {len(d['regions'])}")
        for r in d["regions"]:
            lines.append(
                f"  #{r['id']} [{r['kind']}] graph {r['graph']}, pass {r['pass']}: {', '.join(r['replaced'])} -> {r['op']}"
            )
            lines.append(f"      fused as: {', '.join(r['fused'])}")
            lines.append(f"      kernel on {r['target']}: {r['kernel']} ({r['kernel_kind']}), runs as {r['runs_as']}")
            lines.extend(f"      replaced: {code}" for code in r["replaced_code"])
            lines.extend(f"      from: {source}" for source in r["source"])
            if r["profile"]:
                p = r["profile"]
                lines.append(f"      measured: eager {p['eager_ms']:.4f} ms, fused {p['fused_ms']:.4f} ms ({p['speedup']:.2f}x)")
        if d["profile_note"]:
            lines.append(f"  profile: {d['profile_note']}")
        executed = "executed here" if self.target.available else "NOT executed: planned from the target tables"
        lines.append(f"plan for {self.target.name} ({executed}):")
        for runs, items in d["plan"].items():
            lines.append(f"  {runs}: {len(items)}")
            lines.extend(f"    {item}" for item in items)
        lines.append(f"fallbacks: {len(d['fallbacks'])}")
        lines.extend(f"  graph {g.ctx.graph_id} {f.pass_name}: {f.reason}" for g in self.graphs for f in g.ctx.fallbacks)
        for t in d["autotune"]:
            timings = ", ".join(f"{name} {ms:.3f} ms" for name, ms in t["timings_ms"].items())
            source = "cached" if t["cached"] else "measured"
            lines.append(f"autotune graph {t['graph']} ({t['mode']}, {source}): {t['choice']} [{timings}]")
            ran = ", ".join(f"{node}: {impl}" for node, impl in t["regions"].items())
            lines.append(f"  regions it runs: {ran or 'none (the captured graph)'}")
            lines.append(f"  timed on: {t['conditions']['clock']} clock")
            lines.extend(f"  rejected {name}: {why}" for name, why in t["rejected"].items())
        return "\n".join(lines)


def _pass_line(p: dict) -> str:
    changes = [f"{len(p[k])} {k}" for k in ("removed", "added", "retargeted") if p[k]]
    what = ", ".join(changes) if changes else "no change"
    return (
        f"  graph {p['graph']} {p['pass']}: {p['num_nodes_before']} -> {p['num_nodes_after']} nodes, "
        f"{p['regions']} region(s); {what} ({p['doc']})"
    )
