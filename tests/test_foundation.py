"""The rec_ascend backend, options, pipeline, fallbacks, explain and dynamic shapes."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend

import recompile
from checks import assert_compiled_equals_eager
from models.dlrm import DLRM, DLRMConfig, synthetic_batch
from recompile import pipeline
from recompile.html_report import render_html
from recompile.lowering import LOWERINGS, detect_target
from recompile.lowering.targets import ASCEND_FBGEMM_OPS

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")

SMALL = DLRMConfig(table_rows=[50, 80, 120], dim=8, bottom=[16, 8], top=[16, 1])


def small_mlp():
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))


@pytest.mark.parametrize("make", ["mlp", "dlrm"])
def test_compiled_forward_and_grads_equal_eager(make):
    if make == "mlp":
        model, args = small_mlp(), (torch.randn(16, 12),)
    else:
        model, args = DLRM(SMALL), synthetic_batch(SMALL, 16)
    assert_compiled_equals_eager(model, args)


def test_entry_point_resolves_in_fresh_process():
    code = textwrap.dedent(
        """
        import torch
        assert "rec_ascend" in torch._dynamo.list_backends()
        f = torch.compile(lambda x: torch.relu(x) * 2, backend="rec_ascend")
        x = torch.randn(8)
        torch.testing.assert_close(f(x), torch.relu(x) * 2)
        import sys; assert "recompile" in sys.modules  # loaded through the entry point
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"tagret": "cpu"}, "unknown recompile option.*valid options: target, offload"),
        ({"target": "tpu"}, "'target' got 'tpu'; valid values: auto, cpu, cuda, npu"),
        ({"offload": "half"}, "valid values: partial, full"),
        ({"bounds_check": "strict"}, "valid values: fatal, warning, ignore"),
        ({"passes": {"nosuch": False}}, "'passes' got 'nosuch'; valid values: normalize"),
        ({"passes": {"jagged": "no"}}, "must be True or False"),
        ({"verify": 1}, "must be True or False"),
        (["target"], "must be a dict or RecompileOptions"),
    ],
)
def test_bad_options_raise_listing_valid_ones(options, message):
    with pytest.raises(ValueError, match=message):
        recompile.RecompileOptions.coerce(options)


def test_bad_options_through_torch_compile():
    compiled = torch.compile(small_mlp(), backend="rec_ascend", options={"target": "tpu"})
    with pytest.raises(Exception, match="valid values: auto, cpu, cuda, npu"):
        compiled(torch.randn(2, 12))


def test_absent_target_refuses_to_run_but_plans():
    compiled = torch.compile(small_mlp(), backend="rec_ascend", options={"target": "npu"})
    with pytest.raises(Exception, match="not present on this machine"):
        compiled(torch.randn(2, 12))
    report = recompile.explain(small_mlp(), torch.randn(2, 12), options={"target": "npu"}).to_dict()
    assert report["executed"] is False and report["target"]["name"] == "npu"


def add_pass(monkeypatch, name, fn):
    """Declare pass ``name`` after every other for this test only."""
    last = max(spec.order for spec in pipeline.passes())
    monkeypatch.setitem(pipeline.PASSES, name, pipeline.PassSpec(name, last + 1, fn, {}, False, "a test pass"))


def test_failing_pass_falls_back_and_is_reported(monkeypatch):
    def broken(gm, ctx):
        for node in gm.graph.nodes:  # half-rewrites the graph, then fails
            if node.op == "call_function":
                node.target = torch.sub
        raise RuntimeError("boom")

    add_pass(monkeypatch, "broken", broken)
    model, x = small_mlp(), torch.randn(4, 12)
    with pytest.warns(UserWarning, match="pass 'broken' failed"):
        out = torch.compile(model, backend="rec_ascend")(x)
    torch.testing.assert_close(out, model(x))
    with pytest.warns(UserWarning):
        report = recompile.explain(model, x).to_dict()
    assert report["fallbacks"] == [{"pass": "broken", "reason": "RuntimeError: boom"}]


