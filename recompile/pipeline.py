"""The rec pass pipeline: ordered, named FX -> FX passes over the graph Dynamo captured.

Each pass is ``(gm, ctx) -> gm``, lives in its own module under ``recompile/passes/`` and declares
itself once with ``register_pass`` (name, order, region kinds and their report colours; its module docstring is
its doc): ``PASSES`` holds the declarations, and ``PASS_ORDER``, ``REGION_KINDS``, ``DRAWS_OTHER_RANDOM`` and the
report's colours are read from them. The pipeline runs every enabled pass on a copy of the graph; if a pass
raises, its input graph is kept, the failure is recorded as a fallback and a warning says so. The
context records every region a pass replaced and the kernel the lowering registry chose for it.
"""
from __future__ import annotations

import functools
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from recompile import dump
from recompile.lowering import LOWERINGS, Impl, Target, choose
from recompile.lowering.registry import bind, unsupported
from recompile.options import RecompileOptions

PassFn = Callable[[fx.GraphModule, "PassContext"], fx.GraphModule]


@dataclass(frozen=True)
class PassSpec:
    """A pass, declared once by its module (``register_pass``); the pipeline, the reports and ``recompile
    inspect`` read it from ``PASSES``."""

    name: str
    order: int  # passes run in increasing order
    fn: PassFn
    regions: Mapping[str, str]  # region kind the pass records -> its colour in the HTML report
    draws_other_random: bool  # its replacement draws other random numbers than the graph: ``verify`` cannot compare
    doc: str  # the pass module's docstring: pattern -> replacement -> why

    @property
    def summary(self) -> str:
        return self.doc.strip().split("\n", 1)[0]


PASSES: dict[str, PassSpec] = {}


def register_pass(
    name: str, order: int, regions: Mapping[str, str] | None = None, draws_other_random: bool = False
) -> Callable[[PassFn], PassFn]:
    """Declare ``fn`` as pass ``name``, run at ``order``, recording regions of the kinds in ``regions`` (kind ->
    report colour). Adding a pass is a module under ``recompile/passes/`` with this decorator, imported there."""

    def wrap(fn: PassFn) -> PassFn:
        spec = PassSpec(name, order, fn, dict(regions or {}), draws_other_random,
                        sys.modules[fn.__module__].__doc__ or fn.__doc__ or "")
        for other in PASSES.values():
            if other.name == name or other.order == order or other.regions.keys() & spec.regions.keys():
                raise ValueError(f"pass {name!r} clashes with pass {other.name!r} (name, order or region kind)")
        PASSES[name] = spec
        return fn

    return wrap


def passes() -> list[PassSpec]:
    """Every pass, in the order they run."""
    import recompile.passes  # noqa: F401  (each pass module registers itself)

    return sorted(PASSES.values(), key=lambda spec: spec.order)


def region_colours() -> dict[str, str]:
    """Region kind -> its colour in the HTML report, as the passes declare them."""
    return {kind: colour for spec in passes() for kind, colour in spec.regions.items()}


def __getattr__(name: str):
    """The names derived from the declarations, computed when read (so always those of the registered passes)."""
    if name == "PASS_ORDER":
        return [spec.name for spec in passes()]
    if name == "REGION_KINDS":
        return tuple(region_colours())
    if name == "DRAWS_OTHER_RANDOM":
        return {spec.name for spec in passes() if spec.draws_other_random}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class Region:
    kind: str
    pass_name: str
    replaced: list[str]
    op: str
    target: str
    impl: Impl

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "pass": self.pass_name,
            "replaced": list(self.replaced),
            "op": self.op,
            "target": self.target,
            "kernel": self.impl.describe,
            "impl": self.impl.impl,
            "kernel_kind": self.impl.kind,
        }


@dataclass
class Fallback:
    pass_name: str
    reason: str

    def to_dict(self) -> dict:
        return {"pass": self.pass_name, "reason": self.reason}


@dataclass
class Stage:
    name: str
    gm: fx.GraphModule = field(repr=False)  # the stage's graph; a later pass works on a copy of it
    num_nodes: int
    graph: int

    @functools.cached_property
    def code(self) -> str:
        """The stage's graph as Python, generated when first read (reports read it; compiling does not)."""
        return self.gm.code

    def to_dict(self) -> dict:
        return {"name": self.name, "code": self.code, "num_nodes": self.num_nodes, "graph": self.graph}


