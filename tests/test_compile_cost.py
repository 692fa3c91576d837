"""What a cold compile costs besides Inductor's: the pass pipeline generates a graph module's Python code once, for
the graph it returns (not twice per pass), and the rewrite without one pass (an autotune candidate) runs only the
passes after it, from the stage it started from, giving the graph the whole pipeline without it gives."""
import functools
from dataclasses import replace

import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

from recompile import autotune
from recompile.lowering import detect_target
from recompile.options import RecompileOptions
from recompile.pipeline import PassContext, run_pipeline
from recompile.tracing import TracingConfig


def _on_dlrm_graph(check) -> None:
    """``check(gm, example_inputs)`` on a small DLRM's captured inference graph (embedding and interaction regions),
    inside Dynamo's compile as a backend runs (the passes read its fake mode)."""
    from models.dlrm import DLRM, DLRMConfig, synthetic_batch

    cfg = DLRMConfig(table_rows=[50, 80, 120], dim=8, bottom=[16, 8], top=[16, 1])
    model, args = DLRM(cfg), synthetic_batch(cfg, 9)
    checked = []

    def backend(gm, example_inputs):
        checked.append(check(gm, example_inputs))
        return gm.forward

    backend.backend_ctx_ctor = TracingConfig  # Dynamo traces as it does for rec_ascend
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(*args)
    assert len(checked) == 1


def _context(example_inputs, **options) -> PassContext:
    return PassContext(replace(RecompileOptions(), **options), detect_target("cpu"), example_inputs)


def test_the_pipeline_generates_code_once_for_the_graph_it_returns(monkeypatch):
    _on_dlrm_graph(functools.partial(_generates_code_once, monkeypatch))


def _generates_code_once(monkeypatch, gm, example_inputs):
    gm.code  # noqa: B018  (the captured graph's own code, generated before the count)
    generated = []
    python_code = torch.fx.Graph.python_code
    monkeypatch.setattr(torch.fx.Graph, "python_code",
                        lambda self, *args, **kwargs: generated.append(self) or python_code(self, *args, **kwargs))
    ctx = _context(example_inputs)
    rewritten = run_pipeline(gm, ctx)
    assert generated == [rewritten.graph]
    assert len(ctx.stages) > 2 and ctx.regions
    assert not isinstance(rewritten, _LazyGraphModule)  # its calls go straight to its code
    # Each stage's code is generated when read, and is the graph of that stage.
    codes = [stage.code for stage in ctx.stages]
    assert codes[0] == gm.code and codes[-1] == rewritten.code
    assert len(set(codes)) > 2
    monkeypatch.undo()


def test_the_last_stage_keeps_its_code_when_the_returned_graph_is_edited():
    _on_dlrm_graph(_keeps_code)


def _keeps_code(gm, example_inputs):
    ctx = _context(example_inputs)
    rewritten = run_pipeline(gm, ctx)
    before = rewritten.code
    kernels = {node: "reference" for node in autotune.graph_regions(rewritten)}
    autotune.apply_regions(rewritten, kernels)  # what the race does to the rewrite's kernel choices
    assert ctx.stages[-1].code == before
    assert autotune.graph_regions(rewritten) == kernels


def test_the_rewrite_without_a_pass_is_the_pipeline_run_without_it():
    _on_dlrm_graph(_ablations)


def _ablations(gm, example_inputs):
    ctx = _context(example_inputs)
    rewritten = run_pipeline(gm, ctx)
    stage_codes = [stage.code for stage in ctx.stages]
    passes = sorted({region.pass_name for region in ctx.regions})
    assert passes == ["embedding", "interaction"]
    for name in passes:
        ablated = autotune.without_pass(gm, ctx, name, {})
        options = RecompileOptions().passes
        whole = run_pipeline(gm, _context(example_inputs, passes={**options, name: False}))
        assert ablated.code == whole.code
        assert not isinstance(ablated, _LazyGraphModule)
    assert [stage.code for stage in ctx.stages] == stage_codes  # the stages the ablations started from are intact
    assert rewritten.code == stage_codes[-1]
