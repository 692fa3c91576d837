"""What the race keeps is checked where it runs: a choice against the captured graph run eagerly, on the first real
calls after the choice (raced or cached), timed as Dynamo calls it (a training call with its part of the caller's
backward); a choice that loses there gives way to the captured graph (a cached one is dropped, to be raced again). And Inductor does not compile the
captured graph when its library calls alone take longer than the fastest graph eagerly."""
import functools
import time

import pytest
import torch

from recompile import autotune
from tests.test_autotune_compiles import _cache, _decisions, _has_rec_ops, inductor_graphs  # noqa: F401  (fixtures)
from tests.test_interaction_autotune import Cross


def _busy(seconds: float) -> None:
    """Work ``seconds`` of the calling thread's CPU time: slow on every clock of the race (a sleep is not, on the
    thread's CPU time: ``autotune.clock_name``)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _slow(x):
    _busy(0.003)
    return x * 2


def _fast(x):
    return x * 2


def _short(x):  # slower than _fast, yet a short call (under SHORT_CALL_S)
    _busy(0.0005)
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


def test_a_choice_of_short_calls_is_checked_over_more_calls(_cache):
    """Calls under SHORT_CALL_S: three timings each are mostly jitter, so the check takes SHORT_CHECK_CALLS (the
    captured graph a short call that is slower, so that the choice holds whatever the jitter)."""
    chooser = _chooser(_fast, _short, False)
    _calls(chooser, 2 * autotune.CHECK_CALLS)
    assert chooser.run == chooser.check_call
    _calls(chooser, 2 * (autotune.SHORT_CHECK_CALLS - autotune.CHECK_CALLS))
    assert chooser.run is _fast and chooser.decision.choice == "inductor"


def test_an_eager_choice_is_not_checked_in_place(_cache):
    for mode in ("training", "inference"):
        decision = autotune.Decision("eager", mode=mode)
        assert autotune.GraphChooser({}, _fast, decision, 0.0, chosen=_slow, eager=_fast).run is _slow


class SlowBackward(torch.autograd.Function):
    """x * 2, whose backward works 4 ms: a forward as fast as the other candidate's, a slower training step."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _busy(0.004)
        return grad * 2


def _steps(chooser, n, backward=True, grad=False):
    """Training calls as a caller makes them: the graph's forward on a leaf, then the loss's backward (or
    ``torch.autograd.grad`` of it)."""
    x = torch.randn(4, requires_grad=True)
    for _ in range(n):
        out = chooser.run(x)
        torch.testing.assert_close(out, x.detach() * 2)
        if grad:
            torch.testing.assert_close(torch.autograd.grad((out * 3).sum(), x)[0], torch.full((4,), 6.0))
        elif backward:
            (out * 3).sum().backward()
    return x


@pytest.mark.parametrize("cached", [False, True])
def test_a_training_choice_whose_backward_is_slower_in_place_gives_way(_cache, cached):
    """The forwards take as long; the pick's backward, timed by autograd hooks in the caller's own steps, is slower."""
    decision = autotune.Decision("inductor", mode="training", cached=cached, key="t" * 32)
    autotune.store(decision)
    chooser = autotune.GraphChooser({"inductor": SlowBackward.apply}, _fast, decision, 0.0, chosen=SlowBackward.apply,
                                    eager=_fast)
    chooser.stored = True
    x = _steps(chooser, 2 * autotune.CHECK_CALLS)
    assert chooser.run is _fast and chooser.decision.choice == "eager"
    assert chooser.decision.timings_ms["in place:inductor"] > 4
    assert chooser.decision.rejected["inductor"].startswith("slower in place than eager")
    assert [d["choice"] for d in _decisions(_cache)] == ([] if cached else ["eager"])
    assert not x._backward_hooks  # every hook removed


def _fast_training_chooser():
    """A training choice (``_fast``) whose captured graph, run eagerly, has the slower backward."""
    decision = autotune.Decision("inductor", mode="training", key="t" * 32)
    return autotune.GraphChooser({"inductor": _fast}, _fast, decision, 0.0, chosen=_fast, eager=SlowBackward.apply)


@pytest.mark.parametrize("grad", [False, True], ids=["backward", "autograd.grad"])
def test_a_training_choice_that_holds_in_place_is_kept(_cache, grad):
    """Timed by the caller's loss.backward() or torch.autograd.grad(loss, x): the hooks work for both (the
    second raised before)."""
    chooser = _fast_training_chooser()
    x = _steps(chooser, 2 * autotune.CHECK_CALLS, grad=grad)
    assert chooser.run is _fast and chooser.decision.choice == "inductor"
    assert chooser.decision.timings_ms["in place:eager"] > 4 > chooser.decision.timings_ms["in place:inductor"]
    assert not x._backward_hooks


class WorkingBackward(torch.autograd.Function):
    """x * 2, whose backward runs ``step`` (work, or a fake machine's charge)."""

    @staticmethod
    def forward(ctx, x, step):
        ctx.step = step
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.step()
        return grad * 2, None


