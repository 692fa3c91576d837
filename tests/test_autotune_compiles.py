"""Autotune's compiles: Inductor compiles only the graphs that can win, decisions are keyed by graph and shapes,
and a stream of batches compiles at most twice."""
import json

import pytest
import torch
import torch.nn as nn

from recompile import autotune
from recompile import backend as rec_backend
from tests import race_checks
from tests.test_interaction_autotune import Cross, eagerly_fastest  # noqa: F401  (a fixture)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    return race_checks.steady_cache(monkeypatch, tmp_path, 0.2)


@pytest.fixture
def inductor_graphs(monkeypatch):
    """The graphs the backend hands to Inductor, which here runs them eagerly (no C++ compile in these tests)."""
    compiled = []

    def compile_fx(graph, example_inputs, **kwargs):
        compiled.append(graph)
        return graph.forward

    monkeypatch.setattr(rec_backend, "compile_fx", compile_fx)
    return compiled


class Plain(nn.Module):
    """No rec region at all."""

    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2


def _decisions(cache_dir):
    return [json.loads(p.read_text()) for p in sorted((cache_dir / "autotune").glob("*.json"))]


def _has_rec_ops(graph) -> bool:
    return any(autotune._op_name(node) for node in graph.graph.nodes)


def _run(model, x, training, dynamic=None, **compile_kwargs):
    torch._dynamo.reset()
    with torch.set_grad_enabled(training):
        out = torch.compile(model, backend="rec_ascend", dynamic=dynamic, **compile_kwargs)(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    if training:
        out.sum().backward()


def _compiled_once(model, x, training, options=None):
    """``model`` compiled by rec_ascend and called once on ``x`` (its result checked against eager); returns what
    Dynamo calls and the graph it captured."""
    returned = []

    def backend(gm, example_inputs):
        returned.append((gm, rec_backend.rec_ascend(gm, example_inputs, options)))
        return returned[-1][1]

    torch._dynamo.reset()
    with torch.set_grad_enabled(training):
        out = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    [(captured, compiled)] = returned
    return compiled, captured


@pytest.mark.parametrize("training", [False, True])
def test_a_graph_without_rec_regions_races_eager_against_one_inductor_compile_of_it(_cache, inductor_graphs, training):
    """The candidates are the captured graph eagerly and Inductor on it, compiled once; the decision is cached."""
    compiled, captured = _compiled_once(Plain(), torch.randn(8, 16, requires_grad=training), training)
    [graph] = inductor_graphs
    assert graph is captured and isinstance(compiled, autotune.CompiledGraph)
    [decision] = _decisions(_cache)
    assert set(decision["compile_s"]) == {"eager", "inductor-captured"} and decision["regions"] == {}
    assert decision["choice"] in ("eager", "inductor-captured")
    assert decision["mode"] == ("training" if training else "inference")


@pytest.mark.parametrize("eager_ms, kept", [(0.9, "eager"), (0.98, "inductor-captured"), (1.1, "inductor-captured")])
def test_a_graph_without_rec_regions_keeps_inductor_unless_eager_wins_by_the_margin(
        _cache, inductor_graphs, monkeypatch, eager_ms, kept):
    """Inductor (what backend="inductor" runs) is the incumbent: eager replaces it only when faster by more than
    MARGIN, so that no time is added where Inductor is as fast; the kept candidate is what Dynamo's call runs."""
    monkeypatch.setattr(autotune, "race", lambda steps, budget_s, **kwargs: {
        name: [eager_ms if name == "eager" else 1.0] * 3 for name in steps})
    compiled, captured = _compiled_once(Plain(), torch.randn(8, 16), False)
    [decision] = _decisions(_cache)
    assert decision["choice"] == kept
    pick = compiled.chooser.pick if kept == "inductor-captured" else compiled.chooser.run
    assert pick == (inductor_graphs[0].forward if kept == "inductor-captured" else captured.forward)


def test_a_cached_eager_choice_compiles_nothing(_cache, inductor_graphs, monkeypatch):
    monkeypatch.setattr(autotune, "race", lambda steps, budget_s, **kwargs: {
        name: [0.5 if name == "eager" else 1.0] * 3 for name in steps})
    model, x = Plain(), torch.randn(8, 16)
    _compiled_once(model, x, False)
    assert len(inductor_graphs) == 1
    compiled, captured = _compiled_once(model, x, False)
    assert len(inductor_graphs) == 1 and compiled.chooser.run == captured.forward
    [decision] = _decisions(_cache)
    assert decision["choice"] == "eager"


def test_a_graph_without_rec_regions_that_cannot_race_is_inductors_compile_alone(_cache, inductor_graphs):
    """Autotune off, or a random op (the candidates would draw other numbers): Inductor on the captured graph, no
    wrapper on its calls, no decision."""
    class Noisy(Plain):
        def forward(self, x):
            return super().forward(x) + torch.rand_like(x)

    for model, options in ((Plain(), {"autotune": False}), (Noisy(), None)):
        inductor_graphs.clear()
        returned = []

        def backend(gm, example_inputs):
            returned.append((gm, rec_backend.rec_ascend(gm, example_inputs, options)))
            return returned[-1][1]

        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend=backend)(torch.randn(8, 16))
        [(captured, compiled)] = returned
        assert inductor_graphs == [captured] and compiled == captured.forward
    assert _decisions(_cache) == []


