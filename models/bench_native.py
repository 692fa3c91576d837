"""The native CPU kernels' per-call cost and their instruction sets, side by side in one process.

    python -m models.bench_native [--rounds N] [--batch 128] [--threads N] [--quick]

Per call (microseconds, a tiny input, so the figure is the call's overhead): each native op through its
``torch.ops.recompile.*`` custom op (the call a compiled graph makes) and, where it stands alone, the C++
operator ``torch.ops.recompile_native.*`` itself. Then the zoo's DLRM forward (``--batch``, small config)
compiled with rec_ascend, and each native op at a working size, on every instruction set this CPU runs
(``recompile.runtime.native.use_isa``: AVX2 is measured on an AVX-512 machine too), timed round by round. Prints the
ISA each figure ran and writes docs/benchmarks/native.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess

import torch

from .bench import backend_step
from .timing import race_ms
from recompile.runtime import native

OUT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "benchmarks", "native.json")
ops, cpp = torch.ops.recompile, torch.ops.recompile_native


def per_call(rounds: int) -> dict[str, float]:
    x, seed, v = torch.randn(8), torch.tensor([1, 2]), torch.randn(2, 3, 8)
    pos, neg = torch.randn(4, 1), torch.randn(4, 8)
    features = [torch.randn(2, 8), torch.randn(2, 3, 8)]
    tables, ids, offsets = [torch.randn(10, 8) for _ in range(4)], torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])
    lookup = ([*tables], [ids] * 4, [offsets] * 4, [torch.empty(0)] * 4, [0] * 4, [-1] * 4, [False] * 4, [False] * 4,
              "stack", "a,b,c,d", "fatal", "native")
    calls = {
        "recompile.dot_interaction": lambda: ops.dot_interaction(features, None, True, False, "native"),
        "recompile.grouped_embedding_bag (4 tables)": lambda: ops.grouped_embedding_bag(*lookup),
        "recompile.dropout": lambda: ops.dropout(x, 0.1, seed, "native"),
        "recompile_native.dropout": lambda: cpp.dropout(x, seed, 0.1),
        "recompile.fm_second_order": lambda: ops.fm_second_order(v, True, "native"),
        "recompile_native.fm_second_order_fwd": lambda: cpp.fm_second_order_fwd(v, True),
        "recompile.sampled_softmax_loss": lambda: ops.sampled_softmax_loss(pos, neg, None, None, 1.0, "native"),
        "aten.add (for scale)": lambda: torch.add(x, x),
    }
    with torch.no_grad():
        return {name: ms * 1e3 for name, ms in race_ms(calls, rounds, iters=200).items()}


def by_isa(rounds: int, batch: int) -> dict[str, dict[str, float]]:
    """Milliseconds per call of each workload on each instruction set, interleaved round by round."""
    g = torch.Generator().manual_seed(0)
    features = [torch.randn(batch, 64, generator=g), torch.randn(batch, 26, 64, generator=g)]
    q, k, v = (torch.randn(4096, 2, 64, generator=g) for _ in range(3))
    offsets = torch.arange(0, 4097, 256)
    x = torch.randn(batch, 4096, generator=g)
    dlrm = backend_step("dlrm", "small", "rec_ascend", False, batch=batch)
    work = {
        f"dlrm forward, batch {batch}": dlrm,
        "dot_interaction 27 x 64": lambda: ops.dot_interaction(features, None, True, False, "native"),
        "hstu_attention 16 x 256": lambda: ops.hstu_attention(q, k, v, offsets, 256, 0.1, True, None, 0, None, None,
                                                              None, "native"),
        "dropout": lambda: ops.dropout(x, 0.1, torch.tensor([1, 2]), "native"),
    }
    isas = native.available_isas()
    steps = {}
    for isa in isas:
        for name, fn in work.items():
            def step(fn=fn, isa=isa):
                with native.use_isa(isa), torch.no_grad():
                    return fn()
            steps[f"{name} [{isa}]"] = step
    ms = race_ms(steps, rounds, iters=5)
    return {name: {isa: ms[f"{name} [{isa}]"] for isa in isas} for name in work}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m models.bench_native", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="3 rounds (checks the script runs)")
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, native kernels: {native.isa()} "
          f"(this CPU runs {', '.join(native.available_isas())})")
    calls = per_call(rounds)
    for name, us in calls.items():
        print(f"per call [{native.isa()}] {name:40s} {us:8.2f} us")
    isas = by_isa(rounds, args.batch)
    for name, row in isas.items():
        base = row.get("avx512")
        print(f"{name:28s} " + "  ".join(
            f"{isa} {ms:8.3f} ms" + (f" ({ms / base:4.2f}x avx512's)" if base and isa != "avx512" else "")
            for isa, ms in row.items()))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
              "isa": native.isa(), "rounds": rounds, "per_call_us": calls, "ms_by_isa": isas}
    if not args.quick:
        os.makedirs(os.path.dirname(OUT), exist_ok=True)
        with open(OUT, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