@dataclass
class PassContext:
    options: RecompileOptions
    target: Target
    # Real inputs of the graph (the backend has them); None when only planning (explain).
    example_inputs: Sequence | None = None
    graph_id: int = 0
    regions: list[Region] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    stages: list[Stage] = field(default_factory=list)
    current_pass: str = ""
    tuning: dict | None = None  # the autotune decision for this graph (recompile.autotune.Decision)
    # When the backend was called (time.perf_counter), and Dynamo's tracing seconds before it: the graph's cold
    # compile, which its compile budget counts (recompile.autotune.CompileBudget).
    started: float = field(default_factory=time.perf_counter)
    traced_s: float = 0.0

    def lower(self, op: str, *args, **kwargs) -> Impl:
        """The implementation of ``op`` the target runs: the first in the lowering table it can run whose kernel
        supports the op's arguments ``args``/``kwargs`` (FX nodes or values, as the op's call will get them; their
        example values are what ``supports`` sees). A pass gives them: ``check_kernels`` rejects a pass whose
        graph calls a kernel on arguments it does not support."""
        args, kwargs = fx.node.map_arg((args, kwargs), example_value)
        return choose(op, self.target, *args, **kwargs)

    def record_region(self, kind: str, replaced: Sequence[fx.Node | str], op: str, impl: Impl) -> None:
        kinds = region_colours()
        if kind not in kinds:
            raise ValueError(f"region kind {kind!r} is not one declared by a pass: {tuple(kinds)}")
        names = [n.name if isinstance(n, fx.Node) else n for n in replaced]
        self.regions.append(Region(kind, self.current_pass, names, op, self.target.name, impl))

    def record_stage(self, name: str, gm: fx.GraphModule) -> None:
        stage = Stage(name, gm, len(gm.graph.nodes), self.graph_id)
        self.stages.append(stage)
        if self.options.dump_dir:
            dump.write_stage(self.options.dump_dir, self.graph_id, len(self.stages) - 1, name, gm)


def graph_fake_mode(graph: fx.Graph):
    """The fake mode of ``graph``'s example values (every node of a graph shares one), None where it has none."""
    return next((v.fake_mode for n in graph.nodes for v in [n.meta.get("example_value", n.meta.get("val"))]
                 if hasattr(v, "fake_mode")), None)


def example_value(node: fx.Node):
    """The fake value of ``node`` (Dynamo's ``example_value`` or AOT's ``val``); for a node a pass added without one,
    its target run on its arguments' fake values (and kept)."""
    value = node.meta.get("example_value", node.meta.get("val"))
    if value is not None or node.op not in ("call_function", "call_method"):
        return value
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), example_value)
    fake_mode = graph_fake_mode(node.graph)
    if fake_mode is None:
        raise ValueError(f"node {node.name} has no example value: no kernel can be chosen for its arguments")
    with fake_mode:
        target = getattr(args[0], node.target) if node.op == "call_method" else node.target
        value = node.meta["example_value"] = target(*args[node.op == "call_method":], **kwargs)
    return value


def call_before(graph: fx.Graph, target: Any, args: tuple, before: fx.Node, **kwargs: Any) -> fx.Node:
    """A new call of ``target`` before ``before``, in its layer (``nn_module_stack``), with its example value."""
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs)
    for key in ("nn_module_stack", "stack_trace"):
        if key in before.meta:
            node.meta[key] = before.meta[key]
    example_value(node)  # its target run on its inputs' fake values, kept in its meta
    return node


