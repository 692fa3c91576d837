"""The corpus tests' parametrization and checks, shared by tests/test_corpus_recbole.py and test_corpus_torchrec.py.

Each case gets three tests: numbers and compile count (``check``), each expected region (one test per row of
``expected.EXPECTED``, ``xfail(strict=True)`` where a named track builds it), and its graph breaks.
"""
from __future__ import annotations

import functools

import pytest

from .expected import EXPECTED, graph_breaks
from .harness import CASES, check, found_regions


def cases(prefix: str) -> list:
    return [pytest.param(c, id=c.name) for c in CASES.values() if c.model.startswith(prefix)]


def expectations(prefix: str) -> list:
    params = []
    for case in CASES.values():
        if not case.model.startswith(prefix):
            continue
        for i, expect in enumerate(EXPECTED[case.model]):
            marks = [pytest.mark.xfail(strict=True, reason=expect.track)] if expect.track else []
            params.append(pytest.param(case, expect, id=f"{case.name}-{i}-{expect.kind}", marks=marks))
    return params


def breaks(prefix: str) -> list:
    params = []
    for case in CASES.values():
        if case.model.startswith(prefix):
            track = graph_breaks(case.name)[2]
            marks = [pytest.mark.xfail(strict=True, reason=track)] if track else []
            params.append(pytest.param(case, id=case.name, marks=marks))
    return params


@functools.lru_cache(maxsize=None)
def found(case):
    return found_regions(case)


def check_numbers_and_compiles(case, inductor: bool = False) -> None:
    """Outputs and gradients equal eager's on three batch sizes; at most two compilations per captured graph
    (the first batch's static one, then one dynamic graph the third batch reuses). Autotune off: the rewritten
    graph is what runs, so it is what is compared. Without ``inductor`` the rewritten graph runs through AOT
    autograd eagerly (``harness.rec_passes_aot_eager``): Inductor's C++ compile of every corpus graph would
    take the suite's whole time budget, so a few cases go through it (``inductor=True``)."""
    checked = check(case, options={"autotune": False}, inductor=inductor)
    assert checked.compiles <= 2 * checked.first, f"{case.name}: {checked.compiles} compilations of {checked.first} graphs"


def check_region(case, expect) -> None:
    got = found(case)
    assert expect.found(got.regions) >= expect.count, (
        f"{case.name}: expected {expect.label} ({expect.why}); found {dict(got.regions)}, fallbacks {got.fallbacks}")


def check_graph_breaks(case) -> None:
    want, why, _ = graph_breaks(case.name)
    got = found(case).breaks
    assert len(got) == want, f"{case.name}: {len(got)} graph breaks, expected {want} ({why or 'one graph'}): {got}"
