"""Decisions that hold (issue 17, item 4): a cached decision records the conditions it was measured under (CPU model,
ISA flags, threads, load) and is raced again under others; a race whose rounds disagree beyond the margin keeps the
safe candidate and caches nothing, also where the graph has no incumbent. Timings are injected (no timed test)."""
import json
import os
import pathlib

import pytest
import torch

from recompile import autotune
from tests.test_autotune_compiles import inductor_graphs  # noqa: F401  (a fixture)
from tests.test_autotune_determinism import tiny_dlrm
from tests.test_interaction_autotune import Cross

CPUINFO = "processor\t: 0\nmodel name\t: {model}\nflags\t\t: {flags}\n"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RECOMPILE_CACHE_DIR", str(tmp_path))
    return tmp_path


def _decisions(cache_dir):
    return [json.loads(p.read_text()) for p in sorted((cache_dir / "autotune").glob("*.json"))]


@pytest.fixture
def races(monkeypatch):
    """The first calls' races run (each a list of its candidates: the compiled ones among them); every candidate
    times alike (the captured graph kept)."""
    raced = []

    def race(steps, budget_s, **kwargs):
        if "inductor-captured" in steps:
            raced.append(sorted(steps))
        return {name: [1.0] * 3 for name in steps}

    monkeypatch.setattr(autotune, "race", race)
    return raced


def _cpu(monkeypatch, model: str, flags: str) -> str:
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self: CPUINFO.format(model=model, flags=flags))
    return autotune._cpu.__wrapped__()


def test_conditions_name_the_cpu_model_its_isa_the_threads_and_the_load(monkeypatch):
    avx2 = _cpu(monkeypatch, "Xeon 8380", "fpu sse4_2 avx2 fma")
    assert avx2.startswith("Xeon 8380 isa:")
    assert _cpu(monkeypatch, "Xeon 8380", "fpu sse4_2 avx2 fma avx512f") != avx2  # same model, other ISA
    assert _cpu(monkeypatch, "EPYC 7763", "fpu sse4_2 avx2 fma") != avx2
    monkeypatch.undo()
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (0.6 * cores, 0.0, 0.0))
    assert autotune.conditions()["busy"]
    monkeypatch.setattr(os, "getloadavg", lambda: (0.4 * cores, 0.0, 0.0))
    assert not autotune.conditions()["busy"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert autotune.conditions()["threads"] == 1
    finally:
        torch.set_num_threads(threads)
    assert autotune.conditions()["cpu"] == autotune._cpu()


def _set(monkeypatch, condition: str, value) -> dict:
    """Put the machine under ``value`` of ``condition``; returns the conditions then."""
    if condition == "cpu":
        monkeypatch.setattr(autotune, "_cpu", lambda: value)
    elif condition == "threads":
        monkeypatch.setattr(torch, "get_num_threads", lambda: value)
    else:
        monkeypatch.setattr(os, "getloadavg", lambda: (value * (os.cpu_count() or 1), 0.0, 0.0))
    return autotune.conditions()


@pytest.mark.parametrize("condition, first, other", [
    ("cpu", "Xeon 8380 isa:0a1b", "EPYC 7763 isa:0a1b"),  # another CPU model
    ("cpu", "Xeon 8380 isa:0a1b", "Xeon 8380 isa:2c3d"),  # the same model, other ISA flags
    ("threads", 2, 1),
    ("load", 0.0, 2.0),  # quiet, then busy
])
def test_a_cached_decision_is_raced_again_when_a_condition_differs(_cache, inductor_graphs, races, monkeypatch,
                                                                   condition, first, other):
    """Under other conditions than a cached decision's, the graph is raced again and decided apart; back under the
    first, the first decision applies without a race."""
    model, x = Cross(), torch.randn(8, 16)
    measured = []
    for value in (first, other, first):
        measured.append(_set(monkeypatch, condition, value))
        torch._dynamo.reset()
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(model, backend="rec_ascend")(x), model(x), rtol=1e-5, atol=1e-5)
    assert len(races) == 2
    stored = sorted(json.dumps(d["conditions"], sort_keys=True) for d in _decisions(_cache))
    assert stored == sorted(json.dumps(c, sort_keys=True) for c in measured[:2])
    assert stored[0] != stored[1]


def test_without_an_incumbent_an_unsettled_race_keeps_the_safe_candidate_and_caches_nothing(_cache, inductor_graphs,
                                                                                           monkeypatch):
    """Lookups that clamp ids (bounds_check="warning") leave no captured graph, hence no incumbent: an ablation
    faster at the median but slower by 20% in three rounds of eight gives way to Inductor on the rewrite (what
    autotune off runs), and nothing is cached (before: the ablation was kept and cached)."""
    shaky = [0.7, 0.7, 0.7, 0.7, 0.7, 1.2, 1.2, 1.2]

    def race(steps, budget_s, **kwargs):
        return {name: shaky if name == "rec+eager-interaction" else [1.0] * 8 for name in steps}

    monkeypatch.setattr(autotune, "race", race)
    monkeypatch.setattr(autotune, "fastest_eagerly", lambda *args: "rec+eager")
    monkeypatch.setattr(autotune, "inductor_can_win", lambda *args: True)
    chosen, compiled_graph = [], autotune.CompiledGraph
    monkeypatch.setattr(autotune, "CompiledGraph", lambda chooser: chosen.append(chooser) or compiled_graph(chooser))
    model, args, _ = tiny_dlrm(9)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="rec_ascend", options={"bounds_check": "warning"})(*args)
        torch.testing.assert_close(out, model(*args), rtol=1e-5, atol=1e-5)
    [chooser] = chosen
    assert "eager" not in chooser.candidates and {"inductor", "rec+eager-interaction"} <= set(chooser.candidates)
    assert chooser.decision.choice == "inductor" and chooser.run is chooser.candidates["inductor"]
    assert "rounds disagree" in chooser.decision.rejected["rec+eager-interaction"]
    assert _decisions(_cache) == []
