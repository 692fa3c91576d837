"""``recompile.explain``: capture a model with Dynamo and run the pipeline, without compiling it."""
from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch._dynamo import symbolic_convert

from recompile import autotune
from recompile.backend import detect_target
from recompile.tracing import TracingConfig
from recompile.options import RecompileOptions
from recompile.pipeline import PassContext, run_pipeline
from recompile.report import GraphBreak, GraphReport, Report


def _graph_break(gm: torch.fx.GraphModule) -> GraphBreak | None:
    """Why Dynamo ended ``gm`` early, and where in the user's code (FILE:LINE in FUNCTION: CODE); None if it ended
    with its frame."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    frame = reason.user_stack[-1] if reason.user_stack else None
    where = f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}" if frame else None
    return GraphBreak(str(reason.reason), where)


# Dynamo's graph-break log line: "Graph break [(user stack suppressed ...)] in user code at FILE:LINE\nGraph Break
# Reason: REASON", then the stack.
_LOGGED_BREAK = re.compile(r"in user code at (?P<where>.+?:\d+)\nGraph Break Reason: (?P<reason>.*?)"
                           r"(?:\n\n(?:Stack variable source attribution|User code traceback)|\Z)", re.S)


class _BreakLog(logging.Handler):
    """Every graph break Dynamo logs, also one that ends no captured graph: a break before the frame's first op,
    or a break in a loop, after which Dynamo runs the whole function eagerly."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.breaks: list[GraphBreak] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = _LOGGED_BREAK.search(record.getMessage())
        if match:
            found = GraphBreak(match["reason"].strip(), match["where"])
            # Dynamo logs a break once per enclosing frame it traced, and again when it restarts an analysis.
            if all((b.summary, b.where) != (found.summary, found.where) for b in self.breaks):
                self.breaks.append(found)


@contextlib.contextmanager
def logged_breaks():
    """Listen to Dynamo's graph-break log (the ``graph_breaks`` artifact of TORCH_LOGS) while Dynamo traces
    (``explain``, ``models.bench_corpus``), without printing it; the logger's settings are restored after."""
    log, handler = symbolic_convert.graph_break_log, _BreakLog()
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    try:
        yield handler.breaks
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def _one_list(breaks: list[GraphBreak], ended: list[tuple[GraphReport, GraphBreak | None]]) -> None:
    """Point each graph that ends at a break to that break in Dynamo's log (``breaks``: FILE:LINE only; the graph's
    reason adds the function and the line of code), so a break is reported once."""
    for graph, own in ended:
        if own is None:
            continue
        logged = next((b for b in breaks if b.where and own.where and own.where.startswith(f"{b.where} ")), None)
        if logged is None:
            breaks.append(own)
        else:
            logged.where = own.where
        graph.graph_break = logged or own


@dataclass
class _RecordingContext(PassContext):
    """A PassContext that also keeps each stage's graph module, for drawing, diffing and profiling."""

    modules: list[fx.GraphModule] = field(default_factory=list)

    def record_stage(self, name: str, gm: fx.GraphModule) -> None:
        super().record_stage(name, gm)
        self.modules.append(gm)


def explain(model, *example_inputs, options: RecompileOptions | Mapping[str, Any] | None = None) -> Report:
    """Report what rec_ascend would do to ``model``: stages, regions, chosen kernels and fallbacks.

    The model runs once eagerly on ``example_inputs`` (Dynamo captures its graphs that way); nothing
    is compiled, and a target that is not present here (``target="npu"`` on a CPU machine) is planned for.
    The report keeps each stage's graph module and each graph's inputs: ``recompile.profile`` times the
    regions on them, and the JSON and HTML forms draw every stage.
    """
    opts = RecompileOptions.coerce(options)
    report = Report(detect_target(opts.target))
    ended = []

    def capture(gm: torch.fx.GraphModule, inputs):
        ctx = _RecordingContext(opts, report.target, None, graph_id=len(report.graphs))
        ctx.tuning = autotune.cached_decision(run_pipeline(gm, ctx), report.target.name)
        report.graphs.append(GraphReport(ctx, None, ctx.modules, list(inputs)))
        ended.append((report.graphs[-1], _graph_break(gm)))
        return gm.forward

    capture.backend_ctx_ctor = TracingConfig  # Dynamo traces as it does for rec_ascend
    with logged_breaks() as breaks:
        torch.compile(model, backend=capture)(*example_inputs)
    _one_list(breaks, ended)
    report.breaks = breaks
    return report
