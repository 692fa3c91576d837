"""What canonical graphs save the interaction pass: its pattern count and its time per graph.

Captures the zoo's DLRM, DCN-v2 (stacked and mixture) and DeepFM graphs with Dynamo, runs ``normalize`` on each,
then times the ``interaction`` pass on copies of the normalized graph (best of rounds, matcher already built), and
prints one row per graph plus the pattern count. Run it on two checkouts to compare (it reads only the pass
registry, so older trees work too).

    python -m models.bench_canonical [--quick] [--rounds N] [--json docs/benchmarks/canonical.json]
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

from models.ctr import CTRConfig, DCNConfig, DCNv2, DeepFM
from models.dlrm import DLRM, DLRMConfig, synthetic_batch
from recompile.lowering import detect_target
from recompile.options import RecompileOptions
from recompile.pipeline import PASSES, PassContext, copy_graph_module


def models(quick: bool) -> dict:
    rows = [200] * (4 if quick else 26)
    dlrm = DLRMConfig(table_rows=rows, dim=16, bottom=[32, 16], top=[32, 1])
    dcn = DCNConfig(table_rows=rows, dim=8, num_cross=3, deep=[32])
    mix = DCNConfig(table_rows=rows, dim=8, num_cross=2, deep=[32], low_rank=4, num_experts=3)
    fm = CTRConfig(table_rows=rows, dim=8, deep=[32])
    return {"dlrm": (DLRM(dlrm), dlrm), "dcn": (DCNv2(dcn), dcn), "dcn_mix": (DCNv2(mix), mix),
            "deepfm": (DeepFM(fm), fm)}


def captured(model, args) -> list[tuple[torch.fx.GraphModule, list]]:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(*args)
    return graphs


def pattern_count() -> int:
    from recompile.passes import interaction

    if hasattr(interaction, "pattern_count"):
        return interaction.pattern_count()
    ctx = PassContext(RecompileOptions(), detect_target("cpu"))
    return sum(len(v) for v in interaction.build_matcher(ctx).patterns.values())  # before patterns were built once


def time_pass(gm, example_inputs, rounds: int) -> tuple[float, int]:
    """(best ms of the interaction pass on a normalized copy of ``gm``, regions it found)."""
    ctx = PassContext(RecompileOptions(), detect_target("cpu"), example_inputs)
    normalized = PASSES["normalize"](copy_graph_module(gm), ctx)
    best, regions = float("inf"), 0
    for _ in range(rounds):
        ctx = PassContext(RecompileOptions(), detect_target("cpu"), example_inputs)
        graph = copy_graph_module(normalized)
        start = time.perf_counter()
        PASSES["interaction"](graph, ctx)
        best = min(best, time.perf_counter() - start)
        regions = len(ctx.regions)
    return best * 1e3, regions


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)
    rows = []
    count = pattern_count()
    print(f"interaction patterns: {count}")
    for name, (model, cfg) in models(opts.quick).items():
        for i, (gm, inputs) in enumerate(captured(model, synthetic_batch(cfg, 64))):
            ms, regions = time_pass(gm, inputs, 1 if opts.quick else opts.rounds)
            rows.append({"model": name, "graph": i, "nodes": len(gm.graph.nodes), "pass_ms": round(ms, 2),
                         "regions": regions})
            print(f"{name:8s} graph {i}: {len(gm.graph.nodes):4d} nodes  interaction pass {ms:8.2f} ms  "
                  f"{regions} regions")
    if opts.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        record = {"machine": platform.machine(), "processor": platform.processor(), "threads": torch.get_num_threads(),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "commit": commit,
                  "pattern_count": count, "graphs": rows}
        os.makedirs(os.path.dirname(opts.json) or ".", exist_ok=True)
        with open(opts.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