@pytest.mark.parametrize("fastest", ["eager", "rec+eager"])
def test_training_compiles_inductor_once_on_the_graph_fastest_eagerly(_cache, inductor_graphs, monkeypatch, fastest):
    """Once where the captured graph's library calls alone take longer than the fastest graph eagerly (the other
    case: tests/test_autotune_inplace.py)."""
    def fastest_eagerly(graphs, sandbox, training, decision, budget_s):
        decision.timings_ms[f"eagerly:{fastest}"] = 1.0
        return fastest

    monkeypatch.setattr(autotune, "fastest_eagerly", fastest_eagerly)
    monkeypatch.setattr(autotune, "inductor_floor_ms", lambda *args: 1e9)
    _run(Cross(), torch.randn(8, 16, requires_grad=True), True)
    [graph] = inductor_graphs
    assert _has_rec_ops(graph) == (fastest == "rec+eager")
    [decision] = _decisions(_cache)
    if fastest == "rec+eager":
        assert decision["rejected"]["inductor-captured"].startswith("not compiled: its library calls alone take")
    else:
        assert decision["rejected"]["inductor"] == "not compiled: eager ran fastest eagerly"


@pytest.mark.parametrize("fastest, can_win, compiled", [
    ("eager", True, {"inductor-captured"}),
    ("rec+eager", True, {"inductor", "inductor-captured"}),
    ("rec+eager", False, {"inductor-captured"}),
])
def test_inference_compiles_the_captured_graph_above_its_floor_however_far_inductor_on_the_rewrite_runs_ahead(
        _cache, inductor_graphs, monkeypatch, fastest, can_win, compiled):
    """Inductor on the graph fastest eagerly is compiled first (where it can win), then the captured graph above its
    floor, even where Inductor on the rewrite ran far ahead of the rewrite eagerly: that says nothing of plain
    Inductor, which may fuse what the rewrite replaced (RecBole's SASRec full sort under no_grad)."""
    def fastest_eagerly(graphs, sandbox, training, decision, budget_s):
        decision.timings_ms[f"eagerly:{fastest}"] = 100.0
        return fastest

    monkeypatch.setattr(autotune, "fastest_eagerly", fastest_eagerly)
    monkeypatch.setattr(autotune, "inductor_can_win", lambda *args: can_win)
    monkeypatch.setattr(autotune, "inductor_floor_ms", lambda *args: 0.0)
    monkeypatch.setattr(autotune, "inductor_ms", lambda *args: 1.0)  # 100x ahead of its graph eagerly
    _run(Cross(), torch.randn(8, 16), False)
    [decision] = _decisions(_cache)
    assert decision["compile_s"].keys() & {"inductor", "inductor-captured"} == compiled
    assert len(inductor_graphs) == len(compiled)


