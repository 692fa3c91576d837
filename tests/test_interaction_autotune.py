"""Autotune: a correct candidate is kept, a wrong one is rejected whatever its speed, decisions are cached."""
import json

import pytest
import torch
import torch.nn as nn

import recompile
from recompile import autotune
from recompile.runtime.kernels import KERNELS
from tests import race_checks


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    return race_checks.steady_cache(monkeypatch, tmp_path, 0.3)


@pytest.fixture
def eagerly_fastest(monkeypatch):
    """What ``fastest_eagerly`` returned (the graph Inductor compiles for training), call by call."""
    chosen, timed = [], autotune.fastest_eagerly
    monkeypatch.setattr(autotune, "fastest_eagerly", lambda *args: chosen.append(timed(*args)) or chosen[-1])
    return chosen


class Cross(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x0):
        x = x0 * self.a(x0) + x0
        return torch.tanh(x0 * self.b(x) + x)


def _decisions(cache_dir):
    return [json.loads(p.read_text()) for p in sorted((cache_dir / "autotune").glob("*.json"))]


def _train(model, x):
    model.zero_grad()
    out = model(x)
    out.sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("training", [False, True])
def test_keeps_a_correct_candidate_and_caches_it(_cache, training):
    model, x = Cross(), torch.randn(32, 16)
    compiled = torch.compile(model, backend="rec_ascend")
    with torch.set_grad_enabled(training):
        got, want = compiled(x), model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    [decision] = _decisions(_cache)
    assert decision["mode"] == ("training" if training else "inference")
    assert decision["choice"] in decision["timings_ms"] and not decision["choice"].startswith("eagerly:")
    assert set(decision["kernels"].values()) <= set(KERNELS["cross_stack"]) and len(decision["kernels"]) == 1
    runs_rewrite = decision["choice"] not in ("eager", "inductor-captured")
    assert decision["regions"] == (decision["kernels"] if runs_rewrite else {})
    if training:
        out_c, grads_c = _train(compiled, x)
        out_e, grads_e = _train(model, x)
        torch.testing.assert_close(grads_c, grads_e, rtol=1e-5, atol=1e-5)


def test_cached_decision_is_reused_without_timing(_cache, monkeypatch):
    model, x = Cross(), torch.randn(8, 16)
    torch.compile(model, backend="rec_ascend")(x)
    [first] = _decisions(_cache)
    torch._dynamo.reset()

    def no_timing(*args, **kwargs):
        raise AssertionError("a cached graph must not be timed again")

    monkeypatch.setattr(autotune, "race", no_timing)
    torch.testing.assert_close(torch.compile(model, backend="rec_ascend")(x), model(x), rtol=1e-5, atol=1e-5)
    report = recompile.explain(model, x).to_dict()
    [shown] = report["autotune"]
    assert shown["cached"] and shown["choice"] == first["choice"] and shown["key"] == first["key"]
    assert f"autotune graph 0 (training, cached): {first['choice']}" in recompile.explain(model, x).to_text()


