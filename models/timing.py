"""Side-by-side timing for the benchmark scripts."""
from __future__ import annotations

import time
from typing import Callable


def race_ms(steps: dict[str, Callable[[], object]], rounds: int, iters: int = 1) -> dict[str, float]:
    """Wall-clock milliseconds per step of each candidate: the best of ``rounds`` rounds, each timing every
    candidate in turn (``iters`` steps each), so that load from other processes falls on all of them alike."""
    for step in steps.values():
        for _ in range(3):
            step()
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(iters):
                step()
            best[name] = min(best[name], (time.perf_counter() - start) / iters * 1e3)
    return best