def _one_node(x, w):
    """A compiled graph's backward: one autograd node gives both inputs their gradients, in 2 ms."""
    return WorkingBackward.apply(x + w, functools.partial(_busy, 0.002))


def _node_by_node(x, w):
    """The same graph run eagerly: ``x``'s gradient comes at once, ``w``'s after a 6 ms node."""
    return WorkingBackward.apply(w, functools.partial(_busy, 0.006)) + x * 2


def test_a_training_check_times_the_backward_to_the_last_input_reached(_cache):
    """Run eagerly, a graph gives its inputs their gradients one node after another: timed to the first one
    reached, eager's 6 ms backward looked instant and the 2 ms compiled graph gave way (DCNV2's loss at batch
    2048 kept eager at 1.4 ms a call "in place", whose real step took 4.0 ms against Inductor's 2.5 ms)."""
    decision = autotune.Decision("inductor", mode="training", key="t" * 32)
    chooser = autotune.GraphChooser({"inductor": _one_node}, _one_node, decision, 0.0, chosen=_one_node,
                                    eager=_node_by_node)
    x, w = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    for _ in range(2 * autotune.CHECK_CALLS):
        chooser.run(x, w).sum().backward()
    assert chooser.run is _one_node and chooser.decision.choice == "inductor"
    assert chooser.decision.timings_ms["in place:eager"] > 6 > chooser.decision.timings_ms["in place:inductor"] > 2
    assert not x._backward_hooks and not w._backward_hooks


def test_a_training_check_reads_a_backward_that_reaches_some_inputs_at_the_next_call(_cache):
    """``torch.autograd.grad`` of one input: the other input's hook never fires; the call is read at the next."""
    decision = autotune.Decision("inductor", mode="training", key="t" * 32)
    chooser = autotune.GraphChooser({"inductor": _one_node}, _one_node, decision, 0.0, chosen=_one_node,
                                    eager=_node_by_node)
    x, w = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    for _ in range(2 * autotune.CHECK_CALLS + 1):
        torch.autograd.grad(chooser.run(x, w).sum(), w)
    assert chooser.run is _one_node and chooser.decision.choice == "inductor"
    assert chooser.decision.timings_ms["in place:eager"] > 6
    assert not x._backward_hooks and not w._backward_hooks


def test_a_training_check_without_backward_keeps_the_pick_and_its_hooks_go(_cache):
    """Calls under grad mode whose backward never comes: after 4 * CHECK_CALLS the pick stays, no hook is left."""
    chooser = _fast_training_chooser()
    x = _steps(chooser, 4 * autotune.CHECK_CALLS, backward=False)
    assert chooser.run is _fast and chooser.decision.choice == "inductor"
    assert not x._backward_hooks


def test_the_captured_graph_is_not_compiled_when_its_library_calls_cannot_win(_cache, inductor_graphs, monkeypatch):
    def fastest_eagerly(graphs, sandbox, training, decision, budget_s):
        decision.timings_ms["eagerly:rec+eager"] = 0.01
        return "rec+eager"

    monkeypatch.setattr(autotune, "fastest_eagerly", fastest_eagerly)
    monkeypatch.setattr(autotune, "inductor_floor_ms", lambda *args: 1.0)
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
    assert autotune.inductor_floor_ms(gm, sandbox, False) > 0


def test_training_floor_counts_a_product_that_needs_a_gradient_twice(monkeypatch):
    """In training the floor bounds the backward too: a GEMM whose output needs a gradient counts twice, one
    that does not (no input needs one) once."""
    gm = torch.fx.symbolic_trace(lambda x, w, v: torch.mm(x, w) + torch.mm(x, v))
    w = torch.randn(64, 64, requires_grad=True)
    mm_w, mm_v = [n for n in gm.graph.nodes if n.target is torch.mm]
    mm_w.meta["example_value"], mm_v.meta["example_value"] = torch.mm(torch.randn(2, 64), w), torch.zeros(2, 64)
    weights = {}
    monkeypatch.setattr(autotune, "calls_alone_ms", lambda gm, sandbox, weight: weights.update(
        {n.name: weight(n) for n in gm.graph.nodes}) or 1.0)
    autotune.inductor_floor_ms(gm, None, True)
    assert (weights[mm_w.name], weights[mm_v.name], weights["add"]) == (2, 1, 0)
    autotune.inductor_floor_ms(gm, None, False)
    assert (weights[mm_w.name], weights[mm_v.name]) == (1, 1)