def test_wrong_kernel_is_rejected_even_when_fastest(_cache, monkeypatch):
    monkeypatch.setitem(KERNELS["cross_stack"], "cpu", lambda x0, x, w, b, d, save: (x + 1, []))  # fast and wrong
    model, x = Cross(), torch.randn(8, 16)
    with torch.no_grad():
        out = torch.compile(model, backend="rec_ascend")(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    [decision] = _decisions(_cache)
    assert set(decision["kernels"].values()) <= set(KERNELS["cross_stack"]) - {"cpu"}  # any correct kernel may win
    assert all("differs from the reference" in why for name, why in decision["rejected"].items() if ":cpu" in name)
    assert sum(":cpu" in name for name in decision["rejected"]) == 1


def test_wrong_graph_candidate_is_rejected(_cache, monkeypatch):
    monkeypatch.setattr(autotune, "MIN_FUSABLE_SHARE", 0.0)  # always compile the (broken) Inductor candidate
    model, x = Cross(), torch.randn(8, 16)
    captured = {}

    def backend(gm, example_inputs):
        from recompile.backend import resolve_target
        from recompile.options import RecompileOptions
        from recompile.pipeline import PassContext, run_pipeline

        opts = RecompileOptions()
        ctx = PassContext(opts, resolve_target(opts), example_inputs)
        rewritten = run_pipeline(gm, ctx)
        chooser = autotune.autotune(gm, rewritten, example_inputs, ctx, lambda g: lambda *a: [t * 0 for t in g(*a)])
        captured["chooser"] = chooser
        return chooser

    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    decision = captured["chooser"].chooser.decision
    inductors = [name for name in ("inductor", "inductor-captured") if name in decision.compile_s]
    assert inductors and all("differs" in decision.rejected[name] for name in inductors)
    assert decision.choice in ("eager", "rec+eager")


def test_random_graphs_without_rec_regions_are_not_tuned(_cache):
    def noisy(x):
        return torch.rand_like(x) * x * 2

    torch.compile(noisy, backend="rec_ascend")(torch.randn(4, 4))
    assert _decisions(_cache) == []


def test_unwritable_cache_warns_and_still_runs(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv("RECOMPILE_CACHE_DIR", str(blocker))
    model, x = Cross(), torch.randn(4, 16)
    with pytest.warns(UserWarning, match="autotune decision not cached"), torch.no_grad():
        out = torch.compile(model, backend="rec_ascend")(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def test_mutating_ops_are_not_tuned():
    def bump(x, counter):
        torch.ops.aten.add.out(counter, counter, out=counter)  # mutates, though its name has no trailing _
        return x * 2

    gm = torch.fx.symbolic_trace(bump)
    assert not autotune.tunable(gm, (torch.randn(2), torch.zeros(1)))
    assert autotune.tunable(torch.fx.symbolic_trace(lambda x: x * 2), (torch.randn(2),))


def test_chosen_candidate_is_called_directly_fresh_and_cached(_cache):
    """After the first call and its check in place (with a cached decision, from the start) Dynamo's callable runs
    the chosen candidate itself: no chooser or timing code on the call path."""
    model, x = Cross(), torch.randn(8, 16)
    compiled = []

    def backend(gm, example_inputs):
        from recompile.backend import rec_ascend

        compiled.append(rec_ascend(gm, example_inputs))
        return compiled[-1]

    for attempt in range(2):
        torch._dynamo.reset()
        with torch.no_grad():
            fn = torch.compile(model, backend=backend)
            torch.testing.assert_close(fn(x), model(x), rtol=1e-5, atol=1e-5)
            for _ in range(2 * autotune.SHORT_CHECK_CALLS):  # an inference choice is first checked in place
                fn(x)
        chooser = compiled[-1].chooser
        assert chooser.decision.cached == (attempt == 1)
        assert chooser.run not in (chooser.first_call, chooser.check_call)
        if attempt == 0:
            assert chooser.run == chooser.candidates[chooser.decision.choice]


def test_inductor_is_compiled_only_where_it_can_win():
    """A graph that is one big GEMM leaves Inductor nothing to fuse; a chain of pointwise ops does."""
    gemm = torch.fx.symbolic_trace(lambda x, w: torch.nn.functional.linear(x, w))
    pointwise = torch.fx.symbolic_trace(lambda x, w: torch.sigmoid(torch.relu(x * 2 + 1) - x).exp())
    x, w = torch.randn(512, 512), torch.randn(512, 512)
    assert not autotune.inductor_can_win(gemm, autotune.Sandbox([x, w]))
    assert autotune.inductor_can_win(pointwise, autotune.Sandbox([x, w]))


def test_each_pass_can_be_left_out(_cache):
    """DLRM has embedding and interaction regions: the race also runs the rewrite without either pass, and a
    cached choice of such a candidate is rebuilt without timing."""
    from models.dlrm import DLRM, DLRMConfig, synthetic_batch

    cfg = DLRMConfig(table_rows=[50, 80, 120], dim=8, bottom=[16, 8], top=[16, 1])
    model, args = DLRM(cfg), synthetic_batch(cfg, 9)
    with torch.no_grad():
        want = model(*args)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(model, backend="rec_ascend")(*args), want, rtol=1e-5, atol=1e-5)
        [decision] = _decisions(_cache)
        assert {"rec+eager-embedding", "rec+eager-interaction"} <= set(decision["timings_ms"])
        decision["choice"] = "rec+eager-embedding"  # as if it had won
        (_cache / "autotune" / f"{decision['key']}.json").write_text(json.dumps(decision))
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(model, backend="rec_ascend")(*args), want, rtol=1e-5, atol=1e-5)
        assert [d["timings_ms"] for d in _decisions(_cache)] == [decision["timings_ms"]]  # applied, not re-timed


def test_plain_inductor_races_where_the_rewrite_leaves_it_nothing_to_fuse(_cache, monkeypatch):
    monkeypatch.setattr(autotune, "MIN_FUSABLE_SHARE", 1.1)  # no inference graph is worth Inductor on the rewrite
    model, x = Cross(), torch.randn(8, 16)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="rec_ascend")(x), model(x), rtol=1e-5, atol=1e-5)
    [decision] = _decisions(_cache)
    assert "inductor-captured" in decision["timings_ms"] and "inductor" not in decision["timings_ms"]
    assert decision["rejected"]["inductor"].startswith("not compiled")


