"""Time each fused region against the eager code it replaced, on the inputs ``explain`` captured.

For a region made by pass P, the graph before P runs once on the graph's inputs to get the values
flowing into the region; the replaced nodes (eager) and the nodes P put in their place (fused, with
the kernel chosen for the target) are each cut out as a graph module and timed on those values.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.utils.fuser_utils import fuse_as_graphmodule
from torch.utils.benchmark import Timer

from recompile.report import Report

MIN_RUN_TIME_S = 0.05


def _values(gm: fx.GraphModule, inputs) -> dict[str, object]:
    """Every node's value when ``gm`` runs on ``inputs``."""
    interpreter = fx.Interpreter(gm, garbage_collect_values=False)
    interpreter.run(*inputs)
    return {node.name: value for node, value in interpreter.env.items()}


def _time_ms(gm: fx.GraphModule, nodes: list[str], values: dict[str, object]) -> float:
    wanted = set(nodes)
    sub, inputs, _ = fuse_as_graphmodule(gm, [n for n in gm.graph.nodes if n.name in wanted], "region")
    args = [values[n.name] for n in inputs]
    timer = Timer(stmt="fn(*args)", globals={"fn": sub, "args": args})
    return timer.blocked_autorange(min_run_time=MIN_RUN_TIME_S).median * 1e3


def profile_regions(report: Report) -> None:
    """Fill ``report.profile`` (region id -> eager_ms, fused_ms, speedup), or say why nothing was measured."""
    if not report.target.available:
        report.profile_note = f"not measured: target {report.target.name} is not present here"
        return
    devices = {x.device.type for g in report.graphs for x in g.inputs or () if isinstance(x, torch.Tensor)}
    if devices - {report.target.name}:
        report.profile_note = f"not measured: the example inputs are on {', '.join(sorted(devices))}, the target is {report.target.name}"
        return
    values: dict[tuple[int, int], dict] = {}  # (graph, stage) -> node values
    with torch.no_grad():
        for region_id, (graph, region) in enumerate(report.regions()):
            details = graph.region_details(region)
            after = graph.stage_index(region.pass_name)
            for index in (after - 1, after):
                if (graph.ctx.graph_id, index) not in values:
                    values[graph.ctx.graph_id, index] = _values(graph.modules[index], graph.inputs)
            eager = _time_ms(graph.modules[after - 1], region.replaced, values[graph.ctx.graph_id, after - 1])
            fused = _time_ms(graph.modules[after], details["fused"], values[graph.ctx.graph_id, after])
            report.profile[region_id] = {"eager_ms": eager, "fused_ms": fused, "speedup": eager / fused}
    if not report.profile:
        report.profile_note = "no regions to measure"
