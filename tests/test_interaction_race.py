"""The race's decision logic, on injected timings (no timed test): candidates are compared round by round, an
outlier round does not decide, the captured graph is left only for a win beyond the margin, the race keeps to
its budget, and the decision lists the regions of the graph that runs."""
import json

import pytest
import torch

import recompile
from recompile import autotune
from recompile import backend as rec_backend
from tests.test_interaction_autotune import Cross


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RECOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(rec_backend, "compile_fx", lambda graph, example_inputs, **kwargs: graph.forward)
    return tmp_path


def _decision(cache_dir):
    [path] = (cache_dir / "autotune").glob("*.json")
    return json.loads(path.read_text())


def fake_race(seconds):
    """A race that runs nothing and reports ``seconds(name)`` (a list of per-round times) for each candidate."""
    def race(steps, budget_s, min_rounds=autotune.MIN_ROUNDS, clock=None, reset=None):
        return {name: list(seconds(name)) for name in steps}
    return race


def test_an_outlier_round_does_not_decide():
    """The minimum would keep Inductor for one lucky round; round by round it is no faster than eager."""
    samples = {"eager": [2.69, 2.70, 2.68, 2.71, 2.69], "inductor": [2.40, 2.75, 2.80, 2.70, 2.72]}
    assert min(samples, key=lambda name: min(samples[name])) == "inductor"
    assert autotune.fastest(samples, autotune.INCUMBENTS, autotune.MARGIN) == "eager"


def test_rounds_are_compared_with_each_other():
    """Load that slows whole rounds falls on every candidate of the round: a steady 10% win is seen through it."""
    eager = [1.0, 3.0, 1.0, 2.5, 3.0]
    samples = {"eager": eager, "inductor": [0.9 * t for t in eager]}
    assert autotune.relative_times(samples, "eager")["inductor"] == pytest.approx(0.9)
    assert autotune.fastest(samples, autotune.INCUMBENTS, autotune.MARGIN) == "inductor"


@pytest.mark.parametrize("speedup, kept", [(0.98, "eager"), (1.0 - autotune.MARGIN / 2, "eager"),
                                           (1.0 - 2 * autotune.MARGIN, "rec+eager")])
def test_the_captured_graph_is_left_only_for_a_win_beyond_the_margin(speedup, kept):
    samples = {"eager": [1.0] * 5, "rec+eager": [speedup] * 5}
    assert autotune.fastest(samples, autotune.INCUMBENTS, autotune.MARGIN) == kept


def test_incumbents_in_order_then_the_fastest():
    """Eager first, then the Inductor a user would otherwise get, each if within the margin of the fastest."""
    samples = {"eager": [1.0] * 3, "inductor-captured": [0.81] * 3, "inductor": [0.8] * 3}
    assert autotune.fastest(samples, autotune.INCUMBENTS, autotune.MARGIN) == "inductor-captured"
    samples["inductor"] = [0.7] * 3
    assert autotune.fastest(samples, autotune.INCUMBENTS, autotune.MARGIN) == "inductor"
    del samples["eager"], samples["inductor-captured"]  # no incumbent (clamping lookups): the fastest
    samples["rec+eager"] = [0.72] * 3
    assert autotune.fastest(samples, autotune.INCUMBENTS, autotune.MARGIN) == "inductor"
    assert autotune.fastest({}) is None


class FakeClock:
    """Time that moves only when a step runs: step ``name`` takes ``cost[name]`` seconds."""

    def __init__(self, cost):
        self.now, self.cost, self.order = 0.0, cost, []

    def __call__(self):
        return self.now

    def step(self, name):
        def run():
            self.order.append(name)
            self.now += self.cost[name]
        return run


def test_race_interleaves_rotates_and_keeps_to_its_budget():
    clock = FakeClock({"a": 1, "b": 2, "c": 3})
    samples = autotune.race({name: clock.step(name) for name in "abc"}, budget_s=30, clock=clock)
    assert samples == {"a": [1] * 5, "b": [2] * 5, "c": [3] * 5}  # 6 s a round: 5 rounds fill the 30 s
    assert clock.order[:9] == list("abc" "bca" "cab")  # each round starts one candidate further