def test_the_floor_times_each_library_call_alone_on_its_real_arguments(monkeypatch):
    """Each call the floor counts runs alone, called directly on the arguments it had in an eager run of the graph
    (timed inside the run through fx.Interpreter, a call also carried the interpreter's microseconds: on TorchRec's
    DeepFM the floor was as long as the whole graph); the fastest of its runs counts, times its weight."""
    x, w, v = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 3)
    gm = torch.fx.symbolic_trace(lambda x, w, v: torch.nn.functional.linear(torch.relu(x), w).sum() + torch.mm(x, v).sum())
    results = {}

    def race(steps, budget_s, min_rounds=autotune.MIN_ROUNDS, **kwargs):
        results.update({name: step() for name, step in steps.items()})
        assert min_rounds == autotune.FLOOR_ROUNDS
        return {name: [3e-3, 1e-3, 2e-3] for name in steps}

    monkeypatch.setattr(autotune, "race", race)
    floor = autotune.calls_alone_ms(gm, autotune.Sandbox([x, w, v]), lambda n: 2 if n.target is torch.mm else
                                    int(n.target in autotune.KEPT_BY_INDUCTOR))
    assert floor == pytest.approx(1.0 + 2 * 1.0)
    linear, mm = (n.name for n in gm.graph.nodes if n.target in autotune.KEPT_BY_INDUCTOR)
    assert results.keys() == {linear, mm}
    torch.testing.assert_close(results[linear], torch.nn.functional.linear(torch.relu(x), w))
    torch.testing.assert_close(results[mm], torch.mm(x, v))


def test_a_training_graph_compiles_the_captured_graph_when_its_floor_is_below(_cache, inductor_graphs, monkeypatch):
    """Plain Inductor can win a training graph where it fuses what a region does eagerly (SASRec's short softmax):
    its captured graph is compiled unless its library calls alone take longer than the fastest graph eagerly."""
    def fastest_eagerly(graphs, sandbox, training, decision, budget_s):
        decision.timings_ms["eagerly:rec+eager"] = 1.0
        return "rec+eager"

    monkeypatch.setattr(autotune, "fastest_eagerly", fastest_eagerly)
    floors = []
    monkeypatch.setattr(autotune, "inductor_floor_ms", lambda gm, sandbox, training: floors.append(training) or 0.5)
    monkeypatch.setattr(autotune, "rewrite_floor_ms", lambda *args: 0.0)  # Inductor on the rewrite can win
    model, x = Cross(), torch.randn(8, 16)
    torch._dynamo.reset()
    out = torch.compile(model, backend="rec_ascend")(x)
    out.sum().backward()
    [decision] = _decisions(_cache)
    assert floors == [True]
    assert {"inductor", "inductor-captured"} <= decision["compile_s"].keys()


def _train_cross(fastest: str, captured_floor_ms: float, rewrite_floor_ms: float, monkeypatch, dynamic=False):
    def fastest_eagerly(graphs, sandbox, training, decision, budget_s):
        decision.timings_ms[f"eagerly:{fastest}"] = 1.0
        return fastest

    monkeypatch.setattr(autotune, "fastest_eagerly", fastest_eagerly)
    monkeypatch.setattr(autotune, "inductor_floor_ms", lambda *args: captured_floor_ms)
    monkeypatch.setattr(autotune, "rewrite_floor_ms", lambda *args: rewrite_floor_ms)
    model = Cross()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="rec_ascend", dynamic=dynamic)
    for rows in ((8, 11) if dynamic else (8,)):
        x = torch.randn(rows, 16)
        out = compiled(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
        out.sum().backward()


def test_a_training_graph_defers_inductor_on_the_rewrite_and_skips_it_where_the_captured_graph_runs_at_its_floor(
        _cache, inductor_graphs, monkeypatch):
    """Training, both Inductor graphs can win: the captured graph's (plain Inductor's compile) is built while Dynamo
    compiles, the rewrite's deferred to the first call, which does not build it where Inductor on the captured graph
    already runs within the margin of the rewrite's floor: one Inductor compile, as plain Inductor's."""
    _train_cross("rec+eager", 0.0, 1e6, monkeypatch)
    [decision] = _decisions(_cache)
    assert "inductor" not in decision["compile_s"] and "inductor-captured" in decision["compile_s"]
    assert decision["rejected"]["inductor"].startswith("not compiled: inductor-captured ran")
    assert decision["timings_ms"]["floor:inductor"] == 1e6
    assert [_has_rec_ops(g) for g in inductor_graphs] == [False]


def test_a_deferred_inductor_graph_is_built_checked_and_raced_at_the_first_call_where_it_can_win(
        _cache, inductor_graphs, monkeypatch):
    _train_cross("rec+eager", 0.0, 0.0, monkeypatch)
    [decision] = _decisions(_cache)
    assert {"inductor", "inductor-captured"} <= decision["compile_s"].keys()
    assert {"inductor", "inductor-captured"} <= decision["timings_ms"].keys()
    assert "before compiling inductor:inductor-captured" in decision["timings_ms"]
    assert [_has_rec_ops(g) for g in inductor_graphs] == [False, True]  # the captured graph's first


def test_a_training_graph_with_symbolic_sizes_builds_both_while_dynamo_compiles(_cache, inductor_graphs, monkeypatch):
    """Inductor's compile of a graph with symbolic sizes adds guards, which only a compile inside Dynamo's keeps:
    nothing is deferred."""
    _train_cross("rec+eager", 0.0, 1e6, monkeypatch, dynamic=True)
    decisions = _decisions(_cache)
    assert decisions and all(d["key"][32:] for d in decisions)  # size buckets: the graph has symbolic sizes
    for decision in decisions:
        assert {"inductor", "inductor-captured"} <= decision["compile_s"].keys()
        assert "floor:inductor" not in decision["timings_ms"]
