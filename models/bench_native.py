"""The native CPU kernels' per-call cost and their instruction sets, side by side in one process.

    python -m models.bench_native [--rounds N] [--batch 128] [--threads N] [--quick]

Per call (microseconds, a tiny input, so the figure is the call's overhead): each native op through its
``torch.ops.recompile.*`` custom op (the call a compiled graph makes; FM second order and sampled softmax also
with their inputs requiring grad, the call recording its autograd node) and, where it stands alone, the C++
operator ``torch.ops.recompile_native.*`` itself. Then the zoo's DLRM forward (``--batch``, small config)
compiled with rec_ascend, each native op at a working size (forward, or forward and backward), and ``make
run``'s HSTU training step under eager and rec_ascend, on every instruction set this CPU runs
(``recompile.runtime.native.use_isa``: AVX2 is measured on an AVX-512 machine too), timed round by round (CPU time of
the thread with ``--threads 1``). Prints the ISA each figure ran and writes docs/benchmarks/native.json.
``use_isa`` switches only recompile's kernels; to run ATen and Inductor's code as an AVX2-only machine would,
start the process with ``ATEN_CPU_CAPABILITY=avx2`` (docs/native_kernels.md).
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

from .bench import backend_step
from .timing import race_ms
from recompile.runtime import native

OUT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "benchmarks", "native.json")
ops, cpp = torch.ops.recompile, torch.ops.recompile_native
HSTU_STEP = "hstu training step"  # make run's (models.main), under eager and rec_ascend


def _recorded(fn):
    """fn with gradients recorded (its inputs require grad): the op's autograd layer in the call."""
    def call():
        with torch.enable_grad():
            return fn()
    return call


def per_call(rounds: int) -> dict[str, float]:
    x, seed, v = torch.randn(8), torch.tensor([1, 2]), torch.randn(2, 3, 8)
    pos, neg = torch.randn(4, 1), torch.randn(4, 8)
    leaves = [t.clone().requires_grad_() for t in (v, pos, neg)]
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
        "recompile.fm_second_order, recording grad": _recorded(lambda: ops.fm_second_order(leaves[0], True, "native")),
        "recompile.sampled_softmax_loss, recording grad": _recorded(
            lambda: ops.sampled_softmax_loss(leaves[1], leaves[2], None, None, 1.0, "native")),
        "aten.add (for scale)": lambda: torch.add(x, x),
    }
    with torch.no_grad():
        return {name: ms * 1e3 for name, ms in race_ms(calls, rounds, iters=200).items()}


def _training(fn, *leaves):
    """A step running fn forward and backward (a random cotangent of its first output) through ``leaves``."""
    def first(*a):
        out = fn(*a)
        return out[0] if isinstance(out, tuple) else out

    cotangent = torch.randn(first(*leaves).shape, generator=torch.Generator().manual_seed(1))
    return lambda: torch.autograd.grad(first(*leaves), leaves, cotangent)


def workloads(batch: int, hstu_step: bool) -> dict[str, tuple]:
    """name -> (step, whether it runs without autograd): each native op at a working size (``other_tracks``
    too), the zoo's DLRM forward, and (``hstu_step``) make run's HSTU training step under eager and rec_ascend."""
    g = torch.Generator().manual_seed(0)
    features = [torch.randn(batch, 64, generator=g), torch.randn(batch, 26, 64, generator=g)]
    q, k, v = (torch.randn(4096, 2, 64, generator=g, requires_grad=True) for _ in range(3))
    offsets = torch.arange(0, 4097, 256)
    x = torch.randn(batch, 4096, generator=g)
    pos, neg = torch.randn(3200, 1, generator=g, requires_grad=True), torch.randn(3200, 1024, generator=g, requires_grad=True)

    def hstu(q, k, v):
        return ops.hstu_attention(q, k, v, offsets, 256, 0.1, True, None, 0, None, None, None, "native")

    work = {
        f"dlrm forward, batch {batch}": (backend_step("dlrm", "small", "rec_ascend", False, batch=batch), True),
        "dot_interaction 27 x 64": (lambda: ops.dot_interaction(features, None, True, False, "native"), True),
        "hstu_attention 16 x 256": (lambda: hstu(q, k, v), True),
        "hstu_attention 16 x 256 fwd+bwd": (_training(hstu, q, k, v), False),
        "dropout": (lambda: ops.dropout(x, 0.1, torch.tensor([1, 2]), "native"), True),
        "sampled_softmax 3200 x 1024 fwd+bwd": (
            _training(lambda p, n: ops.sampled_softmax_loss(p, n, None, None, 20.0, "native"), pos, neg), False),
    }
    work.update(other_tracks(g))
    if hstu_step:
        from .main import training_steps
        from .train import parser

        for backend, step in training_steps(parser().parse_args(["--model", "hstu", "--quiet"])).items():
            work[f"{HSTU_STEP}, {backend}"] = (step, False)
    return work


