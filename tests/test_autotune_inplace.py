"""What the race keeps is checked where it runs: an inference choice against the captured graph run eagerly, on
the first real calls after the choice (raced or cached), timed as Dynamo calls it; a choice that loses there gives
way to the captured graph (a cached one is dropped, to be raced again). And Inductor does not compile the
captured graph when its library calls alone take longer than the fastest graph eagerly."""
import time

import pytest
import torch

from recompile import autotune
from tests.test_autotune_compiles import _cache, _decisions, inductor_graphs  # noqa: F401  (fixtures)
from tests.test_interaction_autotune import Cross


def _slow(x):
    time.sleep(0.003)
    return x * 2


def _fast(x):
    return x * 2


def _chooser(pick, eager, cached: bool):
    decision = autotune.Decision("inductor", mode="inference", cached=cached, key="k" * 32)
    autotune.store(decision)
    return autotune.GraphChooser({"inductor": pick}, eager, decision, 0.0, chosen=pick, eager=eager)


def _calls(chooser, n=2 * autotune.CHECK_CALLS):
    x = torch.randn(4)
    for _ in range(n):
        torch.testing.assert_close(chooser.run(x), x * 2)


@pytest.mark.parametrize("cached", [False, True])
def test_a_choice_slower_in_place_gives_way_to_the_captured_graph(_cache, cached):
    chooser = _chooser(_slow, _fast, cached)
    chooser.stored = True
    assert chooser.run == chooser.check_call
    _calls(chooser)
    assert chooser.run is _fast and chooser.decision.choice == "eager"
    assert chooser.decision.rejected["inductor"].startswith("slower in place than eager")
    stored = _decisions(_cache)
    if cached:
        assert stored == []  # raced again at the next compile
    else:
        assert [d["choice"] for d in stored] == ["eager"]


def test_a_choice_that_holds_in_place_is_then_called_directly(_cache):
    chooser = _chooser(_fast, _slow, False)
    _calls(chooser, 2 * autotune.CHECK_CALLS - 1)
    assert chooser.run == chooser.check_call  # still checking
    _calls(chooser, 1)
    assert chooser.run is _fast and chooser.decision.choice == "inductor"
    assert {"in place:inductor", "in place:eager"} <= set(chooser.decision.timings_ms)


def test_training_and_eager_choices_are_not_checked_in_place(_cache):
    for mode, choice in (("training", "inductor"), ("inference", "eager")):
        decision = autotune.Decision(choice, mode=mode)
        assert autotune.GraphChooser({}, _fast, decision, 0.0, chosen=_slow, eager=_fast).run is _slow


def test_the_captured_graph_is_not_compiled_when_its_library_calls_cannot_win(_cache, inductor_graphs, monkeypatch):
    def fastest_eagerly(graphs, sandbox, training, decision, budget_s):
        decision.timings_ms["eagerly:rec+eager"] = 0.01
        return "rec+eager"

    monkeypatch.setattr(autotune, "fastest_eagerly", fastest_eagerly)
    monkeypatch.setattr(autotune, "inductor_floor_ms", lambda gm, sandbox: 1.0)
    monkeypatch.setattr(autotune, "inductor_can_win", lambda *args: True)
    model, x = Cross(), torch.randn(8, 16)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="rec_ascend")(x), model(x), rtol=1e-5, atol=1e-5)
    [decision] = _decisions(_cache)
    assert "inductor-captured" not in decision["compile_s"] and "inductor" in decision["compile_s"]
    assert decision["rejected"]["inductor-captured"].startswith("not compiled: its library calls alone take 1.000 ms")
    assert len(inductor_graphs) == 1


def test_inductor_floor_counts_gemms_not_pointwise_work():
    gm = torch.fx.symbolic_trace(lambda x, w: torch.sigmoid(torch.nn.functional.linear(x, w)).exp() * 3)
    sandbox = autotune.Sandbox([torch.randn(256, 256), torch.randn(256, 256)])
    timer = autotune.timed_nodes(gm, sandbox, lambda node: node.target in autotune.KEPT_BY_INDUCTOR)
    assert 0 < timer.fixed < timer.total
    assert autotune.inductor_floor_ms(gm, sandbox) > 0
