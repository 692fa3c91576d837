"""Side-by-side timing for the benchmark scripts."""
from __future__ import annotations

import itertools
import time
from typing import Callable

import torch

from recompile.lowering.targets import synchronize

MAX_ROUNDS = 50  # what a timing budget (``race_rounds``' ``budget_s``) may stretch the rounds to


def race_rounds(steps: dict[str, Callable[[], object]], rounds: int, iters: int = 1,
                device: torch.device = torch.device("cpu"), warmup: int = 3,
                clock: Callable[[], float] = time.perf_counter, budget_s: float = 0.0) -> dict[str, list[float]]:
    """Milliseconds per step of each candidate in every round, on ``clock``: each round times every candidate in
    turn (``iters`` steps each, then waiting for ``device``), round ``r`` starting at the ``r``-th candidate, so that
    load from other processes falls on all of them alike and none always runs right after the same other (whose
    caches and allocations it would meet). ``rounds`` rounds, more while the rounds so far took less than
    ``budget_s`` wall-clock seconds (up to ``MAX_ROUNDS``): a cell of short steps gets many rounds, whose best moves
    less from run to run on a loaded machine. ``warmup`` untimed runs of each first."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    names = list(steps)
    samples: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for r in itertools.count():
        if r >= rounds and (r >= MAX_ROUNDS or time.perf_counter() - start >= budget_s):
            break
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(_sample(steps[name], iters, clock, device) / iters * 1e3)
    return samples


def race_ms(steps: dict[str, Callable[[], object]], rounds: int, iters: int = 1,
            device: torch.device = torch.device("cpu"), warmup: int = 3,
            clock: Callable[[], float] = time.perf_counter, budget_s: float = 0.0) -> dict[str, float]:
    """Milliseconds per step of each candidate: the best of its rounds (``race_rounds``). ``clock=time.thread_time``
    counts CPU time instead of wall-clock (single-threaded CPU steps on a loaded machine: the time other processes
    hold the core left out)."""
    samples = race_rounds(steps, rounds, iters, device, warmup, clock, budget_s)
    return {name: min(ms) for name, ms in samples.items()}


def autorange(steps: dict[str, Callable[[], object]], min_ms: float = 10.0,
              clock: Callable[[], float] = time.perf_counter, device: torch.device = torch.device("cpu")) -> int:
    """The number of consecutive calls that makes one timed sample of the fastest step last at least ``min_ms``: the
    first of 1, 2, 5, 10, 20, 50, ... that does, as ``timeit``'s autorange picks it (one count for every step, so that
    ``race_ms(steps, rounds, iters=autorange(steps))`` compares them side by side, each sample a run of back-to-back
    calls as a server or a training loop makes them, the clock's own cost spread over them)."""
    for power in itertools.count():
        for factor in (1, 2, 5):
            iters = factor * 10**power
            fastest = min(_sample(step, iters, clock, device) for step in steps.values())
            if fastest * 1e3 >= min_ms:
                return iters


def _sample(step: Callable[[], object], iters: int, clock: Callable[[], float], device: torch.device) -> float:
    """Seconds on ``clock`` of ``iters`` back-to-back calls of ``step``, ``device`` waited for before and after."""
    synchronize(device)
    start = clock()
    for _ in range(iters):
        step()
    synchronize(device)
    return clock() - start
