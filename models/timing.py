"""Side-by-side timing for the benchmark scripts."""
from __future__ import annotations

import itertools
import time
from typing import Callable

import torch

from recompile.lowering.targets import synchronize


def race_ms(steps: dict[str, Callable[[], object]], rounds: int, iters: int = 1,
            device: torch.device = torch.device("cpu"), warmup: int = 3,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Wall-clock milliseconds per step of each candidate: the best of ``rounds`` rounds, each timing every
    candidate in turn (``iters`` steps each, then waiting for ``device``), so that load from other processes
    falls on all of them alike. ``warmup`` untimed runs of each first. ``clock=time.thread_time`` counts CPU time
    instead (single-threaded CPU steps on a loaded machine: the time other processes hold the core left out)."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(rounds):
        for name, step in steps.items():
            best[name] = min(best[name], _sample(step, iters, clock, device) / iters * 1e3)
    return best


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