def test_verify_raises_on_wrong_rewrite(monkeypatch):
    def wrong(gm, ctx):
        for node in gm.graph.nodes:
            if node.target is torch.relu:
                node.target = torch.tanh
                ctx.record_region("interaction", [node], "recompile::complete_cumsum", ctx.lower("recompile::complete_cumsum"))
        return gm

    add_pass(monkeypatch, "wrong", wrong)
    f = torch.compile(lambda x: torch.relu(x) + 1, backend="rec_ascend", options={"verify": True})
    with pytest.raises(Exception, match="pass 'wrong' changed the results"):
        f(torch.randn(8))


def test_disabled_pass_does_not_run():
    import torch.nn.functional as F

    def offsets(lengths):
        return F.pad(torch.cumsum(lengths, 0), (1, 0))

    lengths = torch.randint(0, 5, (7,))
    assert recompile.explain(offsets, lengths).to_dict()["regions"]
    assert not recompile.explain(offsets, lengths, options={"passes": {"jagged": False}}).to_dict()["regions"]


def test_explain_documented_keys_and_graph_breaks():
    def with_break(x):
        y = torch.relu(x)
        torch._dynamo.graph_break()
        return y * 2

    report = recompile.explain(with_break, torch.randn(3))
    d = report.to_dict()
    assert {"stages", "regions", "fallbacks"} <= d.keys()
    assert len(d["graphs"]) == 2 and d["breaks"][d["graphs"][0]["break"]]["reason"]
    for stage in d["stages"]:
        assert {"name", "code", "num_nodes"} <= stage.keys()
    assert [s["name"] for s in d["stages"] if s["graph"] == 0][0] == "captured"
    json.dumps(d)
    assert "graphs captured: 2" in report.to_text()

    model = DLRM(SMALL)
    d = recompile.explain(model, *synthetic_batch(SMALL, 4)).to_dict()
    for region in d["regions"]:
        assert {"kind", "pass", "replaced", "op", "target", "kernel"} <= region.keys()
        assert region["kind"] in pipeline.REGION_KINDS


def test_dump_dir_writes_every_stage(tmp_path):
    model, x = small_mlp(), torch.randn(4, 12)
    torch.compile(model, backend="rec_ascend", options={"dump_dir": str(tmp_path)})(x)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.endswith("_captured.py") for n in names) and any(n.endswith("_normalize.json") for n in names)
    graph = json.loads(next(tmp_path.glob("*_captured.json")).read_text())
    assert any(node["op"] == "placeholder" for node in graph["nodes"])


def test_batch_size_changes_compile_at_most_twice():
    model = DLRM(SMALL)
    counter = CompileCounterWithBackend("rec_ascend")
    compiled = torch.compile(model, backend=counter)
    for batch in (8, 13, 21, 34, 55, 89):
        args = synthetic_batch(SMALL, batch)
        torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-5, atol=1e-6)
    assert counter.frame_count <= 2


def test_targets_and_lowering_tables():
    cpu = detect_target("cpu")
    assert cpu.available and cpu.has_fbgemm("asynchronous_complete_cumsum")
    npu = detect_target("npu")
    assert not npu.available and npu.fbgemm_ops == ASCEND_FBGEMM_OPS["A3"] and npu.chip == "A3"
    assert npu.triton == "triton-ascend"
    for op, impls in LOWERINGS.items():
        assert impls[-1].kind == "reference", op


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.reshape(-1) * 2,
        lambda x: x.reshape(4, -1).sum(1),
        lambda x: x.reshape((2, -1)),
        lambda x: x.permute(1, 0).sum(0),
        lambda x: x.permute([1, 0]),
        lambda x: x.transpose(0, 1).softmax(-1),
    ],
)
def test_normalize_keeps_method_semantics(fn):
    x = torch.randn(4, 6)
    torch.testing.assert_close(torch.compile(fn, backend="rec_ascend", options={"verify": True})(x), fn(x))