def test_race_runs_the_rounds_a_median_needs_even_past_its_budget():
    clock = FakeClock({"a": 1, "b": 1})
    samples = autotune.race({name: clock.step(name) for name in "ab"}, budget_s=0.5, clock=clock)
    assert [len(times) for times in samples.values()] == [autotune.MIN_ROUNDS] * 2
    clock = FakeClock({"a": 1e-6})
    assert len(autotune.race({"a": clock.step("a")}, budget_s=1.0, clock=clock)["a"]) == autotune.MAX_ROUNDS


@pytest.mark.parametrize("inductor_share, kept", [(0.98, "eager"), (0.85, "inductor-captured")])
def test_the_graph_race_keeps_eager_within_the_margin(_cache, monkeypatch, inductor_share, kept):
    monkeypatch.setattr(autotune, "race", fake_race(lambda name: [inductor_share if name.startswith("inductor") else 1.0] * 5))
    model, x = Cross(), torch.randn(8, 16)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="rec_ascend")(x), model(x), rtol=1e-5, atol=1e-5)
    decision = _decision(_cache)
    assert decision["choice"] == kept and decision["regions"] == {}


def test_regions_are_those_of_the_graph_that_runs(_cache, monkeypatch):
    """DLRM's rewrite has a lookup and an interaction region; when the rewrite without the embedding pass is kept,
    the decision (and the report) lists only the interaction region, with the kernel it runs."""
    from models.dlrm import DLRM, DLRMConfig, synthetic_batch

    monkeypatch.setattr(autotune, "race", fake_race(lambda name: [0.5 if name.endswith("-embedding") else 1.0] * 3))
    cfg = DLRMConfig(table_rows=[50, 80, 120], dim=8, bottom=[16, 8], top=[16, 1])
    model, args = DLRM(cfg), synthetic_batch(cfg, 9)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="rec_ascend")(*args), model(*args), rtol=1e-5, atol=1e-5)
        text = recompile.explain(model, *args).to_text()
    decision = _decision(_cache)
    assert decision["choice"] in ("rec+eager-embedding", "inductor-embedding")
    ops = {node.rsplit("_", 1)[0] for node in decision["kernels"]}
    assert ops == {"grouped_embedding_bag", "dot_interaction"}
    [(node, impl)] = decision["regions"].items()
    assert node.startswith("dot_interaction") and impl == decision["kernels"][node]
    assert f"  regions it runs: {node}: {impl}" in text.splitlines()


def _rec_ops(gm):
    return [node for node in gm.graph.nodes if autotune._op_name(node)]


@pytest.mark.parametrize("training", [False, True])
def test_an_eager_rewrite_calls_the_op_functions_for_inference(_cache, monkeypatch, training):
    """Kept for inference, the rewrite run eagerly calls the rec ops' Python functions (no dispatch); training
    keeps the ops (their autograd). The rewrite itself, which Inductor compiles, keeps its ops either way."""
    monkeypatch.setattr(autotune, "race", fake_race(lambda name: [0.5 if name == "rec+eager" else 1.0] * 3))
    chosen = []
    monkeypatch.setattr(autotune, "CompiledGraph", lambda chooser: chosen.append(chooser) or chooser.first_call)
    model, x = Cross(), torch.randn(8, 16, requires_grad=training)
    with torch.set_grad_enabled(training):
        torch.testing.assert_close(torch.compile(model, backend="rec_ascend")(x), model(x), rtol=1e-5, atol=1e-5)
    [chooser] = chosen
    assert chooser.decision.choice == "rec+eager"
    runs = chooser.candidates["rec+eager"].__self__
    assert bool(_rec_ops(runs)) == training and bool(_rec_ops(chooser.graphs["rec+eager"]()))
    if not training:
        [call] = [node for node in runs.graph.nodes if getattr(node.target, "__name__", "") == "cross_stack"]
        assert call.target is torch._library.custom_ops.OPDEFS["recompile::cross_stack"]._init_fn