def test_plain_inductor_always_races_inference_graphs(_cache, monkeypatch):
    """The Inductor a user would otherwise get is a candidate, so the choice never loses to it."""
    monkeypatch.setattr(autotune, "MIN_FUSABLE_SHARE", 0.0)  # Inductor on the rewrite races too
    monkeypatch.setattr(autotune, "fastest_eagerly", lambda *args: "rec+eager")
    monkeypatch.setattr(autotune, "inductor_ms", lambda *args: None)  # else one compile where it is at its floor
    model, x = Cross(), torch.randn(8, 16)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="rec_ascend")(x), model(x), rtol=1e-5, atol=1e-5)
    [decision] = _decisions(_cache)
    assert {"inductor", "inductor-captured"} <= set(decision["timings_ms"])


@pytest.mark.parametrize("fn, repeatable", [
    (lambda x: torch.nn.functional.normalize(x, dim=-1) * 2, True),  # "normal" in the name, not random
    (lambda x: torch.nn.functional.dropout(x, 0.5, False) + 1, True),  # eval-mode dropout: the identity
    (lambda x: torch.nn.functional.dropout(x, 0.0) + 1, True),
    (lambda x: torch.nn.functional.dropout(x, 0.5) + 1, False),
    (lambda x: x + torch.randn_like(x), False),
    (lambda x: x.normal_(), False),
])
def test_only_random_ops_make_a_graph_untunable(fn, repeatable):
    assert autotune.tunable(torch.fx.symbolic_trace(fn), (torch.randn(4, 4),)) is repeatable


class DroppedBags(nn.Module):
    """A rec region (the lookups) and dropout in training: outputs differ between runs."""

    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(40, 8, mode="sum") for _ in range(2))

    def forward(self, ids, offsets):
        pooled = torch.cat([bag(ids, offsets) for bag in self.bags], 1)
        return torch.nn.functional.dropout(pooled, 0.5, training=True).sum(1)


def test_random_graphs_race_the_rewrite_and_draw_no_numbers_of_the_run(_cache):
    model = DroppedBags()
    ids, offsets = torch.randint(0, 40, (12,)), torch.tensor([0, 3, 7, 7, 10])
    compiled = torch.compile(model, backend="rec_ascend")
    torch.manual_seed(0)
    first = compiled(ids, offsets)  # the race, then the call, with the RNG as the race found it
    torch.manual_seed(0)
    torch.testing.assert_close(compiled(ids, offsets), first)
    [decision] = _decisions(_cache)
    assert decision["mode"] == "training"
    assert decision["rejected"] == {}  # none ran and failed
    timings = decision["timings_ms"]
    # the lifted seeds make the rewrite repeatable: its kernels are tuned, and it races through Inductor only
    assert {"rec+eager", "inductor"} <= set(timings) and "eager" not in timings and decision["choice"] in timings
    assert set(decision["compile_s"]) == {"rec+eager", "inductor"}
