"""Choices per size bucket: a graph Dynamo compiled with a dynamic batch races its compiled candidates again on the
first call of each power-of-two size bucket (in the race's sandbox), caches each bucket's decision and dispatches
by bucket afterwards, with no recompile; timings are injected (no timed test)."""
import copy

import pytest
import torch

from recompile import autotune
from recompile import backend as rec_backend
from tests import race_checks
from tests.test_autotune_compiles import _cache, _decisions, inductor_graphs  # noqa: F401  (fixtures)
from tests.test_interaction_autotune import Cross

SMALL, LARGE = (9, 12, 8), (40, 50)  # buckets 4 (and the static graph of 8) and 6


def _call_size(step) -> int | None:
    """The symbolic batch a whole-graph race step runs (Dynamo passes it as an int input); None: static sizes."""
    return next((a for a in step.args[1] if type(a) is int), None)


@pytest.fixture
def flipping(monkeypatch):
    """Inductor wins small batches, the captured graph run eagerly wins large ones; returns the sizes each
    whole-graph race ran on."""
    raced = []

    def race(steps, budget_s, **kwargs):
        if "eager" not in steps:  # a region's kernels
            return {name: [1.0] * 3 for name in steps}
        size = _call_size(next(iter(steps.values())))
        raced.append(size)
        small = size is None or size < 32
        return {name: [0.5 if name.startswith("inductor") == small and name != "rec+eager" else 1.0] * 3
                for name in steps}

    monkeypatch.setattr(autotune, "race", race)
    monkeypatch.setattr(autotune, "fastest_eagerly", lambda *args: "rec+eager")
    monkeypatch.setattr(autotune, "inductor_can_win", lambda *args: True)
    monkeypatch.setattr(autotune, "inductor_floor_ms", lambda *args: 0.0)
    monkeypatch.setattr(autotune, "rewrite_floor_ms", lambda *args: 0.0)  # a deferred Inductor graph is built
    monkeypatch.setattr(autotune, "inductor_ms", lambda *args: None)
    monkeypatch.setattr(autotune.GraphChooser, "checked", lambda self, pick: pick)  # no check in place here
    return raced


def _stream(model, batches, training):
    counter = torch._dynamo.testing.CompileCounterWithBackend("rec_ascend")
    returned = []

    def backend(gm, example_inputs):
        returned.append(counter(gm, example_inputs))
        return returned[-1]

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.set_grad_enabled(training):
        for batch in batches:
            x = torch.randn(batch, 16, requires_grad=training)
            out = compiled(x)
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
            if training:
                out.sum().backward()
    return counter.frame_count, returned


@pytest.mark.parametrize("training", [False, True])
def test_each_size_bucket_races_once_and_runs_its_own_choice(_cache, inductor_graphs, flipping, training):
    frames, returned = _stream(Cross(), (8, 9, 40, 12, 50, 41), training)
    assert frames == 2  # the static graph of batch 8, then one dynamic graph for every other batch
    assert flipping == [None, 9, 40]  # one race per bucket: 12 and 50, 41 dispatch to their bucket's choice
    dynamic = returned[-1].buckets
    assert set(dynamic.choosers) == {4, 6}
    small, large = dynamic.choosers[4], dynamic.choosers[6]
    assert small.decision.choice.startswith("inductor") and large.decision.choice == "eager"
    assert small.run is small.candidates[small.decision.choice] and large.run is large.candidates["eager"]
    assert small.candidates is large.candidates  # the same compiled candidates: no compile per bucket
    assert len(inductor_graphs) == 2 * 2  # per Dynamo graph (floor 0: the captured graph too), as without buckets
    keys = {d["key"]: d["choice"] for d in _decisions(_cache)}
    assert keys[small.decision.key] == small.decision.choice and keys[large.decision.key] == "eager"
    assert small.decision.key.endswith("-4") and large.decision.key.endswith("-6")


def test_a_warm_cache_applies_every_buckets_decision_without_a_race(_cache, inductor_graphs, flipping, monkeypatch):
    _stream(Cross(), (8, 9, 40), False)
    before = _decisions(_cache)

    def no_race(*args, **kwargs):
        raise AssertionError("a decided bucket is not raced again")

    monkeypatch.setattr(autotune, "race", no_race)
    _, returned = _stream(Cross(), (8, 9, 40, 12), False)
    dynamic = returned[-1].buckets
    assert dynamic.choosers[4].decision.cached and dynamic.choosers[6].decision.cached
    assert dynamic.choosers[6].run is dynamic.choosers[6].candidates["eager"]
    assert dynamic.choosers[4].decision.choice in dynamic.choosers[4].candidates  # built at the compile
    assert _decisions(_cache) == before


def test_past_max_buckets_a_bucket_takes_the_nearest_choice(_cache, inductor_graphs, flipping, monkeypatch):
    monkeypatch.setattr(autotune, "MAX_BUCKETS", 1)
    _, returned = _stream(Cross(), (8, 9, 40, 600), False)
    assert flipping == [None, 9]
    dynamic = returned[-1].buckets
    assert dynamic.choosers[6] is dynamic.choosers[10] is dynamic.choosers[4]


def test_the_bucket_is_the_power_of_two_of_the_symbolic_sizes():
    shape_env = torch.fx.experimental.symbolic_shapes.ShapeEnv()
    fake = torch._subclasses.FakeTensorMode(shape_env=shape_env)
    gm = torch.fx.symbolic_trace(lambda n, x, y, w: x.sum() + y.sum() + w.sum() + n)
    b, length = (shape_env.create_unbacked_symint() for _ in range(2))
    with fake:
        values = [b, torch.empty(b, length), torch.empty(b, 4), torch.empty(3, 3)]
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), values):
        node.meta["example_value"] = value
    slots = autotune.size_slots(gm)
    assert slots == [(0, None), (1, 1)]  # one place per symbol; static sizes are none
    args = [128, torch.empty(128, 50), torch.empty(128, 4), torch.empty(3, 3)]
    assert autotune.size_bucket(slots, args) == (128 * 50).bit_length()
    args[0], args[1] = 200, torch.empty(200, 50)
    assert autotune.size_bucket(slots, args) == (128 * 50).bit_length() + 1


class BatchNormCross(Cross):
    """A cross layer (a rec region, so the graph is raced) after a BatchNorm that updates its statistics."""

    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(16)

    def forward(self, x0):
        return super().forward(self.bn(x0))


def test_a_race_in_a_new_bucket_is_invisible(_cache, monkeypatch, quick_race):
    """A training stream whose batches land in new buckets: each bucket's race runs in the sandbox, so the statistics
    count one step per call, the gradients are eager's and the caller's random stream is where eager leaves it."""
    race_checks.inductor_draws_its_own_numbers(monkeypatch)
    torch.manual_seed(0)
    model = BatchNormCross()
    ref = copy.deepcopy(model)
    returned = []

    def backend(gm, example_inputs):
        returned.append(rec_backend.rec_ascend(gm, example_inputs))
        return returned[-1]

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    for batch in (8, 9, 40, 12, 600):
        x = torch.randn(batch, 16)
        torch.manual_seed(batch)
        compiled(x).pow(2).sum().backward()
        after = torch.rand(1)
        torch.manual_seed(batch)
        ref(x).pow(2).sum().backward()
        assert torch.equal(after, torch.rand(1)), f"batch {batch}: the race drew from the caller's random stream"
    assert set(returned[-1].buckets.choosers) == {4, 6, 10}
    assert model.bn.num_batches_tracked.item() == 5
    for name, buffer in ref.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer, rtol=1e-5, atol=1e-6, msg=name)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
