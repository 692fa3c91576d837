"""What canonical graphs save the interaction pass: its pattern count and its time per graph.

Captures the zoo's DLRM, DCN-v2 (stacked and mixture) and DeepFM graphs with Dynamo, runs the passes before
``interaction`` on each, then times the ``interaction`` pass on copies of the result (best of rounds, matcher already built) and ``normalize``
on copies of the captured graph, and prints one row per graph plus the pattern count. Run it on two checkouts to compare (it reads only the pass
registry, so older trees work too).

    python -m models.bench_canonical [--quick] [--rounds N] [--json docs/benchmarks/canonical.json]
                                     [--before OLD.json]

``--before`` reads the JSON an older checkout wrote and prints the ratios beside this run's figures (and records
them): two runs, so compare them on a quiet machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import time

import torch

from .ctr import CTRConfig, DCNConfig, DCNv2, DeepFM
from .dlrm import DLRM, DLRMConfig, synthetic_batch
from recompile.lowering import detect_target
from recompile.options import RecompileOptions
from recompile.pipeline import PASS_ORDER, PASSES, PassContext, copy_graph_module


def models(quick: bool) -> dict:
    rows = [200] * (4 if quick else 26)
    dlrm = DLRMConfig(table_rows=rows, dim=16, bottom=[32, 16], top=[32, 1])
    dcn = DCNConfig(table_rows=rows, dim=8, num_cross=3, deep=[32])
    mix = DCNConfig(table_rows=rows, dim=8, num_cross=2, deep=[32], low_rank=4, num_experts=3)
    fm = CTRConfig(table_rows=rows, dim=8, deep=[32])
    return {"dlrm": (DLRM(dlrm), dlrm), "dcn": (DCNv2(dcn), dcn), "dcn_mix": (DCNv2(mix), mix),
            "deepfm": (DeepFM(fm), fm)}


def timed_graphs(model, args, rounds: int) -> list[tuple[int, float, float, int]]:
    """(nodes, normalize ms, interaction ms, regions it found) per graph Dynamo captures, timed inside the
    backend call (constant buffers are readable only while Dynamo compiles)."""
    rows = []

    def backend(gm, example_inputs):
        rows.append((len(gm.graph.nodes), *time_passes(gm, example_inputs, rounds)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(*args)
    return rows


def pattern_count() -> int:
    from recompile.passes import interaction

    if hasattr(interaction, "pattern_count"):
        return interaction.pattern_count()
    ctx = PassContext(RecompileOptions(), detect_target("cpu"))
    return sum(len(v) for v in interaction.build_matcher(ctx).patterns.values())  # before patterns were built once


def _best_ms(run_pass, graph, example_inputs, rounds: int) -> tuple[float, PassContext]:
    """Best ms of ``run_pass`` on fresh copies of ``graph`` (copied outside the timing), and its last context."""
    best = float("inf")
    for _ in range(rounds):
        ctx, copy = PassContext(RecompileOptions(), detect_target("cpu"), example_inputs), copy_graph_module(graph)
        start = time.perf_counter()
        run_pass(copy, ctx)
        best = min(best, time.perf_counter() - start)
    return best * 1e3, ctx


def time_passes(gm, example_inputs, rounds: int) -> tuple[float, float, int]:
    """(best ms of normalize on ``gm``, best ms of the interaction pass on ``gm`` after the passes before it, the
    regions it found)."""
    normalize_ms, _ = _best_ms(PASSES["normalize"].fn, gm, example_inputs, rounds)
    ctx = PassContext(RecompileOptions(), detect_target("cpu"), example_inputs)
    prepared = copy_graph_module(gm)
    for name in PASS_ORDER[:PASS_ORDER.index("interaction")]:
        prepared = PASSES[name].fn(prepared, ctx)
    interaction_ms, ctx = _best_ms(PASSES["interaction"].fn, prepared, example_inputs, rounds)
    return normalize_ms, interaction_ms, len(ctx.regions)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--before", default=None, help="JSON written by this script on an older checkout")
    opts = parser.parse_args(argv)
    before = None
    if opts.before:
        with open(opts.before) as f:
            before = json.load(f)
    old = {(r["model"], r["graph"]): r for r in before["graphs"]} if before else {}
    rows = []
    count = pattern_count()
    print(f"interaction patterns: {count}" + (f" (before: {before['pattern_count']}, "
                                              f"{before['pattern_count'] / count:.0f}x fewer)" if before else ""))
    for name, (model, cfg) in models(opts.quick).items():
        for i, (nodes, norm_ms, ms, regions) in enumerate(timed_graphs(model, synthetic_batch(cfg, 64), opts.rounds)):
            row = {"model": name, "graph": i, "nodes": nodes, "normalize_ms": round(norm_ms, 2), "pass_ms": round(ms, 2),
                   "interaction_regions": regions}
            was = old.get((name, i))
            if was is not None:
                row.update(before_pass_ms=was["pass_ms"], speedup=round(was["pass_ms"] / max(ms, 1e-6), 1),
                           before_normalize_ms=was.get("normalize_ms"))
            rows.append(row)
            print(f"{name:8s} graph {i}: {nodes:4d} nodes  normalize {norm_ms:7.2f} ms  interaction {ms:7.2f} ms  "
                  f"{regions} regions" + (f"  (before: normalize {was.get('normalize_ms', float('nan')):.2f} ms, "
                                          f"interaction {was['pass_ms']:.2f} ms: {row['speedup']}x)" if was else ""))
    if opts.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        record = {"machine": platform.machine(), "processor": platform.processor(), "threads": torch.get_num_threads(),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "commit": commit,
                  "pattern_count": count, "graphs": rows,
                  "before": None if before is None else {k: before[k] for k in ("commit", "date", "pattern_count")}}
        os.makedirs(os.path.dirname(opts.json) or ".", exist_ok=True)
        with open(opts.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