def rewrite_each(gm: fx.GraphModule, match: Callable[[fx.Node], Any],
                 rewrite: Callable[[fx.Graph, fx.Node, Any], fx.Node]) -> fx.GraphModule:
    """``gm`` with each node that ``match`` finds (not None) replaced by ``rewrite(graph, node, found)``'s node: a
    copy, ``gm`` left as it is (the race runs it eagerly), or ``gm`` itself where ``match`` finds none."""
    from recompile.passes.utils import replace_node  # the passes import this module

    if not any(match(node) is not None for node in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in list(graph.nodes):
        if (found := match(node)) is not None:
            replace_node(node, rewrite(graph, node, found))
    return fx.GraphModule(gm, graph)


def check_kernels(gm: fx.GraphModule) -> None:
    """Every call of a registered op in ``gm`` names a kernel (its ``impl`` argument) that supports the call's
    arguments, so the kernel the report names is the one that runs; raise naming the node otherwise."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        op = node.target._schema.name
        if op not in LOWERINGS:
            continue
        arguments = bind(op, *fx.node.map_arg((node.args, node.kwargs), example_value))
        impl = next((i for i in LOWERINGS[op] if i.impl == arguments.get("impl")), None)
        why = "no such kernel" if impl is None else unsupported(op, impl, arguments)
        if why is not None:
            raise ValueError(f"{node.name} calls {op} with kernel {arguments.get('impl')!r}, which does not support "
                             f"its arguments ({why})")


class VerificationError(RuntimeError):
    """A pass's rewritten graph disagreed with its input graph on the example inputs."""


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with a copy of the graph; parameters and submodules are shared, not copied. Its Python
    code is generated when first needed (called, or ``code`` read): the pipeline's passes work on the graph, so
    only the graph the pipeline returns is turned into code (a GraphModule's codegen and ``exec`` were most of
    the pipeline's time, twice per pass)."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return _LazyGraphModule(gm, graph)


def run_pipeline(gm: fx.GraphModule, ctx: PassContext, after: str | None = None) -> fx.GraphModule:
    """``gm`` rewritten by every enabled pass, as a plain GraphModule (its code generated once, here: a lazy one
    would pass each later call, and each call after an in-place edit, through its recompile check). ``after``: only
    the passes that run after pass ``after``, on ``gm``, the graph it started from in an earlier run."""
    given = gm
    if after is not None:
        gm = copy_graph_module(gm)  # the earlier run's stage is left as it was
    ctx.record_stage("captured" if after is None else f"before {after}", gm)
    for spec in passes():
        if ctx.options.enabled(spec.name) and (after is None or spec.order > PASSES[after].order):
            gm = _run_pass(spec, gm, ctx)
    if gm is given or not isinstance(gm, _LazyGraphModule):
        return gm
    result = fx.GraphModule(gm, gm.graph)  # shares the graph: later in-place edits (kernel choices) land in both
    ctx.stages[-1].code = result.code  # so the last stage's code is the pipeline's output, as for every stage
    return result


def _run_pass(spec: PassSpec, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    name = ctx.current_pass = spec.name
    num_regions = len(ctx.regions)
    try:
        result = spec.fn(copy_graph_module(gm), ctx)
        result.graph.lint()
        check_kernels(result)
        result.recompile()
    except Exception as exc:  # a failing pass must never cost correctness: keep its input graph
        del ctx.regions[num_regions:]
        reason = f"{type(exc).__name__}: {exc}"
        ctx.fallbacks.append(Fallback(name, reason))
        warnings.warn(f"recompile: pass {name!r} failed and was skipped ({reason})", stacklevel=2)
        return gm
    if ctx.options.verify and len(ctx.regions) > num_regions and not spec.draws_other_random:
        _verify(name, gm, result, ctx)
    ctx.record_stage(name, result)
    return result


def concrete_inputs(example_inputs: Sequence) -> list:
    """The example inputs with each symbolic size Dynamo passes for a dynamic dimension as the int it stands for."""
    return [x.node.hint if isinstance(x, torch.SymInt) else x for x in example_inputs]


def _verify(name: str, before: fx.GraphModule, after: fx.GraphModule, ctx: PassContext) -> None:
    if ctx.example_inputs is None:
        return
    from recompile.autotune import Sandbox  # (autotune imports this module)

    # On the call's own tensors: whatever the graphs write into (BatchNorm statistics) is put back after each.
    with torch.no_grad(), Sandbox(concrete_inputs(ctx.example_inputs)) as sandbox:
        torch.manual_seed(0)
        expected = before(*sandbox.args)
        sandbox.restore()
        torch.manual_seed(0)
        got = after(*sandbox.args)
    try:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, equal_nan=True)
    except AssertionError as exc:
        regions = [r.to_dict() for r in ctx.regions if r.pass_name == name]
        raise VerificationError(f"recompile: pass {name!r} changed the results of regions {regions}: {exc}") from None