@pytest.mark.parametrize("training, floor_ms, first_ms, compiled", [
    (False, 0.5, 0.52, {"inductor"}),  # within the margin of the captured graph's library calls: it cannot win
    (False, 0.1, 0.5, {"inductor", "inductor-captured"}),
    (True, 0.5, 0.52, {"inductor", "inductor-captured"}),  # training: no timing inside Dynamo's compile
])
def test_the_captured_graph_is_compiled_only_when_it_can_beat_inductor_on_the_rewrite(
        _cache, inductor_graphs, monkeypatch, training, floor_ms, first_ms, compiled):
    """An inference graph's Inductor on the graph fastest eagerly is compiled and timed first; the captured graph
    (plain Inductor's) is compiled after it only when its library calls alone take less than that time by more
    than the margin. Counts the graphs handed to compile_fx: one where the captured graph cannot win."""
    def fastest_eagerly(graphs, sandbox, training, decision, budget_s):
        decision.timings_ms["eagerly:rec+eager"] = 1.0
        return "rec+eager"

    ahead = []
    monkeypatch.setattr(autotune, "fastest_eagerly", fastest_eagerly)
    monkeypatch.setattr(autotune, "inductor_can_win", lambda *args: True)
    monkeypatch.setattr(autotune, "inductor_floor_ms", lambda *args: floor_ms)
    monkeypatch.setattr(autotune, "inductor_ms", lambda *args: ahead.append(args) or first_ms)
    monkeypatch.setattr(autotune, "rewrite_floor_ms", lambda *args: 0.0)  # training: the deferred one is built
    _run(Cross(), torch.randn(8, 16, requires_grad=training), training)
    [decision] = _decisions(_cache)
    assert decision["compile_s"].keys() & {"inductor", "inductor-captured"} == compiled
    assert len(inductor_graphs) == len(compiled) and len(ahead) == (not training)
    assert all(args[5:] == ("inductor",) for args in ahead)  # timed under the name of the graph it compiled
    # inference: Inductor on the rewrite first; training: the captured graph's, the rewrite's deferred to the call
    assert _has_rec_ops(inductor_graphs[0]) == (not training)
    if len(compiled) == 1:
        assert decision["rejected"]["inductor-captured"] == (
            f"not compiled: inductor ran {first_ms:.3f} ms, its library calls alone take {floor_ms:.3f} ms")


@pytest.mark.parametrize("name, graph, before", [
    ("inductor", "rec+eager", "inductor-captured"),
    ("inductor-embedding", "rec+eager-embedding", "inductor-captured"),  # the rewrite without one pass's regions
    ("inductor-captured", "eager", "inductor"),
])
def test_inductor_ms_is_its_median_raced_against_its_graph_eagerly_and_none_where_results_differ(
        monkeypatch, name, graph, before):
    """Recorded under the names of the candidates timed: the Inductor graph and the graph it compiles, run eagerly."""
    sandbox = autotune.Sandbox([torch.randn(8)])
    monkeypatch.setattr(autotune, "race", lambda steps, budget_s, **kwargs: dict(zip(steps, ([1.0] * 3, [0.5] * 3))))
    decision = autotune.Decision("eager")
    assert autotune.inductor_ms(lambda x: x * 2, lambda x: x * 2, sandbox, decision, 0.0, name, before) == 500.0
    assert decision.timings_ms == {f"before compiling {before}:{name}": 500.0, f"before compiling {before}:{graph}": 1000.0}
    assert autotune.inductor_ms(lambda x: x * 3, lambda x: x * 2, sandbox, decision, 0.0, name, before) is None  # wrong


