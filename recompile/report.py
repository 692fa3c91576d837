"""What the pipeline did to a model: ``recompile.explain`` returns a Report."""
from __future__ import annotations

from dataclasses import dataclass, field

from recompile.lowering import Target
from recompile.pipeline import PassContext


@dataclass
class GraphReport:
    ctx: PassContext
    break_reason: str | None  # why Dynamo ended this graph (a graph break), None at the frame's end

    def to_dict(self) -> dict:
        stages = self.ctx.stages
        return {
            "id": self.ctx.graph_id,
            "break_reason": self.break_reason,
            "num_nodes_before": stages[0].num_nodes,
            "num_nodes_after": stages[-1].num_nodes,
        }


@dataclass
class Report:
    target: Target
    graphs: list[GraphReport] = field(default_factory=list)

    def to_dict(self) -> dict:
        contexts = [g.ctx for g in self.graphs]
        return {
            "target": self.target.to_dict(),
            "executed": self.target.available,
            "graphs": [g.to_dict() for g in self.graphs],
            "stages": [s.to_dict() for c in contexts for s in c.stages],
            "regions": [r.to_dict() for c in contexts for r in c.regions],
            "fallbacks": [f.to_dict() for c in contexts for f in c.fallbacks],
            "autotune": [{"graph": c.graph_id, **c.tuning} for c in contexts if c.tuning],
        }

    def to_text(self) -> str:
        d = self.to_dict()
        lines = [f"target: {self.target.name} ({self.target.chip})"]
        if not self.target.available:
            lines.append("  plan only: this target is not present here; nothing was executed on it")
        lines.append(f"graphs captured: {len(self.graphs)}")
        for g in d["graphs"]:
            brk = f"; graph break: {g['break_reason']}" if g["break_reason"] else ""
            lines.append(f"  graph {g['id']}: {g['num_nodes_before']} -> {g['num_nodes_after']} nodes{brk}")
        lines.append(f"regions: {len(d['regions'])}")
        for r in d["regions"]:
            lines.append(
                f"  [{r['kind']}] {r['pass']}: {', '.join(r['replaced'])} -> {r['op']} "
                f"on {r['target']} via {r['kernel']} ({r['kernel_kind']})"
            )
        lines.append(f"fallbacks: {len(d['fallbacks'])}")
        lines.extend(f"  {f['pass']}: {f['reason']}" for f in d["fallbacks"])
        for t in d["autotune"]:
            timings = ", ".join(f"{name} {ms:.3f} ms" for name, ms in t["timings_ms"].items())
            source = "cached" if t["cached"] else "measured"
            lines.append(f"autotune graph {t['graph']} ({t['mode']}, {source}): {t['choice']} [{timings}]")
            lines.extend(f"  rejected {name}: {why}" for name, why in t["rejected"].items())
        return "\n".join(lines)
