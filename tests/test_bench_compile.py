"""models.bench_compile's warm compile: a second process on the cache folders a cold one filled loads Inductor's
graphs and the race's decision (no race, no cache miss) and computes the cold process's first step bit for bit; a
row says unequal where any repeat's first steps differ."""
import pytest
import torch

from models import bench_compile


def test_the_digest_tells_tensors_apart_bit_for_bit():
    x = torch.randn(4, 3)
    same = bench_compile.digest((x.clone(), {"grad": x * 2}))
    assert same == bench_compile.digest((x, {"grad": x * 2}))
    assert same != bench_compile.digest((torch.nextafter(x, x + 1), {"grad": x * 2}))  # one ulp
    assert same != bench_compile.digest((x.double(), {"grad": x * 2}))
    assert same != bench_compile.digest((x.reshape(3, 4), {"grad": x * 2}))


def test_a_warm_row_is_unequal_where_any_repeats_first_steps_differ(monkeypatch):
    runs = iter([("a", "a"), ("b", "b"), ("a", "a"), ("b", "c")])  # per repeat, inductor then rec_ascend

    def cold_and_warm(model, mode, backend, threads):
        first = next(runs)
        return tuple({"compile_s": 2.0, "cpu_s": 1.0, "first": f, "races": 0, "caches": {}, "decisions": []}
                     for f in first)

    monkeypatch.setattr(bench_compile, "cold_and_warm", cold_and_warm)
    (row,) = bench_compile.run_warm(["deepfm"], ["forward"], 2, 1)
    assert row["inductor"]["equal"] and not row["rec_ascend"]["equal"]


@pytest.mark.slow  # two compiling processes: 1-3 min on 2 loaded cores (the tests above check the rest)
def test_a_warm_compile_loads_the_cold_ones_graphs_and_decision_and_computes_its_first_step():
    """The warm process races only where the cold one stored no decision (a race whose rounds disagree, under
    load), and compiles no graph Inductor's cache misses: the kept candidate's graphs, where it has any, are the
    cold process's."""
    cold, warm = bench_compile.cold_and_warm(bench_compile.CROSS, "train", "rec_ascend", 1)
    assert cold["caches"]["fxgraph_cache_miss"] > 0  # the race compiled Inductor's candidates
    assert warm["races"] == 0 or cold["races"] == 0
    assert not warm["caches"]["fxgraph_cache_miss"] and not warm["caches"]["fxgraph_cache_bypass"]
    assert warm["caches"]["fxgraph_cache_hit"] <= cold["caches"]["fxgraph_cache_miss"]
    assert warm["first"] == cold["first"]