def test_fastest_eagerly_times_every_graph_and_returns_the_fastest():
    slow = torch.fx.symbolic_trace(lambda x: torch.stack([x.sin() for _ in range(200)]).sum(0))
    fast = torch.fx.symbolic_trace(lambda x: x.sin() * 200)
    decision = autotune.Decision("eager")
    graphs = {"rec+eager": lambda: fast, "eager": lambda: slow}
    # a budget for all MAX_ROUNDS rounds (~0.1 s): a few rounds preempted by the other test worker cannot decide
    assert autotune.fastest_eagerly(graphs, autotune.Sandbox([torch.randn(64, 64)]), False, decision, 1.0) == "rec+eager"
    assert decision.timings_ms["eagerly:rec+eager"] < decision.timings_ms["eagerly:eager"]


def test_random_graphs_compile_inductor_once_on_the_rewrite(_cache, inductor_graphs):
    """The captured graph draws eager's dropout masks, the rewrite its own: only the rewrite races."""
    class DroppedCross(Cross):
        def forward(self, x0):
            return torch.nn.functional.dropout(super().forward(x0), 0.5, training=True)

    torch._dynamo.reset()
    torch.compile(DroppedCross(), backend="rec_ascend")(torch.randn(8, 16, requires_grad=True)).sum().backward()
    [graph] = inductor_graphs
    assert _has_rec_ops(graph)
    [decision] = _decisions(_cache)
    assert set(decision["compile_s"]) == {"rec+eager", "inductor"}


def test_clamping_lookups_keep_no_graph_with_the_captured_lookups(_cache, inductor_graphs):
    """bounds_check="warning" clamps ids the captured lookups would raise on: neither the captured graph nor the
    rewrite without the embedding pass is a candidate; the rewrite without the interaction pass is."""
    from models.dlrm import DLRM, DLRMConfig, synthetic_batch

    cfg = DLRMConfig(table_rows=[50, 80, 120], dim=8, bottom=[16, 8], top=[16, 1])
    model, args = DLRM(cfg), synthetic_batch(cfg, 9)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="rec_ascend", options={"bounds_check": "warning"})(*args)
        torch.testing.assert_close(out, model(*args), rtol=1e-5, atol=1e-5)
    [decision] = _decisions(_cache)
    assert "rec+eager-interaction" in decision["compile_s"]
    assert not decision["compile_s"].keys() & {"eager", "inductor-captured", "rec+eager-embedding", "inductor-embedding"}
    assert all(_has_rec_ops(graph) for graph in inductor_graphs)


def test_decision_is_keyed_by_graph_and_shapes(_cache):
    model = Cross()
    with torch.no_grad():
        for batch in (8, 8, 12):
            torch._dynamo.reset()
            torch.compile(model, backend="rec_ascend", dynamic=False)(torch.randn(batch, 16))
        assert len(_decisions(_cache)) == 2  # the second batch of 8 used the first's decision
        torch._dynamo.reset()
        torch.compile(Cross(8), backend="rec_ascend", dynamic=False)(torch.randn(8, 8))
    assert len(_decisions(_cache)) == 3
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    for node in gm.graph.find_nodes(op="placeholder"):
        node.meta["example_value"] = torch.empty(4, 3)
    key = autotune.graph_key(gm, "cpu", False)
    assert key != autotune.graph_key(gm, "cpu", True) and key != autotune.graph_key(gm, "cuda", False)
    node.meta["example_value"] = torch.empty(5, 3)
    assert key != autotune.graph_key(gm, "cpu", False)


@pytest.mark.parametrize("model", [Cross, Plain])
@pytest.mark.parametrize("training", [False, True])
def test_a_stream_of_batches_compiles_at_most_twice(_cache, inductor_graphs, training, model):
    """Dynamo compiles at most twice (static, then dynamic sizes), and each compile compiles Inductor at most once
    per graph: a graph without rec regions too, whose size buckets race the candidates already built."""
    model = model()
    counter = torch._dynamo.testing.CompileCounterWithBackend("rec_ascend")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counter)
    with torch.set_grad_enabled(training):
        for batch in (8, 9, 10, 13, 17, 300):
            x = torch.randn(batch, 16, requires_grad=training)
            out = compiled(x)
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
            if training:
                out.sum().backward()
    assert counter.frame_count <= 2
    assert len(inductor_graphs) <= 2 * counter.frame_count
    if isinstance(model, Plain):
        assert len(inductor_graphs) <= counter.frame_count


