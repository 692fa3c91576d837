"""Checks that the autotune race is invisible, for any model: its losses, random draws and buffers do not
depend on the cache's state nor on which candidate the race keeps (``docs/determinism.md``).

``assert_race_invisible(make, steps)`` takes ``make() -> (model, inputs, loss)``, a fresh model each call (the
same parameters every time) with its inputs and ``loss(output) -> scalar``. Inductor is replaced by the graph run
eagerly under a random stream of its own (``inductor_draws_its_own_numbers``): a random op left inside a graph
Inductor compiles then draws other numbers than the same graph run eagerly, as real Inductor's do, without its
compile time.
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn

from recompile import autotune
from recompile import backend as rec_backend

SEED = 1234


def inductor_draws_its_own_numbers(monkeypatch) -> None:
    def compile_fx(graph, example_inputs, **kwargs):
        def run(*args):
            with torch.random.fork_rng():
                torch.manual_seed(987654321)
                return graph(*args)
        return run

    monkeypatch.setattr(rec_backend, "compile_fx", compile_fx)
    # run eagerly, a graph calling invoke_subgraph has no backward (it needs a fake mode): layers stay inline
    steps = tuple(step for step in rec_backend.BEFORE_INDUCTOR if step is not rec_backend.outline_repeated_layers)
    monkeypatch.setattr(rec_backend, "BEFORE_INDUCTOR", steps)


def train(model: nn.Module, inputs: tuple, loss, steps: int, compiled: bool = True, options: dict | None = None):
    """Losses of ``steps`` SGD steps (seeded before each) and the buffers after them."""
    runner = torch.compile(model, backend="rec_ascend", options=options) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        torch.manual_seed(SEED + step)
        optimizer.zero_grad()
        value = loss(runner(*inputs))
        value.backward()
        optimizer.step()
        losses.append(value.detach().clone())
    return torch.stack(losses), {name: b.clone() for name, b in model.named_buffers()}


def without_dropout(model: nn.Module) -> nn.Module:
    """A copy whose ``nn.Dropout`` layers drop nothing: compiled dropout draws other masks than eager's."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def assert_buffers_equal(got: dict, want: dict, exact: bool) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        if exact or not value.is_floating_point():
            assert torch.equal(got[name], value), name
        else:
            torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)


@contextlib.contextmanager
def forced(choice: str | None):
    """The race keeps ``choice`` whenever it is a candidate (None: as the race decides)."""
    if choice is None:
        yield
        return
    real = autotune.fastest

    def pick(samples, *args, **kwargs):
        return choice if choice in samples else real(samples, *args, **kwargs)

    autotune.fastest = pick
    try:
        yield
    finally:
        autotune.fastest = real


def assert_race_invisible(make, steps: int, cache_root, monkeypatch, choices=("rec+eager",)) -> None:
    """For ``steps`` training steps of the model ``make()`` builds:

    - an empty and a warm autotune cache give bit-identical losses and buffers;
    - autotune off (Inductor on the rewrite) and each of ``choices`` forced give the same random draws, so losses
      within 1e-6 relative;
    - with its dropout off, the compiled model's losses and buffers (BatchNorm statistics, counters) are eager's;
    - the caller's random stream is where eager leaves it (the race draws nothing from it).
    """
    inductor_draws_its_own_numbers(monkeypatch)
    monkeypatch.setattr(autotune, "settled", lambda *args: True)  # every race is cached: this is not about timing

    def compiled(cache: str, options=None, choice=None, model=None):
        monkeypatch.setenv("RECOMPILE_CACHE_DIR", str(cache_root / cache))
        torch._dynamo.reset()
        model, inputs, loss = make() if model is None else model
        with forced(choice):
            result = train(model, inputs, loss, steps, options=options)
        return result, torch.random.get_rng_state()

    (cold, cold_buffers), rng_cold = compiled("shared")
    (warm, warm_buffers), rng_warm = compiled("shared")
    assert torch.equal(cold, warm), f"empty cache {cold.tolist()} != warm cache {warm.tolist()}"
    assert_buffers_equal(warm_buffers, cold_buffers, exact=True)
    assert torch.equal(rng_cold, rng_warm)
    (off, _), rng_off = compiled("off", options={"autotune": False})
    torch.testing.assert_close(cold, off, rtol=1e-6, atol=1e-7)
    assert torch.equal(rng_cold, rng_off)
    for choice in choices:
        (got, _), _ = compiled(f"forced-{choice}", choice=choice)
        torch.testing.assert_close(got, off, rtol=1e-6, atol=1e-7, msg=f"{choice} forced")
    model, inputs, loss = make()
    plain = without_dropout(model)
    eager, eager_buffers = train(copy.deepcopy(plain), inputs, loss, steps, compiled=False)
    (got, got_buffers), _ = compiled("no-dropout", model=(plain, inputs, loss))
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-5)
    assert_buffers_equal(got_buffers, eager_buffers, exact=False)


def steady_cache(monkeypatch, tmp_path, budget_s: float):
    """Decisions cached in ``tmp_path``, taken and keyed alike whatever the machine's load does during a test: on a
    loaded machine a race's rounds may disagree and then cache nothing (``settled``, test_interaction_race), and a
    load crossing the busy line between two compiles would key them apart (``conditions``, tested in
    test_autotune_conditions.py). No compile budget (``CompileBudget``, tested in test_autotune_budget.py): against
    the tests' compiles, faked or of small graphs, the passes and races weigh more than in a model."""
    monkeypatch.setenv("RECOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune.CompileBudget, "why_not", lambda self, name, decision: None)
    monkeypatch.setattr(autotune, "BUDGET_S", budget_s)
    monkeypatch.setattr(autotune, "settled", lambda *args: True)
    held = autotune.conditions()
    monkeypatch.setattr(autotune, "conditions", lambda: held)
    return tmp_path


def fake_estimates(monkeypatch, eagerly: dict[str, float], fastest: str = "rec+eager", **measured: float) -> None:
    """The compile choice's measurements faked: ``fastest_eagerly`` records ``eagerly`` (graph -> ms run eagerly)
    and returns ``fastest``; each of ``measured`` (``inductor_floor_ms=0.6``, ...) returns its value; Inductor can
    win around the regions (``inductor_can_win``)."""
    def fastest_eagerly(graphs, sandbox, training, decision, budget_s):
        decision.timings_ms.update({f"eagerly:{graph}": ms for graph, ms in eagerly.items()})
        return fastest

    monkeypatch.setattr(autotune, "fastest_eagerly", fastest_eagerly)
    monkeypatch.setattr(autotune, "inductor_can_win", lambda *args: True)
    for name, value in measured.items():
        monkeypatch.setattr(autotune, name, lambda *args, value=value: value)
