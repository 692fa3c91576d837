"""Side-by-side timing for the benchmark scripts."""
from __future__ import annotations

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
            synchronize(device)
            start = clock()
            for _ in range(iters):
                step()
            synchronize(device)
            best[name] = min(best[name], (clock() - start) / iters * 1e3)
    return best