def test_verify_with_dynamic_batch():
    import torch.nn.functional as F

    def offsets(lengths, x):
        positions = torch.arange(x.shape[0]).reshape(x.shape[0], 1)  # a symbolic size reaches the graph
        return F.pad(torch.cumsum(lengths, 0), (1, 0)), x * positions

    compiled = torch.compile(offsets, backend="rec_ascend", options={"verify": True})
    for n in (5, 9, 17):
        lengths, x = torch.randint(0, 4, (n,)), torch.randn(n, 3)
        torch.testing.assert_close(compiled(lengths, x), offsets(lengths, x))


def test_full_reductions_leave_pattern_matching_unambiguous():
    def loss(x, y):
        weight = (y > 0).to(torch.float32)
        return torch.sum(x * weight) / torch.sum(weight) + x.mean()  # a masked mean, as a loss is written

    x, y = torch.randn(4, 3), torch.randn(4, 3)
    assert recompile.explain(loss, x, y).to_dict()["fallbacks"] == []
    torch.testing.assert_close(torch.compile(loss, backend="rec_ascend")(x, y), loss(x, y))


def test_passes_are_declared_once_and_everything_reads_the_declaration():
    specs = pipeline.passes()
    assert pipeline.PASS_ORDER == [s.name for s in specs] == sorted(pipeline.PASSES, key=lambda n: pipeline.PASSES[n].order)
    assert pipeline.REGION_KINDS == tuple(k for s in specs for k in s.regions) == tuple(pipeline.region_colours())
    assert pipeline.DRAWS_OTHER_RANDOM == {"dropout"}
    for spec in specs:  # each pass module's docstring is its doc: "name: what it does", then pattern -> replacement
        assert spec.summary.startswith(f"{spec.name}: ") and "\n" in spec.doc.strip(), spec.name


@pytest.fixture
def restore_passes():
    saved = {spec.name: spec for spec in pipeline.passes()}
    yield
    pipeline.PASSES.clear()
    pipeline.PASSES.update(saved)


def test_a_new_pass_is_one_declaration(restore_passes):
    """A pass declared with register_pass alone runs in its place, and the reports show its regions and doc."""

    def tanh_to_cumsum(gm, ctx):
        for node in gm.graph.nodes:
            if node.target is torch.tanh:
                ctx.record_region("probe", [node], "recompile::complete_cumsum", ctx.lower("recompile::complete_cumsum"))
        return gm

    order = pipeline.PASSES["embedding"].order + 1
    pipeline.register_pass("probe", order=order, regions={"probe": "#123456"})(tanh_to_cumsum)
    assert pipeline.PASS_ORDER.index("probe") == pipeline.PASS_ORDER.index("embedding") + 1
    assert pipeline.region_colours()["probe"] == "#123456" and "probe" in pipeline.REGION_KINDS
    report = recompile.explain(lambda x: torch.tanh(x) + 1, torch.randn(4))
    assert [r["kind"] for r in report.to_dict()["regions"]] == ["probe"]
    assert "graph 0 probe:" in report.to_text() and "#123456" in render_html(report.to_dict(), "probe")
    with pytest.raises(ValueError, match="clashes with pass 'probe'"):
        pipeline.register_pass("other", order=order)(tanh_to_cumsum)
    with pytest.raises(ValueError, match="clashes with pass 'jagged'"):
        pipeline.register_pass("other", order=order + 1000, regions={"attention": "#000000"})(tanh_to_cumsum)


def test_imports_are_light():
    """``import hkv`` and ``import recompile.distributed`` load neither Inductor, nor a pass, nor the TF importer."""
    code = textwrap.dedent(
        """
        import sys
        import hkv, recompile.distributed
        heavy = [m for m in sys.modules if m in ("torch._inductor.compile_fx", "tensorflow", "recompile.backend")
                 or m.startswith(("recompile.passes", "recompile.frontends"))]
        assert not heavy, heavy
        import recompile.explain  # the submodule does not hide the function
        assert callable(recompile.explain) and recompile.PASS_ORDER[0] == "normalize"
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