def test_rounds_that_disagree_beyond_the_margin_are_not_settled():
    steady = {"eager": [1.0] * 8, "inductor": [0.8] * 8}
    assert autotune.settled(steady, "inductor", "eager")
    # faster at the median, slower by 20% in three rounds of eight: the machine's load moved under the race
    shaky = {"eager": [1.0] * 8, "inductor": [0.7, 0.7, 0.7, 0.7, 0.8, 1.2, 1.2, 1.2]}
    assert not autotune.settled(shaky, "inductor", "eager")
    assert autotune.settled(shaky, "eager", "eager")


def test_a_race_whose_rounds_disagree_keeps_the_safe_candidate_and_caches_nothing(_cache, monkeypatch):
    rounds = [0.7, 0.7, 0.7, 0.7, 0.8, 1.2, 1.2, 1.2]
    monkeypatch.setattr(autotune, "race", fake_race(lambda name: rounds if name.startswith("inductor") else [1.0] * 8))
    chosen = []
    monkeypatch.setattr(autotune, "CompiledGraph", lambda chooser: chosen.append(chooser) or chooser.first_call)
    model, x = Cross(), torch.randn(8, 16)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="rec_ascend")(x), model(x), rtol=1e-5, atol=1e-5)
    [chooser] = chosen
    assert chooser.decision.choice == "eager" and "rounds disagree" in " ".join(chooser.decision.rejected.values())
    assert not list((_cache / "autotune").glob("*.json"))


def test_an_unsettled_race_keeps_the_faster_incumbent_its_rounds_settle(_cache, monkeypatch):
    """Inductor on the captured graph steadily beats eager; the rewrite through Inductor is faster at the median
    but slower than both in three rounds of eight: the race keeps Inductor on the captured graph, not eager (TorchRec
    DeepFM's forward at batch 2048 kept eager, 0.82x of Inductor), and caches nothing."""
    shaky = [0.5, 0.5, 0.5, 0.5, 0.5, 1.2, 1.2, 1.2]
    times = {"inductor-captured": [0.8] * 8}
    monkeypatch.setattr(autotune, "race",
                        fake_race(lambda name: times.get(name, shaky if "inductor" in name else [1.0] * 8)))
    # both Inductor graphs compiled (no compile budget: these compiles take no time)
    monkeypatch.setattr(autotune, "choose_compiles", lambda graphs, builders, *args, **kwargs: ("rec+eager", None))
    monkeypatch.setattr(autotune, "captured_cannot_win", lambda *args: None)
    chosen = []
    monkeypatch.setattr(autotune, "CompiledGraph", lambda chooser: chosen.append(chooser) or chooser.first_call)
    model, x = Cross(), torch.randn(8, 16)
    with torch.no_grad():
        compiled = torch.compile(model, backend="rec_ascend", options={"compile_budget": None})
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    [chooser] = chosen
    assert {"eager", "inductor-captured", "inductor"} <= set(chooser.candidates)
    assert chooser.decision.choice == "inductor-captured"
    assert "rounds disagree" in " ".join(chooser.decision.rejected.values())
    assert not list((_cache / "autotune").glob("*.json"))


def test_a_decision_is_raced_again_under_other_conditions(_cache, monkeypatch):
    """A decision taken while the machine was busy (or on another CPU, or with other threads) is not applied on
    a quiet one: each set of conditions has its own."""
    model, x = Cross(), torch.randn(8, 16)
    monkeypatch.setattr(autotune, "race", fake_race(lambda name: [1.0] * 3))
    for busy in (True, True, False):
        monkeypatch.setattr(autotune, "conditions", lambda busy=busy: {"cpu": "x", "threads": 2, "busy": busy})
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend="rec_ascend")(x)
    decisions = [json.loads(p.read_text()) for p in (_cache / "autotune").glob("*.json")]
    assert sorted(d["conditions"]["busy"] for d in decisions) == [False, True]