def _dynamo_graph(fn, *args):
    captured = {}

    def backend(gm, example_inputs):
        captured["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    return captured["gm"]


def test_logical_operators_are_not_in_place_but_augmented_assignments_are():
    """``x & y`` is ``operator.and_`` (a trailing underscore, not in-place); ``x += y`` is ``operator.iadd``: into an
    input that requires grad it is not raced (the race runs such inputs as leaves of its own), into an input that
    does not it is (the race puts its value back), and into an intermediate (``l2 += w.norm()``) it is."""
    def masked(x, y):
        return torch.where((x > 0) & (y > 0) | (x < -1), x, y)

    def accumulate(x, y):
        x += y
        return x * 2

    def regularized(x, y):
        l2 = x.pow(2).sum()
        l2 += y.norm()
        return x * l2

    args = (torch.randn(6), torch.randn(6))
    assert autotune.tunable(_dynamo_graph(masked, *args), args)
    assert autotune.tunable(_dynamo_graph(accumulate, *[a.clone() for a in args]), args)
    grad = (torch.randn(6).mul(1).requires_grad_(), torch.randn(6, requires_grad=True))
    assert not autotune.tunable(_dynamo_graph(accumulate, grad[0] * 1, grad[1]), grad)
    assert autotune.tunable(_dynamo_graph(regularized, *grad), grad)


def test_inductor_keeps_its_size_guarding_decompositions_on_static_graphs_only(_cache, monkeypatch):
    """A graph with static sizes (batch 1 always is) gets Inductor's whole decomposition table, as plain Inductor: at
    batch 1 a matrix-vector product becomes a fused reduction; one with symbolic sizes does without the
    decompositions that would guard on them (and recompile a stream of batches)."""
    tables = []

    def compile_fx(graph, example_inputs, **kwargs):
        tables.append(kwargs["decompositions"])
        return graph.forward

    monkeypatch.setattr(rec_backend, "compile_fx", compile_fx)
    torch._dynamo.reset()
    compiled = torch.compile(Plain(), backend="rec_ascend", options={"autotune": False})
    with torch.no_grad():
        for batch in (1, 8, 9):
            compiled(torch.randn(batch, 16))
    static, *rest = tables
    assert all(op in static for op in rec_backend.SIZE_GUARDING_DECOMPOSITIONS)
    assert rest and not any(op in table for table in rest for op in rec_backend.SIZE_GUARDING_DECOMPOSITIONS)


def _compile_twice(monkeypatch, tmp_path, dynamic: bool = True, between=lambda: None):
    """Plain's training step compiled twice on one Inductor cache folder: per compile, its loss and gradients and
    Inductor's cache counters."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model, x = Plain(), torch.randn(8, 16)
    steps = []
    for run in range(2):
        if run:
            between()
        torch._dynamo.reset()
        counters.clear()
        model.zero_grad()
        loss = torch.compile(model, backend="rec_ascend", dynamic=dynamic, options={"autotune": False})(x).sum()
        loss.backward()
        steps.append(([loss.detach(), *(p.grad for p in model.parameters())],
                      {**counters["inductor"], **counters["aot_autograd"]}))
    return steps


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_graph_compiled_again_comes_from_inductors_caches(dynamic, tmp_path, monkeypatch):
    """rec_ascend's compiles are keyed by Inductor's FX graph and AOT autograd caches as plain Inductor's are (its
    decomposition table pickles as how it is made): the same model compiled again, in training, hits both, and
    gives the same loss and gradients."""
    (cold, _), (warm, counts) = _compile_twice(monkeypatch, tmp_path, dynamic)
    assert not counts.get("fxgraph_cache_bypass") and not counts.get("autograd_cache_bypass")
    assert counts.get("fxgraph_cache_hit") == 2 and counts.get("autograd_cache_hit") == 1
    for got, want in zip(warm, cold):
        assert torch.equal(got, want)


def test_a_compile_after_the_custom_ops_changed_misses_inductors_caches(tmp_path, monkeypatch):
    """AOT autograd traces a custom op's fake and autograd formula, which Inductor's caches know by its name only:
    once the files that define the ops change (their hash, ``op_definitions_hash``), the same graph hits neither."""
    edited = lambda: monkeypatch.setattr(rec_backend, "op_definitions_hash", lambda: b"edited")  # noqa: E731
    _, (_, counts) = _compile_twice(monkeypatch, tmp_path, between=edited)
    assert not counts.get("fxgraph_cache_bypass") and not counts.get("autograd_cache_bypass")
    assert not counts.get("fxgraph_cache_hit") and not counts.get("autograd_cache_hit")
    assert counts.get("fxgraph_cache_miss") == 2 and counts.get("autograd_cache_miss") == 1


def test_the_decomposition_tables_pickle_as_how_they_are_made():
    """The FX graph cache keys a compile by its pickled decomposition table: the two tables pickle apart, and
    each as itself."""
    import pickle

    tables = [rec_backend.inductor_decompositions(dynamic) for dynamic in (False, True)]
    assert pickle.dumps(tables[0]) != pickle.dumps(tables[1])
    assert all(pickle.loads(pickle.dumps(table)) == table for table in tables)


def test_the_rewrite_estimate_swaps_what_inductor_makes_of_the_replaced_code_for_the_kernels():
    """Figures from the corpus' decisions (ms): Inductor on the rewrite lost to Inductor on the captured graph in
    RecBole FM predict at batch 128 (0.052 against 0.042) and won in SASRec full sort (0.489 against 0.540)."""
    fm = autotune.RewriteEstimate(floor_ms=0.0144, kernels_ms=0.0144, eager_ms=0.217, captured_eager_ms=0.247)
    assert fm.ms(0.0424) == pytest.approx(0.0424 - 0.0444 * 0.0424 / 0.247 + 0.0144)
    assert not fm.can_win(0.0424)
    sasrec = autotune.RewriteEstimate(floor_ms=0.175, kernels_ms=0.175, eager_ms=0.738, captured_eager_ms=1.15)
    assert sasrec.can_win(0.54)
    # the captured graph's library calls replaced by a region (a lookup) count as they are, not sped up
    lookups = autotune.RewriteEstimate(floor_ms=0.1, kernels_ms=0.1, eager_ms=1.0, captured_eager_ms=1.2,
                                       captured_floor_ms=0.3)
    assert lookups.ms(0.6) == pytest.approx(0.6 - (0.3 + 0.0 * 0.3) + 0.1)
    assert autotune.RewriteEstimate(floor_ms=0.5, kernels_ms=0.1).ms(0.6) == 0.5  # no eager times: the floor
    assert fm.ms(0.0) == fm.floor_ms  # never below the floor
    assert fm.why_not("inductor", 0.0424).startswith("not compiled: inductor-captured ran 0.042 ms, inductor would")


@pytest.mark.parametrize("eager_ms, compiled", [(1.9, 1), (1.0, 2)])
def test_a_static_inference_graph_compiles_plain_inductor_first_and_the_rewrite_only_where_it_can_win(
        _cache, inductor_graphs, monkeypatch, eager_ms, compiled):
    """Where the rewrite's floor leaves the captured graph a chance (it is compiled whatever Inductor on the rewrite
    runs), plain Inductor's graph is compiled and timed first; the rewrite's only where its estimate beats that by
    the margin: one Inductor compile, as plain Inductor's, where the regions save less than Inductor makes of the
    code they replace (captured 2.0 ms eagerly, 1.0 ms through Inductor; kernels 0.2 ms; rewrite 1.9 or 1.0 ms
    eagerly)."""
    def fastest_eagerly(graphs, sandbox, training, decision, budget_s):
        decision.timings_ms.update({"eagerly:rec+eager": eager_ms, "eagerly:eager": 2.0})
        return "rec+eager"

    timed = []
    monkeypatch.setattr(autotune, "fastest_eagerly", fastest_eagerly)
    monkeypatch.setattr(autotune, "inductor_can_win", lambda *args: True)
    monkeypatch.setattr(autotune, "inductor_floor_ms", lambda *args: 0.0)
    monkeypatch.setattr(autotune, "rewrite_floor_ms", lambda *args: 0.2)
    monkeypatch.setattr(autotune, "kernels_ms", lambda *args: 0.2)
    monkeypatch.setattr(autotune, "inductor_ms", lambda *args: timed.append(args[5:]) or 1.0)
    _run(Cross(), torch.randn(8, 16), False)
    [decision] = _decisions(_cache)
    assert timed == [("inductor-captured", "inductor")]
    assert [_has_rec_ops(g) for g in inductor_graphs] == [False, True][:compiled]
    assert ("inductor" in decision["compile_s"]) == (compiled == 2)
    if compiled == 1:
        assert decision["rejected"]["inductor"] == ("not compiled: inductor-captured ran 1.000 ms, inductor would take "
                                                    "about 1.050 ms (its library calls and regions alone 0.200 ms)")


def test_a_deferred_training_compile_is_skipped_where_its_estimate_cannot_beat_the_captured_graph(
        _cache, inductor_graphs, monkeypatch):
    """The deferred Inductor graph of a training graph: its floor (0) leaves it a chance, but the captured graph's
    step timed at the first call leaves the rewrite's estimate no gain by the margin (the rewrite saves eagerly
    about what its kernels take): not compiled."""
    def fastest_eagerly(graphs, sandbox, training, decision, budget_s):
        decision.timings_ms.update({"eagerly:rec+eager": 100.0, "eagerly:eager": 100.0})
        return "rec+eager"

    monkeypatch.setattr(autotune, "fastest_eagerly", fastest_eagerly)
    monkeypatch.setattr(autotune, "inductor_floor_ms", lambda *args: 0.0)
    monkeypatch.setattr(autotune, "rewrite_floor_ms", lambda *args: 0.0)
    _run(Cross(), torch.randn(8, 16, requires_grad=True), True)
    [decision] = _decisions(_cache)
    assert "inductor" not in decision["compile_s"] and "inductor-captured" in decision["compile_s"]
    assert decision["rejected"]["inductor"].startswith("not compiled: inductor-captured ran")
    assert [_has_rec_ops(g) for g in inductor_graphs] == [False]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("captured_eager_ms, compiled", [(2.0, 1), (None, 2)])
def test_an_inference_graph_whose_rewrite_floor_is_the_captured_graphs_compiles_only_inductor_on_the_rewrite(
        _cache, inductor_graphs, monkeypatch, captured_eager_ms, compiled, dynamic):
    """The cross nets' forward: the rewrite's floor (library calls 0.3 ms and kernels 0.2 ms) is within the margin of the
    captured graph's library calls (0.6 ms), so Inductor on the rewrite is compiled and timed first (1.0 ms). The
    captured graph through Inductor takes at least that time with the kernels swapped back for the library calls they
    replaced (0.3 ms, no more than the captured graph's 2.0 ms less the rewrite's 1.5 ms eagerly plus the kernels):
    1.1 ms, no win: one Inductor compile. Without the captured graph's eager time only its floor bounds it: both. A
    graph with symbolic sizes (its buckets race what is built) alike."""
    eagerly = {"rec+eager": 1.5, **({"eager": captured_eager_ms} if captured_eager_ms is not None else {})}
    race_checks.fake_estimates(monkeypatch, eagerly, inductor_floor_ms=0.6, rewrite_floor_ms=0.5, kernels_ms=0.2,
                               inductor_ms=1.0)
    _run(Cross(), torch.randn(8, 16), False, dynamic)
    [decision] = _decisions(_cache)
    assert bool(autotune.size_slots(inductor_graphs[0])) == dynamic
    assert [_has_rec_ops(g) for g in inductor_graphs] == [True, False][:compiled]
    assert ("inductor-captured" in decision["compile_s"]) == (compiled == 2)
    if compiled == 1:
        assert decision["rejected"]["inductor-captured"] == (
            "not compiled: inductor ran 1.000 ms, inductor-captured would take at least 1.100 ms (its library calls "
            "alone 0.600 ms)")


def test_the_captured_graph_takes_at_least_the_rewrites_time_with_its_kernels_swapped_for_the_calls_they_replaced():
    """TorchRec CrossNet's forward at batch 128 (ms, corpus decisions): the lookups grouped (kernel 0.022) replace
    embedding_bag calls (captured floor 0.059, the rewrite's GEMMs 0.029); Inductor on the rewrite ran 0.063, on the
    captured graph 0.094. A region that replaced no library call (a softmax): the kernel's time alone comes off."""
    cross = autotune.RewriteEstimate(floor_ms=0.051, kernels_ms=0.022, eager_ms=0.065, captured_eager_ms=0.081,
                                     captured_floor_ms=0.059)
    assert cross.replaced_library_ms() == pytest.approx(0.059 - 0.029)
    assert cross.captured_least_ms(0.063) == pytest.approx(0.063 - 0.022 + 0.030)
    assert autotune.captured_cannot_win("inductor", 0.063, cross, 0.059).startswith(
        "not compiled: inductor ran 0.063 ms, inductor-captured would take at least 0.071 ms")
    softmax = autotune.RewriteEstimate(floor_ms=0.175, kernels_ms=0.175, eager_ms=0.738, captured_eager_ms=1.15)
    assert softmax.captured_least_ms(0.94) == pytest.approx(0.94 - 0.175)
    assert autotune.captured_cannot_win("inductor", 0.94, softmax, 0.0) is None
    # no eager times: only the captured graph's library calls bound it
    assert autotune.RewriteEstimate(floor_ms=0.5, kernels_ms=0.1).captured_least_ms(1.0) == 0.0
    assert autotune.captured_cannot_win("inductor", 0.52, None, 0.5) == (
        "not compiled: inductor ran 0.520 ms, its library calls alone take 0.500 ms")


def test_a_second_inductor_compile_needs_an_estimated_win_beyond_the_estimates_error():
    """GR HSTU's forward at batch 128 (ms, corpus decisions): Inductor on the captured graph 0.680; on the rewrite (two
    attention kernels, six jagged regions run by their reference) estimated 0.636, within ESTIMATE_MARGIN; it ran 0.681.
    Not compiled: plain Inductor's graph runs, one compile. SASRec's full sort (estimated 0.439 against 0.540) is."""
    hstu = autotune.RewriteEstimate(floor_ms=0.503, kernels_ms=0.444, eager_ms=0.683, captured_eager_ms=0.898,
                                    captured_floor_ms=0.0592)
    assert hstu.ms(0.68) == pytest.approx(0.636, abs=1e-3)
    assert hstu.ms(0.68) * (1 + autotune.MARGIN) < 0.68 and not hstu.can_win(0.68)
    sasrec = autotune.RewriteEstimate(floor_ms=0.175, kernels_ms=0.175, eager_ms=0.738, captured_eager_ms=1.15)
    assert sasrec.can_win(0.54)


def test_a_tie_with_a_captured_graph_inductor_cannot_compile_compiles_the_rewrite(_cache, inductor_graphs, monkeypatch):
    """The captured graph holding ATen's GRU ran fastest eagerly by a hair (RecBole GRU4Rec's loss at batch 2048:
    53.0 against 53.2 ms) but Inductor would unroll it: Inductor compiles the rewrite (the GRU as one op), not nothing."""
    from tests.test_gru import SequenceModel, train_step

    race_checks.fake_estimates(monkeypatch, {"eager": 53.0, "rec+eager": 53.2}, fastest="eager")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, ids = SequenceModel(), torch.randint(0, 50, (4, 5))
    got, want = train_step(torch.compile(model, backend="rec_ascend"), ids), train_step(model, ids)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    [graph] = inductor_graphs
    assert _has_rec_ops(graph)
    [decision] = _decisions(_cache)
    assert "inductor" in decision["compile_s"]
    assert decision["rejected"]["inductor-captured"] == "not compiled: Inductor would unroll its recurrent call step by step"