def other_tracks(g: torch.Generator, tables: int = 8, rows: int = 20_000, dim: int = 64, batch: int = 2048,
                 bag: int = 20) -> dict[str, tuple]:
    """The grouped embedding (fp32 forward, forward+backward; int8 forward) and the interaction kernels at
    training sizes: name -> (step, whether it runs without autograd)."""
    from recompile.runtime.quantized import quantize_rows

    weights = [torch.randn(rows, dim, generator=g, requires_grad=True) for _ in range(tables)]
    int8 = [quantize_rows(w.detach(), "int8") for w in weights]
    lengths = [torch.randint(1, 2 * bag, (batch,), generator=g) for _ in weights]
    lookup = ([torch.randint(0, rows, (int(n.sum()),), generator=g) for n in lengths],
              [torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)]) for n in lengths],
              [torch.empty(0)] * tables, [0] * tables, [-1] * tables, [True] * tables)
    names = ",".join(f"t{i}" for i in range(tables))
    x0, x = (torch.randn(batch, 256, generator=g, requires_grad=True) for _ in range(2))
    weight, bias = torch.randn(256, 256, generator=g, requires_grad=True), torch.randn(256, generator=g, requires_grad=True)
    v = torch.randn(batch, 27, 64, generator=g, requires_grad=True)
    features = [torch.randn(batch, 64, generator=g, requires_grad=True),
                torch.randn(batch, 26, 64, generator=g, requires_grad=True)]

    def embedding(*w):
        return ops.grouped_embedding_bag(list(w), *lookup, [False] * tables, "concat", names, "fatal", "native")

    size = f"{tables} x {rows // 1000}k x {dim}, batch {batch}"
    return {
        f"grouped_embedding_bag {size}": (lambda: embedding(*weights), True),
        f"grouped_embedding_bag {size} fwd+bwd": (_training(embedding, *weights), False),
        f"grouped_embedding_bag int8 {size}": (lambda: ops.grouped_embedding_bag_quantized(
            int8, *lookup, "int8", "concat", names, "fatal", "native"), True),
        f"dot_interaction 27 x 64, batch {batch} fwd+bwd": (
            _training(lambda *f: ops.dot_interaction(list(f), None, True, False, "native"), *features), False),
        f"fm_second_order 27 x 64, batch {batch} fwd+bwd": (
            _training(lambda v: ops.fm_second_order(v, True, "native"), v), False),
        f"cross_layer 256, batch {batch} fwd+bwd": (
            _training(lambda *a: ops.cross_layer(*a, None, "native"), x0, x, weight, bias), False),
    }


def by_isa(rounds: int, batch: int, hstu_step: bool, clock, isas: list[str] | None = None, only: str = "") -> dict:
    """Milliseconds per call of each workload (those whose name contains ``only``) on each instruction set
    (``isas``, of those this CPU runs), interleaved round by round: {workload: {isa: ms}}."""
    isas = [isa for isa in native.available_isas() if isas is None or isa in isas]
    steps = {}
    hstu_step = hstu_step and any(only in f"{HSTU_STEP}, {backend}" for backend in ("eager", "rec_ascend"))
    for name, (fn, no_grad) in workloads(batch, hstu_step).items():
        if only not in name:
            continue
        for isa in isas:
            def step(fn=fn, isa=isa, no_grad=no_grad):
                with native.use_isa(isa), torch.set_grad_enabled(not no_grad):
                    return fn()
            steps[(name, isa)] = step
    ms = race_ms(steps, rounds, iters=5, clock=clock)
    rows = {}
    for (name, isa), t in ms.items():
        rows.setdefault(name, {})[isa] = t
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m models.bench_native", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="3 rounds (checks the script runs)")
    parser.add_argument("--no-hstu-step", action="store_true", help="leave out make run's HSTU training step")
    parser.add_argument("--isas", nargs="+", choices=native.ISAS, help="these instruction sets only (of those the "
                        "CPU runs)")
    parser.add_argument("--only", default="", help="the workloads whose name contains this")
    parser.add_argument("--out", default=OUT, help="the JSON file written (not with --quick)")
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    # One thread: CPU time of this thread (load from other processes left out); more: wall clock.
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads ({clock.__name__}), native kernels: "
          f"{native.isa()} (this CPU runs {', '.join(native.available_isas())}), ATen and Inductor: "
          f"{torch.backends.cpu.get_cpu_capability()}")
    calls = per_call(rounds)
    for name, us in calls.items():
        print(f"per call [{native.isa()}] {name:40s} {us:8.2f} us")
    isas = by_isa(rounds, args.batch, not args.no_hstu_step, clock, args.isas, args.only)
    for name, row in isas.items():
        base = row.get("avx512")
        print(f"{name:36s} " + "  ".join(
            f"{isa} {ms:8.3f} ms" + (f" ({ms / base:4.2f}x avx512's)" if base and isa != "avx512" else "")
            for isa, ms in row.items()))
    eager, compiled = isas.get(f"{HSTU_STEP}, eager"), isas.get(f"{HSTU_STEP}, rec_ascend")
    if eager:
        print(f"{HSTU_STEP}: rec_ascend " + ", ".join(f"{eager[isa] / compiled[isa]:.2f}x eager with {isa} kernels"
                                                    for isa in compiled) +
              f" (eager: ATen {torch.backends.cpu.get_cpu_capability()} either way)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
              "isa": native.isa(), "aten_isa": torch.backends.cpu.get_cpu_capability(),
              "clock": clock.__name__, "load_average": os.getloadavg(), "rounds": rounds, "per_call_us": calls, "ms_by_isa": isas}
    if not args.quick:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
